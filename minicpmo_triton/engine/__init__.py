"""How a network runs: an exported graph on ONNX Runtime or TensorRT (`exported`, `kv_batch`, `plan_cache`,
`stage_engine`: no torch), or the device engine core (schedule -> step -> update) of the LLM, the TTS and the
streaming Whisper: session state resident on the device (a KV pool per decoder, paged attention), a persistent
batch in static device buffers fed by one staging copy per iteration, the rules and the sampling on the device
(graph-safe), CUDA graphs of the decode step, and the ledgers of bytes moved and work done. `protocol` is what the
stages import (no torch)."""
