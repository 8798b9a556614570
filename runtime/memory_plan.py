"""What a configuration will allocate, worked out before anything is allocated, and the check
that refuses one that cannot fit.

Without it a setting such as `--top-k 5000` (a 29 GB device tier for the default model) or
`--max-batch-size 200` (a 75 GB host pool) is found out by the kernel's OOM killer or by an
allocation traceback. `plan_memory` is plain arithmetic over the shapes that the runtime's
constructors allocate:

    weights         LlamaModel's parameters (engine_dir.expected_shapes), in the engine's dtype
    packed_weights  plugins.cpu's packed copy of each 2-D weight a decode step multiplies (fp32)
    prefill_weights the prefill kernels' copy of each layer's 2-D weights (prefill_precision
                    bfloat16: bf16 panels; int8: int8 panels with their scales and offset sums;
                    decode_precision int8 takes the int8 ones, once, and the logits' weight's)
    rope            RotaryEmbedding's cos/sin tables [max_model_len, head_dim]
    host_kv_pool    KVPool's k and v [L, KVH, num_host_blocks, block_size, D], in kv_dtype; a
                    lookahead pool pinned for a GPU counts what pinning takes (`PINNING`)
    device_tier     LookaheadAttention's dev_k/dev_v [buffers, lanes, KVH, slots, block_size, D],
                    in kv_dtype (the device tier follows the host pool)
    summaries       its kmin/kmax [L, lanes * max_blocks, KVH, D], in kv_dtype on CPU and fp32 on a
                    GPU (runtime/lookahead/summaries.py `summary_dtype`) (sparse mode: fp32, one per
                    pool block, [L, num_host_blocks, KVH, D], beside the pool)
    cached_summaries lookahead with prefix caching: the summaries of the pool's named blocks
                    (SummaryStore), [L, num_host_blocks, KVH, D] kmin/kmax as the lane's, in host memory
    bookkeeping     its SlotTable, pred, masks, lane_blocks and metrics tensors
    allocator       estimate: BlockAllocator's Python free list (ints, not tensors)
    step_buffers    estimate: one step's transient peak (activations, logits, attention's
                    GQA-expanded K/V of a prefill chunk, lookahead's per-step score tables)

tests/test_memory_plan.py checks the exact components against the tensors that real engines
hold, so the formulas cannot drift from the constructors unnoticed. `check_memory` compares the
host's share with the host's available memory (on CPU that is everything, the device tier
included; on a GPU the components of `ON_DEVICE` are left to the device's allocator) and names
the one field whose reduction makes it fit, with the value that does.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .config import LookaheadConfig, ModelConfig
from .errors import ConfigError
from .lookahead.budget import check_device_budget
from .lookahead.device_tier import num_buffers
from .lookahead.summaries import KV_DTYPE_SUMMARIES

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SUMMARY_BYTES = 4                   # fp32 block summaries (sparse mode's; lookahead's on a GPU)
ALLOCATOR_BYTES_PER_BLOCK = 64     # a free-list entry: list slot + int object + set slot when used
HEADROOM = 0.9                      # plan against 90 % of what is available: the rest is the
                                    # interpreter, torch's own buffers and the estimates' error
# Fields check_memory may name, in the order it tries them when none stands out, with the least
# value each may take. (num_host_blocks, an Engine keyword, is tried when the caller fixed it.)
FIELD_MIN = {"max_batch_size": 1, "max_model_len": 1, "top_k": 1, "recent_window": 0, "block_size": 1,
             "prefill_chunk": 1, "num_sink_blocks": 0}
EXACT = ("weights", "packed_weights", "prefill_weights", "rope", "host_kv_pool", "device_tier", "summaries", "cached_summaries",
         "bookkeeping")
ESTIMATES = ("allocator", "step_buffers")


@dataclass(frozen=True)
class PlanInputs:
    """What a plan was computed from: check_memory re-plans with one field changed."""

    mcfg: ModelConfig
    cfg: LookaheadConfig
    dtype_bytes: int
    num_host_blocks: int | None    # None: derived from the config, as Engine does
    max_model_len: int | None      # None: min(cfg.max_model_len, max_position_embeddings)
    weights: bool
    packed_weights: bool
    device_type: str = "cpu"       # where the engine runs: on "cuda" only the host's share is checked
    weight_saving: int = 0         # bytes a quantized engine's weights take fewer than at dtype_bytes
    pinning: str = "allocator"     # how a GPU engine's lookahead host pool is pinned (PINNING)
    prefill: str = "float32"       # the resolved prefill precision (runtime/ops.py resolve_prefill)
    int8_group: int | None = None  # an int8 engine's group size (0: per output channel); None: not int8
    decode: str = "float32"        # the decode precision: int8 keeps the W8A8 kernel's copies too


# What lives in device memory when the engine runs on a GPU (Engine places it): everything but the
# lookahead host pool and the allocator's free list; dense mode's pool is on the device too.
ON_DEVICE = frozenset({"weights", "rope", "device_tier", "summaries", "bookkeeping", "step_buffers"})


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes by component (see the module docstring), and one sequence's device share."""

    weights: int
    packed_weights: int
    prefill_weights: int
    rope: int
    host_kv_pool: int
    device_tier: int
    summaries: int
    cached_summaries: int
    bookkeeping: int
    allocator: int
    step_buffers: int
    per_seq_device_tier: int      # one lane's dev_k + dev_v
    per_seq_device: int           # that plus the lane's summaries (what device_budget_bytes bounds)
    num_host_blocks: int
    max_model_len: int
    inputs: PlanInputs

    def components(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in EXACT + ESTIMATES}

    @property
    def total(self) -> int:
        return sum(self.components().values())

    def host_components(self) -> dict[str, int]:
        """The components in host memory: all of them on CPU; on a GPU those Engine keeps on
        the host (the lookahead host pool, the allocator)."""
        if self.inputs.device_type == "cpu":
            return self.components()
        device = ON_DEVICE | ({"host_kv_pool"} if self.inputs.cfg.mode in ("dense", "sparse") else set())
        return {k: v for k, v in self.components().items() if k not in device}

    @property
    def host_total(self) -> int:
        return sum(self.host_components().values())

    @property
    def exact_total(self) -> int:
        """The tensors' bytes alone (no estimates): what the tests compare with real engines."""
        return sum(getattr(self, name) for name in EXACT)

    def describe(self, top: int = 3) -> str:
        """'29.6 GiB (device_tier 29.4 GiB, host_kv_pool 96.0 MiB, ...)': the largest parts."""
        parts = sorted(((v, k) for k, v in self.host_components().items() if v), reverse=True)[:top]
        return f"{fmt_bytes(self.host_total)} ({', '.join(f'{k} {fmt_bytes(v)}' for v, k in parts)})"


