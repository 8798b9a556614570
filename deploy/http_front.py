"""A small HTTP/1.1 reverse proxy in front of tritonserver's HTTP port: requests it cannot survive stop here.

tritonserver 2.51 (the one in nvidia-pytriton 0.7.0) dies with SIGSEGV on request bodies it parses on
its HTTP threads' stacks: a flat JSON body over ~4 MB (a 5 MB prompt or `stop` string on /generate or
/infer) and deeply nested JSON far smaller than that (a 1 MB body of 175,000 nested objects). With an
8 MB stack the flat-body limit is ~4.0-4.19 MB; with a 64 MB stack 20 MB survive and 40 MB crash, so the
overflow grows with the body. 2.51 has no flag that limits the request size (`--http-max-input-size`
came later and is an unknown option here). So this proxy listens on the public HTTP port and forwards
to tritonserver bound to an internal loopback port, after:

- a body-size cap (Content-Length or the decoded size of a chunked body): over it, `413` and the
  connection is closed (the body is drained first, so the client reads the 413 and not a reset);
- a JSON check of every request body (for binary /infer requests, of its JSON header): a body that
  Python's `json` cannot parse, nested too deeply included, gets `400` here;
- a 64 KiB cap on the request line and headers (`431`), and no request smuggling: both Content-Length
  and Transfer-Encoding, several Content-Lengths, or a transfer coding other than chunked, get `400`.

- one parser of the request target (deploy/request_target.py): origin-form only, and every check
  and the upstream see the same normalised path.

Everything else passes through unchanged, responses streamed as they come, except a response a `rewrite`
transforms (the OpenAI front's echo): it is read whole, at most `max_response_bytes` (16 MiB by default, a
cap of its own: such answers are larger than any request), and one over it is answered with the transform's
own 400. When tritonserver dies or restarts mid-response, the client's connection is closed: a streaming
client gets an error instead of waiting. A client that closes its connection before its response is
complete cancels: the front watches its socket while it waits on the upstream (`ClientReader`,
`until_gone`) and closes the upstream connection. With `grpc_upstream` (tritonserver's gRPC port),
/generate and /generate_stream are served over gRPC instead (deploy/generate_front.py), since tritonserver
2.51 never cancels an HTTP request. gRPC clients have a guard of their own, `deploy.grpc_guard`.

    python -m deploy.http_front --listen 127.0.0.1:8000 --upstream 127.0.0.1:8100
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Any

from .http_answers import (QUEUE_FULL, REASONS, RETRY_AFTER_S, STREAM_CUT, HttpError,  # noqa: F401 (re-exported)
                           cut_event)
from .request_target import TargetError, parse_target

log = logging.getLogger("lookahead.http_front")

# tritonserver 2.51 survives 4,000,035 bytes and crashes at 4,194,035: half the smaller, by default.
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024
# a response a `rewrite` transforms is read here whole: at most this much of it, and of its result
DEFAULT_MAX_RESPONSE_BYTES = 16 * 1024 * 1024
MAX_BODY_LIMIT = 3_900_000              # a higher --max-body-bytes is refused
MAX_HEAD_BYTES = 64 * 1024
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024   # read (and drop) at most this much of a refused body
DRAIN_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 300.0                 # a keep-alive connection with no new request is closed
BODY_TIMEOUT_S = 60.0                  # to receive a request's head and body
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
              "upgrade", "expect", "content-length"}


PEEK_BYTES = 64 * 1024                 # an error response read before its status is sent on


class BodyTooLarge(Exception):
    """A body (a request's, or a response read whole) longer than `limit` bytes; `unread`: the
    bytes of the chunk that passed the limit, not read."""

    def __init__(self, limit: int, unread: int = 0):
        super().__init__(f"over {limit} bytes")
        self.limit, self.unread = limit, unread


@dataclass
class Request:
    method: str
    target: str                 # origin-form, normalised (deploy.request_target): what goes upstream
    version: str
    headers: list[tuple[str, str]]
    body: bytes = b""
    keep_alive: bool = True
    generate: Any = None        # a GenerateCall when the front serves it over gRPC (deploy.generate_front)

    @property
    def path(self) -> str:
        """The target's path: what every check and route keys on."""
        return self.target.partition("?")[0]

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k.lower() == name]
        return values[0] if values else None


