"""Serve a `runtime.Engine` as an NVIDIA Dynamo worker: the OpenAI API through `python -m dynamo.frontend`.

    python -m serving.dynamo_worker --engine engines/default [--device cpu|cuda|cuda:N] \\
        [--mode lookahead --top-k 128 ... (any LookaheadConfig field)] \\
        [--model-name lookahead_llm] [--namespace lookahead] [--run-dir build/dynamo] [--worker-index 0]

`deploy/dynamo_launch.py` starts the frontend and N of these with the right environment
(`deploy.dynamo_launch.base_env`); run by hand, set the same DYN_* variables first.

How a request flows
- The worker registers the model in *tokens* mode for chat and completions
  (`register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, ...)`) from a model
  dir it writes under the run dir (`make_model_dir`: the engine's tokenizer.json, its
  tokenizer_config.json with the chat template inlined, a minimal config.json and
  generation_config.json). The frontend applies the chat template, tokenizes, detokenizes, applies
  stop strings to the text and counts completion tokens.
- The handler gets `token_ids`, `stop_conditions` and `sampling_options`, builds a
  `runtime.sampling.SamplingParams` from them (`sampling_params_from_request`: the validation the
  Triton path uses, raising RequestError naming the field) and submits the ids to one `EngineLoop`
  (serving/loop.py), whose background thread steps the engine for every request of the
  worker. Outputs cross back to asyncio through `call_soon_threadsafe`; each chunk carries the new
  token ids and its choice's `index` (n > 1: the frontend sends one request with
  `sampling_options.n`; the engine runs n sequences on the prompt's shared blocks), with logprobs
  asked for (`output_options.logprobs` = k) `log_probs` and `top_logprobs`; a choice's last chunk
  its finish reason, the request's last `completion_usage` with
  `prompt_tokens_details.cached_tokens` (the frontend reports both to the client). A completions
  `echo` (and a `prompt_logprobs` field) reaches the worker as `output_options.prompt_logprobs`;
  the request's last chunk then carries the prompt's ids, each token's exact piece of the text
  (`TextTokenizer.token_texts`) and the log-probabilities in `engine_data`, which the front
  (deploy/openai_front.py `prompt_logprobs_rewrite`) writes into a completions answer (Dynamo's
  frontend writes a chat answer's `prompt_logprobs` itself).
- KV-aware routing: the prefix cache's events (`engine.kv_events`: blocks stored with their token
  ids, removed) go to Dynamo's `KvEventPublisher` (`KvEventRelay`), and the blocks in use to its
  `WorkerMetricsPublisher`, over the event plane; the model is registered with the engine's block
  size, which the router hashes the request's tokens with.
- Stop strings go to the engine too, so it stops (and frees the blocks) at the same token where the
  frontend cuts the text.

Errors. A bad request raises `InvalidArgument` (HTTP 400, message naming the field as the OpenAI
request calls it: the runtime's `prompt` is `prompt/messages`, serving/fields.py) inside the
response generator, before its first chunk; a full queue raises `HttpError(429)`. Raising *outside*
the generator (in the handler call itself) makes Dynamo 1.6 treat the worker as failed: it answers
503 and routes nothing to it for several seconds, so this module never does. For a streaming request
the frontend still sends a 4xx only if it holds the HTTP status back until the first chunk:
dynamo_launch sets `DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS` on the frontend for that (without it the
error arrives as an SSE `error` event inside a 200 response). The frontend itself refuses
`max_tokens` <= 0, temperature outside [0, 2], top_p outside (0, 1], empty messages and unknown
models before a worker sees them.

Cancellation. A client that disconnects stops the request's Dynamo context (and the frontend stops
it when it has cut the text at a stop string). A task per request awaits
`context.async_killed_or_stopped()` and marks the request's sink cancelled, and so does closing the
response generator; `EngineLoop` polls the sink (every 0.2 s) and aborts the request in the engine,
which frees its KV blocks at its next step. The worker logs "cancelled ... KV blocks freed" with the
pool's free count, and publishes the engine's stats (free_blocks, total_blocks, num_running,
aborted_requests, ...) to `<run-dir>/worker-<i>.stats.json` and, when DYN_SYSTEM_PORT is set, on
`GET http://127.0.0.1:$DYN_SYSTEM_PORT/engine/stats`; what the engine resolved at load (precisions and where
they came from, kernels, the fused step, the memory plan: `Engine.describe()`) at `.../engine/spec`.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from runtime.threads import off_main_thread, prepare_threads

if __name__ == "__main__":  # the worker process: before runtime.sampling loads torch (runtime/threads.py)
    prepare_threads()

from runtime.errors import LookaheadError, RequestError

from .fields import OPENAI_FIELDS, client_error

log = logging.getLogger("serving.dynamo_worker")

DEFAULT_MODEL_NAME = "lookahead_llm"
DEFAULT_NAMESPACE = "lookahead"
COMPONENT, ENDPOINT = "backend", "generate"

# Dynamo's finish reasons (the Rust layer's FinishReason): the engine's "abort" is a cancellation.
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled"}

# sampling_options / stop_conditions / output_options keys this engine cannot honour, with the value
# that means "off" (what OpenAI clients often send explicitly). Anything else is refused by name.
# `n` and `logprobs` are honoured when the runtime's SamplingParams has them (ENGINE_FIELDS).
_UNSUPPORTED_OFF = {
    "sampling_options": {"best_of": (None, 1), "use_beam_search": (None, False),
                         "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                         "repetition_penalty": (None, 1, 1.0), "min_p": (None, 0, 0.0),
                         "length_penalty": (None, 1, 1.0), "guided_decoding": (None,),
                         "include_stop_str_in_output": (None, False)},
    "stop_conditions": {"min_tokens": (None, 0), "stop_token_ids_visible": (None, []),
                        "max_thinking_tokens": (None,)},
    "output_options": {"return_tokens_as_token_ids": (None, False)},
}
_FIX = {"n": "this engine returns one choice per request: send n=1 or omit it",
        "best_of": "send best_of=1 or omit it",
        "guided_decoding": "structured output (response_format, guided_json, ...) is not supported: omit it",
        "logprobs": "log-probabilities are not returned by this engine: omit logprobs",
        # the frontend turns a completions request's `echo` into prompt_logprobs
        "prompt_logprobs": "prompt log-probabilities (completions `echo`) are not returned: omit echo"}


def _engine_fields() -> frozenset[str]:
    from runtime.sampling import SamplingParams
    return frozenset(f.name for f in dataclasses.fields(SamplingParams))


ENGINE_FIELDS = _engine_fields()


# ---- request -> SamplingParams (pure: no dynamo import) -------------------------------------------
def token_ids_of(request: dict[str, Any]) -> list[int]:
    """The prompt's token ids: a list, or the packed little-endian int32 bytes Dynamo may send."""
    value = request.get("token_ids")
    if value is None:
        return []
    if isinstance(value, (bytes, bytearray, memoryview)):
        import array
        buf = memoryview(value).cast("B")
        if buf.nbytes % 4:
            raise RequestError("token_ids", f"packed ids are {buf.nbytes} bytes, not a multiple of 4",
                               "a frontend bug: send a list of ids")
        ids = array.array("i")
        ids.frombytes(buf)
        if sys.byteorder != "little":
            ids.byteswap()
        return ids.tolist()
    return list(value.tolist() if hasattr(value, "tolist") else value)


