"""Request-level limits (issue 19): queue admission, malformed parameters, size bounds before
tokenizing, tokenizing off the step loop; in process, then through a real tritonserver."""
from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from runtime.config import LookaheadConfig, ModelConfig
from runtime.engine import Engine
from runtime.engine_dir import TOKENIZER_DIR, write_manifest
from runtime.errors import RequestError
from runtime.sampling import SamplingParams
from runtime.scheduler import QueueFullError
from serving.loop import EngineLoop, encode_releasing_gil
from serving.request import (MAX_JSON_BYTES, MAX_STOP_STRINGS, RequestLimits, max_token_bytes,
                                     parse_request)
from runtime.tokenizer import TextTokenizer
from tiny_engine import TINY, byte_tokenizer, make_tiny_engine
from triton_fixtures import triton_backend_dir  # noqa: F401  (a session fixture)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = ROOT / "engines" / "default" / "tokenizer"
LONG_TOKEN = "z" * 1024


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("limits_tiny"), seed=5)


def long_token_engine(path: Path, **lookahead) -> Path:
    """The tiny engine whose tokenizer also has one 1024-byte token: its byte bound is 1024x the
    token bound, so a prompt of a few hundred KB passes the byte check and must be tokenized
    (the byte-level BPE without merges takes ~2 s a MB here)."""
    cfg = LookaheadConfig(**lookahead)
    make_tiny_engine(path, seed=7, lookahead=cfg, vocab_size=257)
    tok = byte_tokenizer()
    tok.add_tokens([LONG_TOKEN])
    tok.save(str(path / TOKENIZER_DIR / "tokenizer.json"))
    write_manifest(path, name="tiny-long-token", model=ModelConfig(**{**TINY, "vocab_size": 257}), dtype="float32",
                   lookahead=cfg, source={"kind": "random", "seed": 7}, versions={})
    return path


def text(s) -> np.ndarray:
    return np.array([s.encode() if isinstance(s, str) else s], dtype=np.object_)


def parse(parameters=None, limits=None, **inputs):
    return parse_request(inputs.get, parameters, limits)


# ---- queue admission ----------------------------------------------------------------------------
def test_a_burst_fills_free_batch_slots_before_the_queue(tiny_dir):
    """Issue 19: with max_queue 4 a burst of 16 got 4-6 accepted while 8 batch slots were free,
    because requests still in the engine's inbox counted as queued. Now 8 start + 4 wait."""
    engine = Engine.from_dir(tiny_dir, max_queue=4)          # max_batch_size 8, blocks for 8 full contexts
    accepted, refused = 0, []
    for i in range(16):                                      # no step runs: all stay in the inbox
        try:
            engine.add_request(f"burst {i}", SamplingParams(max_tokens=4))
            accepted += 1
        except QueueFullError as e:
            refused.append(str(e))
    assert accepted == 8 + 4 and len(refused) == 4
    assert "queue is full" in refused[0] and "retry later" in refused[0]
    engine.step()                                            # 8 admitted, 4 waiting: still full
    assert (len(engine.scheduler.running), len(engine.scheduler.waiting)) == (8, 4)
    with pytest.raises(QueueFullError):
        engine.add_request("one more", SamplingParams(max_tokens=4))


