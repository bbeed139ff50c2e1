"""The stage computations (numpy + an engine), free of Triton: the Triton models and the in-process
pipeline both run these."""