def sampling_params_from_request(request: dict[str, Any], max_model_len: int,
                                 default_max_tokens: int | None = None):
    """(prompt ids, SamplingParams) of one Dynamo tokens-mode request (a PreprocessedRequest dict).

    The values are checked by `SamplingParams` itself, as on the Triton path: a bad one raises
    RequestError naming the field. Options this engine has no implementation of (n > 1, penalties,
    logprobs, guided decoding, min_tokens) are refused by name rather than ignored. A missing
    max_tokens means "up to the context": max_model_len - prompt length (or `default_max_tokens`,
    whichever is smaller). top_k -1 (vLLM's "off", which the frontend accepts) is 0 here.
    """
    from runtime.sampling import SamplingParams

    so = request.get("sampling_options") or {}
    sc = request.get("stop_conditions") or {}
    oo = request.get("output_options") or {}
    for section, values in (("sampling_options", so), ("stop_conditions", sc), ("output_options", oo)):
        for key, off in _UNSUPPORTED_OFF[section].items():
            v = values.get(key)
            if v not in off:
                raise RequestError(key, f"is not supported by this engine (got {v!r})",
                                   _FIX.get(key, f"omit {key}"))
    for key, value, off in (("n", so.get("n"), (None, 1)), ("logprobs", oo.get("logprobs"), (None,)),
                            ("prompt_logprobs", oo.get("prompt_logprobs"), (None,))):
        if key not in ENGINE_FIELDS and value not in off:       # a runtime without n > 1 / logprobs
            raise RequestError(key, f"is not supported by this engine (got {value!r})", _FIX[key])
    ids = token_ids_of(request)
    if not ids:
        raise RequestError(OPENAI_FIELDS["prompt"], "has no tokens", "send a non-empty prompt or at least one message")
    values: dict[str, Any] = {}
    max_tokens = sc.get("max_tokens")
    if max_tokens is None:
        max_tokens = max(1, max_model_len - len(ids))
        if default_max_tokens is not None:
            max_tokens = min(max_tokens, default_max_tokens)
    values["max_tokens"] = max_tokens
    for key in ("temperature", "top_p", "seed"):
        if so.get(key) is not None:
            values[key] = so[key]
    top_k = so.get("top_k")
    if top_k is not None:
        values["top_k"] = 0 if top_k == -1 else top_k
    if sc.get("stop"):
        values["stop"] = list(sc["stop"])
    if sc.get("ignore_eos") is not None:
        values["ignore_eos"] = bool(sc["ignore_eos"])
    # n: the frontend checks 1..128, the engine 1..16. logprobs: chat `top_logprobs` k (the frontend
    # sends 1 for `logprobs: true` without top_logprobs) or completions `logprobs` k (0..5).
    if so.get("n") is not None and "n" in ENGINE_FIELDS:
        values["n"] = so["n"]
    if oo.get("logprobs") is not None and "logprobs" in ENGINE_FIELDS:
        values["logprobs"] = oo["logprobs"]
    # prompt_logprobs: the frontend's rendering of a completions request's `echo` with `logprobs` k
    if oo.get("prompt_logprobs") is not None and "prompt_logprobs" in ENGINE_FIELDS:
        values["prompt_logprobs"] = oo["prompt_logprobs"]
    try:
        return ids, SamplingParams(**values)
    except RequestError as e:
        raise client_error(e, OPENAI_FIELDS) from None


