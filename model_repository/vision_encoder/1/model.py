"""Triton model `vision_encoder`: the code lives in minicpmo_triton.serving.triton_models."""

from minicpmo_triton.serving.triton_models import VisionEncoderModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
