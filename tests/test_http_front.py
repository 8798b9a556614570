"""deploy.http_front without a server: the heads it sends each way, and a stream cut mid-response."""
from __future__ import annotations

import asyncio

from deploy.http_front import Front, Request, Response, client_head, response_framing, upstream_head


def _response(status: int, headers: list[tuple[str, str]], version: str = "HTTP/1.1") -> Response:
    return Response(version, status, "OK", headers, {k.lower(): v for k, v in headers})


def test_the_upstream_head_drops_hop_by_hop_headers_and_states_the_body_length():
    chunked = Request("POST", "/v2/models/m/generate", "HTTP/1.1",
                      [("Host", "x"), ("Transfer-Encoding", "chunked"), ("Connection", "keep-alive"),
                       ("Expect", "100-continue")], body=b"{}")
    assert upstream_head(chunked) == b"POST /v2/models/m/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n"
    old = Request("GET", "/v2/health/ready", "HTTP/1.0", [])
    assert upstream_head(old) == b"GET /v2/health/ready HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"


def test_the_response_framing_and_the_clients_head():
    assert response_framing("HEAD", _response(200, [("Content-Length", "5")])) == ("none", 0)
    assert response_framing("GET", _response(204, [])) == ("none", 0)
    assert response_framing("GET", _response(200, [("Transfer-Encoding", "Chunked")])) == ("chunked", 0)
    assert response_framing("GET", _response(200, [("Content-Length", "12")])) == ("length", 12)
    assert response_framing("GET", _response(200, [("Content-Length", "x")])) == ("eof", 0)
    assert _response(200, [], "HTTP/1.0").closes and _response(200, [("Connection", "close")]).closes
    assert not _response(200, []).closes and not _response(200, [("Connection", "keep-alive")], "HTTP/1.0").closes
    resp = _response(200, [("Content-Length", "1"), ("Connection", "close"), ("Keep-Alive", "5")])
    assert client_head(Request("GET", "/", "HTTP/1.0", []), resp, keep=True) == \
        b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\nConnection: keep-alive\r\n\r\n"


def _relay(answer: bytes, upstream_name: str = "tritonserver") -> bytes:
    """What a client reads from a Front whose upstream sends `answer` and closes."""
    async def upstream(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def main():
        up = await asyncio.start_server(upstream, "127.0.0.1", 0)
        front = Front("127.0.0.1", 0, "127.0.0.1", up.sockets[0].getsockname()[1], upstream_name=upstream_name)
        await front.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", front.server.sockets[0].getsockname()[1])
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        got = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        front.close()
        up.close()
        return got

    return asyncio.run(main())


def test_a_stream_cut_between_chunks_ends_with_an_error_event_and_no_last_chunk():
    event = b'data: {"text_output":"a"}\n\n'
    chunk = b"%x\r\n%s\r\n" % (len(event), event)
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
    sse = _relay(head + b"Content-Type: text/event-stream\r\n\r\n" + chunk)
    assert sse.startswith(b"HTTP/1.1 200 OK\r\n") and chunk in sse
    tail = sse.split(chunk, 1)[1]
    assert b'"error": "tritonserver closed the stream' in tail and not tail.endswith(b"0\r\n\r\n"), sse
    assert b'"error": "dynamo closed the stream' in _relay(head + b"Content-Type: text/event-stream\r\n\r\n" + chunk,
                                                          upstream_name="dynamo")
    # not SSE, or cut inside a chunk: the connection just closes, the response short
    assert _relay(head + b"\r\n" + chunk).endswith(chunk)
    mid = _relay(head + b"Content-Type: text/event-stream\r\n\r\n" + chunk[:9])
    assert mid.endswith(chunk[:9]) and b"error" not in mid


def test_a_client_that_leaves_closes_its_upstream_request():
    """Issue 41 item 2: the front watched the client only while writing to it, so a client gone
    before the first response byte (a long prefill) left its request running upstream. Now the
    upstream connection is closed when the client goes, which is what makes the server behind
    (Dynamo's frontend) abort the request. Counted by the upstream itself: it sees its request's
    connection end without having answered. A pipelined second request is not mistaken for a
    disconnect, and keep-alive still serves it."""
    async def main():
        arrived, closed = asyncio.Queue(), asyncio.Queue()

        async def upstream(reader, writer):
            while head := await reader.readuntil(b"\r\n\r\n"):
                target = head.split(b" ")[1]
                await arrived.put(target)
                if target == b"/slow":                   # never answers: a prefill that goes on
                    await reader.readexactly(2)          # its body
                    await closed.put(await reader.read())    # b"" once the front closes the connection
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()

        up = await asyncio.start_server(upstream, "127.0.0.1", 0)
        front = Front("127.0.0.1", 0, "127.0.0.1", up.sockets[0].getsockname()[1])
        await front.start()
        port = front.server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            assert await asyncio.wait_for(arrived.get(), 10) == b"/slow"
            writer.close()                               # the client leaves before any response byte
            assert await asyncio.wait_for(closed.get(), 10) == b""

            # two pipelined requests on one connection: both answered, nothing closed early
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            for _ in range(2):
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200 ") and await reader.readexactly(2) == b"ok"
            writer.close()
        finally:
            await front.aclose()
            up.close()

    asyncio.run(main())