# ---- the model dir the frontend reads --------------------------------------------------------------
def make_model_dir(engine_dir: str | Path, out_dir: str | Path, *, max_model_len: int | None = None,
                   tokenizer: Any = None) -> Path:
    """Write the local model dir Dynamo's frontend tokenizes from: tokenizer.json,
    tokenizer_config.json (with the chat template the runtime renders inlined: its own, or
    chat_template.jinja's), config.json (a minimal Llama-style config: context length, special
    token ids) and generation_config.json. The engine's files are read as the runtime reads them
    (TextTokenizer.from_engine: listed in engine.yaml, inside the dir, the template rendered once).
    Each file is written to a temporary name and renamed, so workers sharing one dir never expose
    a half-written file (they all write the same bytes). tokenizer: the engine's, when it is
    loaded already (the worker's), else loaded here."""
    from runtime.engine_dir import TOKENIZER_DIR, engine_file, load_manifest
    from runtime.tokenizer import TextTokenizer

    engine_dir, out = Path(engine_dir), Path(out_dir)
    manifest = load_manifest(engine_dir, verify_checksums=False)
    m = manifest.model
    tok = tokenizer or TextTokenizer.from_engine(manifest)
    tok_cfg = dict(tok.config)
    if tok.chat_template is not None:
        tok_cfg["chat_template"] = tok.chat_template
    out.mkdir(parents=True, exist_ok=True)
    eos = list(m.eos_token_ids)
    ctx = min(max_model_len or m.max_position_embeddings, m.max_position_embeddings)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
              "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
              "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
              "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
              "max_position_embeddings": ctx, "rms_norm_eps": m.rms_norm_eps, "rope_theta": m.rope_theta,
              "tie_word_embeddings": m.tie_word_embeddings, "bos_token_id": m.bos_token_id,
              "eos_token_id": eos[0] if len(eos) == 1 else eos, "torch_dtype": manifest.dtype}
    gen = {"bos_token_id": m.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}
    _atomic_copy(engine_file(manifest, f"{TOKENIZER_DIR}/tokenizer.json"), out / "tokenizer.json")
    _atomic_write(out / "tokenizer_config.json", json.dumps(tok_cfg, indent=1, ensure_ascii=False))
    _atomic_write(out / "config.json", json.dumps(config, indent=1))
    _atomic_write(out / "generation_config.json", json.dumps(gen, indent=1))
    return out


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _atomic_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