def parse_head(head: bytes) -> tuple[str, str, str, list[tuple[str, str]]]:
    """Request line and headers of one request head (CRLF-terminated, the blank line included)."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:                  # pragma: no cover - latin-1 decodes every byte
        raise HttpError(400, "request head is not latin-1")
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1]:
        raise HttpError(400, f"malformed request line {lines[0][:80]!r}")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(505, f"unsupported HTTP version {version[:20]!r}")
    try:
        target = str(parse_target(target))
    except TargetError as e:
        raise HttpError(400, str(e)) from None
    headers = []
    for line in lines[1:]:
        if not line:
            continue
        if line[0] in " \t":
            raise HttpError(400, "obsolete header line folding is not accepted")
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or any(c in name for c in " \t"):
            raise HttpError(400, f"malformed header line {line[:80]!r}")
        headers.append((name, value.strip(" \t")))
    return method, target, version, headers


def body_framing(headers: list[tuple[str, str]]) -> tuple[str, int]:
    """("length", n), ("chunked", 0) or ("none", 0); refuses ambiguous framing (request smuggling)."""
    lengths = {v for k, v in headers if k.lower() == "content-length"}
    codings = [v for k, v in headers if k.lower() == "transfer-encoding"]
    if codings:
        if lengths:
            raise HttpError(400, "both Content-Length and Transfer-Encoding")
        if [c.strip().lower() for c in ",".join(codings).split(",")] != ["chunked"]:
            raise HttpError(501, f"unsupported Transfer-Encoding {', '.join(codings)[:40]!r} (only chunked)")
        return "chunked", 0
    if not lengths:
        return "none", 0
    if len(lengths) > 1:
        raise HttpError(400, "conflicting Content-Length headers")
    value = lengths.pop()
    if not value.isdigit() or len(value) > 18:
        raise HttpError(400, f"bad Content-Length {value[:20]!r}")
    return "length", int(value)


def check_json(body: bytes, headers: list[tuple[str, str]]) -> None:
    """Refuse a body whose JSON (or, with Inference-Header-Content-Length, JSON header) does not parse."""
    if not body:
        return
    part = body
    header_len = next((v for k, v in headers if k.lower() == "inference-header-content-length"), None)
    if header_len is not None:
        if not header_len.isdigit() or int(header_len) > len(body):
            raise HttpError(400, f"Inference-Header-Content-Length {header_len[:20]!r} does not fit the "
                                 f"{len(body)}-byte body")
        if int(header_len) == 0:
            return
        part = body[:int(header_len)]
    try:
        json.loads(part)
    except RecursionError:
        raise HttpError(400, "request JSON is nested too deeply")
    except ValueError as e:                     # JSONDecodeError, UnicodeDecodeError
        raise HttpError(400, f"request body is not valid JSON: {str(e)[:120]}")


@dataclass
class Response:
    """An upstream response's head as read (`lower`: its headers by lower-case name, the last one
    of a name kept) and its body's framing: "length" (`length` bytes), "chunked", "eof" or "none"."""
    version: str
    status: int
    reason: str
    headers: list[tuple[str, str]]
    lower: dict[str, str]
    kind: str = "none"
    length: int = 0

    @property
    def closes(self) -> bool:
        """The upstream closes the connection after this response."""
        conn = self.lower.get("connection", "").lower()
        return "close" in conn or self.version == "HTTP/1.0" and "keep-alive" not in conn


