"""Transfer engines: one behavioural suite for every engine (sync, thread, cuda), the CUDA engine's
own guarantees (stream ordering without host syncs, priorities, pinned pools, stall timing), and
what a machine without a GPU sees (the module imports; the constructor names what is missing).

The cuda cases skip with the reason the engine itself gives (`unavailable_reason()`); the CPU
engines run the same behavioural tests everywhere, so the suite cannot pass vacuously here.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from runtime.transfer import cuda as transfer_cuda
from runtime.errors import LookaheadError
from runtime.transfer import CopyJob, SyncTransferEngine, ThreadTransferEngine, make_transfer_engine
from runtime.transfer.cuda import CudaTransferUnavailable

ROOT = Path(__file__).resolve().parents[1]
CUDA_MISSING = transfer_cuda.unavailable_reason()
requires_cuda_engine = pytest.mark.skipif(CUDA_MISSING is not None, reason=CUDA_MISSING or "")
requires_no_gpu = pytest.mark.skipif(CUDA_MISSING is None, reason="a CUDA device is usable here: the engine starts")
ENGINES = ["sync", "thread", pytest.param("cuda", marks=requires_cuda_engine)]
QUEUED = ["thread", pytest.param("cuda", marks=requires_cuda_engine)]   # sync copies inline at submit

KVH, NB, BS, D = 2, 16, 4, 8          # one layer's pool: heads, blocks, block size, head dim
LANES, SLOTS = 3, 6                   # device buffer [LANES, KVH, SLOTS, BS, D]
GATE_CYCLES = 2_000_000_000           # torch.cuda._sleep: about a second on an H100/H200 clock


def make_engine(kind: str):
    return {"sync": SyncTransferEngine, "thread": ThreadTransferEngine,
            "cuda": transfer_cuda.CudaTransferEngine}[kind]()


@pytest.fixture(params=ENGINES)
def engine(request):
    eng = make_engine(request.param)
    yield eng
    eng.close()


@pytest.fixture(params=QUEUED)
def queued_engine(request):
    eng = make_engine(request.param)
    yield eng
    eng.close()


@pytest.fixture
def cuda_engine():
    if CUDA_MISSING is not None:
        pytest.skip(CUDA_MISSING)
    eng = transfer_cuda.CudaTransferEngine()
    yield eng
    eng.close()


def device_of(eng) -> torch.device:
    return getattr(eng, "device", torch.device("cpu"))


@dataclass
class Tier:
    """A host pool of one layer (as the runtime hands it over) and a device buffer, NaN-poisoned."""

    src_k: torch.Tensor
    src_v: torch.Tensor
    dst_k: torch.Tensor
    dst_v: torch.Tensor
    keep: list = field(default_factory=list)    # base tensors the views come from

    def job(self, blocks, heads, lanes, slots, tag=()) -> CopyJob:
        t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        return CopyJob(self.src_k, self.src_v, self.dst_k, self.dst_v, (t(blocks), t(heads)),
                       (t(lanes), t(heads), t(slots)), tag=tag)


def make_tier(eng, layout: str = "head_major", seed: int = 0, pinned: bool | None = None) -> Tier:
    g = torch.Generator().manual_seed(seed)
    dev = device_of(eng)
    pin = dev.type == "cuda" if pinned is None else pinned
    if layout == "head_major":          # KVPool: [KVH, NB, bs, D] per layer, by_block() transposes
        base = [torch.randn(KVH, NB, BS, D, generator=g) for _ in range(2)]
        base = [b.pin_memory() if pin else b for b in base]
        src = [b.transpose(0, 1) for b in base]
    else:                               # block-major contiguous [NB, KVH, bs, D]
        base = [torch.randn(NB, KVH, BS, D, generator=g) for _ in range(2)]
        base = [b.pin_memory() if pin else b for b in base]
        src = base
    dst = [torch.full((LANES, KVH, SLOTS, BS, D), float("nan"), device=dev) for _ in range(2)]
    return Tier(src[0], src[1], dst[0], dst[1], keep=base)


def expected(tier: Tier, copies) -> tuple[torch.Tensor, torch.Tensor]:
    """The device buffers after `copies` [(blocks, heads, lanes, slots), ...] land in order."""
    ek, ev = torch.full((LANES, KVH, SLOTS, BS, D), float("nan")), torch.full((LANES, KVH, SLOTS, BS, D), float("nan"))
    for blocks, heads, lanes, slots in copies:
        for b, h, ln, s in zip(blocks, heads, lanes, slots):
            ek[ln, h, s], ev[ln, h, s] = tier.src_k[b, h], tier.src_v[b, h]
    return ek, ev


def landed(eng, tier: Tier, *tickets) -> tuple[torch.Tensor, torch.Tensor]:
    """Wait for the tickets, then read the buffers on the host. For the CUDA engine the read is
    queued on the compute stream after `wait`, so it sees the copies without any host sync."""
    for t in tickets:
        eng.wait(t)
    return tier.dst_k.cpu(), tier.dst_v.cpu()


def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


A = ([3, 7, 7, 15], [0, 0, 1, 1], [0, 2, 1, 2], [0, 5, 3, 1])        # blocks, heads, lanes, slots


# ---- the behaviour every engine shares --------------------------------------------------------------

@pytest.mark.parametrize("layout", ["head_major", "block_major"])
def test_copy_lands_where_the_index_says_and_nowhere_else(engine, layout):
    tier = make_tier(engine, layout)
    ticket = engine.submit(tier.job(*A))
    assert_same(landed(engine, tier, ticket), expected(tier, [A]))
    assert ticket.done() and ticket.error is None


@pytest.mark.parametrize("layout", ["head_major", "block_major"])
def test_fixed_capacity_job_skips_its_minus_one_entries(engine, layout):
    """A fixed-capacity list (CopyJob.valid, as the residency manager makes on the device): the
    unused entries name block -1 (gathered as nothing: no PCIe read on a GPU) and their slots keep
    what they held; only the valid entries' bytes are counted."""
    tier = make_tier(engine, layout)
    dev = device_of(engine)
    t = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
    blocks, heads, lanes, slots = [3, -1, 15, -1], [0, 1, 1, 0], [0, 2, 2, 1], [0, 5, 1, 4]
    valid = torch.tensor([True, False, True, False], device=dev)
    job = CopyJob(tier.src_k, tier.src_v, tier.dst_k, tier.dst_v, (t(blocks), t(heads)), (t(lanes), t(heads), t(slots)),
                  valid=valid)
    ticket = engine.submit(job, urgent=True)
    want = expected(tier, [([3, 15], [0, 1], [0, 2], [0, 1])])
    assert_same(landed(engine, tier, ticket), want)
    assert engine.h2d_bytes == 2 * (2 * BS * D * 4)