def test_queue_count_follows_free_blocks_in_arrival_order(tiny_dir):
    engine = Engine.from_dir(tiny_dir, max_queue=1, num_host_blocks=4)   # block_size 16: 64 tokens
    sched = engine.scheduler

    def seq(n_tokens, max_tokens):
        rid = engine.add_request([3] * n_tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return engine._seqs[rid][0]
    big = seq(40, 8)                    # 48 tokens: 3 blocks
    small = seq(10, 6)                  # 1 block: fits after big
    # Known sizes: big and small start (4 blocks), a third 1-block request would wait.
    assert sched.num_queued_after([big, small], None) == 1
    # A 3-block request after big cannot start (1 block left); FIFO keeps small behind it.
    assert sched.num_queued_after([big, big, small], None) == 3
    # A bare count (the engine's current call) assumes one block each: batch slots decide.
    assert sched.num_queued_after(2, None) == 0
    engine.step()
    assert sched.num_queued_after(0, big) == 1 and sched.num_queued_after(0, small) == 1


def test_n_the_engine_can_never_hold_is_refused_naming_n_and_a_possible_one_waits(tiny_dir):
    """Issue 41: n over the batch slots plus the queue got QueueFullError ("retry later") on an idle
    engine, every time. It is a CapacityError naming `n` and the limit; n at the limit is taken (the
    rest of its choices wait), and the limit follows the pool when blocks, not slots, bound it."""
    from runtime.errors import CapacityError

    engine = Engine.from_dir(tiny_dir, max_queue=2, max_batch_size=4)
    with pytest.raises(CapacityError) as err:
        engine.add_request("x", SamplingParams(max_tokens=4, n=7))
    assert not isinstance(err.value, QueueFullError) and err.value.field == "n"
    assert str(err.value).startswith("n: 7 choices can never be held at once") and "send n <= 6" in str(err.value)
    rid = engine.add_request("x", SamplingParams(max_tokens=4, n=6))      # 4 start, 2 wait
    engine.step()
    assert (len(engine.scheduler.running), len(engine.scheduler.waiting)) == (4, 2) and rid in engine._seqs
    small = Engine.from_dir(tiny_dir, max_queue=1, max_batch_size=4, num_host_blocks=4)   # block_size 16
    with pytest.raises(CapacityError, match=r"^n: 4 choices .* runs 2 sequences .*send n <= 3"):
        small.add_request([3] * 20, SamplingParams(max_tokens=8, n=4, ignore_eos=True))   # 2 blocks each
    small.add_request([3] * 20, SamplingParams(max_tokens=8, n=3, ignore_eos=True))


# ---- malformed parameters -----------------------------------------------------------------------
MALFORMED = {
    "100000 nested [ (the issue's)": (dict(sampling_parameters=text("[" * 100_000)),
                                      "sampling_parameters: is 100000 bytes of JSON"),
    "deeply nested JSON": (dict(sampling_parameters=text("[" * 60_000)), "sampling_parameters: nests"),
    "nested JSON in a value": (dict(sampling_parameters=text('{"stop": ' + "[" * 5000 + "]" * 5000 + "}")),
                               "sampling_parameters: nests"),
    "JSON over the size bound": (dict(sampling_parameters=text('{"stop": "' + "x" * MAX_JSON_BYTES + '"}')),
                                 "sampling_parameters: is 65548 bytes of JSON"),
    "a 5000-digit integer": (dict(sampling_parameters=text('{"seed": ' + "9" * 5000 + "}")),
                             "sampling_parameters: holds a value JSON cannot be read"),
    "a 5000-digit string integer": (dict(sampling_parameters=text('{"top_k": "' + "9" * 5000 + '"}')),
                                    "sampling_parameters.top_k: must be int"),
    "a float past double range": (dict(sampling_parameters=text('{"temperature": 1' + "0" * 400 + "}")),
                                  "sampling_parameters.temperature: must be float"),
    "seed 2**70 in JSON": (dict(sampling_parameters=text(json.dumps({"seed": 2 ** 70}))), "seed"),
    "top_k 2**70 in JSON": (dict(sampling_parameters=text(json.dumps({"top_k": 2 ** 70}))),
                            "sampling_parameters.top_k: must be a 64-bit integer"),
    "seed 2**64 as UINT64": (dict(seed=np.array([2 ** 64 - 1], np.uint64)), "seed"),
    "temperature inf": (dict(temperature=np.array([np.inf], np.float32)), "temperature"),
    "temperature nan": (dict(temperature=np.array([np.nan], np.float32)), "temperature"),
    "temperature Infinity in JSON": (dict(sampling_parameters=text('{"temperature": Infinity}')), "temperature"),
    "temperature NaN as a string": (dict(sampling_parameters=text('{"temperature": "nan"}')), "temperature"),
    "top_p -inf": (dict(top_p=np.array([-np.inf], np.float32)), "top_p"),
    "too many stop strings": (dict(stop=np.array([b"s%d" % i for i in range(MAX_STOP_STRINGS + 1)], np.object_)),
                              "stop: holds 65 strings"),
    "too many stop strings in JSON": (dict(sampling_parameters=text(json.dumps({"stop": ["a"] * 65}))),
                                      "sampling_parameters.stop: holds 65 strings"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_parameters_are_request_errors_naming_the_field(name):
    inputs, message = MALFORMED[name]
    with pytest.raises(RequestError) as err:
        parse(**{"text_input": text("hello"), **inputs})
    line = str(err.value)
    assert message in line and "\n" not in line and len(line) < 300, line


def test_request_parameters_json_errors_name_parameters():
    with pytest.raises(RequestError, match="^parameters: nests"):
        parse(parameters="[" * 60_000, text_input=text("x"))
    with pytest.raises(RequestError, match="^parameters: must be a JSON object"):
        parse(parameters="[1]", text_input=text("x"))


def test_in_range_values_still_parse():
    req = parse(text_input=text("x"), sampling_parameters=text(json.dumps(
        {"seed": 2 ** 63 - 1, "temperature": 1e-30, "stop": ["a"] * MAX_STOP_STRINGS})))
    assert req.params.seed == 2 ** 63 - 1 and len(req.params.stop) == MAX_STOP_STRINGS


# ---- size bounds before tokenizing --------------------------------------------------------------
def test_prompt_bytes_over_the_bound_are_refused_naming_text_input():
    limits = RequestLimits(max_model_len=100, max_token_bytes=4)
    assert limits.max_prompt_bytes(1) == 99 * 4 and limits.max_prompt_bytes(10_000) == 4
    parse(limits=limits, text_input=text("x" * 396), max_tokens=np.array([1], np.int32))
    with pytest.raises(RequestError, match=r"^text_input: is 397 bytes, more than max_model_len 100 tokens"):
        parse(limits=limits, text_input=text("x" * 397), max_tokens=np.array([1], np.int32))
    with pytest.raises(RequestError, match=r"^text_input: is 361 bytes.*max_tokens 10 \(at most 360 bytes"):
        parse(limits=limits, text_input=text("é" * 180 + "x"), max_tokens=np.array([10], np.int32))
    with pytest.raises(RequestError, match=r"^stop: holds a string of 401 bytes"):
        parse(limits=limits, text_input=text("x"), stop=np.array([b"s" * 401], np.object_))
    with pytest.raises(RequestError, match=r"^sampling_parameters.stop: holds a string of 401 bytes"):
        parse(limits=limits, text_input=text("x"), sampling_parameters=text(json.dumps({"stop": "s" * 401})))


def test_a_5_mb_prompt_is_refused_without_tokenizing():
    limits = RequestLimits(max_model_len=8192, max_token_bytes=81)        # the default engine's
    t0 = time.perf_counter()
    with pytest.raises(RequestError, match="^text_input: is 5000000 bytes"):
        parse(limits=limits, text_input=text("word " * 1_000_000))
    assert time.perf_counter() - t0 < 1.0          # parsing only; tokenizing it took 6 s


def test_max_token_bytes_of_the_tokenizers():
    from tokenizers import Tokenizer, models, normalizers
    assert max_token_bytes(byte_tokenizer()) == 1
    tok = byte_tokenizer()
    tok.add_tokens([LONG_TOKEN, "é" * 10])
    assert max_token_bytes(tok) == 1024
    assert max_token_bytes(Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))) is None
    bpe = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2, "<unk>": 3}, merges=[("a", "b")], unk_token="<unk>"))
    assert max_token_bytes(bpe) == 5                                    # "<unk>": 5 bytes >= a 4-byte char
    bpe.normalizer = normalizers.NFKC()
    assert max_token_bytes(bpe) == 20


