"""A guard on the public gRPC port: tritonserver's own gRPC port sits behind it on loopback.

tritonserver 2.51 (the one in nvidia-pytriton 0.7.0) dies with SIGSEGV after refusing a ModelStreamInfer request
when the client sent the header `triton_grpc_error: true` (its stream state then handles a cancellation that never
happened: "HandleCancellation called even when the context was not cancelled"). One such message, a BYTES tensor
whose length prefix runs past its data, was enough. The same request without the header is refused cleanly. 2.51
cannot be patched here, so, as `deploy.http_front` guards HTTP, this process guards gRPC:

- **The header never reaches tritonserver.** A client that sends it still gets what it asks for: the first error
  response of its stream becomes the stream's status here (`status_of`: the code read from the message, which the
  Triton model's error messages are written for), and the stream ends.
- **Every inference request is checked before it is forwarded** (`check_infer_request`): datatypes, shapes, the
  size of each raw tensor, and each BYTES element's length prefix. A malformed one is answered here, as
  tritonserver answers one without the header (an error response on the stream, INVALID_ARGUMENT on ModelInfer),
  and never reaches the server. A message that is not a request at all is INVALID_ARGUMENT.
- **Only the serving methods pass** (`ALLOWED`): inference, health, metadata, configuration, statistics. The rest
  (shared-memory registration, which maps host memory by name; model load/unload; log and trace settings) is
  PERMISSION_DENIED: nothing a remote client needs, and each a way to change the server under everyone.
- **A client that leaves cancels its requests**: its stream's upstream call is cancelled, and the engine aborts
  them. A client that leaves after every request on its stream was answered instead half-closes the upstream
  stream: tritonserver 2.51 mishandles a cancel that lands just after a final response (serving/grpc_stream.py).

Messages pass through as bytes; responses are parsed (a few microseconds each) only to see errors and final
flags. Messages up to MAX_MESSAGE_BYTES pass either way.

    python -m deploy.grpc_guard --listen 127.0.0.1:8001 --upstream 127.0.0.1:8101
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import signal
import struct
from typing import Any, AsyncIterator, Iterable

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

log = logging.getLogger("lookahead.grpc_guard")

SERVICE = "/inference.GRPCInferenceService/"
INFER, STREAM_INFER = SERVICE + "ModelInfer", SERVICE + "ModelStreamInfer"
ALLOWED = frozenset(SERVICE + m for m in (
    "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer", "ModelStreamInfer",
    "ModelConfig", "ModelStatistics", "RepositoryIndex"))
ERROR_HEADER = "triton_grpc_error"
# Not forwarded: the error header (above), and what gRPC itself sets on the upstream call.
DROPPED_METADATA = frozenset((ERROR_HEADER, "user-agent", "content-type", "te", "grpc-timeout", "grpc-encoding",
                              "grpc-accept-encoding"))
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_ELEMENTS = 1 << 26                 # elements of one tensor: far past any prompt, far below an overflow
ITEM_BYTES = {"BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2, "BF16": 2, "UINT32": 4,
              "INT32": 4, "FP32": 4, "UINT64": 8, "INT64": 8, "FP64": 8}
# The InferTensorContents field that carries each datatype when a request does not send raw bytes.
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
                  "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
                  "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
                  "FP64": "fp64_contents", "BYTES": "bytes_contents"}
SHM_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
# An error response's gRPC status, for a client that asked for it (the header): the Triton model's error messages
# (triton_model_repo/lookahead_llm/1/model.py) and tritonserver's own; the first prefix that matches wins.
STATUS_BY_PREFIX = (
    ("the waiting queue is full", grpc.StatusCode.UNAVAILABLE),
    ("the server is shutting down", grpc.StatusCode.UNAVAILABLE),
    ("internal error in the engine step", grpc.StatusCode.UNAVAILABLE),
    ("internal error", grpc.StatusCode.INTERNAL),
    ("the request was cancelled", grpc.StatusCode.CANCELLED),
    ("Request for unknown model", grpc.StatusCode.NOT_FOUND),
)
UNHEALTHY_STUB = "is not healthy"       # tritonserver's "Stub process '...' is not healthy."


def status_of(message: str) -> grpc.StatusCode:
    """The gRPC status tritonserver would have ended a `triton_grpc_error` stream with, for an error message."""
    for prefix, code in STATUS_BY_PREFIX:
        if message.startswith(prefix):
            return code
    return grpc.StatusCode.UNAVAILABLE if UNHEALTHY_STUB in message else grpc.StatusCode.INVALID_ARGUMENT


def bytes_elements(data: bytes) -> int | None:
    """How many elements a raw BYTES tensor holds (each a 4-byte little-endian length, then that many bytes);
    None when the buffer is not exactly such a sequence."""
    n, pos, end = 0, 0, len(data)
    while pos < end:
        if end - pos < 4:
            return None
        (length,) = struct.unpack_from("<I", data, pos)
        pos += 4 + length
        n += 1
    return n if pos == end else None


def _tensor_problem(t: Any, raw: bytes | None) -> str | None:
    """What is wrong with one input tensor (its raw bytes, when the request sends them), or None."""
    if t.datatype != "BYTES" and t.datatype not in ITEM_BYTES:
        return f"datatype {t.datatype[:20]!r} is not a Triton datatype"
    if any(d < 0 for d in t.shape):
        return f"shape {list(t.shape)[:8]} has a negative dimension"
    if len(t.shape) > 8 or math.prod(t.shape) > MAX_ELEMENTS:
        return f"shape {list(t.shape)[:8]} is too large (at most 8 dimensions and {MAX_ELEMENTS} elements)"
    if any(p in t.parameters for p in SHM_PARAMETERS):
        return "shared-memory tensors are not served on this port"
    n = math.prod(t.shape)
    if raw is not None:
        if t.HasField("contents"):
            return "has both raw_input_contents and contents"
        if t.datatype == "BYTES":
            count = bytes_elements(raw)
            if count is None:
                return "raw BYTES data is malformed (an element's 4-byte length prefix runs past the data)"
            return None if count == n else f"raw BYTES data holds {count} elements; shape {list(t.shape)} needs {n}"
        size = n * ITEM_BYTES[t.datatype]
        return None if len(raw) == size else f"raw data is {len(raw)} bytes; {t.datatype} shape {list(t.shape)} " \
                                             f"needs {size}"
    field = CONTENTS_FIELD.get(t.datatype)
    if field is None:
        return f"{t.datatype} tensors must be sent as raw_input_contents"
    set_fields = [f.name for f, _ in t.contents.ListFields()]
    if set_fields and set_fields != [field]:
        return f"contents sets {set_fields}; a {t.datatype} tensor uses {field} only"
    count = len(getattr(t.contents, field))
    return None if count == n else f"contents holds {count} elements; shape {list(t.shape)} needs {n}"


def check_infer_request(req: Any) -> str | None:
    """What is wrong with a ModelInferRequest before tritonserver parses it, or None (it may still be refused there,
    as any request may)."""
    if not req.model_name:
        return "model_name is empty"
    raws = list(req.raw_input_contents)
    if raws and len(raws) != len(req.inputs):
        return f"{len(raws)} raw_input_contents for {len(req.inputs)} inputs (one each, in order)"
    names = [t.name for t in req.inputs]
    if len(set(names)) != len(names):
        return "an input name is repeated"
    for i, t in enumerate(req.inputs):
        problem = _tensor_problem(t, raws[i] if raws else None)
        if problem:
            return f"input {t.name[:64]!r}: {problem}"
    for o in req.outputs:
        if any(p in o.parameters for p in SHM_PARAMETERS):
            return f"output {o.name[:64]!r}: shared-memory tensors are not served on this port"
    return None


def parse_request(raw: bytes) -> tuple[Any, str | None]:
    """(the request, what is wrong with it or None); the request is None when the bytes are not one."""
    try:
        req = pb.ModelInferRequest.FromString(raw)
    except DecodeError:
        return None, "the message is not a ModelInferRequest"
    return req, check_infer_request(req)


def error_response(req: Any, message: str) -> bytes:
    """A stream's error response for a refused request, as tritonserver sends one without the header."""
    resp = pb.ModelStreamInferResponse(error_message=message)
    if req is not None:
        resp.infer_response.model_name = req.model_name
        resp.infer_response.model_version = req.model_version
        resp.infer_response.id = req.id
    return resp.SerializeToString()