def test_bytes_jobs_and_urgent_jobs_are_counted(engine):
    tier = make_tier(engine)
    unit = 2 * BS * D * 4                     # one (block, head) of K and of V, float32
    tickets = [engine.submit(tier.job(*A)), engine.submit(tier.job([1], [0], [0], [0]), urgent=True)]
    landed(engine, tier, *tickets)
    assert tickets[0].job_bytes == 4 * unit and tickets[1].job_bytes == unit and tickets[1].urgent
    assert (engine.h2d_bytes, engine.jobs, engine.urgent_jobs) == (5 * unit, 2, 1)


def test_empty_job_is_done_at_once_and_counted(engine):
    tier = make_tier(engine)
    ticket = engine.submit(tier.job([], [], [], []))
    assert ticket.done() and ticket.job_bytes == 0
    engine.wait(ticket)
    assert (engine.jobs, engine.h2d_bytes) == (1, 0)
    assert_same((tier.dst_k.cpu(), tier.dst_v.cpu()), expected(tier, []))


def test_wait_none_is_a_no_op(engine):
    engine.wait(None)
    assert engine.jobs == 0


def test_background_copies_land_in_submission_order(engine):
    tier = make_tier(engine)
    first, second = ([1, 2], [0, 1], [0, 0], [2, 2]), ([9, 10], [0, 1], [0, 0], [2, 2])   # same slots
    tickets = [engine.submit(tier.job(*first)), engine.submit(tier.job(*second))]
    assert_same(landed(engine, tier, *tickets), expected(tier, [first, second]))


class GateJob(CopyJob):
    """A one-unit copy that holds the thread engine's worker until `gate` is set."""

    gate: threading.Event

    def execute(self) -> None:
        assert self.gate.wait(timeout=30), "gate never opened"
        super().execute()


def hold_background(eng, tier: Tier):
    """Stall the engine's background path; returns the function that lets it go."""
    if isinstance(eng, ThreadTransferEngine):
        job = GateJob(tier.src_k, tier.src_v, tier.dst_k.clone(), tier.dst_v.clone(),
                      (torch.tensor([0]), torch.tensor([0])), (torch.tensor([0]),) * 3)
        job.gate = threading.Event()
        eng.submit(job)
        return job.gate.set
    with torch.cuda.stream(eng.prefetch_stream):        # a sleeping kernel ahead of the copies
        torch.cuda._sleep(GATE_CYCLES)
    return lambda: None


