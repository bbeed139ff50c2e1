"""Triton model `tts`: the code lives in minicpmo_triton.triton_models."""

from minicpmo_triton.triton_models import TtsModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