@pytest.mark.skipif(not (DEFAULT_TOKENIZER / "tokenizer.json").is_file(), reason="no default engine built")
def test_the_bound_holds_on_the_default_tokenizer():
    """No text tokenizes to fewer than bytes / max_token_bytes tokens (the bound is safe)."""
    tok = TextTokenizer(DEFAULT_TOKENIZER)
    per_token = max_token_bytes(tok)
    assert per_token == 81                                  # "\n" + 80 spaces
    rng = random.Random(0)
    pieces = [" " * 200, "\n" + " " * 80, "\t" * 50, "=" * 300, "é" * 40, "日本語" * 30, "hello world ",
              "<|im_start|>", "0123456789" * 20, "\U0001F600" * 10]
    for _ in range(50):
        s = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30)))
        assert len(tok.encode(s)) * per_token >= len(s.encode()), s[:40]


def test_encode_releasing_gil_equals_the_tokenizer(tiny_dir):
    tok = TextTokenizer(DEFAULT_TOKENIZER if (DEFAULT_TOKENIZER / "tokenizer.json").is_file()
                        else Path(tiny_dir) / TOKENIZER_DIR)
    for s in ["Hello, world!", "  leading spaces\n\nand <|im_start|> tokens", "é日本" * 100]:
        assert encode_releasing_gil(tok, s) == tok.encode(s)


