"""A long LLM prefill as several calls: prefill-only chunks of at most N tokens, then the call itself.

One call's prefill is one forward, right-padded with every row of the batch it joins: an 8000-token system
prompt, chat history or voice prompt would make every session in that batch wait for it. Split, each chunk is its
own call through the sequence batcher, so other sessions' steps run between the chunks, and the batch a chunk joins
pays for at most N tokens. The KV cache ends the same: the chunks feed the same tokens at the same positions
(the attention is causal), and only the last call decodes.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..stage_io import LlmRequest


def split_prefill(request: LlmRequest, max_tokens: int, audio_placeholder: int) -> list[LlmRequest]:
    """`request` as prefill-only chunks of at most `max_tokens` input tokens and a last call of at most as many,
    which keeps all that only a whole call may carry: the step's own audio (its placeholders come last, after
    every embedding sent), the forced tokens and the decode. A rollback goes with the first chunk, as the stage
    applies it before anything is fed. `max_tokens` <= 0: never split."""
    ids = request.input_ids
    if max_tokens <= 0 or len(ids) <= max_tokens:
        return [request]
    placeholders = np.flatnonzero(ids == audio_placeholder)
    n_sent = len(request.embeds)
    # the step's own audio placeholders (after the sent embeddings') stay in the last call
    tail = min(len(ids) - max_tokens, int(placeholders[n_sent]) if len(placeholders) > n_sent else len(ids))
    chunks: list[LlmRequest] = []
    used = 0  # embeddings given to chunks so far
    for start in range(0, tail, max_tokens):
        part = ids[start:min(start + max_tokens, tail)]
        n_embeds = int((part == audio_placeholder).sum())
        chunks.append(replace(
            request, input_ids=part, embeds=request.embeds[used:used + n_embeds],
            audio=np.zeros(0, np.float32), decode=False, forced_ids=np.zeros(0, np.int64),
            voice=np.zeros(0, np.float32),  # token2wav's reference goes with the call that may speak
            rollback_to=request.rollback_to if start == 0 else -1))
        used += n_embeds
    if not chunks:  # all of it is the step's audio
        return [request]
    last = replace(request, input_ids=ids[tail:], embeds=request.embeds[used:], rollback_to=-1)
    return [*chunks, last]