# ---- the engine side of one request ---------------------------------------------------------------
class _Sink:
    """One request seen from the EngineLoop thread (loop.RequestSink): outputs go to an asyncio
    queue on the worker's event loop."""

    def __init__(self, aloop: asyncio.AbstractEventLoop, on_abort=None):
        self.aloop = aloop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.rid: str | None = None
        self._on_abort = on_abort

    def _put(self, item: Any) -> None:
        self.aloop.call_soon_threadsafe(self.queue.put_nowait, item)

    def on_output(self, out) -> None:
        if request_done(out) and out.finish_reason == "abort" and self._on_abort is not None:
            self._on_abort(out)
        self._put(out)

    def on_error(self, message: str) -> None:
        self._put(_Failure(message, None))

    def on_reject(self, error: LookaheadError) -> None:
        error = client_error(error, OPENAI_FIELDS)
        self._put(_Failure(str(error), error))

    def is_cancelled(self) -> bool:
        return self.cancelled


@dataclasses.dataclass
class _Failure:
    message: str
    error: LookaheadError | None


class EngineHandler:
    """The Dynamo endpoint handler: `generate(request, context)` streams one request's chunks."""

    def __init__(self, engine, engine_loop, *, default_max_tokens: int | None = None):
        self.engine, self.loop = engine, engine_loop
        self.default_max_tokens = default_max_tokens
        self.total_blocks = engine.allocator.num_blocks
        self.num_requests = 0

    def _log_abort(self, out) -> None:
        # on the loop thread, right after the engine released the sequence: the count is current
        log.info("request %s cancelled after %d tokens: its KV blocks are freed (%d/%d blocks free)",
                 out.request_id, out.num_output_tokens, self.engine.allocator.num_free, self.total_blocks)

    async def generate(self, request: dict[str, Any], context):
        from dynamo.llm.exceptions import EngineShutdown, HttpError, InvalidArgument, Unknown

        from runtime.scheduler import QueueFullError

        try:
            ids, params = sampling_params_from_request(request, self.engine.max_model_len, self.default_max_tokens)
        except LookaheadError as e:
            raise InvalidArgument(str(e)) from None
        sink = _Sink(asyncio.get_running_loop(), self._log_abort)
        try:
            sink.rid = self.loop.submit(ids, params, sink)
        except QueueFullError as e:
            raise HttpError(429, str(e)) from None
        except LookaheadError as e:         # the engine's errors name its fields: the OpenAI names
            raise InvalidArgument(str(client_error(e, OPENAI_FIELDS))) from None
        except RuntimeError as e:           # the loop is stopping: the worker is shutting down
            raise EngineShutdown(str(e)) from None
        self.num_requests += 1
        watcher = asyncio.ensure_future(_watch_cancel(context, sink))
        finished = False
        tokens = [0] * params_n(params)         # generated tokens per choice, for the usage
        cached: dict[int, int] = {}             # cached prompt tokens per choice
        prompt_lps: dict[int, list] = {}        # prompt log-probabilities per choice (echo)
        tokenizer = self.engine.tokenizer
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)     # noqa: E731 (a token's text)
        try:
            while True:
                items = [await sink.queue.get()]
                while not sink.queue.empty() and not _ends(items[-1]):
                    items.append(sink.queue.get_nowait())       # the loop ran ahead: fewer chunks
                if isinstance(items[-1], _Failure):
                    failure = items.pop()
                    for chunk in output_chunks(items, tokens, cached, prompt_lps, decode):
                        yield chunk
                    finished = True
                    if isinstance(failure.error, QueueFullError):
                        raise HttpError(429, failure.message)
                    if failure.error is not None:
                        raise InvalidArgument(failure.message)
                    if "shutting down" in failure.message:
                        raise EngineShutdown(failure.message)
                    raise Unknown(failure.message)
                for chunk in output_chunks(items, tokens, cached, prompt_lps, decode):
                    if "engine_data" in chunk:      # echo: the front puts the prompt's tokens in the answer
                        chunk["engine_data"]["prompt_token_ids"] = ids
                        chunk["engine_data"]["prompt_tokens"] = tokenizer.token_texts(ids)
                    yield chunk
                if request_done(items[-1]):
                    finished = True
                    return
        finally:
            if not finished:        # the client left (generator closed or cancelled): free the blocks
                sink.cancelled = True
            watcher.cancel()


def params_n(params) -> int:
    return int(getattr(params, "n", 1) or 1)


def request_done(out) -> bool:
    """The output that ends the request (its last choice's final one), as serving.loop.request_finished."""
    return bool(out.finished and getattr(out, "request_finished", True))


