"""Triton model `tts`: the code lives in minicpmo_triton.serving.triton_models."""

from minicpmo_triton.serving.triton_models import TtsModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
