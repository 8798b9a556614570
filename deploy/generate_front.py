"""Triton's HTTP /generate and /generate_stream, served by the front over gRPC so that a client that leaves cancels.

tritonserver 2.51 never cancels an HTTP request: a client gone during a long prefill leaves the
prompt computed and `max_tokens` generated. Its gRPC streams do cancel (the model aborts the request
in the engine within its cancel poll, mid-prefill included). So `deploy.http_front.Front`, given a
gRPC upstream (`grpc_upstream=(host, port)`), answers these two routes itself:

1. the body is typed and checked before anything goes upstream (`serving.request.generate_json_inputs`
   maps it as tritonserver does, without wrapping integers to INT32 or answering 500 to a wrong JSON
   type; `parse_request` then checks it as the model will): a bad field is a 400 naming it;
2. the request goes to tritonserver's gRPC port on a stream of its own (`serving.grpc_stream`);
3. each response is rendered as tritonserver's HTTP endpoint renders it: one JSON object with
   `model_name`, `model_version` and every output (a one-element output as a value, others as a
   list; keys sorted, as 2.51 writes them), or on /generate_stream one `data: {...}` SSE event per
   response; an error is `{"error": message}`, with status 400 (503 and Retry-After for a full
   queue, 404 for an unknown model) when it comes first, an SSE error event after a 200.

When the client disconnects before the final response (the front watches its socket), the gRPC call
is cancelled and the model aborts the request. After the final response the stream is half-closed
and read to its end instead: 2.51 mishandles a cancel that lands then (serving/grpc_stream.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from runtime.errors import RequestError
from serving.config_template import model_inputs
from serving.grpc_stream import is_final, stream_request
from serving.request import generate_json_inputs, parse_request

from .http_answers import QUEUE_FULL, REASONS, RETRY_AFTER_S, HttpError, cut_event

log = logging.getLogger("lookahead.http_front")

ROUTE = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/(generate|generate_stream)$")
UNKNOWN_MODEL = "Request for unknown model"
# a channel to a restarted tritonserver reconnects within a second (gRPC's default backoff grows to 2 min)
CHANNEL_ARGS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000)]
_TYPES = {"TYPE_STRING": "BYTES"}                 # config data_type -> the wire's datatype (else TYPE_ dropped)
_DONE = object()


@dataclass
class GenerateCall:
    """One checked /generate request: what goes upstream."""
    model: str
    version: str
    stream_route: bool                            # /generate_stream: SSE events
    inputs: dict[str, Any]                        # name -> numpy array
    parameters: dict[str, Any]


def prepare(req) -> GenerateCall | None:
    """The /generate call `req` (a deploy.http_front.Request) asks for (None: not a POST to
    /generate*); HttpError 400 naming the field for a body the model would refuse or tritonserver
    would mangle."""
    m = ROUTE.match(req.path)
    if req.method != "POST" or m is None:
        return None
    sse = m.group(3) == "generate_stream"
    try:
        doc = json.loads(req.body) if req.body else None
        inputs, parameters = generate_json_inputs(doc, model_inputs())
        checked = parse_request(inputs.get, parameters)
    except RequestError as e:
        raise HttpError(400, str(e), getattr(e, "field", None), sse=sse) from None
    if checked.stream and not sse:
        raise HttpError(400, "stream: /generate answers with one response (send stream: false, or POST to "
                             f"/v2/models/{m.group(1)}/generate_stream)", "stream")
    upstream = {k: v for k, v in parameters.items() if not k.startswith("triton_")}   # tritonserver's own
    return GenerateCall(m.group(1), m.group(2) or "", sse, inputs, upstream)


def render(result: Any) -> dict[str, Any]:
    """One response as tritonserver's /generate renders it (BYTES as text, one element as a value)."""
    resp = result.get_response()
    doc: dict[str, Any] = {"model_name": resp.model_name, "model_version": resp.model_version}
    for out in resp.outputs:
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v.item()
                  for v in result.as_numpy(out.name).reshape(-1)]
        doc[out.name] = values[0] if len(values) == 1 else values
    return doc


def error_status(message: str) -> int:
    """The status of an error that comes before any response (tritonserver 2.51 answers 400 to all)."""
    if QUEUE_FULL.decode() in message:
        return 503
    return 404 if message.startswith(UNKNOWN_MODEL) else 400


