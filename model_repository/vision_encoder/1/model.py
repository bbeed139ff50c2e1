"""Triton model `vision_encoder`: the code lives in minicpmo_triton.triton_models."""

from minicpmo_triton.triton_models import VisionEncoderModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