def upstream_metadata(metadata: Iterable[tuple[str, Any]] | None) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in (metadata or ()) if k.lower() not in DROPPED_METADATA and not k.startswith(":"))


def wants_status(metadata: Iterable[tuple[str, Any]] | None) -> bool:
    return any(k.lower() == ERROR_HEADER and str(v).lower() == "true" for k, v in (metadata or ()))


class _Stream:
    """One client stream relayed to one upstream stream: requests checked on the way in, responses watched on the
    way out. Refused requests are answered here, in the order they came."""

    def __init__(self, call, status_mode: bool):
        self.call = call
        self.status_mode = status_mode
        self.out: asyncio.Queue = asyncio.Queue()
        self.open = 0                    # requests forwarded whose final response has not come back

    async def pump(self, requests: AsyncIterator[bytes]) -> None:
        try:
            async for raw in requests:
                req, problem = parse_request(raw)
                if problem:
                    await self.out.put(("refused", req, problem))
                    if self.status_mode:
                        return
                    continue
                self.open += 1
                await self.call.write(raw)
            await self.call.done_writing()
        except asyncio.CancelledError:
            raise
        except Exception as e:                  # the upstream call ended under us: drain_upstream says how
            log.debug("relaying a stream's requests stopped: %r", e)
            self.call.cancel()

    async def drain_upstream(self) -> None:
        try:
            async for raw in self.call:
                await self.out.put(("response", None, raw))
            await self.out.put(("end", None, None))
        except grpc.aio.AioRpcError as e:
            await self.out.put(("upstream_error", None, e))

    def final(self, resp: Any) -> bool:
        p = resp.infer_response.parameters.get("triton_final_response")
        return bool(resp.error_message) or (p is not None and p.bool_param)


