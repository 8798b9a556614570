"""Client side: one request on its own gRPC stream (tritonclient.grpc.aio), closed cleanly.

    await stream_request(client, "lookahead_llm", inputs, on_response)

`on_response(result, error)` sees every response up to the request's final one (an error response
is final too); returning True cancels the request, which the server then aborts. Cancelling the
task that awaits `stream_request` before the final response cancels the call as well (grpc.aio
cancels a call whose read is cancelled): the HTTP front does that when its client disconnects.

Why a helper: after the final response the client must half-close the stream and read it to its
end. Leaving the loop instead lets the call be garbage-collected, which *cancels* it. tritonserver
2.51 (the one nvidia-pytriton bundles) mishandles a cancel that lands just after the final response
was written: its stream state waits for a response callback that never comes, that state keeps the
model loaded, and on shutdown the server waits out --exit-timeout-secs and exits 1. So once the
final response has come, let the task finish rather than cancel it.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

OnResponse = Callable[[Any, Any], bool | None]     # (InferResult | None, error | None) -> cancel?


def is_final(result: Any, error: Any) -> bool:
    """Whether this is the request's last response (the model sends every error with the final flag)."""
    return error is not None or result.get_response().parameters["triton_final_response"].bool_param


async def stream_request(client: Any, model: str, inputs: list, on_response: OnResponse, *,
                         parameters: dict[str, Any] | None = None, model_version: str = "") -> None:
    """Send one request on a new stream and feed its responses to `on_response` until the final
    one; returns once the server has closed the stream (or right after a cancel). `parameters`:
    the request's parameters (bool, int, float or str values)."""
    final = asyncio.Event()

    request: dict[str, Any] = {"model_name": model, "inputs": inputs}
    if parameters:
        request["parameters"] = parameters
    if model_version:
        request["model_version"] = model_version

    async def requests():
        yield request
        await final.wait()                # then the iterator ends: gRPC half-closes the stream

    call = client.stream_infer(requests())
    try:
        async for result, error in call:
            if final.is_set():
                continue                  # past the final response: read on until the server closes
            last = is_final(result, error)
            if on_response(result, error) and not last:
                call.cancel()
                return
            if last:
                final.set()
    finally:
        final.set()
