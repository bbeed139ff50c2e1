"""Triton model `duplex`: the code lives in minicpmo_triton.serving.triton_models."""

from minicpmo_triton.serving.triton_models import DuplexModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
