"""The request target at the public port (deploy/request_target.py), as a class: a table of targets
sent through a real Front to a fake upstream that records what reaches it.

Issue 41 item 3: an absolute-form target or a `#fragment` skipped the front's checks (the OpenAI
checks keyed on the raw target) while the server behind still routed the request. Now every target
is parsed once; what is not plain origin-form is a 400 that never reaches the upstream, and the checks,
the /generate handling and the upstream all see the one normalised path.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from deploy.http_front import Front
from deploy.openai_front import check_openai_request, openai_error_body
from deploy.request_target import TargetError, parse_target

CHAT = "/v1/chat/completions"
TOOLS = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "tools": [{"type": "function", "function": {"name": "f"}}]}).encode()
OK = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()

# target -> what the upstream receives (None: refused with 400, nothing upstream)
TARGETS = {
    "/v2/health/ready": "/v2/health/ready",
    "/v2/health/ready/": "/v2/health/ready",                    # one trailing slash: dropped, here and upstream
    "/v2/models/m/generate?x=1&y=a/../b": "/v2/models/m/generate?x=1&y=a/../b",   # the query passes as sent
    "/v2/models/a%20b": "/v2/models/a%20b",                      # an escape that does not route passes
    "/": "/",
    "http://127.0.0.1:8000/v2/health/ready": None,               # absolute-form
    "127.0.0.1:8000": None,                                      # authority-form
    "*": None,                                                   # asterisk-form
    "/v2/health/ready#x": None,                                  # a fragment
    "/v2/health/ready?#": None,
    "/v2/../v1/models": None,                                    # dot segments
    "/v2/./health/ready": None,
    "/v2//health/ready": None,                                   # an empty segment
    "/v1/chat%2Fcompletions": None,                              # escapes that would route
    "/v1/chat/completion%73": None,
    "/v1/%2e%2e/v1/models": None,
    "/v1/models%2": None,                                        # a malformed escape
    "/v1\\models": None,                                         # a backslash
    "/v1/mod\u00e9ls": None,                                     # not ASCII
}


def _exchange(requests: list[bytes], check=None) -> tuple[list[bytes], list[bytes]]:
    """Send each raw request on its own connection through a Front to a fake upstream ->
    (what each client read, the request lines the upstream received)."""
    seen: list[bytes] = []

    async def upstream(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                seen.append(head.split(b"\r\n", 1)[0])
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main():
        up = await asyncio.start_server(upstream, "127.0.0.1", 0)
        front = Front("127.0.0.1", 0, "127.0.0.1", up.sockets[0].getsockname()[1], check=check,
                      error_body=openai_error_body if check else None)
        await front.start()
        port = front.server.sockets[0].getsockname()[1]
        answers = []
        for raw in requests:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(raw)
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            answers.append(head + await reader.readexactly(length))
            writer.close()
        await front.aclose()
        up.close()
        return answers

    return asyncio.run(main()), seen


def _get(target: str) -> bytes:
    return f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode("utf-8")


def test_each_target_is_forwarded_normalised_or_refused_before_the_upstream():
    answers, seen = _exchange([_get(t) for t in TARGETS])
    forwarded = iter(seen)
    for (target, expected), answer in zip(TARGETS.items(), answers):
        if expected is None:
            assert answer.startswith(b"HTTP/1.1 400 "), (target, answer)
            assert b"request target" in answer, (target, answer)
        else:
            assert answer.startswith(b"HTTP/1.1 200 "), (target, answer)
            assert next(forwarded) == f"GET {expected} HTTP/1.1".encode(), target
    assert next(forwarded, None) is None                  # nothing refused reached the upstream


def _post(target: str, body: bytes) -> bytes:
    return f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def test_the_openai_checks_key_on_the_normalised_path():
    """Every form of the chat route either gets the `tools` check or is refused as a target: none
    reaches the upstream with `tools` unchecked."""
    forms = [CHAT, CHAT + "/", CHAT + "?stream=1", "http://127.0.0.1:8000" + CHAT, CHAT + "#x",
             "/v1/chat/completion%73", "/v1/./chat/completions"]
    answers, seen = _exchange([_post(t, TOOLS) for t in forms] + [_post(CHAT + "/", OK)], check=check_openai_request)
    for target, answer in zip(forms, answers):
        assert answer.startswith(b"HTTP/1.1 400 "), (target, answer)
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == 400, (target, body)
        if "#" not in target and "://" not in target and "%" not in target and "/./" not in target:
            assert body["error"]["param"] == "tools", (target, body)
    assert answers[-1].startswith(b"HTTP/1.1 200 ") and seen == [f"POST {CHAT} HTTP/1.1".encode()]


@pytest.mark.parametrize("target", [t for t, expected in TARGETS.items() if expected is None])
def test_the_parser_names_what_is_wrong(target):
    with pytest.raises(TargetError, match="request target"):
        parse_target(target)
