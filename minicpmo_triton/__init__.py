"""Runtime code shared by the Triton models, the gateway and the exporter (no torch here)."""
