"""The three dialects, each a pure state machine over `state.DialectState` (client frames and step events in,
`Effects` out): `backend` (`/backend`), `openai` (`/v1/realtime`) and `minicpm` (`/v1/realtime?mode=audio|video`);
the two Realtime dialects share their envelope (`realtime_events`).

OpenAI's dialect is in parts: `openai_events` (its client and server events; the objects they carry, typed as the
spec types them, in `openai_objects`), `openai_input` (reading a frame: decoding, resampling, VAD, before the
state is touched), `openai_states` (the response's named states and the transition tables), `openai_turns`
(turn-taking, one object per mode: duplex, server VAD, manual), `openai_duplex` (duplex caller audio: seconds,
barge-in rollback), `openai_response` (a response's server events), `openai_config` (session.update),
`openai_conversation` (items), and `openai` (the state machine that ties them together).
"""
