"""What the resumable evaluation scripts share (scripts/eval_accuracy.py, scripts/profile_agreement.py,
the experiments): engines over one loaded model, mode specs, the JSONL records, machine info.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def mode_overrides(mode: str, top_k: int) -> dict[str, Any]:
    """'dense' or 'RESIDENCY:MISS_POLICY', either with '@FIELD=VALUE,...' -> LookaheadConfig
    overrides, e.g. 'resident:urgent@group_score=max,top_k=64' (a field set there wins over --top-k),
    'dense@prefill_precision=float32'."""
    base, _, extra = mode.partition("@")
    if base == "dense":
        out: dict[str, Any] = {"mode": "dense"}
    else:
        residency, _, miss = base.partition(":")
        out = {"mode": "lookahead", "residency": residency, "miss_policy": miss, "top_k": top_k}
    for item in filter(None, extra.split(",")):
        name, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{item!r} in mode {mode!r}: expected FIELD=VALUE")
        out[name] = typed_value(value)
    return out


def typed_value(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


class EngineFactory:
    """Engines that share one loaded model (it holds no per-request state) and one prefill cache.

    A fresh engine per run gives per-run stats and costs a KV-pool allocation, not a weight load.
    The modes of a sample run back to back on the same prompt: the first prefills it, the others
    replay that prefill (runtime/prefill_cache.py; decoding is bit-identical to a fresh prefill).
    """

    def __init__(self, engine_dir: str | Path, max_model_len: int):
        from runtime.engine import Engine
        from runtime.prefill_cache import PrefillCache
        self.max_model_len = max_model_len
        self.prefill_cache = PrefillCache(max_prompts=1)
        self.base = Engine.from_dir(engine_dir, max_batch_size=1, max_model_len=max_model_len,
                                    num_host_blocks=1)
        self.tokenizer = self.base.tokenizer
        self.internals = None       # the engines' runtime.internals.Internals (None: the base's)

    def make(self, **overrides: Any):
        return self.base.sibling(self.prefill_cache, max_batch_size=1, max_model_len=self.max_model_len,
                                 internals=self.internals, **overrides)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))


def engine_policy(engine_dir: str | Path) -> dict[str, Any]:
    """The lookahead config a mode starts from (engine.yaml + the runtime's defaults): records made
    under other defaults (e.g. before group_score's default changed) are not comparable."""
    from runtime.engine_dir import load_manifest
    from runtime.errors import EngineDirError
    try:
        return load_manifest(engine_dir, verify_checksums=False).lookahead.to_dict()
    except EngineDirError:      # no engine: nothing to run, and --report-only finds no records
        return {}


def append_record(path: Path, rec: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()


def add_run_args(p, stem: str, unit: str, report: str) -> None:
    """The flags every resumable evaluation script shares (eval_accuracy.py, profile_agreement.py)."""
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads; 1 because on a shared 2-core machine OpenMP's spin-waiting "
                        "threads made runs 3-15x slower (measured), 2 on an idle machine")
    p.add_argument("--report-only", action="store_true", help=f"run nothing: {report}")
    p.add_argument("--jsonl", default=str(ROOT / "results" / f"{stem}.jsonl"),
                   help=f"{unit} results, appended (the resume state)")
    p.add_argument("--json", default=str(ROOT / "results" / f"{stem}.json"), help="summary")


def set_threads(n: int) -> None:
    import torch
    torch.set_num_threads(n)


def machine_info() -> dict:
    import os
    import platform

    import torch
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "platform": platform.platform(), "python": platform.python_version(), **cpu_model()}


# the CPU features that decide which units a peer's kernels use (vLLM CPU and oneDNN take AMX where
# it exists; our kernels use AVX512_BF16 / AVX512_VNNI): a comparison is only side by side on one CPU
DOT_PRODUCT_FLAGS = ("avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "avx512_fp16")


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """{"cpu_model": its name, "cpu_dot_products": the DOT_PRODUCT_FLAGS it has} from /proc/cpuinfo
    (empty where there is none)."""
    try:
        text = open(cpuinfo).read()
    except OSError:
        return {}
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), None)
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return {"cpu_model": model, "cpu_dot_products": [f for f in DOT_PRODUCT_FLAGS if f in flags]}