def upstream_head(req: Request) -> bytes:
    """The head `req` goes upstream with: hop-by-hop headers dropped, its (de-chunked) body's length
    stated, and HTTP/1.0 asked to keep the upstream connection open."""
    lines = [f"{req.method} {req.target} {req.version}"]
    lines += [f"{k}: {v}" for k, v in req.headers if k.lower() not in HOP_BY_HOP]
    if req.body or req.method in ("POST", "PUT", "PATCH") or req.header("content-length") is not None \
            or req.header("transfer-encoding") is not None:
        lines.append(f"Content-Length: {len(req.body)}")
    if req.version == "HTTP/1.0":
        lines.append("Connection: keep-alive")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _read_response_head(reader: asyncio.StreamReader) -> Response:
    """The upstream's final response head (interim 1xx responses skipped; 101 is final)."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, _, rest = head[:-4].decode("latin-1").partition("\r\n")
        parts = status_line.split(" ", 2)
        status = int(parts[1])
        if not 100 <= status < 200 or status == 101:
            break
    headers = [tuple(p.strip() for p in h.split(":", 1)) for h in rest.split("\r\n") if ":" in h]
    return Response(parts[0], status, parts[2] if len(parts) > 2 else "", headers,
                    {k.lower(): v for k, v in headers})


def response_framing(method: str, resp: Response) -> tuple[str, int]:
    """How the response body is delimited: (kind, length) as in `Response`."""
    if method == "HEAD" or resp.status in (204, 304):
        return "none", 0
    if "chunked" in resp.lower.get("transfer-encoding", "").lower():
        return "chunked", 0
    if resp.lower.get("content-length", "").isdigit():
        return "length", int(resp.lower["content-length"])
    return "eof", 0


def client_head(req: Request, resp: Response, keep: bool) -> bytes:
    """The response head sent to the client, in its HTTP version, saying whether the connection stays."""
    out = [f"{'HTTP/1.1' if req.version == 'HTTP/1.1' else 'HTTP/1.0'} {resp.status} {resp.reason}".rstrip()]
    out += [f"{k}: {v}" for k, v in resp.headers if k.lower() not in ("connection", "keep-alive")]
    out.append("Connection: keep-alive" if keep else "Connection: close")
    return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")


class ClientGone(Exception):
    """The client closed its connection while its request was being served."""


class ClientReader(asyncio.StreamReader):
    """A client connection's reader that also tells when the client has gone: `gone` is set at its
    EOF or a connection error, without reading anything (a pipelined request stays buffered). A
    client that half-closes its side counts as gone, as it does for nginx."""

    def __init__(self, limit: int):
        super().__init__(limit=limit)
        self.gone = asyncio.Event()

    def feed_eof(self) -> None:
        super().feed_eof()
        self.gone.set()

    def set_exception(self, exc: BaseException) -> None:
        super().set_exception(exc)
        self.gone.set()


async def until_gone(reader: ClientReader, work) -> Any:
    """Await the coroutine `work`, unless the client goes first: then it is cancelled and
    ClientGone raised (the caller closes the upstream connection, which stops the work there)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(reader.gone.wait())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class Front:
    """One proxy: `await Front(...).serve()`; `close()` stops accepting and ends open connections."""

    def __init__(self, listen_host: str, listen_port: int, upstream_host: str, upstream_port: int,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, *, check=None, error_body=None,
                 upstream_name: str = "tritonserver", rewrite=None,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES, grpc_upstream: tuple[str, int] | None = None):
        """`check(request)`: raises HttpError for a request to answer here (after the JSON check);
        `error_body(status, message, field) -> bytes`: the JSON of such an answer (default Triton's
        {"error": message}); `upstream_name` names the server behind in 502 answers.
        `rewrite(request) -> transform | None`: may change the request's body before it goes
        upstream; a transform(status, body) -> body it returns gets the whole response body (read
        here, not streamed) and its result is sent instead. Such a response, or its result, over
        `max_response_bytes` is answered with `transform.too_large(limit)`, an HttpError naming
        what the client asked for (the upstream connection is closed, never read on or cut short).
        `grpc_upstream`: tritonserver's gRPC (host, port): POSTs to /v2/models/<m>/generate and
        /generate_stream are then served over it (deploy/generate_front.py), so a client that
        leaves cancels them; without it they go to the HTTP upstream like any other request."""
        if not 0 < max_body_bytes <= MAX_BODY_LIMIT:
            raise ValueError(f"max_body_bytes must be in 1..{MAX_BODY_LIMIT} (tritonserver 2.51 crashes on "
                             f"HTTP bodies over ~4 MB), got {max_body_bytes}")
        self.listen = (listen_host, listen_port)
        self.upstream = (upstream_host, upstream_port)
        self.max_body = max_body_bytes
        self.max_response = max_response_bytes
        self.check, self.error_body, self.upstream_name = check, error_body, upstream_name
        self.rewrite = rewrite
        self.grpc_upstream = grpc_upstream
        self._generate = None                   # the GenerateFront of grpc_upstream, made on first use
        self.server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self.refused = 0                        # requests answered here (4xx/5xx), for tests and logs

    async def start(self) -> None:
        """Listen (asyncio.start_server's wiring, with a ClientReader per connection)."""
        def protocol() -> asyncio.StreamReaderProtocol:
            return asyncio.StreamReaderProtocol(ClientReader(MAX_HEAD_BYTES), self._client)
        self.server = await asyncio.get_running_loop().create_server(protocol, *self.listen, reuse_address=True)

    async def serve(self) -> None:
        if self.server is None:
            await self.start()
        async with self.server:
            await self.server.serve_forever()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in list(self._tasks):
            t.cancel()
        if self._generate is not None:
            generate, self._generate = self._generate, None
            self._close_later(generate)

    async def aclose(self) -> None:
        """close(), then wait for what it started (the gRPC channel's close) to finish."""
        self.close()
        await asyncio.gather(*[t for t in self._tasks if t is not asyncio.current_task()], return_exceptions=True)

    def _generate_front(self):
        """The GenerateFront for the current grpc_upstream (a new one when it changed)."""
        from .generate_front import GenerateFront

        if self._generate is None or self._generate.address != self.grpc_upstream:
            if self._generate is not None:
                self._close_later(self._generate)
            self._generate = GenerateFront(self.grpc_upstream)
        return self._generate

    def _close_later(self, generate) -> None:
        """Close a GenerateFront's channel in the background (a task kept until it ran)."""
        task = asyncio.ensure_future(generate.aclose())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- one client connection ---------------------------------------------------------------
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    req = await self._read_request(reader, writer)
                except HttpError as e:
                    self.refused += 1
                    log.warning("refused a request: %d %s", e.status, e)
                    await self._answer(writer, e.status, str(e), e.field, e.sse)
                    return
                if req is None:
                    return
                if req.generate is not None:
                    if not await until_gone(reader, self._generate_front().serve(req.generate, req, writer)):
                        return
                    continue
                if up is None or up[0].at_eof() or up[1].is_closing():
                    if up is not None:
                        _close(up[1])
                    try:
                        up = await asyncio.open_connection(*self.upstream, limit=MAX_HEAD_BYTES)
                    except OSError as e:
                        self.refused += 1
                        await self._answer(writer, 502, f"{self.upstream_name} is not reachable "
                                                        f"({e.strerror or e}); it may be restarting: retry")
                        return
                if not await until_gone(reader, self._forward(req, up, writer)):
                    return
        except ClientGone:
            log.info("a client left before its response was complete: its upstream request was closed")
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ValueError):
            pass                            # a client or upstream that broke the protocol or went away
        except asyncio.CancelledError:
            pass
        finally:
            self._tasks.discard(task)
            if up is not None:
                _close(up[1])
            _close(writer)

    async def _read_request(self, reader, writer) -> Request | None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_TIMEOUT_S)
        except asyncio.IncompleteReadError as e:
            if e.partial.strip():
                raise HttpError(400, "incomplete request head")
            return None                                     # the client closed between requests
        except asyncio.LimitOverrunError:
            raise HttpError(431, f"request line and headers exceed {MAX_HEAD_BYTES} bytes")
        except asyncio.TimeoutError:
            return None
        if head.startswith(b"\r\n"):                        # a stray CRLF between requests (RFC 9112 2.2)
            head = head.lstrip(b"\r\n")
            if not head:
                return await self._read_request(reader, writer)
            if b"\r\n\r\n" not in head:
                head += await reader.readuntil(b"\r\n\r\n")
        method, target, version, headers = parse_head(head[:-4])
        req = Request(method, target, version, headers)
        conn = (req.header("connection") or "").lower()
        req.keep_alive = ("close" not in conn) if version == "HTTP/1.1" else ("keep-alive" in conn)
        kind, length = body_framing(headers)
        expect = (req.header("expect") or "").lower()
        if kind == "length" and length > self.max_body:
            if expect != "100-continue":                    # the client sends the body: read it first
                await _drain(reader, min(length, DRAIN_LIMIT_BYTES))
            raise HttpError(413, f"request body of {length} bytes exceeds the server's limit of "
                                 f"{self.max_body} bytes")
        if expect == "100-continue" and kind != "none":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        if kind == "length":
            req.body = await asyncio.wait_for(reader.readexactly(length), BODY_TIMEOUT_S)
        elif kind == "chunked":
            try:
                req.body = await asyncio.wait_for(_read_chunked(reader, self.max_body), BODY_TIMEOUT_S)
            except BodyTooLarge as e:
                # the client is still sending: read the rest (bounded) before answering
                await _drain_chunked(reader, e.unread)
                raise HttpError(413, f"chunked request body exceeds the server's limit of {e.limit} bytes")
        check_json(req.body, headers)
        if self.check is not None:
            self.check(req)
        if self.grpc_upstream is not None:
            from .generate_front import prepare
            req.generate = prepare(req)
        return req

    async def _answer(self, writer, status: int, message: str, field: str | None = None, sse: bool = False) -> None:
        body = self.error_body(status, message, field) if self.error_body else json.dumps({"error": message}).encode()
        kind = "application/json"
        if sse:
            body, kind = b"data: " + body + b"\n\n", "text/event-stream; charset=utf-8"
        head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        try:
            writer.write(head.encode() + body)
            await writer.drain()
        except ConnectionError:
            pass

    async def _forward(self, req: Request, up, writer) -> bool:
        """Send `req` upstream and stream the response back; True when the connection stays open."""
        up_reader, up_writer = up
        transform = self.rewrite(req) if self.rewrite is not None else None
        try:
            up_writer.write(upstream_head(req) + req.body)
            await up_writer.drain()
            resp = await _read_response_head(up_reader)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as e:
            self.refused += 1
            await self._answer(writer, 502, f"{self.upstream_name} closed the connection ({type(e).__name__}); "
                                            f"it may have died or be restarting: retry")
            return False
        resp.kind, resp.length = response_framing(req.method, resp)
        keep = req.keep_alive and resp.kind != "eof"
        if transform is not None:
            return await self._transformed(req, up_reader, up_writer, writer, resp, keep, transform)
        start = await self._map_model_error(up_reader, resp, writer)
        if start is None:
            return False
        peeked, first_line = start
        writer.write(client_head(req, resp, keep) + peeked)
        await writer.drain()
        # From here on an upstream failure can only cut the response short: close both sides.
        await self._relay_body(up_reader, writer, resp, len(peeked), first_line)
        if resp.closes or resp.kind == "eof":
            _close(up_writer)
        return keep

    async def _transformed(self, req: Request, up_reader, up_writer, writer, resp: Response, keep: bool,
                           transform) -> bool:
        """The whole response body read here (at most `max_response` bytes), `transform(status,
        body)` sent on with its length; a body or result over the limit: `transform.too_large`."""
        try:
            body = await _read_response_body(up_reader, resp, self.max_response)
        except BodyTooLarge as e:
            return await self._too_large(writer, up_writer, transform, e.limit)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, HttpError):
            self.refused += 1
            await self._answer(writer, 502, f"{self.upstream_name} closed the connection mid-response: retry")
            return False
        try:
            body = transform(resp.status, body)
        except Exception as e:              # the answer cannot be completed: say so, never half of it
            log.exception("rewriting a response failed")
            self.refused += 1
            await self._answer(writer, 502, f"the answer of {self.upstream_name} could not be completed here "
                                            f"({type(e).__name__}: {e})")
            return False
        if len(body) > self.max_response:
            return await self._too_large(writer, up_writer, transform, self.max_response)
        resp.headers = [(k, v) for k, v in resp.headers if k.lower() not in ("content-length", "transfer-encoding")]
        resp.headers.append(("Content-Length", str(len(body))))
        writer.write(client_head(req, resp, keep) + body)
        await writer.drain()
        if resp.closes or resp.kind == "eof":
            _close(up_writer)
        return keep

    async def _too_large(self, writer, up_writer, transform, limit: int) -> bool:
        """Answer a transformed response over `limit` with the transform's own error; the upstream
        connection is closed (whatever is left of its body is never read)."""
        _close(up_writer)
        self.refused += 1
        err = transform.too_large(limit)
        await self._answer(writer, err.status, str(err), err.field)
        return False

    async def _map_model_error(self, up_reader, resp: Response, writer) -> tuple[bytes, bytes | None] | None:
        """-> (the body's start read here, a chunk-size line read but not sent) for the relay, or None
        when the upstream broke off (answered 502 here). tritonserver 2.51 answers every model error
        400 (it reads the code of a freed error); a full queue is retryable: this turns it into 503
        with Retry-After, told by the model's stable message."""
        if not (resp.status == 400 and (resp.kind == "chunked" or resp.kind == "length" and resp.length <= PEEK_BYTES)):
            return b"", None
        try:
            peeked, first_line = await _peek(up_reader, resp.kind, resp.length)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            self.refused += 1
            await self._answer(writer, 502, f"{self.upstream_name} closed the connection mid-response: retry")
            return None
        if QUEUE_FULL in peeked:
            resp.status, resp.reason = 503, REASONS[503]
            resp.headers.append(("Retry-After", str(RETRY_AFTER_S)))
        return peeked, first_line

    async def _relay_body(self, up_reader, writer, resp: Response, sent: int, first_line: bytes | None) -> None:
        """Copy the response body on as it comes, after the `sent` bytes the head went out with."""
        if resp.kind == "length":
            await _copy(up_reader, writer, resp.length - sent)
        elif resp.kind == "chunked":
            sse = resp.lower.get("content-type", "").startswith("text/event-stream")
            await self._relay_chunks(up_reader, writer, first_line, sse)
        elif resp.kind == "eof":
            while data := await up_reader.read(65536):
                writer.write(data)
                await writer.drain()

    async def _relay_chunks(self, up_reader, writer, first_line: bytes | None, sse: bool) -> None:
        """Copy a chunked body chunk by chunk, trailers included (`first_line`: a size line read
        already); cut off between two chunks, an SSE stream gets an error event first."""
        at_boundary = True
        try:
            while True:
                line = first_line if first_line is not None else await up_reader.readuntil(b"\r\n")
                first_line = None
                size = int(line[:-2].split(b";", 1)[0].strip(), 16)
                writer.write(line)
                at_boundary = False
                if size == 0:
                    while True:
                        trailer = await up_reader.readuntil(b"\r\n")
                        writer.write(trailer)
                        if trailer == b"\r\n":
                            break
                    await writer.drain()
                    return
                await _copy(up_reader, writer, size + 2)
                at_boundary = True
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            if sse and at_boundary:
                await self._send_cut_event(writer)
            raise

    async def _send_cut_event(self, writer) -> None:
        """An SSE client gets an error event, as tritonserver sends them; the connection is then
        closed without the last chunk, so an HTTP client sees the response cut short."""
        if writer.is_closing():
            return
        event = cut_event(self.upstream_name)
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        try:
            await writer.drain()
        except ConnectionError:
            pass