# ---- tokenizing off the step loop ---------------------------------------------------------------
class Sink:
    def __init__(self, cancel=False):
        self.outs, self.errors, self.rejected, self.cancel = [], [], [], cancel
        self.times: list[float] = []
        self.done = threading.Event()

    def on_output(self, out):
        self.outs.append(out)
        self.times.append(time.monotonic())
        if out.finished:
            self.done.set()

    def on_error(self, message):
        self.errors.append(message)
        self.done.set()

    def on_reject(self, error):
        self.rejected.append(error)
        self.times.append(time.monotonic())
        self.done.set()

    def is_cancelled(self):
        return self.cancel

    @property
    def text(self):
        return "".join(o.delta_text for o in self.outs)


@pytest.fixture(scope="module")
def long_token_dir(tmp_path_factory):
    return long_token_engine(tmp_path_factory.mktemp("long_token"))


def test_a_long_prompt_is_tokenized_while_streams_go_on(long_token_dir):
    """Issue 19: a 5 MB prompt tokenized on the request path delayed other requests from 0.36 s to
    6.2 s (`encode` holds the GIL). Now a long prompt is tokenized on the loop's tokenizer thread,
    GIL released: a running stream keeps producing tokens the whole time."""
    engine = Engine.from_dir(long_token_dir)
    limits = RequestLimits.for_engine(engine)
    big = ("abcdefgh " * 88_889)[:800_000]
    assert len(big) <= limits.max_prompt_bytes(64)            # allowed by the byte bound: it is tokenized
    loop = EngineLoop(engine)
    loop.start()
    try:
        stream, long = Sink(), Sink()
        loop.submit("keep streaming", SamplingParams(max_tokens=3000, ignore_eos=True), stream)
        while len(stream.outs) < 3:
            time.sleep(0.01)
        t_sent = time.monotonic()
        loop.submit(big, SamplingParams(max_tokens=64), long)  # returns at once
        t_submitted = time.monotonic()
        assert long.done.wait(60)
        t_answer = long.times[-1]
        stream.cancel = True
        assert stream.done.wait(30)
    finally:
        loop.stop()
    window = t_answer - t_sent
    during = [t for t in stream.times if t_sent < t < t_answer]
    gaps = np.diff([t_sent] + during + [t_answer])
    print(f"\ntokenizing {len(big)} bytes took {window:.2f} s; the stream got {len(during)} tokens meanwhile, "
          f"largest gap {gaps.max() * 1e3:.0f} ms; submit returned in {(t_submitted - t_sent) * 1e3:.1f} ms")
    assert t_submitted - t_sent < 0.25                        # tokenizing it takes seconds
    # the loop names the runtime's field; the Triton model maps it to text_input (the served test below)
    assert len(long.rejected) == 1 and str(long.rejected[0]).startswith("prompt: is 800000 tokens")
    assert window > 0.2, "the prompt tokenized too fast to show anything"
    # Before: no token at all while the GIL was held. Generous: at least 5 tokens, no gap over half.
    assert len(during) >= 5 and gaps.max() < window / 2


