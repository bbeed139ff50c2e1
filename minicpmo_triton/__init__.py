"""Runtime code shared by the Triton models, the gateway and the exporter (no torch here, but in `paged/`: the paged
LLM engine, imported only where one is built)."""
