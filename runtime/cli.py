"""`python -m runtime generate …`: generate from an engine dir, streaming text or printing JSON;
`python -m runtime info --engine DIR`: what that engine resolves to on this machine.

Lookahead flags are derived from LookaheadConfig's fields (one source of truth).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from .config import (DECODE_PRECISIONS, DRAFTS, GROUP_SCORES, KV_DTYPES, MISS_POLICIES, MODES, PREFILL_PRECISIONS,
                     RESIDENCY, LookaheadConfig)
from .errors import LookaheadError

# the values of the settings that take a name (help only: a bad one is the config's ConfigError)
VALUES = {"mode": MODES, "residency": RESIDENCY, "miss_policy": MISS_POLICIES, "draft": DRAFTS,
          "group_score": GROUP_SCORES, "kv_dtype": KV_DTYPES, "prefill_precision": PREFILL_PRECISIONS,
          "decode_precision": DECODE_PRECISIONS}


def add_lookahead_flags(parser: argparse.ArgumentParser) -> None:
    """One `--field-name` flag per LookaheadConfig field; unset flags keep the engine's value. The
    settings a user chooses (runtime.spec.ESSENTIAL) and the tuning ones are two help groups."""
    from .spec import ESSENTIAL, GOVERNS

    groups = {True: parser.add_argument_group("settings (override engine.yaml; dense reads the first four, sparse "
                                              "adds --top-k, lookahead the rest)"),
              False: parser.add_argument_group("tuning (override engine.yaml; the defaults fit long contexts: "
                                               "docs/SETTINGS.md)")}
    rank = {name: i for i, name in enumerate(ESSENTIAL)}
    for f in sorted(dataclasses.fields(LookaheadConfig), key=lambda f: rank.get(f.name, len(rank))):
        group = groups[f.name in ESSENTIAL]
        modes = GOVERNS.get(f.name)
        read_by = f"{' and '.join(modes)} mode{'s' if len(modes) > 1 else ''}; " if modes else ""
        typ = {"int": int, "float": float, "str": str, "bool": parse_bool}.get(str(f.type).split(" |")[0], int)
        values = f"{', '.join(VALUES[f.name])}; " if f.name in VALUES else ""
        default = "the weights' dtype" if f.name == "kv_dtype" else f.default
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=typ, default=None,
                           help=f"{read_by}{values}default: {default}")
    groups[False].add_argument("--allow-unverified-precision", dest="allow_unverified_precision", type=parse_bool,
                       nargs="?", const=True, default=None,
                       help="run a prefill/decode precision the engine's build did not verify (default: refused)")


def parse_bool(text: str) -> bool:
    """A yes/no flag's value: true/false, yes/no, on/off or 1/0 (argparse reports anything else)."""
    value = {"true": True, "yes": True, "on": True, "1": True,
             "false": False, "no": False, "off": False, "0": False}.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return value


def lookahead_overrides(args: argparse.Namespace) -> dict:
    names = [f.name for f in dataclasses.fields(LookaheadConfig)] + ["allow_unverified_precision"]
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion")
    g.add_argument("--engine", required=True, help="engine dir (scripts/build_engine.py makes one)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k-sampling", dest="top_k_sampling", type=int, default=0,
                   help="top-k sampling (--top-k is the lookahead block budget)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object with ids, timings, metrics")
    g.add_argument("--device", default="auto",
                   help="where the engine runs: cpu, cuda or cuda:N (default: auto, cuda when torch has a GPU, "
                        "else cpu); one that is not there is a one-line error naming device")
    add_lookahead_flags(g)
    i = sub.add_parser("info", help="what an engine dir resolves to on this machine: precisions, kernels, "
                                    "the fused step, what falls back to torch, the memory plan")
    i.add_argument("--engine", required=True, help="engine dir")
    i.add_argument("--device", default="auto", help="as for generate")
    i.add_argument("--json", action="store_true", help="print it as one JSON object")
    add_lookahead_flags(i)
    return p


def info(args: argparse.Namespace) -> int:
    from .engine import Engine

    engine = Engine.from_dir(args.engine, device=args.device, **lookahead_overrides(args))
    spec = engine.describe()
    engine.close()
    if args.json:
        print(json.dumps(spec, indent=2))
        return 0
    for line in render_info(spec):
        print(line)
    return 0


def render_info(spec: dict) -> list[str]:
    """`Engine.describe()` as aligned `key  value` lines; nested sections flattened with a dot."""
    rows: list[tuple[str, str]] = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif prefix.startswith("memory_plan_bytes."):
            rows.append((prefix.replace("_bytes", ""), f"{value / 2**20:,.1f} MiB"))
        elif isinstance(value, list):
            rows.append((prefix, "; ".join(value) if value else "none"))
        else:
            rows.append((prefix, str(value)))
    walk("", spec)
    width = max(len(k) for k, _ in rows)
    return [f"{k:<{width}}  {v}" for k, v in rows]


def generate(args: argparse.Namespace) -> int:
    from .engine import Engine
    from .sampling import SamplingParams

    t0 = time.perf_counter()
    engine = Engine.from_dir(args.engine, device=args.device, **lookahead_overrides(args))
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k_sampling, seed=args.seed, stop=args.stop)
    prompt = args.prompt if args.raw else engine.tokenizer.apply_chat_template(args.prompt)
    if args.json:
        c = engine.generate([prompt], params)[0]
        print(json.dumps({"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                          "num_prompt_tokens": c.num_prompt_tokens, "load_s": round(load_s, 3), "device": str(engine.device),
                          "ttft_s": round(c.ttft_s, 4), "total_s": round(c.total_s, 4),
                          "decode_tokens_per_s": round(c.tokens_per_s, 2), "mode": engine.config.mode,
                          "kv_dtype": engine.config.kv_dtype,
                          "request_metrics": c.metrics, "engine_metrics": engine.stats()}, indent=2))
        engine.close()
        return 0
    t1, n = time.perf_counter(), 0
    for out in engine.stream(prompt, params):
        n += len(out.new_token_ids)
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
    dt = time.perf_counter() - t1
    engine.close()
    print(f"\n[{n} tokens in {dt:.2f} s, {n / dt:.1f} tokens/s; engine loaded in {load_s:.1f} s; "
          f"mode {engine.config.mode}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return info(args) if args.command == "info" else generate(args)
    except LookaheadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
