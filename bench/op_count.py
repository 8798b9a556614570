"""How many ops one steady-state decode step dispatches on the torch kernel table (a GPU's path).

    python -m bench.op_count                        # dense b1/b2/b5, lookahead resident b5; 2 and 6 layers
    python -m bench.op_count --json op_count.json   # the same, and the table as JSON
    python -m bench.op_count --top 15               # and each case's most frequent non-view ops per layer

On the path a CUDA engine runs (`select_ops(..., impl="torch")`, `fused=False`) every op is a kernel
launch, so the op count of a decode step is what a GPU step pays on the host before any copy is
hidden, and what a CUDA graph would have to capture. This counts it on CPU: random-weight engine
dirs (engine.yaml's `random_weights:` recipe, generated at load) with the torch table and no fused
step; prompts of ragged lengths are prefilled, a few decode steps warm the step up (the lookahead
working set settles), then every aten op that `Engine.step` dispatches over `--steps` decode steps
is counted with a TorchDispatchMode (views apart: `OpOverload.is_view`, no launch on a GPU;
`--decompose`: a composite op counted as the ops it runs, see `OpCounter`). A
case runs at two layer counts (`--layers 2 6`); the difference is the per-layer ops, extrapolated
linearly to `--target-layers` (32). The count depends on the code path, not on the sizes: a tiny
shape is used (`--shape` names a builder shape instead, its layer count overridden).

The lookahead engine copies with the "sync" transfer engine, so its copies are dispatched (and
counted) on the step's thread, where a CUDA engine's copy launches would be too. On CPU the torch
table calls the lookahead ops' torch implementations directly (`plugins.direct`: their inner ops
are counted); a CUDA engine's torch table calls `torch.ops.lookahead.*` (the slot plan and the
copy jobs included), each one CUDA launch there (block_topk: its score and select kernels, one
call): `--dispatcher` builds the table so, and each lookahead op counts one (dense calls none).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the op count does not depend on the sizes: a tiny llama (GQA group 2) keeps every case fast
TINY = dict(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0,
            tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
# the lookahead geometry: small blocks so a few hundred tokens give top-K a real choice
LOOKAHEAD = dict(mode="lookahead", residency="resident", block_size=4, top_k=8, recent_window=16,
                 num_sink_blocks=1, miss_policy="urgent", draft="dual_token")
CASES = (("dense", 1), ("dense", 2), ("dense", 5), ("lookahead", 5))
PROMPT_LENS = (97, 131, 64, 150, 113, 77, 120, 141)      # ragged contexts, taken in order per batch


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched under it (total, views, and per op name).

    Under inference mode (what `Engine.step` runs in) a composite op (`matmul`, `linear`,
    `reshape`, `rms_norm`, ...) reaches the counter whole, and counts one. decompose=True counts
    the ops it runs instead (a batched `matmul` whose operand must be copied into the batch
    layout is a `clone` and a `bmm`): closer to the kernels a GPU launches, though a CUDA build
    may have a fused kernel where the CPU's decomposition has several (`rms_norm`)."""

    def __init__(self, decompose: bool = False):
        super().__init__()
        self.total, self.views, self.decompose = 0, 0, decompose
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.decompose and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(),
                                                                               "CompositeImplicitAutograd"):
            with self:                  # the mode is off inside its handler: count the parts
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        self.total += 1
        if func.is_view or func.overloadpacket is torch.ops.aten._unsafe_view:   # (a view its schema omits)
            self.views += 1
        else:
            self.by_op[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)

    @property
    def non_view(self) -> int:
        return self.total - self.views


