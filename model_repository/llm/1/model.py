"""Triton model `llm`: the code lives in minicpmo_triton.serving.triton_models."""

from minicpmo_triton.serving.triton_models import LlmModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
