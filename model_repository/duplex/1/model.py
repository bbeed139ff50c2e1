"""Triton model `duplex`: the code lives in minicpmo_triton.triton_models."""

from minicpmo_triton.triton_models import DuplexModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