def test_urgent_copy_overtakes_queued_background_copies(queued_engine):
    eng = queued_engine
    tier = make_tier(eng)
    release = hold_background(eng, tier)
    background, urgent = ([4], [1], [1], [0]), ([11], [1], [1], [0])          # the same slot
    t_bg = eng.submit(tier.job(*background))
    t_urgent = eng.submit(tier.job(*urgent), urgent=True)
    if hasattr(t_urgent, "synchronize"):     # CUDA: the urgent copy lands while background is held
        t_urgent.synchronize()
        assert not t_bg.done()
    release()
    # the urgent copy ran first, so the background copy, queued before it, wrote the slot last
    assert_same(landed(eng, tier, t_bg, t_urgent), expected(tier, [urgent, background]))


def test_error_in_a_job_surfaces_at_wait_and_the_engine_goes_on(queued_engine):
    eng = queued_engine
    tier = make_tier(eng)
    bad = eng.submit(tier.job([NB + 5], [0], [0], [0]))      # block id past the pool
    with pytest.raises(IndexError):
        eng.wait(bad)
    ok = eng.submit(tier.job(*A))
    assert_same(landed(eng, tier, ok), expected(tier, [A]))


def test_close_twice_is_harmless(engine):
    engine.close()
    engine.close()


# ---- the CUDA engine's own guarantees (GPU) -----------------------------------------------------------

def test_wait_orders_the_compute_stream_and_does_not_block_the_host(cuda_engine):
    eng = cuda_engine
    tier = make_tier(eng)
    hold_background(eng, tier)
    ticket = eng.submit(tier.job(*A))
    t0 = time.perf_counter()
    eng.wait(ticket)
    assert time.perf_counter() - t0 < 0.1
    assert not ticket.done(), "wait() blocked the host until the copy landed"
    out = tier.dst_k * 1                       # compute queued after wait: must see the copy
    torch.testing.assert_close(out.cpu(), expected(tier, [A])[0], rtol=0, atol=0, equal_nan=True)


def test_copy_waits_for_compute_queued_before_submit(cuda_engine):
    eng = cuda_engine
    tier = make_tier(eng)
    blocks = torch.zeros(4, dtype=torch.long, device=eng.device)
    ids = torch.tensor(A[0], device=eng.device)             # (a blocking copy: made before the sleep)
    torch.cuda._sleep(GATE_CYCLES // 4)                    # on the compute stream
    blocks += ids                                           # the ids only exist after the sleep
    t = lambda xs: torch.tensor(xs, dtype=torch.long, device=eng.device)  # noqa: E731
    job = CopyJob(tier.src_k, tier.src_v, tier.dst_k, tier.dst_v, (blocks, t(A[1])), (t(A[2]), t(A[1]), t(A[3])))
    ticket = eng.submit(job)
    del blocks, job                                          # the engine keeps what it still reads
    assert_same(landed(eng, tier, ticket), expected(tier, [A]))


def test_device_resident_source_is_copied_on_the_stream(cuda_engine):
    eng = cuda_engine
    tier = make_tier(eng, pinned=False)
    host = (tier.src_k, tier.src_v)
    tier.src_k, tier.src_v = (s.to(eng.device) for s in host)
    ticket = eng.submit(tier.job(*A))
    tier.src_k, tier.src_v = host
    assert_same(landed(eng, tier, ticket), expected(tier, [A]))


def test_streams_are_non_blocking_and_use_the_priority_range(cuda_engine):
    from cuda.bindings import runtime as cudart
    eng = cuda_engine
    _, least, greatest = cudart.cudaDeviceGetStreamPriorityRange()
    for kind, want in (("prefetch", least), ("urgent", greatest)):
        handle = getattr(eng, f"{kind}_stream").cuda_stream
        assert cudart.cudaStreamGetPriority(handle)[1] == want
        assert cudart.cudaStreamGetFlags(handle)[1] & cudart.cudaStreamNonBlocking
    assert eng.priorities["urgent"] <= eng.priorities["prefetch"]


def test_unpinned_host_pool_is_refused_with_the_fix(cuda_engine):
    tier = make_tier(cuda_engine, pinned=False)
    with pytest.raises(transfer_cuda.UnpinnedPoolError, match="pin_pool"):
        cuda_engine.submit(tier.job(*A))


def test_destination_off_the_gpu_is_refused(cuda_engine):
    tier = make_tier(cuda_engine)
    tier.dst_k, tier.dst_v = tier.dst_k.cpu(), tier.dst_v.cpu()
    with pytest.raises(ValueError, match="device tier must be allocated on the GPU"):
        cuda_engine.submit(tier.job(*A))


def test_pin_pool_pins_in_place_and_the_engine_reads_it(cuda_engine):
    from runtime.config import ModelConfig
    from runtime.kv_pool import KVPool
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=KVH, head_dim=D, max_position_embeddings=64)
    pool = KVPool(cfg, 4096, BS)                 # 1 MiB per tensor: pages of its own
    pool.k.normal_(), pool.v.normal_()
    ptr = pool.k.data_ptr()
    assert transfer_cuda.pin_pool(pool) is pool
    assert pool.k.is_pinned() and pool.v.is_pinned() and pool.k.data_ptr() == ptr
    src_k, src_v = pool.by_block(1)
    dst = [torch.full((LANES, KVH, SLOTS, BS, D), float("nan"), device=cuda_engine.device) for _ in range(2)]
    tier = Tier(src_k, src_v, *dst)
    copies = ([4000, 17, 17], [0, 1, 0], [0, 1, 2], [5, 0, 3])
    assert_same(landed(cuda_engine, tier, cuda_engine.submit(tier.job(*copies))), expected(tier, [copies]))