def _ends(item) -> bool:
    return isinstance(item, _Failure) or request_done(item)


def prompt_logprobs_payload(entries: list, decode=None) -> list[dict[str, dict[str, Any]] | None]:
    """An engine output's `prompt_logprobs` as Dynamo carries them to the frontend (in the final
    chunk's `engine_data`): per prompt position, None for the first, else {token id as a string:
    {"logprob", "rank", "decoded_token"}} for the prompt token and its k most likely alternatives.
    `decode(ids) -> text` fills in the token text (omitted without it)."""
    payload: list[dict[str, dict[str, Any]] | None] = []
    for t in entries:
        if t is None:
            payload.append(None)
            continue
        pos = {str(tid): {"logprob": float(lp), "rank": r + 1} for r, (tid, lp) in enumerate(t.top)}
        pos[str(t.token_id)] = {"logprob": float(t.logprob), "rank": int(t.rank) if t.rank is not None else None}
        if decode is not None:
            for tid, entry in pos.items():
                entry["decoded_token"] = decode([int(tid)])
        payload.append(pos)
    return payload


def output_chunks(outs: list, tokens: list[int], cached: dict[int, int] | None = None,
                  prompt_lps: dict[int, list] | None = None, decode=None) -> list[dict[str, Any]]:
    """Dynamo response chunks (LLMEngineOutput dicts) for consecutive engine outputs of one request.

    Consecutive outputs of one choice merge into one chunk: `token_ids`, `index` (the choice), and
    with logprobs asked for `log_probs` (one float a token) and `top_logprobs` (per token, the k
    most likely {rank, token_id, token, logprob}; the frontend fills in the token text). A choice's
    last chunk carries its `finish_reason`. The request's last chunk also carries
    `completion_usage`: prompt tokens, generated tokens of all choices (the frontend counts
    them too), and `prompt_tokens_details.cached_tokens`, the prompt tokens whose KV came from
    the prefix cache (the frontend passes it on as OpenAI's `usage.prompt_tokens_details`): the
    least any choice reports, since with n > 1 the later choices find the blocks the first one
    prefilled. `tokens` (generated tokens per choice so far) and `cached` (choice -> its cached
    tokens) are updated. Prompt log-probabilities (asked for: completions `echo` with `logprobs`)
    come on a choice's first output and are kept in `prompt_lps` (choice -> entries); the request's
    last chunk carries choice 0's as `engine_data.prompt_logprobs` (prompt_logprobs_payload, token
    text through `decode`)."""
    chunks: list[dict[str, Any]] = []
    cached = {} if cached is None else cached
    prompt_lps = {} if prompt_lps is None else prompt_lps
    for out in outs:
        index = int(getattr(out, "index", 0) or 0)
        if getattr(out, "prompt_logprobs", None) is not None:
            prompt_lps[index] = out.prompt_logprobs
        cached[index] = min(cached.get(index, 1 << 62), int(getattr(out, "num_cached_tokens", 0) or 0))
        if index >= len(tokens):
            tokens.extend([0] * (index + 1 - len(tokens)))
        tokens[index] += len(out.new_token_ids)
        lps = getattr(out, "logprobs", None)
        last = chunks[-1] if chunks else None
        if last is None or last["index"] != index or "finish_reason" in last:
            last = {"token_ids": [], "index": index}
            if lps is not None:
                last["log_probs"], last["top_logprobs"] = [], []
            chunks.append(last)
        last["token_ids"].extend(out.new_token_ids)
        if lps is not None and "log_probs" in last:
            last["log_probs"].extend(float(t.logprob) for t in lps)
            last["top_logprobs"].extend([{"rank": r + 1, "token_id": int(tid), "token": None, "logprob": float(lp)}
                                         for r, (tid, lp) in enumerate(t.top)] for t in lps)
        if out.finished:
            last["finish_reason"] = FINISH_REASONS.get(out.finish_reason, out.finish_reason or "stop")
        if request_done(out):
            generated = sum(tokens)
            last["completion_usage"] = {
                "prompt_tokens": out.num_prompt_tokens, "completion_tokens": generated,
                "total_tokens": out.num_prompt_tokens + generated,
                "prompt_tokens_details": {"cached_tokens": min(cached.values())}}
            if prompt_lps:
                first = prompt_lps.get(0, next(iter(prompt_lps.values())))
                last["engine_data"] = {"prompt_logprobs": prompt_logprobs_payload(first, decode)}
    return [c for c in chunks if c["token_ids"] or "finish_reason" in c]