def engine_dir(root: Path, layers: int, shape: str | None = None, seed: int = 0) -> Path:
    """A random-weight engine dir of `layers` layers (TINY, or the builder shape `shape`)."""
    from builder.random_weights import INIT, write_byte_tokenizer
    from runtime.config import LookaheadConfig, ModelConfig
    from runtime.engine_dir import TOKENIZER_DIR, write_manifest

    if shape is None:
        fields = dict(TINY)
    else:
        from builder.shapes import SHAPES
        fields = dict(SHAPES[shape])
    cfg = ModelConfig(**{**fields, "num_layers": layers})
    path = root / f"{shape or 'tiny'}-{layers}l"
    if (path / "engine.yaml").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = write_byte_tokenizer(path / TOKENIZER_DIR)
    token_ids = "tokenizer" if tok["num_tokens"] == cfg.vocab_size else "synthetic"
    write_manifest(path, name=path.name, model=cfg, dtype="float32",
                   lookahead=LookaheadConfig(max_model_len=1024),
                   source={"kind": "random", "shape": shape or "op_count-tiny", "seed": seed}, versions={},
                   random_weights={"shape": shape or "op_count-tiny", "seed": seed, "dtype": "float32",
                                   "init": INIT, "verified": False},
                   tokenizer={"source": "built-in byte-level tokenizer", "num_tokens": tok["num_tokens"],
                              "vocab_size": cfg.vocab_size, "token_ids": token_ids})
    return path


def make_engine(path: Path, mode: str, batch: int, dispatcher: bool = False):
    """The engine of a case: the torch table, no fused step; dispatcher: its lookahead ops through
    `torch.ops.lookahead` (as a CUDA engine's torch table calls them)."""
    from dataclasses import replace

    from runtime.engine import Engine
    from runtime.internals import Internals
    from runtime.ops import job_copy, select_ops

    overrides = dict(LOOKAHEAD) if mode == "lookahead" else dict(mode=mode)
    # a CUDA engine's draft row attends the device tier (runtime/lookahead/attention.py
    # resolve_draft_attention): what a CPU engine resolves instead would count the CPU's ops
    kw = dict(transfer="sync", draft_attention="tier") if mode == "lookahead" else {}
    if dispatcher:
        d = torch.ops.lookahead
        kw["ops"] = replace(select_ops(torch.device("cpu"), torch.float32, impl="torch"),
                            block_gather=d.block_gather, block_topk=d.block_topk,
                            update_summaries=d.update_summaries, lookahead_attention=d.lookahead_attention,
                            plan_slots_fixed=d.plan_slots, copy_blocks=job_copy(d.copy_blocks),
                            name="torch/cpu+dispatcher")
    return Engine.from_dir(path, device="cpu", internals=Internals(impl="torch", fused=False, **kw),
                           max_batch_size=max(batch, 1), prefix_caching=False, max_model_len=1024, **overrides)


@dataclass
class Count:
    total: float
    non_view: float
    by_op: Counter


def count_step(path: Path, mode: str, batch: int, warm: int = 3, steps: int = 2, seed: int = 0,
               decompose: bool = False, dispatcher: bool = False) -> Count:
    """The mean ops of one decode step of `batch` sequences after `warm` decode steps."""
    from runtime.sampling import SamplingParams

    engine = make_engine(path, mode, batch, dispatcher)
    try:
        g = torch.Generator().manual_seed(seed)
        params = SamplingParams(max_tokens=warm + steps + 8, ignore_eos=True)
        for i in range(batch):
            n = PROMPT_LENS[i % len(PROMPT_LENS)]
            engine.add_request(torch.randint(3, 256, (n,), generator=g).tolist(), params)
        seqs = engine.scheduler
        for _ in range(64):          # the prompts in the cache (prefill chunks; a step may mix in decodes)
            engine.step()
            if len(seqs.running) == batch and not any(s.in_prefill for s in seqs.running):
                break
        else:
            raise RuntimeError("the prompts did not finish prefilling")
        for _ in range(warm):
            engine.step()
        counter = OpCounter(decompose)
        with counter:
            for _ in range(steps):
                engine.step()
        assert not any(s.finish_reason for s in seqs.running), "a sequence finished inside the counted steps"
        by_op = Counter({k: v / steps for k, v in counter.by_op.items()})
        return Count(counter.total / steps, counter.non_view / steps, by_op)
    finally:
        engine.close()


