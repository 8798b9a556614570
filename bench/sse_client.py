"""A lean asyncio client for streaming OpenAI requests (server-sent events over HTTP/1.1).

    async for t, event in stream_json("http://127.0.0.1:8010/v1/completions", body):
        ...   # t: time.perf_counter() when the event's bytes arrived; event: the parsed `data:` JSON

Why not the `openai` SDK: a load generator shares this machine's cores with the server it measures.
The SDK builds an httpx response and a pydantic model for every chunk, which costs more CPU per
token than the server's own frontend does; on 2 cores, that work pre-empts the engine's threads
mid-step, so a 1-stream run measured the client: served/in-process was 75.7% with the SDK and
100.7% with this client (load_test --rounds 4, int8 engine behind Dynamo, one run each). This
client reads the socket, undoes chunked transfer encoding and parses each `data:` line with
`json.loads`, nothing more.

A status other than 200 raises `HttpStatusError` with the body's text; an SSE `error` event (a
server that failed after it had sent 200) raises `StreamError`. One connection per request
(`Connection: close`), as a client on another machine would open.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from typing import Any, AsyncIterator


class HttpStatusError(RuntimeError):
    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text[:400]}")
        self.status, self.text = status, text


class StreamError(RuntimeError):
    """The server reported an error inside the event stream."""


def split_url(url: str) -> tuple[str, int, str]:
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http":
        raise ValueError(f"{url!r}: only http:// URLs are supported")
    return u.hostname or "127.0.0.1", u.port or 80, (u.path or "/") + (f"?{u.query}" if u.query else "")


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives, chunked transfer encoding undone."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


async def stream_json(url: str, body: dict[str, Any], timeout: float = 600.0) -> AsyncIterator[tuple[float, Any]]:
    """POST `body` as JSON to `url` and yield (arrival time, parsed JSON) for each SSE `data:`
    event until `[DONE]` or the end of the stream."""
    host, port, path = split_url(url)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        payload = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                     .encode() + payload)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), timeout)
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise HttpStatusError(0, f"not an HTTP response: {status_line[:100]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != 200:
            text = b"".join([chunk async for chunk in _body(reader, headers)])
            raise HttpStatusError(status, text.decode("utf-8", "replace"))
        pending = b""
        async for data in _body(reader, headers):
            now = time.perf_counter()
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                event = json.loads(payload)
                if isinstance(event, dict) and "error" in event and "choices" not in event:
                    raise StreamError(str(event["error"]))
                yield now, event
    finally:
        writer.close()