def test_long_prompts_via_the_tokenizer_thread_serve_like_short_ones(tiny_dir):
    params = SamplingParams(max_tokens=6)
    prompts = ["first prompt", "the second, longer prompt", "x"]
    expected = [c.text for c in Engine.from_dir(tiny_dir).generate(prompts, params)]
    engine = Engine.from_dir(tiny_dir, max_queue=1, max_batch_size=1)
    loop = EngineLoop(engine, inline_tokenize_chars=0)        # every prompt takes the tokenizer thread
    loop.start()
    try:
        sinks = [Sink() for _ in prompts]
        for p, s in zip(prompts, sinks):
            assert loop.submit(p, params, s)
        cancelled = Sink(cancel=True)
        loop.submit("cancelled before it joined", params, cancelled)
        assert all(s.done.wait(30) for s in sinks + [cancelled])
    finally:
        loop.stop()
    done = [s for s in sinks if not s.rejected]
    assert [s.text for s in done] == [e for e, s in zip(expected, sinks) if not s.rejected]
    assert all(isinstance(s.rejected[0], QueueFullError) for s in sinks if s.rejected)
    assert cancelled.outs[-1].finish_reason == "abort" and loop.num_live() == 0


def test_stop_answers_a_request_still_tokenizing(long_token_dir):
    engine = Engine.from_dir(long_token_dir)
    loop = EngineLoop(engine)
    loop.start()
    sink = Sink()
    loop.submit("abc " * 200_000, SamplingParams(), sink)
    time.sleep(0.05)
    loop.stop()
    assert sink.errors == ["the server is shutting down"]
    loop._tok_thread.join(30)                                 # it finishes tokenizing, then exits
    assert not loop._tok_thread.is_alive()
    assert not sink.rejected and not sink.outs and sink.errors == ["the server is shutting down"]


# ---- through a real tritonserver ----------------------------------------------------------------
MODEL = "lookahead_llm"


@pytest.fixture(scope="module")
def small_server(tmp_path_factory, triton_backend_dir, monkeypatch_module):
    """tritonserver on the long-token engine with 2 batch slots and max_queue 2."""
    import serving.config_template as ct
    from triton_fixtures import start_server

    engine_dir = long_token_engine(tmp_path_factory.mktemp("small_server_engine"), max_batch_size=2)
    write = ct.write_model_repo
    # tests/triton_fixtures.start_server has no max_queue argument: give its repository writer one.
    monkeypatch_module.setattr(ct, "write_model_repo", lambda *a, **kw: write(*a, **{**kw, "max_queue": 2}))
    server = start_server(tmp_path_factory.mktemp("small_server"), engine_dir, triton_backend_dir)
    monkeypatch_module.undo()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def grpc_inputs(**values):
    from tritonclient.grpc import InferInput
    dtypes = {"max_tokens": (np.int32, "INT32"), "stream": (np.bool_, "BOOL"), "temperature": (np.float32, "FP32")}
    out = []
    for name, v in values.items():
        if name in ("text_input", "sampling_parameters"):
            arr, dt = np.array([v.encode() if isinstance(v, str) else v], dtype=np.object_), "BYTES"
        else:
            arr, dt = np.array([v], dtype=dtypes[name][0]), dtypes[name][1]
        t = InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


NO_EOS = json.dumps({"ignore_eos": True})