class Guard:
    """The gRPC server on the public port. `upstream` (host, port) is tritonserver's gRPC address; the supervisor
    sets it whenever it starts a server. Until then, and while it restarts, calls are UNAVAILABLE."""

    def __init__(self, listen_host: str, listen_port: int, upstream: tuple[str, int] | None = None):
        self.listen = (listen_host, listen_port)
        self.upstream = upstream
        self._channel: grpc.aio.Channel | None = None
        self._channel_for: tuple[str, int] | None = None
        self.server: grpc.aio.Server | None = None
        self.refused = 0                 # requests answered here (malformed, or a method not served)
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)]
        self.server = grpc.aio.server(options=opts)
        self.server.add_generic_rpc_handlers([_Handlers(self)])
        host, port = self.listen
        if self.server.add_insecure_port(f"{host}:{port}") == 0:
            raise OSError(f"cannot listen on {host}:{port} (gRPC): the port is taken")
        await self.server.start()
        log.info("gRPC guard on %s:%d", host, port)

    async def stop(self, grace: float = 1.0) -> None:
        if self.server is not None:
            await self.server.stop(grace)
        if self._channel is not None:
            await self._channel.close()

    def channel(self) -> grpc.aio.Channel | None:
        if self.upstream is None:
            return None
        if self._channel_for != self.upstream:
            old, self._channel_for = self._channel, self.upstream
            if old is not None:
                asyncio.ensure_future(old.close(grace=5.0))   # calls on the old server end on their own
            opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
            self._channel = grpc.aio.insecure_channel("%s:%d" % self.upstream, options=opts)
        return self._channel

    async def unary(self, method: str, raw: bytes, context) -> bytes:
        if method == INFER:
            _, problem = parse_request(raw)
            if problem:
                self.refused += 1
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        channel = self.channel()
        if channel is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "tritonserver is (re)starting: retry")
        call = channel.unary_unary(method)(raw, metadata=upstream_metadata(context.invocation_metadata()),
                                           timeout=context.time_remaining())
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "")
        finally:
            call.cancel()                # a no-op once it finished; a client that left cancels it

    async def stream(self, requests: AsyncIterator[bytes], context) -> AsyncIterator[bytes]:
        channel = self.channel()
        if channel is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "tritonserver is (re)starting: retry")
        metadata = context.invocation_metadata()
        call = channel.stream_stream(STREAM_INFER)(metadata=upstream_metadata(metadata))
        s = _Stream(call, wants_status(metadata))
        tasks = [asyncio.ensure_future(s.pump(requests)), asyncio.ensure_future(s.drain_upstream())]
        clean = False
        try:
            while True:
                kind, req, item = await s.out.get()
                if kind == "end":
                    clean = True
                    return
                if kind == "upstream_error":
                    clean = True
                    await context.abort(item.code(), item.details() or "")
                if kind == "refused":
                    self.refused += 1
                    if s.status_mode:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, item)
                    yield error_response(req, item)
                    continue
                resp = pb.ModelStreamInferResponse.FromString(item)
                if s.final(resp):
                    s.open -= 1
                if s.status_mode and resp.error_message:
                    await context.abort(status_of(resp.error_message), resp.error_message)
                yield item
        finally:
            tasks[0].cancel()                   # read no more of the client
            if clean:
                tasks[1].cancel()
            elif s.open <= 0:
                # Nothing in flight (the client left after its last answer, or its stream ended on an error):
                # half-close upstream as a client should and read it to its end, in the background; a cancel
                # here is what 2.51 mishandles (serving/grpc_stream.py).
                task = asyncio.ensure_future(_half_close(call, tasks[1]))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            else:
                call.cancel()                   # the client left mid-request: the engine aborts what is left
                tasks[1].cancel()


async def _half_close(call, drain: asyncio.Task) -> None:
    with contextlib.suppress(Exception):
        await call.done_writing()
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await drain


class _Handlers(grpc.GenericRpcHandler):
    def __init__(self, guard: Guard):
        self.guard = guard

    def service(self, details):
        method = details.method
        if method == STREAM_INFER:
            return grpc.stream_stream_rpc_method_handler(self.guard.stream)
        if method in ALLOWED:
            async def unary(raw: bytes, context) -> bytes:
                return await self.guard.unary(method, raw, context)
            return grpc.unary_unary_rpc_method_handler(unary)
        if method.startswith(SERVICE):
            return grpc.unary_unary_rpc_method_handler(self._refuse(method))
        return None                             # another service: UNIMPLEMENTED

    def _refuse(self, method: str):
        async def refuse(_raw: bytes, context) -> bytes:
            self.guard.refused += 1
            name = method.rsplit("/", 1)[-1][:64]
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{name} is not served on this port (only inference, health, metadata and "
                                f"statistics are); use the server's local ports for administration")
        return refuse


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--listen", required=True, help="host:port to serve gRPC on")
    ap.add_argument("--upstream", required=True, help="tritonserver's gRPC host:port")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s grpc_guard: %(message)s")

    async def run() -> None:
        guard = Guard(*_hostport(args.listen), upstream=_hostport(args.upstream))
        await guard.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await guard.stop()
    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