def _json(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


class GenerateFront:
    """The gRPC side of a Front: one channel to `address`, reused by every /generate request."""

    def __init__(self, address: tuple[str, int]):
        self.address = address
        self._client = None
        self._draining: set[asyncio.Task] = set()     # calls past their final response, read to their end

    def _channel(self):
        if self._client is None:
            import tritonclient.grpc.aio as grpcclient
            self._client = grpcclient.InferenceServerClient(f"{self.address[0]}:{self.address[1]}",
                                                            channel_args=CHANNEL_ARGS)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    async def serve(self, call: GenerateCall, req, writer: asyncio.StreamWriter) -> bool:
        """Answer `call` on `writer`; True when the connection stays open. Cancelled (the client
        left), it cancels the gRPC call unless the final response has come."""
        from tritonclient.grpc import InferInput

        inputs = []
        for name, arr in call.inputs.items():
            data_type = model_inputs()[name]
            inp = InferInput(name, list(arr.shape), _TYPES.get(data_type, data_type.removeprefix("TYPE_")))
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        queue: asyncio.Queue = asyncio.Queue()
        final = []

        def on_response(result, error):
            if is_final(result, error):
                final.append(True)
            queue.put_nowait((result, error))

        task = asyncio.ensure_future(stream_request(self._channel(), call.model, inputs, on_response,
                                                    parameters=call.parameters or None,
                                                    model_version=call.version))
        task.add_done_callback(lambda _: queue.put_nowait(_DONE))
        try:
            return await _Relay(call, req, writer).run(queue, task)
        finally:
            if not task.done():
                if final:
                    self._draining.add(task)
                    task.add_done_callback(self._draining.discard)
                else:
                    task.cancel()                 # the client left: the model aborts the request


class _Relay:
    """Responses from the gRPC call -> the client, in /generate's or /generate_stream's shape."""

    def __init__(self, call: GenerateCall, req, writer: asyncio.StreamWriter):
        self.call, self.writer = call, writer
        self.chunked = call.stream_route and req.version == "HTTP/1.1"
        self.keep = req.keep_alive and (self.chunked or not call.stream_route)
        self.started = False

    async def run(self, queue: asyncio.Queue, task: asyncio.Task) -> bool:
        while True:
            item = await queue.get()
            if item is _DONE:
                return await self._ended(task)
            result, error = item
            if error is not None:
                await self._send(error_status(str(error)), {"error": str(error)})
            else:
                await self._send(200, render(result))
            if is_final(result, error):
                if self.chunked:
                    self.writer.write(b"0\r\n\r\n")
                    await self.writer.drain()
                return self.keep

    async def _ended(self, task: asyncio.Task) -> bool:
        """The call ended before its final response: tritonserver went away (it died or restarts)."""
        error = None if task.cancelled() else task.exception()
        log.warning("a /generate call ended before its final response: %r", error)
        why = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}" if error else "no final response"
        if not self.started:
            await self._send(502, {"error": f"tritonserver's gRPC port did not answer ({why}); it may be "
                                            f"restarting: retry"}, close=True)
        elif self.call.stream_route:
            await self._write_event(cut_event("tritonserver"))
        return False

    async def _send(self, status: int, doc: dict[str, Any], close: bool = False) -> None:
        if not self.started:
            self.started = True
            self.keep = self.keep and not close
            self.writer.write(self._head(status, None if self.call.stream_route else len(_json(doc))))
        if self.call.stream_route:
            await self._event(doc)
        else:
            self.writer.write(_json(doc))
            await self.writer.drain()

    async def _event(self, doc: dict[str, Any]) -> None:
        await self._write_event(b"data: " + _json(doc) + b"\n\n")

    async def _write_event(self, event: bytes) -> None:
        self.writer.write(b"%x\r\n%s\r\n" % (len(event), event) if self.chunked else event)
        await self.writer.drain()

    def _head(self, status: int, length: int | None) -> bytes:
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'OK' if status == 200 else 'Error')}"]
        if self.call.stream_route:
            lines.append("Content-Type: text/event-stream; charset=utf-8")
            if self.chunked:
                lines.append("Transfer-Encoding: chunked")
        else:
            lines += ["Content-Type: application/json", f"Content-Length: {length}"]
        if status == 503:
            lines.append(f"Retry-After: {RETRY_AFTER_S}")
        lines.append("Connection: keep-alive" if self.keep else "Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
