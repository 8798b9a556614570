"""The OpenAI API on NVIDIA Dynamo: serving/dynamo_worker.py behind a real `dynamo.frontend`.

Three parts:
- pure tests of the request mapping, the model dir and the launcher's checks (no Dynamo needed);
- the handler on a real EngineLoop over a tiny engine, and the launcher facing a worker that dies
  at start (Dynamo needed, no real model);
- one real deployment (TestLive: a frontend and two workers on the default engine, started by
  deploy.dynamo_launch, stopped even on failure) driven with the official `openai` client:
  models list, greedy equality with the in-process engine (chat and completions, streaming and
  not), sampling parameters, stop strings, usage counts, 16 concurrent streams, 4xx answers while
  another stream goes on, a cancelled stream freeing its KV blocks, and both workers serving; then
  one worker on etcd + NATS (TestEtcdNats, when Debian's etcd-server and nats-server are installed).
The Dynamo parts skip, saying why, when Dynamo or openai is not importable (scripts/install_dynamo.sh
installs both). About 35 s on 2 cores.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import shutil
import threading
import time
import urllib.request

import pytest
import yaml

from runtime.errors import RequestError
from deploy import dynamo_launch
from serving.dynamo_worker import make_model_dir, sampling_params_from_request

MODEL = "lookahead_llm"
MAX_MODEL_LEN = 512


# ---- without Dynamo -------------------------------------------------------------------------------
def _req(token_ids=(5, 6, 7), sampling=None, stop=None, output=None):
    return {"token_ids": list(token_ids), "sampling_options": sampling or {}, "stop_conditions": stop or {},
            "output_options": output or {}}


def test_request_maps_to_sampling_params():
    ids, p = sampling_params_from_request(
        _req(sampling={"temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3, "n": None},
             stop={"max_tokens": 12, "stop": ["\n\n"], "ignore_eos": True, "stop_token_ids_hidden": [2]}), 64)
    assert ids == [5, 6, 7]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos) == \
        (12, 0.5, 0.9, 7, 3, ["\n\n"], True)


def test_request_defaults():
    _, p = sampling_params_from_request(_req(sampling={"top_k": -1}), 64)     # -1: vLLM's "off"
    assert p.max_tokens == 64 - 3 and p.greedy and p.top_k == 0 and p.stop == []
    _, p = sampling_params_from_request(_req(), 64, default_max_tokens=10)
    assert p.max_tokens == 10
    packed = (5).to_bytes(4, "little") + (9).to_bytes(4, "little")            # DYN_TOKEN_IDS_AS_BYTES
    assert sampling_params_from_request({"token_ids": packed}, 64)[0] == [5, 9]


@pytest.mark.parametrize("request_, field", [
    (_req(stop={"max_tokens": 0}), "max_tokens"),
    (_req(sampling={"temperature": -1.0}), "temperature"),
    (_req(sampling={"top_p": 0.0}), "top_p"),
    (_req(sampling={"top_k": -5}), "top_k"),
    (_req(sampling={"seed": 1 << 64}), "seed"),
    (_req(sampling={"n": 17}), "n"),                     # the frontend allows 1..128, the engine 1..16
    (_req(sampling={"n": 0}), "n"),
    (_req(sampling={"presence_penalty": 0.5}), "presence_penalty"),
    (_req(sampling={"guided_decoding": {"json": {}}}), "guided_decoding"),     # response_format
    (_req(output={"logprobs": 21}), "logprobs"),
    (_req(output={"logprobs": -1}), "logprobs"),
    (_req(output={"prompt_logprobs": 21}), "prompt_logprobs"),                 # completions `echo`
    (_req(stop={"min_tokens": 4}), "min_tokens"),
    (_req(token_ids=()), "prompt/messages"),      # the runtime's `prompt`, under the OpenAI names
])
def test_bad_request_names_the_field(request_, field):
    with pytest.raises(RequestError) as err:
        sampling_params_from_request(request_, 64)
    assert err.value.field == field and str(err.value).startswith(field + ":")


def test_n_and_logprobs_reach_the_engine():
    _, p = sampling_params_from_request(_req(sampling={"n": 4, "seed": 7}, output={"logprobs": 3}), 64)
    assert (p.n, p.logprobs, p.seed) == (4, 3, 7)
    _, p = sampling_params_from_request(_req(output={"logprobs": 0}), 64)     # chat logprobs, top_logprobs 0
    assert (p.n, p.logprobs) == (1, 0)
    _, p = sampling_params_from_request(_req(sampling={"n": None}, output={"logprobs": None}), 64)
    assert (p.n, p.logprobs, p.prompt_logprobs) == (1, None, None)
    _, p = sampling_params_from_request(_req(output={"logprobs": 1, "prompt_logprobs": 1}), 64)   # echo
    assert (p.logprobs, p.prompt_logprobs) == (1, 1)


def test_a_bad_value_is_one_line_naming_the_field():
    for req, field in ((_req(sampling={"n": 17}), "n"), (_req(output={"logprobs": 99}), "logprobs")):
        with pytest.raises(RequestError) as err:
            sampling_params_from_request(req, 64)
        assert str(err.value).startswith(field + ":") and "\n" not in str(err.value)


class _Out:
    """A RequestOutput stand-in (the fields the worker reads)."""

    def __init__(self, ids, index=0, finished=False, reason=None, request_finished=None, cached=0, logprobs=None,
                 prompt=10, generated=0):
        self.request_id, self.new_token_ids, self.index = "r", list(ids), index
        self.finished, self.finish_reason = finished, reason
        self.request_finished = finished if request_finished is None else request_finished
        self.num_cached_tokens, self.logprobs = cached, logprobs
        self.num_prompt_tokens, self.num_output_tokens, self.delta_text = prompt, generated, ""
        self.prompt_logprobs = None


def test_output_chunks_one_choice_merged_with_usage_and_cached_tokens():
    from serving.dynamo_worker import output_chunks
    tokens = [0]
    chunks = output_chunks([_Out([5], cached=32), _Out([6], cached=32),
                            _Out([7], finished=True, reason="length", cached=32)], tokens)
    assert chunks == [{"token_ids": [5, 6, 7], "index": 0, "finish_reason": "length",
                       "completion_usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                                            "prompt_tokens_details": {"cached_tokens": 32}}}]


def test_output_chunks_n_choices_and_logprobs():
    """n = 2: chunks per choice (`index`), a choice's finish on its own chunk, usage on the request's
    last; logprobs as Dynamo's `log_probs` / `top_logprobs` (rank from 1, text left to the frontend)."""
    from runtime.sampling import TokenLogprob
    from serving.dynamo_worker import output_chunks

    lp = lambda t: [TokenLogprob(t, -0.25, [(t, -0.25), (t + 1, -2.0)])]     # noqa: E731
    tokens = [0, 0]
    first = output_chunks([_Out([5], 0, logprobs=lp(5)), _Out([8], 1, logprobs=lp(8)),
                           _Out([6], 0, finished=True, reason="stop", request_finished=False, logprobs=lp(6))],
                          tokens)
    assert [(c["index"], c["token_ids"], c.get("finish_reason")) for c in first] == \
        [(0, [5], None), (1, [8], None), (0, [6], "stop")]
    assert first[0]["log_probs"] == [-0.25]
    assert first[0]["top_logprobs"] == [[{"rank": 1, "token_id": 5, "token": None, "logprob": -0.25},
                                         {"rank": 2, "token_id": 6, "token": None, "logprob": -2.0}]]
    assert all("completion_usage" not in c for c in first)
    last = output_chunks([_Out([9], 1, finished=True, reason="length", cached=16, logprobs=lp(9))], tokens)
    assert last[0]["index"] == 1 and last[0]["finish_reason"] == "length"
    assert last[0]["completion_usage"]["completion_tokens"] == 4            # both choices' tokens
    assert last[0]["completion_usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    # the later choices find the blocks the first prefilled: the request reports the least
    tokens, cached = [0, 0], {}
    output_chunks([_Out([5], 0, cached=0), _Out([6], 1, finished=True, reason="stop", request_finished=False,
                                              cached=48)], tokens, cached)
    (end,) = output_chunks([_Out([7], 0, finished=True, reason="stop", cached=0)], tokens, cached)
    assert end["completion_usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_prompt_logprobs_ride_on_the_last_chunk_as_engine_data():
    """echo: the choice's first output brings them; the request's last chunk carries them as Dynamo's
    engine_data.prompt_logprobs (position 0 None; the prompt token with its rank, and the k best)."""
    from runtime.sampling import TokenLogprob
    from serving.dynamo_worker import output_chunks

    first = _Out([5])
    first.prompt_logprobs = [None, TokenLogprob(3, -1.5, [(4, -0.5)], rank=2), TokenLogprob(4, -0.1, [(4, -0.1)], 1)]
    tokens, cached, plp = [0], {}, {}
    chunks = output_chunks([first], tokens, cached, plp, decode=lambda ids: f"<{ids[0]}>")
    assert "engine_data" not in chunks[0]                     # not the last chunk yet
    (end,) = output_chunks([_Out([6], finished=True, reason="length")], tokens, cached, plp,
                           decode=lambda ids: f"<{ids[0]}>")
    assert end["engine_data"]["prompt_logprobs"] == [
        None,
        {"4": {"logprob": -0.5, "rank": 1, "decoded_token": "<4>"},
         "3": {"logprob": -1.5, "rank": 2, "decoded_token": "<3>"}},
        {"4": {"logprob": -0.1, "rank": 1, "decoded_token": "<4>"}}]
    (plain,) = output_chunks([_Out([7], finished=True, reason="length")], [0])
    assert "engine_data" not in plain


def test_kv_event_relay_carries_token_ids_and_signed_hashes():
    """The router hashes the events' token ids itself; the engine's unsigned 64-bit hashes cross
    as signed ints (Dynamo's Python API), a clear as the removal of every stored block."""
    from dataclasses import dataclass

    from serving.dynamo_worker import KvEventRelay, signed64

    @dataclass
    class BlockStored:
        block_hashes: list
        parent_hash: object
        token_ids: list
        block_size: int

    @dataclass
    class BlockRemoved:
        block_hashes: list

    class AllBlocksCleared:
        pass

    class Publisher:
        def __init__(self):
            self.calls = []

        def publish_stored(self, **kw):
            self.calls.append(("stored", kw))

        def publish_removed(self, **kw):
            self.calls.append(("removed", kw))

    assert signed64(5) == 5 and signed64((1 << 64) - 1) == -1 and signed64(1 << 63) == -(1 << 63)
    pub = Publisher()
    relay = KvEventRelay(pub)
    try:
        big = (1 << 64) - 2
        relay.put(BlockStored([11, big], None, list(range(8)), 4))
        relay.put(BlockStored([12], big, [9, 9, 9, 9], 4))
        relay.put(BlockRemoved([11]))
        relay.put(AllBlocksCleared())
        relay.flush()
    finally:
        relay.close()
    assert pub.calls[0] == ("stored", {"token_ids": list(range(8)), "num_block_tokens": [4, 4],
                                       "block_hashes": [11, -2], "parent_hash": None})
    assert pub.calls[1] == ("stored", {"token_ids": [9, 9, 9, 9], "num_block_tokens": [4], "block_hashes": [12],
                                       "parent_hash": -2})
    assert pub.calls[2] == ("removed", {"block_hashes": [11]})
    assert pub.calls[3] == ("removed", {"block_hashes": sorted([-2, 12])})
    assert relay.counts == {"stored_blocks": 3, "removed_blocks": 3, "cleared": 1, "failed": 0}


def test_engine_stats_as_prometheus_text():
    from serving.metrics import prometheus_text
    text = prometheus_text({"prefix_cache_hits": 96, "prefix_cache_hit_rate": None, "cached_blocks": 6,
                            "prefix_cache_evictions": 2}, {"model": "m", "worker": "0"})
    assert 'lookahead_prefix_cache_hit_tokens_total{model="m",worker="0"} 96' in text
    assert 'lookahead_prefix_cache_hit_rate{model="m",worker="0"} NaN' in text
    assert 'lookahead_prefix_cache_blocks{model="m",worker="0"} 6' in text
    assert 'lookahead_prefix_cache_evicted_blocks_total{model="m",worker="0"} 2' in text
    assert "lookahead_h2d_bytes_total" not in text                  # a counter the stats lack is left out


def test_errors_name_the_openai_fields():
    """The Dynamo worker's mapping: an empty prompt is `prompt/messages`, sampling errors keep their
    OpenAI names, and an engine error from submit is mapped before it becomes a 400."""
    from serving.dynamo_worker import _Sink as DynamoSink

    with pytest.raises(RequestError, match=r"^prompt/messages: has no tokens"):
        sampling_params_from_request({"token_ids": []}, 64)
    with pytest.raises(RequestError, match=r"^temperature: "):
        sampling_params_from_request({"token_ids": [1], "sampling_options": {"temperature": -1}}, 64)

    async def rejected():
        sink = DynamoSink(asyncio.get_running_loop())
        sink.on_reject(RequestError("prompt", "is 900 tokens", "shorten the prompt"))     # as the loop does
        return await asyncio.wait_for(sink.queue.get(), 5)
    failure = asyncio.run(rejected())
    assert failure.message == "prompt/messages: is 900 tokens (shorten the prompt)"
    assert type(failure.error) is RequestError


def test_model_dir_holds_tokenizer_template_and_config(tmp_path):
    from tiny_engine import make_tiny_engine

    from runtime.engine_dir import sha256_file

    engine_dir = make_tiny_engine(tmp_path / "engine")
    jinja = engine_dir / "tokenizer" / "chat_template.jinja"
    jinja.write_text("{{ messages[0]['content'] }}")
    doc = yaml.safe_load((engine_dir / "engine.yaml").read_text())
    doc["files"]["tokenizer/chat_template.jinja"] = sha256_file(jinja)      # as the builder lists it
    (engine_dir / "engine.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    out = make_model_dir(engine_dir, tmp_path / "model", max_model_len=1024)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "tokenizer.json",
                                                      "tokenizer_config.json"]
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == "{{ messages[0]['content'] }}"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 1024 and cfg["vocab_size"] == 256 and cfg["model_type"] == "llama"


def test_launcher_environment_and_commands(tmp_path):
    env = dynamo_launch.base_env(tmp_path, "file")
    assert env["DYN_FILE_KV"] == str(tmp_path / "kv") and env["DYN_DISCOVERY_BACKEND"] == "file"
    assert (env["DYN_REQUEST_PLANE"], env["DYN_EVENT_PLANE"]) == ("tcp", "zmq")
    assert all(env[k] == "127.0.0.1" for k in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST",
                                                  "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST"))
    etcd = dynamo_launch.base_env(tmp_path, "etcd", etcd_endpoints="http://127.0.0.1:1", nats_server="nats://x:2")
    assert (etcd["ETCD_ENDPOINTS"], etcd["NATS_SERVER"], etcd["DYN_REQUEST_PLANE"]) == \
        ("http://127.0.0.1:1", "nats://x:2", "nats")
    fe = dynamo_launch.frontend_command("py", 9000, "file", "ns")
    assert fe[:3] == ["py", "-m", "dynamo.frontend"] and fe[fe.index("--http-port") + 1] == "9000"
    assert fe[fe.index("--http-host") + 1] == "127.0.0.1" and fe[fe.index("--discovery-backend") + 1] == "file"
    w = dynamo_launch.worker_command("py", "E", 1, run_dir=tmp_path, model_name="m", namespace="ns",
                                     lookahead_overrides={"mode": "lookahead", "top_k": 64}, threads=1,
                                     worker_options={"max_queue": 9, "no_verify_checksums": True,
                                                     "num_host_blocks": None})
    assert w[:3] == ["py", "-m", "serving.dynamo_worker"]
    joined = " ".join(w)
    assert "--mode lookahead" in joined and "--top-k 64" in joined and "--max-queue 9" in joined
    assert "--no-verify-checksums" in w and "--num-host-blocks" not in w and "--worker-index 1" in joined


def test_workers_get_the_device(tmp_path):
    cmd = dynamo_launch.worker_command("py", "E", 0, run_dir=tmp_path, model_name="m", namespace="n",
                                       worker_options={"device": "cuda:1"})
    assert cmd[cmd.index("--device") + 1] == "cuda:1"
    assert "--device" not in dynamo_launch.worker_command("py", "E", 0, run_dir=tmp_path, model_name="m",
                                                          namespace="n", worker_options={"device": None})


def test_worker_flags_cover_every_lookahead_field():
    import dataclasses

    from runtime.config import LookaheadConfig
    from serving.dynamo_worker import build_parser

    args = build_parser().parse_args(["--engine", "E", "--mode", "lookahead", "--top-k", "32", "--fetch-ratio", "0.1"])
    assert (args.mode, args.top_k, args.fetch_ratio) == ("lookahead", 32, 0.1)
    assert all(hasattr(args, f.name) for f in dataclasses.fields(LookaheadConfig))


def test_launcher_refuses_a_taken_port_and_a_bad_engine_dir(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(dynamo_launch.LaunchError, match=f"port {port} on 127.0.0.1 is taken"):
            dynamo_launch.check_port_free(port)
    with pytest.raises(dynamo_launch.LaunchError, match="does not exist"):
        dynamo_launch.start(tmp_path / "missing", run_dir=tmp_path / "run", progress=None)
    assert not list((tmp_path).glob("run/*.pid"))


def test_dynamo_pytest_plugins_do_not_hide_project_tests(pytestconfig):
    """ai-dynamo registers pytest plugins (entry point pytest11) in every venv it is installed in.
    Its `triton_tests` plugin ignores every file named test_triton_*.py unless the in-process
    `tritonserver` API is importable, which it is not here: tests/test_triton_server.py would vanish
    from the run without a word. pyproject.toml's addopts block the four plugins."""
    pm = pytestconfig.pluginmanager
    active = [n for n in ("triton_tests", "sglang_tests", "trtllm_tests", "vllm_tests") if pm.get_plugin(n) is not None]
    assert not active, (f"ai-dynamo's pytest plugins {active} are loaded and hide tests/test_triton_*.py: add "
                        "'-p no:triton_tests -p no:sglang_tests -p no:trtllm_tests -p no:vllm_tests' "
                        "to [tool.pytest.ini_options] addopts in pyproject.toml")


def _missing() -> str | None:
    for mod, what in (("dynamo.frontend", "NVIDIA Dynamo (ai-dynamo 1.6.1)"), ("dynamo.llm", "NVIDIA Dynamo"),
                      ("openai", "the openai client")):
        try:
            importlib.import_module(mod)
        except Exception as e:             # ImportError, or a broken install failing at import
            return f"{what} is not importable ({type(e).__name__}: {e}); run scripts/install_dynamo.sh"
    return None


class _Context:
    """A stand-in for Dynamo's request Context: `stop()` resolves async_killed_or_stopped()."""

    def __init__(self):
        self._stopped = asyncio.get_running_loop().create_future()

    def async_killed_or_stopped(self):
        return self._stopped

    def stop(self):
        self._stopped.set_result(True)


def _dynamo_exceptions():
    reason = _missing()
    if reason:
        pytest.skip(reason)
    return importlib.import_module("dynamo.llm.exceptions")


@pytest.mark.timeout(60)
def test_handler_streams_counts_and_cancels_on_a_tiny_engine(tmp_path):
    """EngineHandler against a real EngineLoop (tiny random engine), no frontend: chunk format and
    usage, a 400 raised inside the generator, a full queue as 429, a stopped context aborting the
    request with its blocks freed."""
    exc = _dynamo_exceptions()
    from runtime.engine import Engine
    from serving.dynamo_worker import EngineHandler
    from serving.loop import EngineLoop
    from tiny_engine import make_tiny_engine

    engine = Engine.from_dir(make_tiny_engine(tmp_path / "e"), max_queue=0, max_batch_size=1)
    loop = EngineLoop(engine, cancel_poll_s=0.02)
    loop.start()
    handler = EngineHandler(engine, loop)

    async def collect(request, ctx=None):
        return [c async for c in handler.generate(request, ctx or _Context())]

    async def main():
        chunks = await collect(_req(token_ids=[1, 2, 3], stop={"max_tokens": 5}))
        assert sum(len(c["token_ids"]) for c in chunks) == 5 and chunks[-1]["finish_reason"] == "length"
        assert chunks[-1]["completion_usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                                                  "prompt_tokens_details": {"cached_tokens": 0}}
        with pytest.raises(exc.InvalidArgument, match="temperature"):
            await collect(_req(sampling={"temperature": -2.0}))
        # raised by the engine at submit, naming its `prompt`: the client reads the OpenAI names
        with pytest.raises(exc.InvalidArgument, match="prompt/messages: holds token ids outside the vocabulary"):
            await collect(_req(token_ids=[1, 10 ** 6]))
        # n over what the engine can ever hold (1 slot, no queue): a 400 naming n, not a 429 to retry
        with pytest.raises(exc.InvalidArgument, match=r"^n: 2 choices can never be held at once.*send n <= 1"):
            await collect(_req(sampling={"n": 2}, stop={"max_tokens": 4}))
        # a long request holds the one batch slot; a second one finds the queue full (max_queue 0);
        # then the long one's context is stopped
        ctx = _Context()
        long = asyncio.ensure_future(collect(_req(stop={"max_tokens": 3000}), ctx))
        deadline = time.monotonic() + 20
        while engine.stats()["num_running"] == 0:
            assert time.monotonic() < deadline and not long.done(), "the long request never ran"
            await asyncio.sleep(0.005)
        with pytest.raises(exc.HttpError) as err:
            await collect(_req(stop={"max_tokens": 4}))
        assert err.value.code == 429
        ctx.stop()
        chunks = await asyncio.wait_for(long, 30)
        assert chunks[-1]["finish_reason"] == "cancelled"
        assert sum(len(c["token_ids"]) for c in chunks) < 3000
    try:
        asyncio.run(main())
        deadline = time.monotonic() + 5
        while engine.allocator.num_free != engine.allocator.num_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.allocator.num_free == engine.allocator.num_blocks
        assert engine.stats()["aborted_requests"] == 1
    finally:
        loop.stop()
        engine.close()


@pytest.mark.timeout(60)
def test_handler_n_logprobs_and_cached_tokens_on_a_tiny_engine(tmp_path):
    """n > 1, logprobs and the prefix cache's cached tokens through EngineHandler and a real
    EngineLoop (tiny random engine, block size 16)."""
    _dynamo_exceptions()
    from runtime.engine import Engine
    from serving.dynamo_worker import EngineHandler
    from serving.loop import EngineLoop
    from tiny_engine import make_tiny_engine

    engine = Engine.from_dir(make_tiny_engine(tmp_path / "e"), max_batch_size=4, block_size=16)
    loop = EngineLoop(engine)
    loop.start()
    handler = EngineHandler(engine, loop)

    async def collect(request):
        return [c async for c in handler.generate(request, _Context())]

    async def main():
        # n = 2 with logprobs: chunks for both choices, a log-probability per token, k alternatives each
        chunks = await collect(_req(token_ids=list(range(1, 41)), sampling={"n": 2, "seed": 5, "temperature": 1.0},
                                    stop={"max_tokens": 4, "ignore_eos": True}, output={"logprobs": 2}))
        for i in range(2):
            mine = [c for c in chunks if c["index"] == i]
            assert sum(len(c["token_ids"]) for c in mine) == 4 and mine[-1]["finish_reason"] == "length"
            assert all(len(c["log_probs"]) == len(c["token_ids"]) == len(c["top_logprobs"]) for c in mine)
            assert all(len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"] for c in mine for top in c["top_logprobs"])
        usage = chunks[-1]["completion_usage"]
        assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] == 40
        # the same 40-token prompt again: its two full 16-token blocks come from the prefix cache
        chunks = await collect(_req(token_ids=list(range(1, 41)), stop={"max_tokens": 2, "ignore_eos": True}))
        assert chunks[-1]["completion_usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    try:
        asyncio.run(main())
    finally:
        loop.stop()
        engine.close()


@pytest.mark.timeout(60)
def test_handler_sends_k_prompt_alternatives_and_the_tokens_exact_pieces(tmp_path):
    """A prompt_logprobs request (echo) through EngineHandler on a tiny engine (byte tokenizer: every
    non-ASCII character split over tokens): engine_data lists k alternatives plus the token per
    position, and the tokens' pieces join to the prompt (they were "\ufffd" per byte before)."""
    _dynamo_exceptions()
    from runtime.engine import Engine
    from serving.dynamo_worker import EngineHandler
    from serving.loop import EngineLoop
    from tiny_engine import make_tiny_engine

    engine = Engine.from_dir(make_tiny_engine(tmp_path / "e"))
    loop = EngineLoop(engine)
    loop.start()
    handler = EngineHandler(engine, loop)
    text = "é 👍 東京"
    ids = engine.tokenizer.encode(text)

    async def main():
        return [c async for c in handler.generate(_req(token_ids=ids, stop={"max_tokens": 1},
                                                       output={"prompt_logprobs": 4}), _Context())]
    try:
        data = asyncio.run(main())[-1]["engine_data"]
    finally:
        loop.stop()
        engine.close()
    assert data["prompt_token_ids"] == ids and "".join(data["prompt_tokens"]) == text
    assert data["prompt_logprobs"][0] is None
    for tid, entries in zip(ids[1:], data["prompt_logprobs"][1:]):
        assert str(tid) in entries and len(entries) in (4, 5)             # 4 best, plus the token if not one
        assert {1, 2, 3, 4} <= {e["rank"] for e in entries.values()}


@pytest.mark.timeout(120)
def test_launcher_reports_a_worker_that_dies_at_start(tmp_path):
    """A tampered engine dir passes the launcher's quick check (no checksums) but not the worker's:
    start() fails with the worker's log tail, and nothing it started is left running."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    from tiny_engine import make_tiny_engine

    engine_dir = make_tiny_engine(tmp_path / "engine")
    with open(engine_dir / "weights.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\0\0\0")
    run_dir = tmp_path / "run"
    with pytest.raises(dynamo_launch.LaunchError) as err:
        dynamo_launch.start(engine_dir, workers=1, http_port=dynamo_launch.free_port(), run_dir=run_dir,
                            timeout=60, progress=None)
    msg = str(err.value)
    assert msg.startswith("worker-0 (pid ") and "exited with code 2 while starting" in msg
    assert "last lines of" in msg and "checksum" in msg.lower()
    pids = [int(p.read_text()) for p in run_dir.glob("*.pid")]
    assert pids and not any(dynamo_launch._alive(pid, "dynamo") for pid in pids)
    assert dynamo_launch.status(run_dir)["running"] == {}


# ---- a real frontend and two workers --------------------------------------------------------------
live = [pytest.mark.skipif(_missing() is not None, reason=_missing() or ""), pytest.mark.real_model,
        pytest.mark.slow, pytest.mark.timeout(240)]

CHAT = "What is the capital of France? Answer in one sentence."
CHAT_LONG = "Write a short poem about the sea."
COMPLETION = "The history of the Roman Empire"
COUNTING = "1, 2, 3, 4, 5,"
TRICKY = "<|im_start|>Café 👍🏽 東京  tabs\tand\nlines"     # a special token, split characters, spaces
SAMPLED = dict(temperature=0.75, top_p=0.875, top_k=20, seed=1234)


@pytest.fixture(scope="module")
def reference(default_engine_dir):
    """Greedy outputs of the in-process engine for the prompts used below, computed before the
    deployment starts (and the engine dropped) so three engines never share the machine's memory."""
    import gc

    from runtime.engine import Engine
    from runtime.sampling import SamplingParams

    engine = Engine.from_dir(default_engine_dir, max_model_len=MAX_MODEL_LEN)
    tok = engine.tokenizer
    chat, chat_long = tok.apply_chat_template(CHAT), tok.apply_chat_template(CHAT_LONG)
    outs = engine.generate([chat, chat_long, COMPLETION], SamplingParams(max_tokens=24))
    ref = {"chat": outs[0], "chat_long": outs[1], "completion": outs[2],
           "prompt_tokens": {"chat": len(tok.encode(chat)), "chat_long": len(tok.encode(chat_long)),
                             "completion": len(tok.encode(COMPLETION))}}
    text = outs[2].text
    words = [w for w in text.split() if len(w) > 3 and text.count(w) == 1]
    assert words, f"no stop word candidate in {text!r}"
    ref["stop"] = " " + words[len(words) // 2]
    ref["stopped"] = engine.generate([COMPLETION], SamplingParams(max_tokens=24, stop=[ref["stop"]]))[0]
    # values float32 holds exactly: the frontend passes temperature and top_p on as float32
    ref["sampled"] = engine.generate([COMPLETION], SamplingParams(max_tokens=16, **SAMPLED))[0]
    ref["n_logprobs"] = engine.generate([COMPLETION], SamplingParams(max_tokens=8, n=3, logprobs=2, **{
        k: v for k, v in SAMPLED.items() if k != "top_k"}))
    ref["echo"] = engine.generate([COMPLETION], SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1))[0]
    ref["echo_k"] = engine.generate([COMPLETION], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    ref["tricky"] = engine.generate([TRICKY], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    engine.close()
    del engine
    gc.collect()
    return ref


@pytest.fixture(scope="class")       # stopped before the next class starts its own
def deployment(reference, default_engine_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dynamo")
    dep = dynamo_launch.start(default_engine_dir, workers=2, http_port=dynamo_launch.free_port(), run_dir=run_dir,
                              lookahead_overrides={"max_model_len": MAX_MODEL_LEN, "prefill_chunk": 256},
                              threads=1, timeout=150, worker_options={"no_verify_checksums": True},
                              router_mode="round-robin", progress=lambda m: print(m, flush=True))
    try:
        yield dep
    finally:
        dynamo_launch.stop(run_dir, grace_s=5, progress=None)


@pytest.fixture(scope="class")
def client(deployment):
    import openai
    return openai.OpenAI(base_url=deployment.url, api_key="unused", max_retries=0, timeout=120)


def worker_stats(dep, i: int) -> dict:
    with urllib.request.urlopen(dep.stats_url(i), timeout=5) as r:
        return json.loads(r.read())


def _chat(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


def _stream_text(stream) -> tuple[str, list, object]:
    text, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            piece = getattr(ch, "delta", None)
            text.append((piece.content or "") if piece is not None else (ch.text or ""))
            finishes.append(ch.finish_reason)
    return "".join(text), finishes, usage


@pytest.mark.usefixtures("deployment")
class TestLive:
    pytestmark = live

    def test_models_list(self, client, deployment):
        assert MODEL in [m.id for m in client.models.list().data]
        for i in range(2):       # the lookahead overrides reached every worker
            cfg = worker_stats(deployment, i)["config"]
            assert (cfg["max_model_len"], cfg["prefill_chunk"]) == (MAX_MODEL_LEN, 256)
            # and what each resolved at load is served beside its stats
            with urllib.request.urlopen(deployment.stats_url(i).replace("/stats", "/spec"), timeout=5) as r:
                spec = json.loads(r.read())
            assert spec["max_model_len"] == MAX_MODEL_LEN and spec["precision"]["prefill"] in ("float32", "bfloat16")

    def test_chat_equals_in_process_with_usage(self, client, reference):
        for key, prompt in (("chat", CHAT), ("chat_long", CHAT_LONG)):
            ref = reference[key]
            r = _chat(client, prompt, max_tokens=24)
            assert r.choices[0].message.content == ref.text
            assert r.choices[0].finish_reason == {"stop": "stop", "length": "length"}[ref.finish_reason]
            assert r.usage.completion_tokens == len(ref.token_ids)
            assert r.usage.prompt_tokens == reference["prompt_tokens"][key]
        assert reference["chat"].finish_reason == "stop"       # one ends on EOS, counted as a token

    def test_streamed_chat_equals_in_process(self, client, reference):
        ref = reference["chat_long"]
        stream = _chat(client, CHAT_LONG, max_tokens=24, stream=True, stream_options={"include_usage": True})
        text, finishes, usage = _stream_text(stream)
        assert text == ref.text and finishes[-1] == ref.finish_reason
        assert usage.completion_tokens == len(ref.token_ids)

    def test_completions_equal_in_process(self, client, reference):
        ref = reference["completion"]
        r = client.completions.create(model=MODEL, prompt=COMPLETION, max_tokens=24, temperature=0)
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == \
            (reference["prompt_tokens"]["completion"], len(ref.token_ids))
        stream = client.completions.create(model=MODEL, prompt=COMPLETION, max_tokens=24, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        text, finishes, usage = _stream_text(stream)
        assert text == ref.text and finishes[-1] == ref.finish_reason
        assert usage.completion_tokens == len(ref.token_ids)

    def test_stop_strings(self, client, reference):
        stop, ref, full = reference["stop"], reference["stopped"], reference["completion"].text
        assert ref.text == full[:full.index(stop)] and ref.finish_reason == "stop"
        r = client.completions.create(model=MODEL, prompt=COMPLETION, max_tokens=24, temperature=0, stop=[stop])
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == len(ref.token_ids)
        stream = client.completions.create(model=MODEL, prompt=COMPLETION, max_tokens=24, temperature=0,
                                           stop=[stop], stream=True)
        text, finishes, _ = _stream_text(stream)
        assert text == ref.text and finishes[-1] == "stop"

    def test_n_choices_and_logprobs_equal_in_process(self, client, reference):
        """n = 3 sampled choices with logprobs: each choice, its tokens' log-probabilities and their
        top-2 alternatives equal the in-process engine's (same seed: choice i draws from seed + i)."""
        refs = reference["n_logprobs"]
        r = client.completions.create(model=MODEL, prompt=COMPLETION, max_tokens=8, n=3, logprobs=2,
                                      temperature=0.75, top_p=0.875, seed=1234)
        assert sorted(c.index for c in r.choices) == [0, 1, 2]
        for choice in r.choices:
            ref = refs[choice.index]
            assert choice.text == ref.text
            assert choice.logprobs.token_logprobs == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-4)
            # OpenAI completions: the k most likely tokens, plus the chosen one when it is not among them
            for d, t in zip(choice.logprobs.top_logprobs, ref.logprobs):
                assert 1 <= len(d) <= 3, d                # tokens of the same text share a key
                assert max(d.values()) == pytest.approx(t.top[0][1], abs=1e-4)
        assert r.usage.completion_tokens == sum(len(x.token_ids) for x in refs)
        chat = _chat(client, CHAT, max_tokens=6, logprobs=True, top_logprobs=3)
        content = chat.choices[0].logprobs.content
        assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
        assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)
        assert content[0].logprob == pytest.approx(max(a.logprob for a in content[0].top_logprobs), abs=1e-5)

    def test_echo_returns_the_prompt_and_its_logprobs_as_in_process(self, client, reference):
        """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1, non-streaming): the text
        starts with the prompt, and every prompt token's log-probability equals the in-process
        engine's prompt_logprobs (the first None); a streaming echo is refused by name."""
        import openai

        ref = reference["echo"]
        r = client.completions.create(model=MODEL, prompt=COMPLETION, max_tokens=1, temperature=0, logprobs=1,
                                      echo=True)
        lp = r.choices[0].logprobs
        n = reference["prompt_tokens"]["completion"]
        assert r.choices[0].text == COMPLETION + ref.text
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:n] == pytest.approx([t.logprob for t in ref.prompt_logprobs[1:]], abs=1e-4)
        assert lp.token_logprobs[n] == pytest.approx(ref.logprobs[0].logprob, abs=1e-4)
        assert "".join(lp.tokens[:n]) == COMPLETION and lp.text_offset[:2] == [0, len(lp.tokens[0])]
        with pytest.raises(openai.BadRequestError, match="echo"):
            client.completions.create(model=MODEL, prompt=COMPLETION, max_tokens=1, echo=True, stream=True)

    def test_echo_lists_k_alternatives_per_prompt_token(self, client, reference):
        """echo with logprobs 3: every prompt token lists its 3 most likely tokens (the frontend
        alone asks the worker for 1), with the in-process engine's log-probabilities."""
        ref = reference["echo_k"]
        r = client.completions.create(model=MODEL, prompt=COMPLETION, max_tokens=1, temperature=0, logprobs=3,
                                      echo=True)
        tops = r.choices[0].logprobs.top_logprobs[:len(ref.prompt_logprobs)]
        assert tops[0] is None
        for d, t in zip(tops[1:], ref.prompt_logprobs[1:]):
            best = sorted(d.values(), reverse=True)[:3]
            assert best == pytest.approx([lp for _, lp in t.top], abs=1e-4), (d, t)

    def test_echo_tokens_join_to_the_text_and_offsets_index_it(self, client, reference):
        """A special token, split UTF-8 characters and runs of spaces: the echo's tokens are the
        text's exact pieces; `prompt_logprobs` (vLLM's field) is answered in the choice."""
        ref = reference["tricky"]
        r = client.completions.create(model=MODEL, prompt=TRICKY, max_tokens=1, temperature=0, logprobs=1, echo=True,
                                      extra_body={"prompt_logprobs": 2})
        choice = r.choices[0]
        lp, plp = choice.logprobs, choice.model_extra["prompt_logprobs"]
        assert choice.text.startswith(TRICKY) and "".join(lp.tokens) == choice.text
        assert all(choice.text[at:at + len(t)] == t for at, t in zip(lp.text_offset, lp.tokens))
        assert "<|im_start|>" in lp.tokens
        assert len(plp) == len(ref.prompt_logprobs) and plp[0] is None
        for got, t in zip(plp[1:], ref.prompt_logprobs[1:]):
            assert got[str(t.token_id)]["logprob"] == pytest.approx(t.logprob, abs=1e-4)
            assert got[str(t.token_id)]["rank"] == t.rank
            assert {str(tid) for tid, _ in t.top} <= set(got)

    def test_chat_prompt_logprobs_are_answered_and_refused_when_streaming(self, client):
        import openai

        r = _chat(client, CHAT, max_tokens=1, extra_body={"prompt_logprobs": 1})
        plp = r.model_extra["prompt_logprobs"]
        assert len(plp) == r.usage.prompt_tokens and plp[0] is None and all(len(e) in (1, 2) for e in plp[1:])
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
            _chat(client, CHAT, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1})

    def test_usage_reports_cached_tokens(self, client):
        r = client.completions.create(model=MODEL, prompt=COMPLETION, max_tokens=2, temperature=0)
        assert isinstance(r.usage.prompt_tokens_details.cached_tokens, int)

    def test_worker_metrics_carry_the_prefix_cache(self, deployment):
        """Each worker's /metrics (its system port) has the engine's families, the Triton model's names."""
        import re
        for i in range(2):
            url = deployment.stats_url(i).replace("/engine/stats", "/metrics")
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            found = dict(re.findall(r"^(lookahead_\w+)\{[^}]*worker=\"%d\"[^}]*\} (\S+)$" % i, text, re.M))
            for name in ("lookahead_prefix_cache_hit_rate", "lookahead_prefix_cache_blocks",
                         "lookahead_prefix_cache_hit_tokens_total", "lookahead_prefix_cache_evicted_blocks_total",
                         "lookahead_free_kv_blocks"):
                assert name in found, (name, sorted(found))
            assert float(found["lookahead_kv_blocks"]) == worker_stats(deployment, i)["total_blocks"]

    def test_sampling_parameters_are_honoured(self, client, reference):
        """temperature, top_p, top_k and seed reach the engine: the same draw as in-process."""
        ref = reference["sampled"]
        r = client.completions.create(model=MODEL, prompt=COMPLETION, max_tokens=16, extra_body={"top_k": 20},
                                      temperature=0.75, top_p=0.875, seed=1234)
        assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.token_ids)

    def test_16_concurrent_streams(self, deployment):
        import openai

        async def one(client, i):
            stream = await client.completions.create(model=MODEL, prompt=f"{COUNTING} {i},", max_tokens=8,
                                                     temperature=0, stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            pieces, usage, finish = [], None, None
            async for chunk in stream:
                usage = chunk.usage or usage
                for ch in chunk.choices:
                    pieces.append(ch.text or "")
                    finish = ch.finish_reason or finish
            return "".join(pieces), finish, usage

        async def main():
            client = openai.AsyncOpenAI(base_url=deployment.url, api_key="unused", max_retries=0, timeout=120)
            try:
                return await asyncio.gather(*(one(client, i) for i in range(16)))
            finally:
                await client.close()
        results = asyncio.run(main())
        assert [f for _, f, _ in results] == ["length"] * 16
        assert [u.completion_tokens for _, _, u in results] == [8] * 16
        assert all(text for text, _, _ in results)

    def test_bad_requests_get_4xx_while_another_stream_goes_on(self, client):
        import openai

        got: list[float] = []
        result: dict = {}

        def background():
            try:
                stream = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=64, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
                for chunk in stream:
                    got.append(time.monotonic())
                    if chunk.usage is not None:
                        result["usage"] = chunk.usage
                    for ch in chunk.choices:
                        result["finish"] = ch.finish_reason or result.get("finish")
            except Exception as e:           # reported by the assertions below
                result["error"] = e

        t = threading.Thread(target=background)
        t.start()
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got, f"the background stream never started: {result}"
        msgs = [{"role": "user", "content": "hi"}]
        cases = [
            (openai.BadRequestError, "max", dict(model=MODEL, messages=msgs, max_tokens=0)),
            (openai.NotFoundError, "not found", dict(model="no-such-model", messages=msgs, max_tokens=4)),
            (openai.BadRequestError, "temperature", dict(model=MODEL, messages=msgs, max_tokens=4, temperature=-1)),
            (openai.BadRequestError, "messages", dict(model=MODEL, messages=[], max_tokens=4)),
            # refused by the worker (SamplingParams and its own checks), streaming: still a 4xx
            (openai.BadRequestError, "n:", dict(model=MODEL, messages=msgs, max_tokens=4, n=17, stream=True)),
            (openai.BadRequestError, "presence_penalty:", dict(model=MODEL, messages=msgs, max_tokens=4,
                                                               presence_penalty=0.5)),
            # never seen by a worker: refused by name by the front
            (openai.BadRequestError, "tools:", dict(model=MODEL, messages=msgs, max_tokens=4, tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])),
            (openai.BadRequestError, "tool_choice:", dict(model=MODEL, messages=msgs, max_tokens=4,
                                                          tool_choice="required")),
            (openai.BadRequestError, "n:", dict(model=MODEL, messages=msgs, max_tokens=4, extra_body={"n": "two"})),
            (openai.BadRequestError, "max_model_len", dict(model=MODEL, messages=msgs, max_tokens=MAX_MODEL_LEN)),
        ]
        for exc, text, kw in cases:
            with pytest.raises(exc) as err:
                r = client.chat.completions.create(**kw)
                if kw.get("stream"):
                    list(r)
            assert 400 <= err.value.status_code < 500 and text in str(err.value).lower(), (kw, err.value)
        answered = time.monotonic()
        t.join(timeout=90)
        assert "error" not in result, result
        assert result.get("finish") == "length" and result["usage"].completion_tokens == 64
        assert any(ts > answered for ts in got), "the stream stalled while the bad requests were answered"

    def test_cancelled_stream_frees_its_blocks(self, client, deployment):
        before = [worker_stats(deployment, i) for i in range(2)]
        stream = client.completions.create(model=MODEL, prompt=COMPLETION, max_tokens=300, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        for _ in range(3):
            next(it)
        busy = [worker_stats(deployment, i) for i in range(2)]
        w = next(i for i in range(2) if busy[i]["num_live"] == 1)
        assert busy[w]["free_blocks_now"] < busy[w]["total_blocks"]        # the request holds blocks
        stream.close()                                                     # the client goes away
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            now = worker_stats(deployment, w)
            if now["aborted_requests"] > before[w]["aborted_requests"] and now["num_live"] == 0:
                break
            time.sleep(0.1)
        assert now["aborted_requests"] == before[w]["aborted_requests"] + 1, now
        assert now["free_blocks_now"] == now["total_blocks"] and now["num_running"] == 0, now
        log = (deployment.run_dir / f"worker-{w}.log").read_text()
        assert "cancelled after" in log and "KV blocks are freed" in log

    def test_load_test_drives_the_openai_endpoint(self, deployment, tmp_path):
        from script_loader import load_script
        load_test = load_script("scripts/load_test.py")
        out = tmp_path / "load.json"
        rc = load_test.main(["--openai-url", deployment.url.removesuffix("/v1"), "--concurrency", "2",
                             "--num-requests", "4", "--max-tokens", "6", "--prompt-len", "40", "--warmup", "0",
                             "--no-progress", "--json", str(out)])
        served = json.loads(out.read_text())["results"]["served"]
        assert rc == 0 and served["completed"] == 4 and served["errors"] == 0
        assert served["output_tokens"] == 4 * 6          # usage-corrected: EOS ignored, exactly max_tokens

    def test_two_workers_both_serve(self, client, deployment):
        before = [worker_stats(deployment, i)["num_requests"] for i in range(2)]
        for i in range(4):
            client.completions.create(model=MODEL, prompt=f"Request {i}:", max_tokens=2, temperature=0)
        after = [worker_stats(deployment, i)["num_requests"] for i in range(2)]
        assert sum(after) - sum(before) == 4
        assert all(a > b for a, b in zip(after, before)), (before, after)


def _document(d: int, words: int = 150) -> str:
    """A long prompt (~700 tokens) of its own: no two share a first block."""
    return f"Document {d}: " + " ".join(f"word{(d * 7919 + k * 31) % 5000}" for k in range(words))


@pytest.fixture(scope="class")
def kv_deployment(default_engine_dir, tmp_path_factory):
    """Two workers under the KV router, watched: the front restarts a worker that dies."""
    run_dir = tmp_path_factory.mktemp("dynamo-kv")
    dep = dynamo_launch.start(default_engine_dir, workers=2, http_port=dynamo_launch.free_port(), run_dir=run_dir,
                              lookahead_overrides={"max_model_len": 1024, "prefill_chunk": 256}, threads=1,
                              timeout=150, worker_options={"no_verify_checksums": True}, router_mode="kv",
                              watch=True, progress=lambda m: print(m, flush=True))
    try:
        yield dep
    finally:
        dynamo_launch.stop(run_dir, grace_s=5, progress=None)


class TestKvRouting:
    """`--router kv`: the workers publish their prefix cache's KV events (blocks stored / removed,
    with their token ids) and their load over the event plane (ZMQ, file discovery), and the
    frontend's router sends a request to the worker that holds the longest prefix of it."""
    pytestmark = live

    def test_a_repeated_long_prompt_goes_to_the_worker_that_holds_its_prefix(self, kv_deployment):
        import openai

        dep = kv_deployment
        client = openai.OpenAI(base_url=dep.url, api_key="unused", max_retries=0, timeout=120)
        served: dict[int, int] = {}
        for rnd in range(2):
            for d in range(4):
                before = [worker_stats(dep, i)["num_requests"] for i in range(2)]
                r = client.completions.create(model=MODEL, prompt=_document(d), max_tokens=2, temperature=0)
                after = [worker_stats(dep, i)["num_requests"] for i in range(2)]
                (w,) = [i for i in range(2) if after[i] > before[i]]
                cached = r.usage.prompt_tokens_details.cached_tokens
                full_blocks = r.usage.prompt_tokens // 16 * 16
                if rnd == 0:
                    served[d] = w
                    assert cached == 0, (d, cached)
                else:       # every full block of the prompt, from the cache of the worker that holds it
                    assert w == served[d], f"document {d} went to worker {w}, its blocks are on {served[d]}"
                    assert cached >= full_blocks - 16, (d, cached, r.usage.prompt_tokens)
        events = [worker_stats(dep, i)["kv_events"] for i in range(2)]
        for i in set(served.values()):
            assert events[i]["stored_blocks"] > 0 and events[i]["failed"] == 0, events
        stats = [worker_stats(dep, i) for i in range(2)]
        assert sum(s["prefix_cache_hits"] for s in stats) >= 4 * 700 - 4 * 32

    def test_a_killed_worker_is_restarted_and_status_says_which_is_up(self, kv_deployment):
        import os
        import signal
        import subprocess
        from pathlib import Path

        import openai

        dep = kv_deployment
        serve = str(Path(__file__).resolve().parents[1] / "scripts" / "serve.sh")

        def status():
            r = subprocess.run([serve, "status", "--run-dir", str(dep.run_dir)], capture_output=True, text=True,
                               timeout=60)
            return r.returncode, r.stdout
        rc, out = status()
        assert rc == 0 and "workers up 2/2" in out, out
        old = int((dep.run_dir / "worker-1.pid").read_text())
        os.kill(old, signal.SIGKILL)
        rc, out = status()
        assert rc == 1 and ("worker-1: DOWN" in out or "worker-1: starting" in out) and "worker-0: up" in out, out
        client = openai.OpenAI(base_url=dep.url, api_key="unused", max_retries=0, timeout=120)
        # the frontend and worker-0 still serve; a request the router sends to the dead worker before
        # it is dropped gets a 503 (Dynamo's "temporarily unavailable": retry), for a few seconds at most
        deadline = time.monotonic() + 15
        while True:
            try:
                r = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=2, temperature=0)
                break
            except openai.InternalServerError as e:
                assert e.status_code == 503 and time.monotonic() < deadline, e
                time.sleep(0.5)
        assert r.choices[0].finish_reason == "length"
        deadline = time.monotonic() + 120
        while True:
            rc, out = status()
            if rc == 0:
                break
            assert time.monotonic() < deadline, f"worker-1 was not restarted: {out}"
            time.sleep(1)
        new = int((dep.run_dir / "worker-1.pid").read_text())
        assert new != old and "restarts 1" in out and "workers up 2/2" in out, out
        assert json.loads((dep.run_dir / "watch.json").read_text())["restarts"] == {"worker-1": 1}
        before = worker_stats(dep, 1)["num_requests"]
        # new documents: the router spreads them by load again (idle workers tie on cost; 12 of them
        # all on worker-0 by chance is 1 in 4096, 6 were 1 in 64 and failed once in a full run)
        for d in range(10, 22):
            client.completions.create(model=MODEL, prompt=_document(d, 40), max_tokens=2, temperature=0)
        assert worker_stats(dep, 1)["num_requests"] > before, "the restarted worker gets no requests"


@pytest.mark.skipif(not (shutil.which("etcd") and shutil.which("nats-server")),
                    reason="etcd and nats-server are not on PATH (Debian: apt-get install etcd-server nats-server)")
class TestEtcdNats:
    """The several-machine setup on loopback: discovery through etcd, requests and events over NATS,
    both servers started and stopped by the launcher."""
    pytestmark = live

    def test_serves_and_stops(self, reference, default_engine_dir, tmp_path):
        import openai

        run_dir = tmp_path / "run"
        dep = dynamo_launch.start(default_engine_dir, workers=1, http_port=dynamo_launch.free_port(), run_dir=run_dir,
                                  discovery="etcd", start_etcd_nats=True, threads=1, timeout=150,
                                  lookahead_overrides={"max_model_len": MAX_MODEL_LEN},
                                  worker_options={"no_verify_checksums": True}, progress=None)
        try:
            assert set(dep.infra_pids) == {"etcd", "nats"}
            assert "NATS request plane" in (run_dir / "worker-0.log").read_text()
            client = openai.OpenAI(base_url=dep.url, api_key="unused", max_retries=0, timeout=120)
            ref = reference["chat_long"]
            text, finishes, _ = _stream_text(_chat(client, CHAT_LONG, max_tokens=24, stream=True))
            assert text == ref.text and finishes[-1] == ref.finish_reason
        finally:
            stopped = dynamo_launch.stop(run_dir, progress=None)
        assert set(stopped) == {"etcd", "nats", "front", "frontend", "worker-0"}   # front: the public port
        assert dynamo_launch.status(run_dir)["running"] == {}


@pytest.mark.skipif(_missing() is not None, reason=_missing() or "")
@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_serve_sh_starts_and_stops_the_dynamo_frontend(default_engine_dir, tmp_path):
    """`scripts/serve.sh start --frontend dynamo` is the one command users run; stop finds it."""
    import subprocess
    from pathlib import Path

    serve = str(Path(__file__).resolve().parents[1] / "scripts" / "serve.sh")
    port, run_dir = dynamo_launch.free_port(), tmp_path / "run dir"
    start = subprocess.run([serve, "start", "--frontend", "dynamo", "--workers", "1", "--http-port", str(port),
                            "--engine", str(default_engine_dir), "--run-dir", str(run_dir), "--prefix-caching", "false",
                            "--", "--max-model-len", str(MAX_MODEL_LEN)], capture_output=True, text=True, timeout=200)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        assert "router round-robin" in start.stdout                      # one worker: nothing to choose
        assert dynamo_launch.status(run_dir)["workers"]["worker-0"]["config"]["prefix_caching"] is False
        for _ in range(2):           # caching off: the same prompt again is prefilled again
            body = json.dumps({"model": MODEL, "prompt": COMPLETION * 8, "max_tokens": 1}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            usage = json.load(urllib.request.urlopen(req, timeout=60))["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage
        models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10))
        assert [m["id"] for m in models["data"]] == ["lookahead_llm"]
        status = subprocess.run([serve, "status", "--frontend", "dynamo", "--run-dir", str(run_dir)],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "worker-0" in status.stdout
    finally:
        stop = subprocess.run([serve, "stop", "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert dynamo_launch.status(run_dir)["running"] == {}
    bad = subprocess.run([serve, "start", "--frontend", "grpc"], capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "--frontend must be triton or dynamo" in bad.stderr
