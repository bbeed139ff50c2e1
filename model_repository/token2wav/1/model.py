"""Triton model `token2wav`: the code lives in minicpmo_triton.triton_models."""

from minicpmo_triton.triton_models import Token2WavModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
