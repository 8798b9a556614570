"""Liveness probe: can the model serve right now? Runs one real one-token request.

tritonserver's /v2/health/ready and model-ready keep answering 200 after the python stub died (every
request then fails with "Stub process ... is not healthy"), so readiness here is a generation:

    python -m deploy.probe --url http://127.0.0.1:8000 [--timeout 10]   # exit 0: serving
    python -m deploy.probe --http-port 8000                              # the same

Exit status: 0 serving, 1 not serving (the reason on stderr), 2 bad arguments.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

MODEL = "lookahead_llm"
PROBE_PROMPT = "ping"


@dataclass
class ProbeResult:
    ok: bool
    detail: str                 # one line: what answered, or why it could not
    seconds: float
    busy: bool = False          # refused because the server is full, or timed out: alive but loaded
    http_status: int | None = None

    def __str__(self) -> str:
        return f"{'serving' if self.ok else 'not serving'}: {self.detail} ({self.seconds:.2f} s)"


def _request_body() -> bytes:
    return json.dumps({"text_input": PROBE_PROMPT, "max_tokens": 1, "temperature": 0.0,
                       "exclude_input_in_output": True}).encode()


def _judge(status: int, payload: bytes, seconds: float) -> ProbeResult:
    """A /generate answer -> ProbeResult (shared by the blocking and the asyncio probe)."""
    try:
        out = json.loads(payload)
    except ValueError:
        out = None
    if status != 200:
        msg = out.get("error", "") if isinstance(out, dict) else ""
        busy = status in (429, 503) or "queue" in msg.lower()
        return ProbeResult(False, f"HTTP {status}: {msg or repr(payload[:120])}", seconds, busy=busy,
                           http_status=status)
    if not isinstance(out, dict) or out.get("num_output_tokens") != 1 or "text_output" not in out:
        return ProbeResult(False, f"unexpected answer {payload[:120]!r}", seconds, http_status=200)
    return ProbeResult(True, "1 token generated", seconds, http_status=200)


async def probe_async(host: str, port: int, timeout: float = 10.0, model: str = MODEL) -> ProbeResult:
    """The same request over asyncio (cancellable): for a supervisor that must not block on it."""
    import asyncio

    t0 = time.monotonic()
    body = _request_body()
    head = (f"POST /v2/models/{model}/generate HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")

    async def exchange() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(head.encode() + body)
            await writer.drain()
            raw = await reader.read(-1)                       # Connection: close: the answer, then EOF
        finally:
            writer.close()
        status_line, _, rest = raw.partition(b"\r\n")
        headers, _, payload = rest.partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in headers.lower():
            payload = _dechunk(payload)
        return int(status_line.split(b" ")[1]), payload
    try:
        status, payload = await asyncio.wait_for(exchange(), timeout)
    except asyncio.TimeoutError:
        return ProbeResult(False, f"no answer within {timeout:g} s", time.monotonic() - t0, busy=True)
    except (OSError, ValueError, IndexError) as e:
        return ProbeResult(False, f"cannot connect or bad answer: {e}", time.monotonic() - t0)
    return _judge(status, payload, time.monotonic() - t0)


def _dechunk(data: bytes) -> bytes:
    out = []
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out.append(data[:size])
        data = data[size + 2:]
    return b"".join(out)


def probe(url: str, timeout: float = 10.0, model: str = MODEL) -> ProbeResult:
    """POST one greedy one-token /generate request; ok when a token came back."""
    body = _request_body()
    req = urllib.request.Request(f"{url.rstrip('/')}/v2/models/{model}/generate", body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    took = lambda: time.monotonic() - t0          # noqa: E731
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # never via $http_proxy
    try:
        with opener.open(req, timeout=timeout) as r:
            return _judge(r.status, r.read(), took())
    except urllib.error.HTTPError as e:
        try:
            payload = e.read()
        except OSError:
            payload = b""
        return _judge(e.code, payload, took())
    except (socket.timeout, TimeoutError) as e:
        return ProbeResult(False, f"no answer within {timeout:g} s ({e})", took(), busy=True)
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            return ProbeResult(False, f"no answer within {timeout:g} s", took(), busy=True)
        return ProbeResult(False, f"cannot connect: {e.reason}", took())
    except (OSError, ValueError) as e:
        return ProbeResult(False, f"{type(e).__name__}: {e}", took())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="the server's HTTP URL (default http://127.0.0.1:<--http-port>)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the token")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--quiet", action="store_true", help="print nothing; the exit status says it")
    args = p.parse_args(argv)
    result = probe(args.url or f"http://127.0.0.1:{args.http_port}", args.timeout, args.model)
    if not args.quiet:
        print(result, file=sys.stdout if result.ok else sys.stderr)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