def fmt_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# How a GPU engine's lookahead host pool is page-locked, and what that takes:
#   allocator   torch's pinned allocator (`torch.empty(..., pin_memory=True)`, what KVPool and so
#               Engine use): each allocation is rounded up to a power of two (40 GiB of K and V
#               pins 64), and a freed one stays cached in the process (torch.cuda.empty_cache does
#               not return it; torch._C._host_emptyCache does)
#   registered  a pageable allocation page-locked in place (cudaHostRegister:
#               runtime.transfer.cuda.pin_pool): exactly its bytes, returned when it is freed
PINNING = ("allocator", "registered")


def pinned_bytes(nbytes: int) -> int:
    """What torch's pinned allocator takes for one `nbytes` allocation: the next power of two."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def plan_memory(mcfg: ModelConfig, cfg: LookaheadConfig, num_host_blocks: int | None, dtype_bytes: int,
                max_model_len: int | None = None, *, weights: bool = True,
                packed_weights: bool | None = None, device_type: str = "cpu",
                weight_saving: int = 0, pinning: str = "allocator", prefill: str = "float32",
                int8_group: int | None = None, decode: str = "float32") -> MemoryPlan:
    """The bytes an Engine over (mcfg, cfg) allocates, without allocating.

    num_host_blocks / max_model_len: as Engine gets them; None derives them as Engine does (then
    check_memory's advice on max_batch_size / max_model_len also shrinks the pool).
    weights=False: the model is already loaded (Engine.sibling), count only the engine's own
    parts. packed_weights: count plugins.cpu's packed copies (default: when the dtype is fp32,
    the only dtype the C linear kernel takes). `cfg` is the effective config (top_k already
    clamped, if the caller clamps it). weight_saving: what a quantized engine's stored weights
    save against `dtype_bytes` per parameter (engine.yaml quantization.quantized_bytes). device_type: where the engine runs ("cpu", "cuda"), which
    decides what check_memory holds against host memory (`host_components`). pinning: how a GPU
    engine's lookahead host pool is page-locked (`PINNING`), which decides what it takes. prefill:
    the resolved prefill precision, whose kernels keep a copy of the layers' weights;
    int8_group: an int8 engine's group size (0: per output channel), None for others; decode: the
    decode precision (int8: the W8A8 copies, shared with an int8 prefill's)."""
    if pinning not in PINNING:
        raise ConfigError("pinning", f"{pinning!r} is not one of {', '.join(PINNING)}",
                          "use 'allocator' (KVPool(..., pin_memory=True), as Engine does) or 'registered'")
    packed = (dtype_bytes == 4 and device_type == "cpu") if packed_weights is None else packed_weights
    inputs = PlanInputs(mcfg, cfg, dtype_bytes, num_host_blocks, max_model_len, weights, packed, device_type,
                        weight_saving, pinning, prefill, int8_group, decode)
    return _plan(inputs)


def _plan(p: PlanInputs) -> MemoryPlan:
    m, c, b = p.mcfg, p.cfg, p.dtype_bytes
    kv = _kv_bytes(c, b)                            # the KV storage: host pool, device tier, dense pool
    L, kvh, d, bs = m.num_layers, m.num_kv_heads, m.head_dim, c.block_size
    max_len = min(c.max_model_len, m.max_position_embeddings, p.max_model_len or math.inf)
    max_blocks = _blocks(max_len, bs)
    n_blocks = p.num_host_blocks or c.max_batch_size * max_blocks
    w, packed = _weight_bytes(m, b) if p.weights else (0, 0)
    w = max(0, w - p.weight_saving) if p.weights else 0      # int8 roles: their stored bytes
    rope = 2 * max_len * d * b if p.weights else 0        # cos and sin of every position it runs
    pool = 2 * L * kvh * n_blocks * bs * d * kv
    if c.mode == "lookahead" and p.device_type == "cuda" and p.pinning == "allocator":
        pool = 2 * pinned_bytes(pool // 2)          # K and V: one pinned allocation each
    tier = summ = books = lane_tier = lane_summ = store = 0
    lanes = c.max_batch_size
    if c.mode == "lookahead":
        wb = _blocks(c.recent_window, bs) + 1 if c.recent_window > 0 else 1      # SlotLayout.from_config
        slots = c.num_sink_blocks + wb + c.top_k
        nbuf = num_buffers(c, L)
        lane_tier = 2 * nbuf * kvh * slots * bs * d * kv
        sb = kv if p.device_type in KV_DTYPE_SUMMARIES else SUMMARY_BYTES     # summaries.py summary_dtype
        lane_summ = 2 * L * max_blocks * kvh * d * sb
        tier, summ = lanes * lane_tier, lanes * lane_summ
        books = (8 * nbuf * lanes * kvh * (2 * c.top_k + max_blocks + 1)    # SlotTable block, last_used, slot_of
                 + lanes * kvh * slots * bs                                  # attention's key mask (bool)
                 + 8 * L * lanes * kvh * c.top_k                             # pred
                 + 9 * L * lanes * kvh * c.top_k                             # a step's true sets, hits (bool)
                 + 2 * L * lanes                                             # has_pred, seeded (bool)
                 + 8 * lanes * max_blocks                                    # lane_blocks
                 + 8 * (2 * L + 2 + 6 * lanes))                              # metrics (float64)
        store = 2 * L * n_blocks * kvh * d * sb if c.prefix_caching else 0
    if c.mode == "sparse":      # runtime/sparse.py: fp32 min/max of every pool block, with the pool
        summ = 2 * L * n_blocks * kvh * d * SUMMARY_BYTES
    return MemoryPlan(weights=w, packed_weights=packed if p.packed_weights else 0,
                      prefill_weights=_kernel_copy_bytes(m, p) if p.weights else 0, rope=rope,
                      host_kv_pool=pool, device_tier=tier, summaries=summ, cached_summaries=store, bookkeeping=books,
                      allocator=ALLOCATOR_BYTES_PER_BLOCK * n_blocks, step_buffers=_step_bytes(m, c, b, max_len),
                      per_seq_device_tier=lane_tier, per_seq_device=lane_tier + lane_summ,
                      num_host_blocks=n_blocks, max_model_len=max_len, inputs=p)


def _weights_dtype(b: int) -> str:
    """The engine dtype of `b`-byte weights (the builder makes float32 or bfloat16 engines; a
    float16 one counts as bfloat16 here, in an estimate)."""
    return "float32" if b == 4 else "bfloat16"


def _kv_bytes(c: LookaheadConfig, b: int) -> int:
    """Bytes of one stored K or V element: `kv_dtype`'s, or the weights' when it is unset."""
    return DTYPE_BYTES[c.kv_dtype] if c.kv_dtype is not None else b


def _weight_bytes(m: ModelConfig, b: int) -> tuple[int, int]:
    """(parameters, packed copies): the layout of engine_dir.WEIGHT_LAYOUT, counted per layer
    (expected_shapes would build a dict of every tensor). plugins.cpu packs a 2-D weight whose
    row count is a multiple of 8; the logits' weight is the embedding when tied."""
    h, qkv, inter = m.hidden_size, m.q_size + 2 * m.kv_size, m.intermediate_size
    mats = [(qkv, h), (h, m.q_size), (2 * inter, h), (h, inter)]
    per_layer = (sum(r * k for r, k in mats) + 2 * h + (qkv if m.attention_bias else 0)
                 + (2 * m.head_dim if m.qk_norm else 0))
    head = m.vocab_size * h
    params = m.num_layers * per_layer + h + head * (1 if m.tie_word_embeddings else 2)
    packed = m.num_layers * sum(r * k for r, k in mats if r % 8 == 0) + (head if m.vocab_size % 8 == 0 else 0)
    return params * b, packed * 4


def _kernel_copy_bytes(m: ModelConfig, p: PlanInputs) -> int:
    """The prefill kernels' copies, and the W8A8 ones decode rows take at decode precision int8
    (the same copies an int8 prefill keeps: counted once), with the logits' weight's."""
    extra = p.decode == "int8" and p.prefill != "int8"
    total = _prefill_weight_bytes(m, p.prefill, p.int8_group) + (_prefill_weight_bytes(m, "int8", p.int8_group)
                                                                  if extra else 0)
    if p.decode == "int8":              # the logits' weight too: every row's logits take W8A8
        h = m.hidden_size
        total += -(-m.vocab_size // 32) * 32 * (h + 8 * (h // (p.int8_group or h)))
    return total


def _prefill_weight_bytes(m: ModelConfig, prefill: str, int8_group: int | None) -> int:
    """The prefill kernels' copies of each layer's projections (plugins/cpu/prefill.py's
    packed_bytes_*: columns padded to the panel, bf16 pairs; or int8 quads with per group an fp32
    scale and an int32 offset sum per column)."""
    h, qkv, inter = m.hidden_size, m.q_size + 2 * m.kv_size, m.intermediate_size
    mats = [(qkv, h), (h, m.q_size), (2 * inter, h), (h, inter)]
    if prefill == "bfloat16":
        per_layer = sum(-(-n // 64) * 64 * -(-k // 2) * 4 for n, k in mats)
    elif prefill == "int8":
        per_layer = sum(-(-n // 32) * 32 * (k + 8 * (k // (int8_group or k))) for n, k in mats)
    else:
        return 0
    return m.num_layers * per_layer


def _step_bytes(m: ModelConfig, c: LookaheadConfig, b: int, max_len: int) -> int:
    """Estimate of one step's transient peak: the rows' activations (fp32, a few live at once),
    logits and sampling's copy, a prefill chunk's causal mask and GQA-expanded K/V (torch's
    CPU flash attention materialises those, not the score matrix), a dense gather of one
    sequence's K/V (in kv_dtype, and its fp32 copy when attention upcasts a half-precision
    cache), and lookahead's per-step membership and score tables."""
    rows = c.prefill_chunk + 2 * c.max_batch_size
    h, inter = m.hidden_size, m.intermediate_size
    act = 4 * rows * (4 * h + 2 * m.q_size + 2 * m.kv_size + 3 * inter)
    logits = 2 * 4 * 2 * c.max_batch_size * m.vocab_size
    kv = _kv_bytes(c, b)
    upcast = (c.kv_dtype or _weights_dtype(b)) != _weights_dtype(b)   # attention reads the cache in fp32
    gather = 2 * m.num_kv_heads * max_len * m.head_dim * (kv + (4 if upcast else 0))
    attn = c.prefill_chunk * max_len + 2 * m.num_heads * max_len * m.head_dim * (4 if upcast else b) + gather
    extra = 0
    if c.mode == "lookahead":
        nb = _blocks(max_len, c.block_size)
        heads = c.max_batch_size * m.num_kv_heads
        extra = m.num_layers * heads * (nb + 2) + 4 * 2 * heads * nb   # metrics' in_pred, block_topk's scores
    return act + logits + attn + extra


def _replan(plan: MemoryPlan, field: str, value: int) -> MemoryPlan:
    p = plan.inputs
    if field == "num_host_blocks":
        return _plan(dataclasses.replace(p, num_host_blocks=value))
    return _plan(dataclasses.replace(p, cfg=p.cfg.replace(**{field: value})))


def _largest_fit(plan: MemoryPlan, field: str, limit: int) -> int | None:
    """The largest value of `field` below its current one with which the plan fits `limit`
    (the total grows with each field; block_size is tried over the powers of two)."""
    current = plan.num_host_blocks if field == "num_host_blocks" else getattr(plan.inputs.cfg, field)
    lo = 1 if field == "num_host_blocks" else FIELD_MIN[field]
    fits = lambda v: _replan(plan, field, v).host_total <= limit     # noqa: E731
    if field == "block_size":
        return next((v for v in (1 << i for i in range(current.bit_length() - 2, -1, -1)) if fits(v)), None)
    if current <= lo or not fits(lo):
        return None
    hi = current - 1                     # invariant: fits(lo); the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _candidates(plan: MemoryPlan) -> list[str]:
    """Fields to name, the most inflated (against its default) first: the one a user set to
    5000 is the one to name, not the batch size they left alone."""
    cfg, default = plan.inputs.cfg, LookaheadConfig()
    ratio = {f: getattr(cfg, f) / max(1, getattr(default, f)) for f in FIELD_MIN}
    if plan.inputs.num_host_blocks is not None:
        derived = cfg.max_batch_size * _blocks(plan.max_model_len, cfg.block_size)
        ratio = {"num_host_blocks": plan.num_host_blocks / derived, **ratio}
    order = list(ratio)
    return sorted(order, key=lambda f: (-ratio[f], order.index(f)))


def check_memory(plan: MemoryPlan, cfg: LookaheadConfig | None = None, available_bytes: int | None = None,
                 *, headroom: float = HEADROOM) -> None:
    """Refuse, before any allocation, a plan that cannot fit: a ConfigError naming the field
    that drives the excess and the value that would fit.

    Checks `cfg.device_budget_bytes` (one sequence's device tier and summaries,
    lookahead/budget.py) and then the host's share (`host_total`) against `headroom` of `available_bytes` (default: the
    host's available memory, `available_host_bytes`). `cfg` defaults to the plan's own."""
    cfg = cfg or plan.inputs.cfg
    if cfg != plan.inputs.cfg:
        plan = _plan(dataclasses.replace(plan.inputs, cfg=cfg))
    _check_device_budget(plan, cfg)
    avail = available_host_bytes() if available_bytes is None else available_bytes
    limit = int(avail * headroom)
    if plan.host_total <= limit:
        return
    need = (f"need {plan.describe()} of host memory, but {fmt_bytes(limit)} is usable "
            f"({headroom:.0%} of {fmt_bytes(avail)} available)")
    for field in _candidates(plan):
        fit = _largest_fit(plan, field, limit)
        if fit is not None:
            raise ConfigError(field, f"{_current(plan, field)} makes this configuration {need}",
                              f"use {field} <= {fit}, or free memory")
    raise ConfigError("memory", f"the model and this configuration {need}, and no one setting brings it within that",
                      "run on a machine with more memory, or build the engine with --dtype bfloat16"
                      + (", or store the KV cache with kv_dtype float16" if _kv_bytes(cfg, plan.inputs.dtype_bytes) == 4
                         else ""))


def _current(plan: MemoryPlan, field: str) -> int:
    return plan.num_host_blocks if field == "num_host_blocks" else getattr(plan.inputs.cfg, field)


def _check_device_budget(plan: MemoryPlan, cfg: LookaheadConfig) -> None:
    check_device_budget(cfg, plan.per_seq_device_tier, plan.per_seq_device - plan.per_seq_device_tier)


def available_host_bytes(meminfo: str | Path = "/proc/meminfo", cgroup_root: str | Path = "/sys/fs/cgroup") -> int:
    """Memory this process may still allocate: MemAvailable, or the cgroup's limit less its usage
    (reclaimable page cache not counted as used) when that is lower. Elsewhere: the physical
    memory sysconf reports, and when even that is unknown, no limit (sys.maxsize)."""
    found = [v for v in (_meminfo_available(Path(meminfo)), _cgroup_available(Path(cgroup_root))) if v is not None]
    if found:
        return max(0, min(found))
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return sys.maxsize


def _meminfo_available(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_available(root: Path) -> int | None:
    """cgroup v2 (memory.max) or v1 (memory/memory.limit_in_bytes); None when unlimited."""
    for limit_f, usage_f, stat_f, key in (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                                          ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                           "memory/memory.stat", "total_inactive_file")):
        limit = _read_int(root / limit_f)
        if limit is None or limit >= 1 << 60:        # v1 writes "unlimited" as ~2^63
            continue
        usage = _read_int(root / usage_f) or 0
        return limit - max(0, usage - _stat(root / stat_f, key))
    return None
