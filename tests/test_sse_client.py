"""bench/sse_client.py against an asyncio HTTP server on loopback: chunked and close-delimited
bodies, events split across chunks, [DONE], a non-200 status and an SSE error event."""
from __future__ import annotations

import asyncio
import json

import pytest

from bench.sse_client import HttpStatusError, StreamError, split_url, stream_json


async def serve(handler):
    """A one-connection-at-a-time server; `handler(body) -> (status, headers, [raw pieces])`."""
    seen: list[dict] = []

    async def on_conn(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
        body = json.loads(await reader.readexactly(length))
        seen.append({"head": head.decode(), "body": body})
        status, headers, pieces = handler(body)
        writer.write(f"HTTP/1.1 {status} X\r\n".encode() + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers)
                     + b"\r\n")
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def chunked(*pieces: bytes) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]


def events(*objs) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs)


async def collect(url, body):
    return [event async for _, event in stream_json(url, body)]


def run(handler, body=None):
    async def main():
        server, port, seen = await serve(handler)
        async with server:
            try:
                return await collect(f"http://127.0.0.1:{port}/v1/completions", body or {"prompt": "hi"}), seen
            finally:
                server.close()
    return asyncio.run(main())


def test_chunked_events_split_anywhere_are_reassembled_and_done_ends_the_stream():
    stream = events({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, {"choices": [], "usage": {"n": 2}})
    stream += b"data: [DONE]\n\n" + events({"choices": [{"text": "after done"}]})
    cuts = [0, 3, 17, 18, 40, len(stream)]            # pieces that cut a `data:` line and a JSON value
    pieces = [stream[a:b] for a, b in zip(cuts, cuts[1:])]
    got, seen = run(lambda body: (200, [("Transfer-Encoding", "chunked")], chunked(*pieces)), {"prompt": "p", "n": 1})
    assert got == [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, {"choices": [], "usage": {"n": 2}}]
    assert seen[0]["body"] == {"prompt": "p", "n": 1}
    assert seen[0]["head"].startswith("POST /v1/completions HTTP/1.1\r\n")


def test_a_close_delimited_body_and_comment_lines():
    raw = b": keep-alive\n\n" + events({"x": 1}) + b"event: ping\n\n" + events({"x": 2})
    got, _ = run(lambda body: (200, [("Content-Type", "text/event-stream")], [raw[:5], raw[5:]]))
    assert got == [{"x": 1}, {"x": 2}]


def test_a_refused_request_raises_with_the_status_and_body():
    msg = b'{"error": {"message": "max_tokens must be positive"}}'
    with pytest.raises(HttpStatusError) as e:
        run(lambda body: (400, [("Content-Length", str(len(msg)))], [msg]))
    assert e.value.status == 400 and "max_tokens must be positive" in e.value.text


def test_an_error_event_inside_a_200_stream_raises():
    raw = events({"choices": [{"text": "a"}]}, {"error": {"message": "engine died"}})
    with pytest.raises(StreamError, match="engine died"):
        run(lambda body: (200, [("Transfer-Encoding", "chunked")], chunked(raw)))


def test_only_plain_http_urls():
    assert split_url("http://h:81/v1/completions") == ("h", 81, "/v1/completions")
    with pytest.raises(ValueError, match="only http://"):
        split_url("https://h/v1")