def measure(root: Path, layers: tuple[int, int] = (2, 6), target: int = 32, cases=CASES,
            shape: str | None = None, warm: int = 3, steps: int = 2, decompose: bool = False,
            dispatcher: bool = False) -> list[dict]:
    """One row per (mode, batch): the counts at both layer counts, per layer, and at `target` layers."""
    lo, hi = layers
    dirs = {n: engine_dir(root, n, shape) for n in layers}
    rows = []
    for mode, batch in cases:
        a, b = (count_step(dirs[n], mode, batch, warm, steps, decompose=decompose, dispatcher=dispatcher)
                for n in layers)
        per = {k: (getattr(b, k) - getattr(a, k)) / (hi - lo) for k in ("total", "non_view")}
        at = {k: getattr(a, k) + per[k] * (target - lo) for k in ("total", "non_view")}
        per_op = Counter({op: (b.by_op[op] - a.by_op.get(op, 0)) / (hi - lo) for op in b.by_op})
        rows.append(dict(case=f"{mode} b{batch}", mode=mode, batch=batch,
                         **{f"total_{lo}l": a.total, f"non_view_{lo}l": a.non_view,
                            f"total_{hi}l": b.total, f"non_view_{hi}l": b.non_view},
                         total_per_layer=per["total"], non_view_per_layer=per["non_view"],
                         **{f"total_{target}l": round(at["total"]), f"non_view_{target}l": round(at["non_view"])},
                         per_layer_ops={k: v for k, v in per_op.most_common() if v}))
    return rows


def table(rows: list[dict], layers: tuple[int, int], target: int) -> str:
    lo, hi = layers
    head = (f"{'case':<14} {f'{lo}L total':>9} {f'{hi}L total':>9} {'/layer':>7} {'non-view/layer':>15} "
            f"{f'{target}L total':>10} {f'{target}L non-view':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['case']:<14} {r[f'total_{lo}l']:>9.0f} {r[f'total_{hi}l']:>9.0f} "
                     f"{r['total_per_layer']:>7.1f} {r['non_view_per_layer']:>15.1f} "
                     f"{r[f'total_{target}l']:>10} {r[f'non_view_{target}l']:>13}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.op_count", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs=2, default=(2, 6), metavar=("LO", "HI"))
    p.add_argument("--target-layers", type=int, default=32)
    p.add_argument("--cases", nargs="+", default=[f"{m}:{b}" for m, b in CASES],
                   help="mode:batch, e.g. dense:5 lookahead:5")
    p.add_argument("--shape", default=None, help="a builder shape (builder/shapes.py) instead of the tiny one")
    p.add_argument("--warm", type=int, default=3, help="decode steps before counting")
    p.add_argument("--steps", type=int, default=2, help="decode steps counted (the mean is reported)")
    p.add_argument("--decompose", action="store_true",
                   help="count the ops a composite op (matmul, linear, reshape, rms_norm) runs, not the op itself")
    p.add_argument("--dispatcher", action="store_true",
                   help="the lookahead ops through torch.ops.lookahead, one op each (a CUDA engine's torch table)")
    p.add_argument("--top", type=int, default=0, help="print each case's N most frequent non-view ops per layer")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--engines", type=Path, default=None, help="where to write the engine dirs (default: a temp dir)")
    a = p.parse_args(argv)
    cases = tuple((m, int(b)) for m, b in (c.split(":") for c in a.cases))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(a.engines or Path(tmp), tuple(a.layers), a.target_layers, cases, a.shape, a.warm, a.steps,
                       a.decompose, a.dispatcher)
    print(table(rows, tuple(a.layers), a.target_layers))
    if a.top:
        for r in rows:
            ops = list(r["per_layer_ops"].items())[: a.top]
            print(f"{r['case']}: " + ", ".join(f"{k} {v:g}" for k, v in ops))
    if a.json:
        a.json.write_text(json.dumps(dict(command="python -m bench.op_count " + " ".join(argv or sys.argv[1:]),
                                          torch=torch.__version__, decompose=a.decompose,
                                          dispatcher=a.dispatcher, layers=a.layers,
                                          target_layers=a.target_layers, rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