def rpc_code(e) -> str | None:
    """The gRPC status name of a stream's exception (grpc's AioRpcError or tritonclient's wrapper)."""
    if hasattr(e, "code") and callable(e.code):
        return e.code().name
    status = e.status() if hasattr(e, "status") else None
    return status.rsplit(".", 1)[-1] if status else None


async def stream_one(client, ins, *, grpc_error: bool, hold: asyncio.Event | None = None, first=None):
    """One request on its own stream. Returns ("ok", n_responses) or ("error", code, message).
    With `grpc_error`, the `triton_grpc_error: true` header: an error ends the stream with its
    gRPC status. `hold`: once a token arrived (`first` is set then), wait for it, then cancel."""
    final = asyncio.Event()

    async def requests():
        yield {"model_name": MODEL, "inputs": ins}
        await final.wait()
    call = client.stream_infer(requests(), headers={"triton_grpc_error": "true"} if grpc_error else None)
    n = 0
    try:
        async for result, error in call:
            if error is not None:
                return ("error", None, str(error))
            n += 1
            if hold is not None:
                first and first.set()
                await hold.wait()
                call.cancel()
                return ("ok", n)
            if result.get_response().parameters["triton_final_response"].bool_param:
                final.set()
        return ("ok", n)
    except Exception as e:
        code = rpc_code(e)
        if code is None:
            raise
        return ("error", code, e.details() if hasattr(e, "details") else str(e))
    finally:
        final.set()


@pytest.mark.triton
@pytest.mark.timeout(120)
def test_queue_full_is_unavailable_with_a_grpc_status(small_server):
    """2 slots + max_queue 2: of a burst of 8 long streams 4 are taken and 4 get UNAVAILABLE, as
    the stream's gRPC status with the `triton_grpc_error` header; without it, as the message."""
    import tritonclient.grpc.aio as grpcclient

    async def main():
        client = grpcclient.InferenceServerClient(small_server.grpc_url)
        release = asyncio.Event()
        try:
            tasks = [asyncio.create_task(stream_one(
                client, grpc_inputs(text_input=f"burst {i}", max_tokens=2000, stream=True, sampling_parameters=NO_EOS),
                grpc_error=True, hold=release)) for i in range(8)]
            deadline = time.monotonic() + 30
            while sum(t.done() for t in tasks) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)                    # a fifth refusal would show by now
            refused_now = sum(t.done() for t in tasks)
            plain = await stream_one(client, grpc_inputs(text_input="one more", max_tokens=4), grpc_error=False)
            release.set()
            return refused_now, plain, await asyncio.gather(*tasks)
        finally:
            release.set()
            await client.close()
    refused_now, plain, results = asyncio.run(main())
    print("\nburst of 8, 2 slots, max_queue 2:", [r[:2] for r in results], "; without the header:", plain[:2])
    errors = [r for r in results if r[0] == "error"]
    assert refused_now == len(errors) == 4
    assert all(r[1] == "UNAVAILABLE" and r[2].startswith("the waiting queue is full") for r in errors)
    assert plain[:2] == ("error", None) and plain[2].startswith("the waiting queue is full")
    wait_idle(small_server)