async def _watch_cancel(context, sink: _Sink) -> None:
    try:
        await context.async_killed_or_stopped()
    except asyncio.CancelledError:
        return
    except Exception:               # no such future on this context: the generator's close still cancels
        return
    sink.cancelled = True


# ---- stats --------------------------------------------------------------------------------------------
class StatsPublisher:
    """EngineLoop's on_stats: keeps the last snapshot, written to a JSON file (atomically)."""

    def __init__(self, path: Path | None, info: dict[str, Any]):
        self.path, self.info = path, info
        self.latest: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.listeners: list[Any] = []          # fn(snapshot), e.g. the router's load publisher

    def update(self, stats: dict[str, Any]) -> None:
        snap = {**self.info, **{k: v for k, v in stats.items() if v is None or isinstance(v, (int, float, str, bool))},
                "time": time.time()}
        with self._lock:
            self.latest = snap
        if self.path is not None:
            _atomic_write(self.path, json.dumps(snap))
        for fn in list(self.listeners):
            try:
                fn(snap)
            except Exception:
                log.exception("a stats listener failed")

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.latest)


# ---- KV events and load for the KV-aware router ---------------------------------------------------
def signed64(h: int) -> int:
    """The engine's unsigned 64-bit block hash as the signed 64-bit int Dynamo's Python API takes."""
    h &= (1 << 64) - 1
    return h - (1 << 64) if h >= 1 << 63 else h


