"""PyTorch modules of the four duplex stages, named like the MiniCPM-o checkpoint's tensors."""
