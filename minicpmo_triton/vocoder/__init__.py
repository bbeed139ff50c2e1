"""token2wav's vocoders in torch (HiFT, minicpmo-utils 1.0.7's causal vocoder) and the official Step-Audio2
modules they load."""
