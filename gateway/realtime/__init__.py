"""`/v1/realtime`: the OpenAI Realtime dialect and MiniCPM-o's own, over the same session engine.

Pure protocol code (`config`, `events`, `conversation`, `engine`, `openai_state`, `minicpm_state`) is kept apart
from the I/O shell (`session`, `route`), so the protocol can be tested without sockets.
"""
