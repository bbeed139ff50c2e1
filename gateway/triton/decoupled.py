"""One request to a decoupled stage model (`llm`: `model_transaction_policy { decoupled: true }`), which gRPC's
unary `infer` refuses: sent on a stream of its own, its answer read until Triton's final flag."""

from __future__ import annotations

from typing import Any

from tritonclient.grpc import aio as grpcaio


async def infer_decoupled(client: grpcaio.InferenceServerClient, model: str, inputs: list[Any],
                          **options: Any) -> Any:
    """The stage's answer (an `InferResult`); raises the `InferenceServerException` it answered instead.
    `options`: `stream_infer`'s per-request keys (sequence_id, sequence_start, sequence_end, ...)."""
    async def one() -> Any:
        yield {"model_name": model, "inputs": inputs, "enable_empty_final_response": True, **options}

    answer = None
    async for result, error in client.stream_infer(one()):
        if error is not None:
            raise error
        if answer is None and result.get_response().outputs:
            answer = result
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    if answer is None:
        raise RuntimeError(f"{model}: the stream ended with no answer")
    return answer
