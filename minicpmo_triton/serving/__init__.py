"""Triton glue: the Python-backend models, the entry model's stage calls and duplex step, the door before the LLM,
the stage settings; and the in-process pipeline that runs the same stages without Triton."""
