"""Triton model `audio_encoder`: the code lives in minicpmo_triton.serving.triton_models."""

from minicpmo_triton.serving.triton_models import AudioEncoderModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
