"""Runtime code shared by the Triton models, the gateway and the exporter (no torch here, but in `engine/`: the
device engine core, imported only where one is built; `engine/protocol.py` is torch-free for the stages)."""
