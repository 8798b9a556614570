"""load_test's report: the comparison table and the latency / throughput plot."""
from __future__ import annotations

import math

import numpy as np

from bench.load_workload import Run

# ---- report ----------------------------------------------------------------------------------------
def print_table(results: dict[str, dict]) -> None:
    rows = [("requests (completed/errors)", lambda s: f"{s['completed']}/{s['errors']}"),
            ("output tokens/s", lambda s: f"{s['output_tokens_per_s']:.1f}"),
            ("requests/s", lambda s: f"{s['requests_per_s']:.2f}"),
            ("TTFT p50 / p90 / p99 (ms)", lambda s: "/".join(_ms(s["ttft_ms"][q]) for q in ("p50", "p90", "p99"))),
            ("ITL p50 / p99 (ms)", lambda s: "/".join(_ms(s["itl_ms"][q]) for q in ("p50", "p99"))),
            ("E2E p50 / p99 (ms)", lambda s: "/".join(_ms(s["e2e_ms"][q]) for q in ("p50", "p99"))),
            ("engine CPU ms / output token", lambda s: _ms(s["cpu_ms_per_output_token"])),
            ("mean prompt tokens", lambda s: str(s["mean_prompt_tokens"])),
            ("wall (s)", lambda s: f"{s['wall_s']:.1f}")]
    names = list(results)
    w0, w = max(len(r[0]) for r in rows), max(16, *(len(n) for n in names))
    print(f"{'':<{w0}}  " + "  ".join(f"{n:>{w}}" for n in names))
    for label, fmt in rows:
        print(f"{label:<{w0}}  " + "  ".join(f"{fmt(results[n]):>{w}}" for n in names))


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def plot(runs: dict[str, Run], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for name, run in runs.items():
        recs = run.records
        ok = [r for r in recs if r.error is None and r.token_times]
        for a, values in ((ax[0], [r.ttft * 1e3 for r in ok]), (ax[1], [x * 1e3 for r in ok for x in r.itls()])):
            if values:
                v = np.sort(values)
                a.plot(v, np.arange(1, len(v) + 1) / len(v), label=name)
        t0 = min(r.start for r in recs)
        times = [(t - t0, n) for r in ok for t, n in r.token_times]
        if times:
            edges = np.arange(0, math.ceil(max(t for t, _ in times)) + 1.0, 1.0)
            hist, _ = np.histogram([t for t, _ in times], bins=edges, weights=[n for _, n in times])
            ax[2].step(edges[:-1], hist, where="post", label=name)
    for a, title, xl in ((ax[0], "time to first token (CDF)", "ms"), (ax[1], "inter-token latency (CDF)", "ms"),
                         (ax[2], "output tokens/s over time (1 s bins)", "s since start")):
        a.set_title(title)
        a.set_xlabel(xl)
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