@pytest.mark.triton
@pytest.mark.timeout(120)
def test_malformed_requests_are_invalid_argument_and_a_5_mb_prompt_is_refused_at_once(small_server):
    import tritonclient.grpc.aio as grpcclient

    bad = {
        "nested": (dict(sampling_parameters="[" * 100_000), "sampling_parameters"),
        "seed 2**70": (dict(sampling_parameters=json.dumps({"seed": 2 ** 70})), "seed"),
        "temperature inf": (dict(temperature=float("inf")), "temperature"),
        "temperature nan": (dict(temperature=float("nan")), "temperature"),
        "5 MB prompt": (dict(text_input="word " * 1_000_000), "text_input"),
    }

    async def main():
        client = grpcclient.InferenceServerClient(small_server.grpc_url)
        try:
            out = {}
            for name, (ins, _) in bad.items():
                t0 = time.monotonic()
                out[name] = (await stream_one(client, grpc_inputs(**{"text_input": "x", **ins}), grpc_error=True),
                             time.monotonic() - t0)
            good = await stream_one(client, grpc_inputs(text_input="still up", max_tokens=3), grpc_error=True)
            return out, good
        finally:
            await client.close()
    out, good = asyncio.run(main())
    for name, ((kind, code, message), _) in ((n, (r, t)) for n, (r, t) in out.items()):
        assert (kind, code) == ("error", "INVALID_ARGUMENT"), (name, message)
        assert bad[name][1] in message and "internal" not in message.lower(), (name, message)
    print(f"\n5 MB prompt refused in {out['5 MB prompt'][1]:.2f} s")
    assert out["5 MB prompt"][1] < 3.0                        # tokenizing 5 MB took 6 s
    assert good == ("ok", 1)


@pytest.mark.triton
@pytest.mark.timeout(120)
def test_http_generate_queue_full_status(small_server):
    """What tritonserver 2.51's /generate answers for a full queue. The model sends UNAVAILABLE;
    the server reads the error's code after freeing it, and has answered 400 every time here."""
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    url = f"{small_server.http_url}/v2/models/{MODEL}/generate"

    def one(i):
        body = json.dumps({"text_input": f"http {i}", "max_tokens": 300, "ignore_eos": True}).encode()
        try:
            urllib.request.urlopen(urllib.request.Request(url, body), timeout=60).read()
            return 200, ""
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["error"]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    print("\nHTTP /generate burst of 8:", sorted(code for code, _ in results))
    refused = [(c, m) for c, m in results if c != 200]
    assert refused and all(c in (400, 503) and "the waiting queue is full" in m for c, m in refused)
    wait_idle(small_server)


@pytest.mark.triton
@pytest.mark.timeout(120)
def test_a_long_prompt_does_not_stall_a_running_stream(small_server):
    """Served: while an 800 KB prompt (allowed by the byte bound, then too many tokens) is
    tokenized, a running stream keeps getting tokens (before: none for the whole tokenizing)."""
    import tritonclient.grpc.aio as grpcclient
    from serving.grpc_stream import stream_request

    big = ("hgfedcba " * 88_889)[:800_000]

    async def main():
        client = grpcclient.InferenceServerClient(small_server.grpc_url)
        times, sent, answered = [], [], []
        try:
            def on_token(result, error):
                times.append(time.monotonic())
                return bool(answered) and times[-1] > answered[0] + 0.2
            stream = asyncio.create_task(stream_request(client, MODEL, grpc_inputs(
                text_input="stream on", max_tokens=2000, stream=True, sampling_parameters=NO_EOS), on_token))
            while len(times) < 3:
                await asyncio.sleep(0.01)
            sent.append(time.monotonic())
            result = await stream_one(client, grpc_inputs(text_input=big, max_tokens=64), grpc_error=True)
            answered.append(time.monotonic())
            await stream
            return times, sent[0], answered[0], result
        finally:
            await client.close()
    times, t_sent, t_answer, result = asyncio.run(main())
    assert result[:2] == ("error", "INVALID_ARGUMENT") and "text_input: is 800000 tokens" in result[2]
    window = t_answer - t_sent
    during = [t for t in times if t_sent < t < t_answer]
    gaps = np.diff([t_sent] + during + [t_answer])
    print(f"\nserved: tokenizing 800 KB took {window:.2f} s; the stream got {len(during)} tokens meanwhile, "
          f"largest gap {gaps.max() * 1e3:.0f} ms")
    assert window > 0.2 and len(during) >= 5 and gaps.max() < window / 2
    wait_idle(small_server)


def wait_idle(server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if not m["lookahead_running_requests"] and not m["lookahead_queue_depth"] \
                and m["lookahead_free_kv_blocks"] == m["lookahead_kv_blocks"]:
            return
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {m}"
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