async def _peek(reader: asyncio.StreamReader, kind: str, length: int) -> tuple[bytes, bytes | None]:
    """The start of an error response, to re-send as read -> (bytes, a chunk-size line read but
    not consumed): the whole body (`length`), or the first chunk with its framing (`chunked`;
    a first chunk that is empty or larger than PEEK_BYTES is left to the copy loop)."""
    if kind == "length":
        return await reader.readexactly(length), None
    line = await reader.readuntil(b"\r\n")
    size = int(line[:-2].split(b";", 1)[0].strip(), 16)
    if not 0 < size <= PEEK_BYTES:
        return b"", line
    return line + await reader.readexactly(size + 2), None


async def _read_chunked(reader: asyncio.StreamReader, limit: int) -> bytes:
    """A chunked body, de-chunked (trailers dropped); BodyTooLarge as soon as it passes `limit`
    bytes (the chunk that passes it is not read)."""
    parts, total = [], 0
    while True:
        line = await reader.readuntil(b"\r\n")
        size_text = line[:-2].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
            if size < 0 or len(size_text) > 16:
                raise ValueError
        except ValueError:
            raise HttpError(400, f"bad chunk size {size_text[:20]!r}")
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":     # trailers: dropped
                pass
            return b"".join(parts)
        total += size
        if total > limit:
            raise BodyTooLarge(limit, size + 2)
        data = await reader.readexactly(size + 2)
        if data[-2:] != b"\r\n":
            raise HttpError(400, "chunk not followed by CRLF")
        parts.append(data[:-2])


