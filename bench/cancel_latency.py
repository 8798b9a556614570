"""How fast a client that leaves during its prefill stops the engine, through a running server.

    scripts/serve.sh start --engine engines/default
    python -m bench.cancel_latency --prompt-words 3700 --after-tokens 1024 --json results/cancel.json

For each route (/generate, /generate_stream) and repeat: a fresh long prompt (seeded random words,
so no prefix-cache hit) goes to the front on a raw socket; once the engine's computed prompt tokens
(the metrics endpoint's `lookahead_prompt_tokens_total`) have grown by --after-tokens, the socket is
closed; then it waits for `lookahead_aborted_requests_total` to grow. Reported per run: seconds from
the close to the abort being visible, prompt tokens computed after the close, output tokens (0 when
the abort landed in the prefill). The engine should be otherwise idle: the deltas are the server's.

The issue 41 target: the prefill stops within ~1 s of the disconnect. Table on stdout, JSON with --json.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import select
import socket
import sys
import time
import urllib.request

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def scrape(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^(lookahead_\w+)\{[^}]*\} (\S+)$", text, re.M):
        out[m[1]] = out.get(m[1], 0.0) + float(m[2])
    return out


def wait_delta(metrics_url: str, before: dict, name: str, at_least: float, timeout_s: float,
               poll_s: float = 0.02, sock: socket.socket | None = None) -> tuple[float, dict]:
    """(the time `name` grew by `at_least` over `before`, the deltas then); with `sock`, an answer
    that comes first (the server refused the request) is an error carrying it."""
    deadline = time.monotonic() + timeout_s
    while True:
        if sock is not None:
            ready, _, _ = select.select([sock], [], [], 0)
            if ready:
                answer = sock.recv(2048).decode(errors="replace")
                raise RuntimeError(f"the server answered before the engine computed {at_least} prompt tokens: "
                                   f"{' '.join(answer.split())[:400]!r}")
        now = scrape(metrics_url)
        delta = {k: v - before.get(k, 0.0) for k, v in now.items()}
        if delta.get(name, 0.0) >= at_least:
            return time.monotonic(), delta
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not grow by {at_least} within {timeout_s} s (deltas {delta})")
        time.sleep(poll_s)


def one(host: str, port: int, metrics_url: str, model: str, route: str, prompt: str,
        after_tokens: int, timeout_s: float) -> dict:
    body = json.dumps({"text_input": prompt, "max_tokens": 512, "ignore_eos": True,
                       "stream": route == "generate_stream"}).encode()
    before = scrape(metrics_url)
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(b"POST /v2/models/%s/%s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (model.encode(), route.encode(), len(body), body))
        _, at_close = wait_delta(metrics_url, before, "lookahead_prompt_tokens_total", after_tokens, timeout_s,
                                 sock=s)
    t_close = time.monotonic()
    t_abort, aborted = wait_delta(metrics_url, before, "lookahead_aborted_requests_total", 1, timeout_s)
    return {"route": route, "abort_after_close_s": round(t_abort - t_close, 3),
            "prompt_tokens_at_close": int(at_close["lookahead_prompt_tokens_total"]),
            "prompt_tokens_after_close": int(aborted["lookahead_prompt_tokens_total"]
                                             - at_close["lookahead_prompt_tokens_total"]),
            "output_tokens": int(aborted.get("lookahead_output_tokens_total", 0.0)),
            "interrupted_steps": int(aborted.get("lookahead_interrupted_steps_total", 0.0))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the front (scripts/serve.sh's HTTP port)")
    ap.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    ap.add_argument("--model", default="lookahead_llm")
    ap.add_argument("--routes", default="generate,generate_stream")
    ap.add_argument("--prompt-words", type=int, default=3700,
                    help="words of the prompt (~1.7 tokens each: 3,700 are ~6.2K tokens)")
    ap.add_argument("--after-tokens", type=int, default=1024,
                    help="disconnect once the engine has computed this many prompt tokens")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--json", help="write the runs here")
    args = ap.parse_args(argv)
    m = re.fullmatch(r"http://([^:/]+):(\d+)/?", args.url)
    if not m:
        ap.error(f"--url: {args.url!r} is not http://HOST:PORT")
    rows = []
    for i in range(args.repeat):
        for route in args.routes.split(","):
            rng = random.Random(f"{route}-{i}-{time.time_ns()}")
            prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
            rows.append(one(m[1], int(m[2]), args.metrics_url, args.model, route, prompt,
                            args.after_tokens, args.timeout_s))
            r = rows[-1]
            print(f"{r['route']:<16} abort {r['abort_after_close_s']:6.2f} s after the close   prompt tokens "
                  f"{r['prompt_tokens_at_close']:>6} at it, +{r['prompt_tokens_after_close']:<5} after   "
                  f"output {r['output_tokens']}   interrupted steps {r['interrupted_steps']}", flush=True)
    worst = max(r["abort_after_close_s"] for r in rows)
    print(f"worst: {worst:.2f} s from a disconnect to the engine's abort ({len(rows)} runs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "runs": rows, "worst_s": worst}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
