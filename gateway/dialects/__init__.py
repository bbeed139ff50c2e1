"""The three dialects of the session engine, each a pure state machine (`engine.EngineState`):
`backend` (`/backend`), `openai` (`/v1/realtime`, with `openai_config` and `openai_conversation`) and
`minicpm` (`/v1/realtime?mode=audio|video`); the two Realtime dialects share `realtime_events`."""