def test_stall_and_transfer_time_are_measured(cuda_engine):
    eng = cuda_engine
    tier = make_tier(eng)
    assert eng.wait_s == 0.0 and eng.transfer_s == 0.0
    hold_background(eng, tier)
    eng.wait(eng.submit(tier.job(*A)))
    torch.cuda.synchronize()
    assert eng.wait_s > 0.1                  # the compute stream stood behind the held copy
    assert 0.0 < eng.transfer_s < eng.wait_s    # the copy itself is short; the hold is not copy time


def test_copy_kernel_serves_the_host_to_device_copies(cuda_engine):
    assert cuda_engine.copy_kernel, "torch.ops.lookahead.copy_blocks has no CUDA kernel: copies run synchronously"


@requires_cuda_engine
def test_make_transfer_engine_builds_the_cuda_engine():
    eng = make_transfer_engine("cuda")
    try:
        assert isinstance(eng, transfer_cuda.CudaTransferEngine)
    finally:
        eng.close()


# ---- without a GPU ----------------------------------------------------------------------------------------

def test_module_imports_without_cuda_python_or_a_gpu():
    """Importing runtime.transfer.cuda touches neither cuda-python nor the driver."""
    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'cuda' or name.startswith('cuda.'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import runtime.transfer.cuda as m\n"
        "assert not any(k == 'cuda' or k.startswith('cuda.') for k in sys.modules), 'cuda imported'\n"
        "print(m.unavailable_reason())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "CUDA transfer engine unavailable" in proc.stdout


@requires_no_gpu
def test_constructing_without_a_gpu_raises_the_typed_error():
    with pytest.raises(CudaTransferUnavailable) as err:
        transfer_cuda.CudaTransferEngine()
    assert isinstance(err.value, RuntimeError) and isinstance(err.value, LookaheadError)
    assert err.value.problem and "transfer='thread'" in err.value.fix
    assert str(err.value) == CUDA_MISSING


@requires_no_gpu
def test_make_transfer_engine_cuda_without_a_gpu_raises_the_typed_error():
    with pytest.raises(CudaTransferUnavailable):
        make_transfer_engine("cuda")


def test_unknown_engine_kind_lists_cuda():
    with pytest.raises(ValueError, match="'cuda'"):
        make_transfer_engine("dma")


@requires_no_gpu
def test_pin_pool_without_a_gpu_raises_the_typed_error():
    class Pool:
        k = v = torch.zeros(4)
    with pytest.raises(CudaTransferUnavailable):
        transfer_cuda.pin_pool(Pool())


def _pretend_cuda_torch(monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_cpu_torch_is_named_with_the_fix(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(CudaTransferUnavailable, match="CPU build") as err:
        transfer_cuda.CudaTransferEngine()
    assert "transfer='thread'" in str(err.value)


def test_invisible_device_is_named_with_the_fix(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CudaTransferUnavailable, match="no CUDA device is visible") as err:
        transfer_cuda.CudaTransferEngine()
    assert "CUDA_VISIBLE_DEVICES" in str(err.value)


def test_missing_cuda_python_is_named_with_the_install_fix(monkeypatch):
    _pretend_cuda_torch(monkeypatch)
    for name in ("cuda", "cuda.bindings", "cuda.bindings.runtime", "cuda.cudart"):
        monkeypatch.setitem(sys.modules, name, None)          # a None entry makes the import fail
    with pytest.raises(CudaTransferUnavailable, match="cuda-python is not installed") as err:
        transfer_cuda.CudaTransferEngine()
    assert "pip install" in err.value.fix


def _installed(module: str) -> bool:
    """find_spec of a submodule raises when its parent package is missing."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _installed("cuda.bindings"), reason="cuda-python is not installed")
@requires_no_gpu
def test_driver_failure_is_named_with_the_cuda_error(monkeypatch):
    """Past the torch checks, the first real cuda-python call fails on a machine without a driver."""
    _pretend_cuda_torch(monkeypatch)
    with pytest.raises(CudaTransferUnavailable, match=r"cudaGetDeviceCount failed with cudaError\w+") as err:
        transfer_cuda.CudaTransferEngine()
    assert "driver" in err.value.fix
