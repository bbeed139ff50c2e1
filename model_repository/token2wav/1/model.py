"""Triton model `token2wav`: the code lives in minicpmo_triton.serving.triton_models."""

from minicpmo_triton.serving.triton_models import Token2WavModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
