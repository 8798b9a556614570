"""The floors of a decode step, for scripts/bench_decode.py.

A decode step must at least read its weights and the KV it attends over once; at the machine's
memory bandwidth, measured in the same run, that takes

    floor_s = step_read_bytes(...) / (bandwidth_gbps x 1e9)

and a row's "x floor" is its measured ms/step over floor ms: how far the step is from memory-bound.
It must also do its arithmetic: every weight multiplies every row the step computes (x 2 FLOPs),
and every row's every head takes a D-long dot product with each key and value it attends over;
at the fp32 matmul rate measured in the same run (a large square GEMM, on the run's threads):

    compute_floor_s = step_flops(...) / (matmul_gflops x 1e9)

On a CPU with few cores a batched decode step can be bound by that instead: then no step gets
near its bandwidth floor, and the larger of the two is the step's real lower bound.

A step that also copies KV host -> device (lookahead) is bounded by two links at once, each
measured in the same run (`device_bandwidths`: a device-to-device copy for the device's memory, a
pinned host-to-device copy for the host link):

    floor_s = max(device_bytes / device_gbps, h2d_bytes / h2d_gbps)         (step_floor)

`StreamClock` times on the compute stream: CUDA events on a GPU, perf_counter on CPU, one API.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch


class StreamClock:
    """Time on the compute stream, the same calls on every device: `mark()` records a CUDA event on
    the current stream (no host sync) or reads perf_counter on CPU; `seconds(a, b)` is the time
    between two marks (on a GPU it waits for `b`). Work on other streams (the transfer engine's
    copies) counts only where the compute stream waits for it."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a

    def sync(self) -> None:
        """Wait for everything queued on the device (between timed windows, never inside one)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)


def device_bandwidths(device: str | torch.device = "cpu", gib: float = 1.0, reps: int = 5) -> dict[str, Any]:
    """The two bandwidths a step's floor divides by, GB/s (1e9), best of `reps`, timed by StreamClock:

    device_gbps: a device-to-device copy of `gib` GiB, bytes read + written per second (HBM on a
                 GPU; host memory on CPU);
    h2d_gbps:    a copy of `gib` GiB from pinned host memory to the device, bytes per second (the
                 PCIe / C2C link on a GPU; on CPU a plain host copy, counted once: what the CPU
                 transfer engine's copies cost).
    """
    device = torch.device(device)
    clock = StreamClock(device)
    n = max(1, int(gib * 2**30))
    src = torch.ones(n, dtype=torch.uint8, device=device)          # touched: no page faults in the timing
    dst = torch.empty_like(src)
    host = torch.ones(n, dtype=torch.uint8, pin_memory=clock.cuda)

    def best(fn) -> float:
        fn()
        clock.sync()
        times = []
        for _ in range(reps):
            a = clock.mark()
            fn()
            times.append(clock.seconds(a, clock.mark()))
        return min(times)

    d2d_s = best(lambda: dst.copy_(src))
    h2d_s = best(lambda: dst.copy_(host, non_blocking=True))
    return {"device_gbps": round(2 * n / d2d_s / 1e9, 2), "h2d_gbps": round(n / h2d_s / 1e9, 2),
            "bytes": n, "reps": reps, "device": str(device), "h2d_source": "pinned host" if clock.cuda else "host",
            "timer": "cuda events" if clock.cuda else "perf_counter"}


def step_floor(device_bytes: float, h2d_bytes: float, device_gbps: float, h2d_gbps: float) -> dict[str, Any]:
    """A step's floor over two links measured in the same run: max(device bytes / device
    bandwidth, H2D bytes / H2D bandwidth), and which of the two binds."""
    device_ms = 1e3 * device_bytes / (device_gbps * 1e9)
    h2d_ms = 1e3 * h2d_bytes / (h2d_gbps * 1e9) if h2d_bytes else 0.0
    return {"device_bytes": device_bytes, "h2d_bytes": h2d_bytes, "device_ms": device_ms, "h2d_ms": h2d_ms,
            "floor_ms": max(device_ms, h2d_ms), "bound": "h2d" if h2d_ms > device_ms else "device"}


def memory_bandwidth(gib: float = 1.0, reps: int = 3, device: str | torch.device = "cpu") -> dict[str, float]:
    """The memory bandwidth of `device` (the CPU on torch's threads, or a GPU's), GB/s (1e9), best
    of `reps`: a sum over a `gib` GiB fp32 tensor (bytes read / s) and a copy of it (bytes read +
    written / s). `bandwidth_gbps`, the larger of the two, is the divisor of every row's floor."""
    device = torch.device(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    x = torch.ones(int(gib * 2**30) // 4, device=device)   # touched: page faults stay out of the timing
    y = torch.empty_like(x)
    y.copy_(x)
    x.sum()
    sync()
    best_sum = best_copy = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        sync()
        best_sum = min(best_sum, time.perf_counter() - t0)
        t0 = time.perf_counter()
        y.copy_(x)
        sync()
        best_copy = min(best_copy, time.perf_counter() - t0)
    read, copy = x.nbytes / best_sum / 1e9, 2 * x.nbytes / best_copy / 1e9
    return {"sum_read_gbps": round(read, 2), "copy_read_write_gbps": round(copy, 2),
            "bandwidth_gbps": round(max(read, copy), 2), "tensor_gib": gib, "reps": reps,
            "device": str(device)}


class BandwidthProbe:
    """The memory bandwidth *while* a benchmark runs: `sample()` times one `sum` over a `gib` GiB
    fp32 tensor on torch's current threads and returns GB/s read. bench_decode.py takes one sample after
    each round of timed decode steps. On a machine whose speed drifts by tens of percent within
    minutes (a shared VM), a floor that divides by a bandwidth measured once at the start is tied
    to that minute, not to the minutes the steps ran in. The floor divides by the samples'
    median: a sample can be stalled on its own (one run had 2.7 GB/s among samples up to 31),
    and the samples' harmonic mean, which would weigh rounds as a mean of step times does, was
    dragged down by such samples far enough to put a dense step at 1.2x its floor."""

    def __init__(self, gib: float = 0.25):
        self.x = torch.ones(int(gib * 2**30) // 4)        # touched: page faults stay out of the timing
        self.x.sum()

    def sample(self) -> float:
        t0 = time.perf_counter()
        self.x.sum()
        return self.x.nbytes / (time.perf_counter() - t0) / 1e9

    @staticmethod
    def divisor(samples: list[float]) -> float:
        """The floor's divisor: the median sample."""
        return statistics.median(samples)


def best_of(fn, reps: int = 3) -> float:
    """Seconds of the fastest of `reps` calls of fn(), after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflops(n: int = 1024, reps: int = 3) -> dict[str, float]:
    """fp32 GEMM rate (1e9 FLOP/s), best of `reps` n^3 matmuls on torch's current threads."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = best_of(lambda: a @ b, reps)
    return {"matmul_gflops": round(2 * n ** 3 / best / 1e9, 1), "n": n, "reps": reps,
            "threads": torch.get_num_threads()}


def step_flops(weights: int, dtype_bytes: int, rows: int, layers: int, heads: int, head_dim: int,
               attended_tokens: int) -> float:
    """FLOPs of one decode step computing `rows` query rows (batch x rows per sequence: 2 with a
    draft row), each attending over `attended_tokens` keys per layer: 2 per weight per row (every
    projection, the MLP and the LM head, whose logits every row here computes) + 4 x head_dim per
    (row, layer, head, key) for q.k and p.v."""
    return 2.0 * rows * weights / dtype_bytes + 4.0 * rows * layers * heads * head_dim * attended_tokens


def weight_bytes(model: torch.nn.Module, input_embedding: torch.Tensor | None = None,
                 output_embedding: torch.Tensor | None = None) -> int:
    """Parameter bytes one decode step reads: every parameter once. A tied embedding counts once
    (the lm_head reads all of it); an untied input embedding is left out (a step reads B rows).
    The embeddings default to a transformers model's (`get_input_embeddings()` ...); pass them
    for another model (ours: `embed_tokens.weight` and `lm_head.weight`, or the former twice)."""
    params = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    emb = input_embedding if input_embedding is not None else model.get_input_embeddings().weight
    head = output_embedding if output_embedding is not None else model.get_output_embeddings().weight
    if emb.data_ptr() != head.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def stored_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of our model's weights as the engine stores them (int8 values and their scales in an
    int8 engine), each tensor once: a tied embedding is the lm_head's weight, read whole per step."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def step_read_bytes(weights: int, kv_bytes_per_token: int, kv_tokens: int, batch: int,
                    sparse: tuple[int, int] | None = None, h2d_per_step: float = 0.0) -> float:
    """Bytes one decode step of `batch` sequences must read (the floor's numerator).

    dense:   weights + kv_bytes_per_token x kv_tokens x batch, where kv_bytes_per_token =
             2 (K, V) x layers x kv_heads x head_dim x dtype bytes and kv_tokens the positions the
             step attends over (the context; a StaticCache's whole buffer);
    sparse:  weights + batch x (working set + summaries) + h2d_per_step, with `sparse` =
             (working set of all layers, block summaries) per sequence: working set = per-layer
             device bytes x layers, summaries = 2 x layers x ceil(context / block) x kv_heads x
             head_dim x 4 (fp32 min/max); h2d_per_step = bytes copied into the device tier.
    """
    if sparse is None:
        return weights + kv_bytes_per_token * kv_tokens * batch
    working_set, summaries = sparse
    return weights + batch * (working_set + summaries) + h2d_per_step
