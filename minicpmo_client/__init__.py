"""A client for minicpmo-triton's `/v1/realtime` (OpenAI Realtime dialect): needs only websockets and numpy.

    import asyncio, minicpmo_client as mc

    async def main(chunks):                      # chunks: async iterator of float32 24 kHz audio
        async with await mc.connect("ws://127.0.0.1:8006/v1/realtime", api_key="...") as s:
            async for ev in s.converse(chunks):
                if isinstance(ev, mc.AudioChunk): play(ev.pcm)
                elif isinstance(ev, mc.TurnFinal): print(ev.transcript, ev.latency_ms)
"""

from .backoff import Backoff
from .events import (
    AudioChunk,
    BargeIn,
    ClientError,
    ClientEvent,
    Closed,
    Error,
    Listening,
    ReplyEvent,
    ReplyStarted,
    Resumed,
    TranscriptDelta,
    TurnFinal,
    UserTurn,
)
from .session import Session, connect
from .state import ConversationState
from .voice import VoiceCheck, check_voice

__all__ = [
    "AudioChunk", "Backoff", "BargeIn", "ClientError", "ClientEvent", "Closed", "ConversationState", "Error",
    "Listening", "ReplyEvent", "ReplyStarted", "Resumed", "Session", "TranscriptDelta", "TurnFinal", "UserTurn",
    "VoiceCheck", "check_voice", "connect",
]
