"""The duplex model stages in PyTorch, their presets, and their export to ONNX / TensorRT."""
