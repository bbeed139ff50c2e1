"""The gateway: a thin Starlette app in front of Triton. A socket goes `routes` -> `endpoints` -> `shell`
(admission, the session, its receive loop and send path) -> a dialect (`dialects/`, pure protocol) -> its
stream to Triton (`triton/stream.py`). `tests/test_layout.py` keeps the layers.

Words, one meaning each:
- session: one caller's conversation, from its first frame to `session.closed`. In the gateway that is a
  `shell.Session` (socket, send path, journal, step queue) around a dialect state (`dialects.state.DialectState`,
  the pure protocol), with one `TritonStream`; the registry sees it as a `registry.LiveSession`. Triton knows it
  as a sequence (its correlation ID), the entry model and each stage as per-sequence state
  (`minicpmo_triton`'s `DuplexSession`, `LlmSession`, ...); `minicpmo_client.Session` is the caller's side of it.
- client: the caller at the other end of a socket. The code that plays one is the client library
  (`minicpmo_client`, and `minicpmo_client.backend` for `/backend`); this package never imports it. The
  gateway's own connection to Triton is a stream (`TritonStream`), not a client.
- frame: one WebSocket message from the client: read (`read_frame`: its CPU work), then decided (`on_frame`).
- step: one request to the `duplex` model (`PlannedStep`): a duplex step (one second of caller audio), a
  context step (text into the model's context), or a chat turn (turn-based); it answers with step events.
- second: one second of caller audio (`STEP_SAMPLES` at 16 kHz), a duplex step's input; `PlannedStep.second`
  counts them. "unit" means only the model's `<unit>...</unit>` tokens around one duplex step in the LLM's
  context (`minicpmo_triton`), and, in checkpoint names, `linear_units` (a conformer's FFN width).
- epoch: what fences a barge-in: a step of an older epoch has none of its events sent.
"""