async def _read_response_body(reader: asyncio.StreamReader, resp: Response, limit: int) -> bytes:
    """A response's whole body, as its framing says; BodyTooLarge past `limit` bytes."""
    if resp.kind == "length":
        if resp.length > limit:
            raise BodyTooLarge(limit)
        return await reader.readexactly(resp.length)
    if resp.kind == "chunked":
        return await _read_chunked(reader, limit)
    if resp.kind == "eof":
        body = bytearray()
        while data := await reader.read(65536):
            body += data
            if len(body) > limit:
                raise BodyTooLarge(limit)
        return bytes(body)
    return b""


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    while n > 0:
        data = await reader.read(min(n, 65536))
        if not data:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(data)
        writer.write(data)
        await writer.drain()


async def _drain(reader: asyncio.StreamReader, n: int) -> None:
    """Read and drop up to n bytes (at most DRAIN_TIMEOUT_S), so a refused client reads our answer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DRAIN_TIMEOUT_S
    try:
        while n > 0:
            left = deadline - loop.time()
            if left <= 0:
                return
            data = await asyncio.wait_for(reader.read(min(n, 1 << 20)), left)
            if not data:
                return
            n -= len(data)
    except (asyncio.TimeoutError, ConnectionError):
        return


async def _drain_chunked(reader: asyncio.StreamReader, rest_of_chunk: int) -> None:
    """Drop the rest of a chunked body: this chunk's `rest_of_chunk` bytes, then whole chunks (bounded)."""
    loop = asyncio.get_running_loop()
    deadline, budget = loop.time() + DRAIN_TIMEOUT_S, DRAIN_LIMIT_BYTES
    try:
        n = rest_of_chunk
        while budget > 0:
            await _drain(reader, min(n, budget))
            budget -= n
            line = await asyncio.wait_for(reader.readuntil(b"\r\n"), max(0.01, deadline - loop.time()))
            n = int(line[:-2].split(b";", 1)[0].strip(), 16) + 2
            if n == 2:
                return
    except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
            ValueError):
        return


def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except Exception:                                 # pragma: no cover - a socket already gone
        pass


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.http_front", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", required=True, help="HOST:PORT to listen on (the public HTTP port)")
    p.add_argument("--upstream", required=True, help="HOST:PORT of tritonserver's HTTP port")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s http_front: %(message)s")
    front = Front(*_hostport(args.listen), *_hostport(args.upstream), max_body_bytes=args.max_body_bytes)

    async def run():
        await front.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, front.close)
        try:
            await front.serve()
        except asyncio.CancelledError:
            pass
    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
