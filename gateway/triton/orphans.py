"""Sequences whose session could not END them: its Triton went silent (hung, partitioned) or its entry model died
with them. Their state would stay in the stages until the 600 s TTL; the endpoint pool ENDs them once the endpoint
answers again (`end_everywhere`): on the entry model, which ENDs the stages it started for it (a hung Triton that
comes back still holds them all), then on each stateful stage directly (an entry model that died forgot which it
had started; the gateway knows the sequence's correlation ID, the same in every stage). An END for a sequence a
model does not hold is refused by Triton (no START) or answered as a no-op by the stage: nothing to end there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from tritonclient.grpc import aio as grpcaio

from minicpmo_triton.duplex_contract import StepInput
from minicpmo_triton.stage_io import LlmRequest, Token2WavRequest, TtsRequest

from .decoupled import stage_inputs
from .stream import ENTRY_MODEL, build_inputs

log = logging.getLogger("gateway.endpoints")

# What each stateful stage is sent to END a sequence (the entry model's own END calls: no work in them)
STAGE_ENDS: dict[str, Any] = {"llm": LlmRequest(decode=False), "tts": TtsRequest(n_tokens=0),
                              "token2wav": Token2WavRequest()}
END_TIMEOUT_S = 10.0


async def _end(client: grpcaio.InferenceServerClient, model: str, inputs: list[Any], corr_id: int) -> bool:
    """One END on a stream of its own, read to Triton's final flag; True when the model took it."""
    async def one() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": model, "inputs": inputs, "sequence_id": corr_id, "sequence_start": False,
               "sequence_end": True, "enable_empty_final_response": True}

    async def read() -> bool:
        async for result, error in client.stream_infer(one()):
            if error is not None:
                return False  # no such sequence there (already ended, or never started): nothing to end
            if result.get_response().parameters["triton_final_response"].bool_param:
                return True
        return False

    return await asyncio.wait_for(read(), END_TIMEOUT_S)  # unanswered: raised, the pool tries again later


async def end_everywhere(client: grpcaio.InferenceServerClient, corr_id: int) -> list[str]:
    """END the sequence on the entry model, then on every stateful stage; the models that took an END. Raises
    when the endpoint does not answer (the caller tries again later)."""
    took = [ENTRY_MODEL] if await _end(client, ENTRY_MODEL, build_inputs(StepInput()), corr_id) else []
    for model, request in STAGE_ENDS.items():
        if await _end(client, model, stage_inputs(request), corr_id):
            took.append(model)
    return took