class KvEventRelay:
    """The engine's prefix-cache events (`engine.kv_events`) -> Dynamo's `KvEventPublisher`.

    `engine.kv_events.subscribe(relay.put)`: `put` runs on the engine's step thread and only
    queues; a thread of its own publishes. BlockStored -> publish_stored(token_ids,
    num_block_tokens, block_hashes, parent_hash): the router hashes the blocks' token ids itself
    (its own hash, with the block size registered with the model) and matches them against a
    request's tokens, so the events must carry the ids; the engine's hashes only name the blocks
    (parent links, removal). BlockRemoved -> publish_removed. AllBlocksCleared -> publish_removed
    of every block this relay saw stored (the Python API has no "cleared")."""

    def __init__(self, publisher: Any):
        import queue as _queue
        self.publisher = publisher
        self._queue: _queue.SimpleQueue = _queue.SimpleQueue()
        self._stored: set[int] = set()
        self.counts = {"stored_blocks": 0, "removed_blocks": 0, "cleared": 0, "failed": 0}
        self._thread = threading.Thread(target=self._run, name="kv-event-relay", daemon=True)
        self._thread.start()

    def put(self, event: Any) -> None:
        self._queue.put(event)

    def close(self, timeout: float = 2.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def flush(self, timeout: float = 5.0) -> None:
        """Until every event queued so far is published (tests)."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def _run(self) -> None:
        while (event := self._queue.get()) is not None:
            if isinstance(event, threading.Event):
                event.set()
                continue
            try:
                self.publish(event)
            except Exception:                  # a bad event must not end the relay
                self.counts["failed"] += 1
                log.exception("publishing a KV event failed")

    def publish(self, event: Any) -> None:
        kind = type(event).__name__
        if kind == "BlockStored":
            hashes = [signed64(h) for h in event.block_hashes]
            parent = None if event.parent_hash is None else signed64(event.parent_hash)
            self.publisher.publish_stored(token_ids=list(event.token_ids),
                                          num_block_tokens=[int(event.block_size)] * len(hashes),
                                          block_hashes=hashes, parent_hash=parent)
            self._stored.update(hashes)
            self.counts["stored_blocks"] += len(hashes)
        elif kind == "BlockRemoved":
            hashes = [signed64(h) for h in event.block_hashes]
            self.publisher.publish_removed(block_hashes=hashes)
            self._stored.difference_update(hashes)
            self.counts["removed_blocks"] += len(hashes)
        elif kind == "AllBlocksCleared":
            if self._stored:
                self.publisher.publish_removed(block_hashes=sorted(self._stored))
            self.counts["removed_blocks"] += len(self._stored)
            self.counts["cleared"] += 1
            self._stored.clear()
        else:
            raise TypeError(f"unknown KV event {kind}")


def kv_used_blocks(stats: dict[str, Any]) -> int:
    """Blocks requests hold now (the router's load signal): the pool less its free blocks (which
    count the cached blocks no request uses: they are reclaimable)."""
    return max(0, int(stats.get("total_blocks") or 0) - int(stats.get("free_blocks") or 0))


# ---- the worker -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from runtime.cli import add_lookahead_flags

    p = argparse.ArgumentParser(prog="python -m serving.dynamo_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, help="engine dir (scripts/build_engine.py makes one)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or cuda:N (default: auto, cuda when torch has a GPU, else cpu); one that "
                        "is not there fails the start with a one-line error naming device")
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME, help="the model id clients send (default: %(default)s)")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="Dynamo namespace (default: %(default)s)")
    p.add_argument("--component", default=COMPONENT)
    p.add_argument("--endpoint", default=ENDPOINT)
    p.add_argument("--run-dir", default="build/dynamo", help="model dir, stats and ready files go here")
    p.add_argument("--worker-index", type=int, default=0, help="names this worker's files in the run dir")
    p.add_argument("--num-host-blocks", type=int, default=None, help="host KV pool size (default: the engine's)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for a batch slot before 429s")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens of a request that sends none (default: up to max_model_len)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--discovery-backend", default=None, choices=("file", "etcd", "mem", "kubernetes"),
                   help="overrides DYN_DISCOVERY_BACKEND (Dynamo's default: etcd)")
    p.add_argument("--request-plane", default=None, choices=("tcp", "nats"), help="overrides DYN_REQUEST_PLANE")
    p.add_argument("--event-plane", default=None, choices=("zmq", "nats"), help="overrides DYN_EVENT_PLANE")
    p.add_argument("--no-verify-checksums", action="store_true", help="skip the engine dir's checksum check")
    p.add_argument("--no-kv-events", action="store_true",
                   help="do not publish the prefix cache's KV events to the router (kv routing then guesses)")
    add_lookahead_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for flag, env in (("discovery_backend", "DYN_DISCOVERY_BACKEND"), ("request_plane", "DYN_REQUEST_PLANE"),
                      ("event_plane", "DYN_EVENT_PLANE")):
        if getattr(args, flag):
            os.environ[env] = getattr(args, flag)
    try:
        import uvloop  # noqa: F401
        from dynamo.runtime import dynamo_worker  # noqa: F401
    except ImportError as e:
        print(f"error: NVIDIA Dynamo is not installed for {sys.executable} ({e}): run scripts/install_dynamo.sh",
              file=sys.stderr)
        return 2
    try:
        state = _load(args)
    except LookaheadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvloop
    uvloop.install()
    try:
        asyncio.run(_serve(args, state))
    finally:
        state["loop"].stop(timeout=2.0)
        if state.get("relay") is not None:
            state["relay"].close()
        state["engine"].close()
    return 0


def _load(args: argparse.Namespace) -> dict[str, Any]:
    """Load the engine (the slow part, before the runtime exists) and start its step loop."""
    import torch

    from runtime.cli import lookahead_overrides
    from runtime.engine import Engine
    from .loop import EngineLoop

    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = lookahead_overrides(args)
    t0 = time.perf_counter()
    # built off the main thread, so the loop thread's OpenMP team is the process's only one
    engine = off_main_thread(lambda: Engine.from_dir(
        args.engine, device=args.device, verify_checksums=not args.no_verify_checksums,
        num_host_blocks=args.num_host_blocks, max_queue=args.max_queue, **overrides))
    model_dir = make_model_dir(args.engine, run_dir / "model", max_model_len=engine.max_model_len,
                               tokenizer=engine.tokenizer)
    info = {"worker_index": args.worker_index, "pid": os.getpid(), "mode": engine.config.mode,
            "device": str(engine.device),
            "model": args.model_name, "max_model_len": engine.max_model_len,
            "config": dataclasses.asdict(engine.config)}
    stats = StatsPublisher(run_dir / f"worker-{args.worker_index}.stats.json", info)
    engine_loop = EngineLoop(engine, on_stats=stats.update, name=f"dynamo-w{args.worker_index}")
    engine_loop.start()
    log.info("engine %s loaded on %s in %.1f s (mode %s, overrides %s, max_model_len %d, %d KV blocks)",
             args.engine, engine.device, time.perf_counter() - t0, engine.config.mode, overrides,
             engine.max_model_len, engine.allocator.num_blocks)
    return {"engine": engine, "loop": engine_loop, "stats": stats, "model_dir": model_dir, "run_dir": run_dir}


async def _serve(args: argparse.Namespace, state: dict[str, Any]) -> None:
    from dynamo.runtime import dynamo_worker

    @dynamo_worker()
    async def worker(runtime) -> None:
        await _run_worker(runtime, args, state)

    await worker()


async def _run_worker(runtime, args: argparse.Namespace, state: dict[str, Any]) -> None:
    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

    engine, engine_loop, stats = state["engine"], state["loop"], state["stats"]
    endpoint = runtime.endpoint(f"{args.namespace}.{args.component}.{args.endpoint}")
    handler = EngineHandler(engine, engine_loop, default_max_tokens=args.default_max_tokens)

    async def stats_route(body: dict) -> dict:
        relay = state.get("relay")
        return {**stats.snapshot(), "free_blocks_now": engine.allocator.num_free,
                "num_live": engine_loop.num_live(), "num_requests": handler.num_requests,
                "kv_events": dict(relay.counts) if relay else None}
    spec = engine.describe()       # what the engine resolved at load (runtime/spec.py): fixed for its life

    async def spec_route(body: dict) -> dict:
        return spec
    try:
        runtime.register_engine_route("stats", stats_route)
        runtime.register_engine_route("spec", spec_route)
    except Exception as e:       # no system server (DYN_SYSTEM_PORT unset): the stats file remains
        log.info("no /engine/stats route (%s); stats go to %s", e, stats.path)

    aloop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    async def shutdown() -> None:
        if stopping.is_set():
            return
        stopping.set()
        log.info("SIGTERM: unregistering from discovery, then stopping")
        try:
            await asyncio.wait_for(endpoint.unregister_endpoint_instance(), 3.0)
        except Exception as e:
            log.warning("unregistering the endpoint failed: %s", e)
        await aloop.run_in_executor(None, lambda: engine_loop.stop(timeout=2.0))
        runtime.shutdown()

    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, lambda: asyncio.ensure_future(shutdown()))

    # KV-aware routing: the cache's block events and the worker's load, over the event plane
    relay = None
    if getattr(engine, "kv_events", None) is not None and not args.no_kv_events:
        from dynamo.llm import KvEventPublisher
        relay = KvEventRelay(KvEventPublisher(endpoint=endpoint, kv_block_size=engine.config.block_size,
                                              enable_local_indexer=True))
        engine.kv_events.subscribe(relay.put)
        state["relay"] = relay
    try:
        from dynamo.llm import WorkerMetricsPublisher
        load = WorkerMetricsPublisher()
        await load.create_endpoint(endpoint)
        load.publish(0, kv_used_blocks=0)
        stats.listeners.append(lambda snap: load.publish(0, kv_used_blocks=kv_used_blocks(snap)))
    except Exception as e:            # routing still works, on the router's own load estimate
        log.warning("no worker load publisher (%s)", e)
    from .metrics import prometheus_text
    labels = {"model": args.model_name, "worker": str(args.worker_index)}
    try:
        endpoint.metrics.register_prometheus_expfmt_callback(lambda: prometheus_text(stats.snapshot(), labels))
    except Exception as e:
        log.warning("engine metrics are not on /metrics (%s); they are at /engine/stats", e)
    log.info("KV events %s (block size %d); load published to the router",
             "published" if relay else "off", engine.config.block_size)

    rc = ModelRuntimeConfig()
    rc.context_length = engine.max_model_len
    rc.total_kv_blocks = engine.allocator.num_blocks
    rc.max_num_seqs = engine.config.max_batch_size
    await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint,
                         str(state["model_dir"]), args.model_name, worker_type=WorkerType.Aggregated,
                         kv_cache_block_size=engine.config.block_size, runtime_config=rc)
    ready = state["run_dir"] / f"worker-{args.worker_index}.ready"
    try:                # names this worker's discovery entries (the watcher removes a dead one's)
        instance = f"{endpoint.connection_id():x}"
    except Exception:
        instance = None
    _atomic_write(ready, json.dumps({"pid": os.getpid(), "model": args.model_name, "instance_id": instance,
                                     "endpoint": f"{args.namespace}.{args.component}.{args.endpoint}"}))
    stats.update(engine.stats() | {"total_blocks": engine.allocator.num_blocks, "tokens_per_s": 0.0})
    log.info("serving model %r on %s.%s.%s", args.model_name, args.namespace, args.component, args.endpoint)
    await endpoint.serve_endpoint(handler.generate, graceful_shutdown=True)


if __name__ == "__main__":
    sys.exit(main())
