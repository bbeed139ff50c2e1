"""Triton model `speaker_encoder`: the code lives in minicpmo_triton.triton_models."""

from minicpmo_triton.triton_models import SpeakerEncoderModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
