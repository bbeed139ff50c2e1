"""One request to a decoupled stage model (`llm`: `model_transaction_policy { decoupled: true }`), which gRPC's
unary `infer` refuses: sent on a stream of its own, its answer read until Triton's final flag; a stage request's
inputs."""

from __future__ import annotations

from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import aio as grpcaio

from minicpmo_triton.stage_io import VisionEncoderRequest, encode

_DTYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(np.bool_): "BOOL",
           np.dtype(np.object_): "BYTES"}


def stage_inputs(request: Any) -> list[grpcclient.InferInput]:
    """A stage request (`minicpmo_triton.stage_io`) as gRPC inputs, batch row 0; an empty optional input is left out
    (the stage's default), but for the vision encoder's images (none is its request)."""
    out = []
    for name, value in encode(request).items():
        if value.size == 0 and not isinstance(request, VisionEncoderRequest):
            continue
        arr = value[None]
        t = grpcclient.InferInput(name, list(arr.shape), _DTYPES[arr.dtype])
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


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
