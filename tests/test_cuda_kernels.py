"""CUDA kernels: the nvcc compile checks (needs nvcc, no GPU: scripts/compile_kernels.sh, and every
source of the torch extension with the flags torch's extension builder gives them), numerics
against the references (GPU: the extension, torch.ops and the public wrappers), and the checks
themselves, run on CPU against the torch implementations so their machinery is tested where no
GPU exists."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gpu_skips import ROOT, nvcc, requires_cuda, requires_nvcc
from bench import cuda_numerics as numerics
from plugins.reference import lookahead_attention_ref

from bench import gpu_kernels as gkc

LAUNCHERS = {"lookahead_kv_block_gather", "lookahead_kv_block_topk", "lookahead_kv_block_topk_strided",
             "lookahead_kv_block_topk_rows",
             "lookahead_kv_update_summaries", "lookahead_kv_attention", "lookahead_kv_attention_workspace_size",
             "lookahead_kv_plan_slots", "lookahead_kv_plan_slots_host", "lookahead_kv_copy_blocks",
             "lookahead_kv_copy_blocks_host"}
CASES = [(fn, case) for fn, cases in numerics.SMALL_CASES.items() for case in cases]
CASE_IDS = [f"{fn.__name__.removeprefix('check_')}-{case}" for fn, case in CASES]


def _as_list(result) -> list[numerics.Check]:
    return result if isinstance(result, list) else [result]


# --- compile check (nvcc, no GPU) -------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """scripts/compile_kernels.sh into a fresh directory (~15 s of CPU on 2 cores)."""
    out = tmp_path_factory.mktemp("cuda_build")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "compile_kernels.sh"), str(out)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "NVCC": nvcc() or ""})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _ptxas_rows(out: Path) -> list[list[str]]:
    """ptxas_summary.txt rows: registers, stack, spill stores, spill loads, kernel."""
    return [line.split("\t") for line in (out / "ptxas_summary.txt").read_text().splitlines()[1:]]


@requires_nvcc
def test_kernels_compile_for_sm90_into_one_library(compiled):
    assert (compiled / "liblookahead_kernels.so").is_file()
    kernels = " ".join(row[4] for row in _ptxas_rows(compiled))
    for name in ("block_gather_kernel", "score_kernel", "select_kernel", "update_summaries_kernel",
                 "attention_kernel", "combine_kernel", "plan_slots_kernel", "copy_blocks_kernel"):
        assert name in kernels
    assert "for 'sm_90'" in (compiled / "ptxas.log").read_text()


@requires_nvcc
def test_launchers_are_exported_with_c_linkage(compiled):
    nm = subprocess.run(["nm", "-D", "--defined-only", str(compiled / "liblookahead_kernels.so")],
                        capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in nm.stdout.splitlines() if " T " in line}
    assert LAUNCHERS <= exported, f"missing: {LAUNCHERS - exported}"


@requires_nvcc
def test_no_kernel_spills_registers(compiled):
    rows = _ptxas_rows(compiled)
    assert len(rows) >= 20
    spilling = [row[4] for row in rows if int(row[2]) or int(row[3])]
    assert not spilling, f"register spills in {spilling}"


# --- the torch extension's build flags (nvcc and the host compiler, no GPU) ------------------

def _torch_cxx_standard() -> str:
    """The -std=... torch's cpp_extension passes by default (what its headers need)."""
    import inspect
    import re
    from torch.utils import cpp_extension
    found = re.findall(r"-std=c\+\+\d+", inspect.getsource(cpp_extension))
    assert found, "torch.utils.cpp_extension names no -std=c++NN"
    return max(found, key=lambda f: int(f.rsplit("+", 1)[1]))


def _torch_extension_flags():
    """What `torch.utils.cpp_extension.load` (plugins/cuda/loader.py) passes for this extension
    with TORCH_CUDA_ARCH_LIST=9.0, as scripts/gpu_check.sh sets it: torch's common nvcc flags
    (no implicit half/bfloat16 conversions, relaxed constexpr), the sm_90 gencode, -fPIC, the
    extension's defines and include paths, then the loader's own flags (no -std among them: the
    C++ standard is torch's own default, as in the real build)."""
    from torch.utils import cpp_extension
    from plugins.cuda import loader

    defines = [f"-DTORCH_EXTENSION_NAME={loader.EXTENSION_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    includes = [f"-I{loader.KERNEL_DIR}", *(f"-I{p}" for p in cpp_extension.include_paths()),
                f"-I{sysconfig.get_paths()['include']}"]
    std = _torch_cxx_standard()
    nvcc_flags = [*defines, *includes, *cpp_extension.COMMON_NVCC_FLAGS, "-gencode=arch=compute_90,code=sm_90",
                  "--compiler-options", "-fPIC", std, *loader.CUDA_FLAGS]
    cxx_flags = [*defines, *includes, "-fPIC", std, *loader.CXX_FLAGS]
    return loader, nvcc_flags, cxx_flags


@pytest.mark.slow
@requires_nvcc
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a GPU is here: plugins.cuda.loader builds the extension for real (the kernels stage)")
def test_extension_sources_build_with_the_torch_extension_flags(tmp_path):
    """Every .cu of the extension compiles for sm_90 under the flags torch's extension builder adds,
    and the loader's C++ bindings pass the host compiler against torch's headers (here the CPU
    wheel's headers, with the one CUDA-build header they lack stubbed; the GPU machine's torch 2.11
    + CUDA 13 build is the kernels stage of scripts/gpu_check.sh)."""
    loader, nvcc_flags, cxx_flags = _torch_extension_flags()
    homes = [os.environ.get("CUDA_HOME"), Path(nvcc()).resolve().parents[1], "/usr/local/cuda"]
    cuda_include = next((Path(h) / "include" for h in homes
                         if h and (Path(h) / "include" / "cuda_runtime_api.h").is_file()), None)
    assert cuda_include, f"no CUDA headers (include/cuda_runtime_api.h) under {homes}"
    stub = tmp_path / "stub"
    macros = stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    macros.parent.mkdir(parents=True)
    macros.write_text("#pragma once\n")          # CPU wheels omit the header a CUDA build generates
    cxx = shutil.which("c++") or shutil.which("g++")
    assert cxx, "no host C++ compiler"

    def build(source: str) -> subprocess.CompletedProcess:
        src = loader.KERNEL_DIR / source
        if source.endswith(".cu"):
            cmd = [nvcc(), *nvcc_flags, "-c", str(src), "-o", str(tmp_path / (source + ".o"))]
        else:
            cmd = [cxx, *cxx_flags, f"-I{stub}", f"-I{cuda_include}", "-fsyntax-only", str(src)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip(loader.SOURCES, pool.map(build, loader.SOURCES)))
    failed = {src: (p.stdout + p.stderr)[-2000:] for src, p in done.items() if p.returncode}
    assert not failed, failed
    assert {s for s in loader.SOURCES if s.endswith(".cu")} == {p.name for p in loader.KERNEL_DIR.glob("*.cu")}


# --- numerics on a GPU ------------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("dtype", numerics.DTYPES, ids=str)
@pytest.mark.parametrize("fn, case", CASES, ids=CASE_IDS)
def test_kernel_matches_reference(fn, case, dtype):
    for check in _as_list(fn(dtype, case)):
        assert check.ok, check


@requires_cuda
@pytest.mark.slow
@pytest.mark.parametrize("fn", list(numerics.LARGE_CASES), ids=lambda fn: fn.__name__)
def test_kernel_large_index(fn):
    """Data past 2^31 elements (4-16 GB of GPU memory): catches 32-bit offset overflow."""
    for check in _as_list(fn(torch.bfloat16, "large")):
        assert check.ok, check


@requires_cuda
@pytest.mark.parametrize("door", ["dispatch", "wrappers"])
@pytest.mark.parametrize("fn, case", CASES, ids=CASE_IDS)
def test_kernel_matches_reference_through_torch_ops_and_wrappers(fn, case, door):
    """The same checks through the doors the runtime and users take: torch.ops.lookahead (the
    loader's registered wrappers) and the validating plugins.<op> wrappers (bf16)."""
    if (door, fn.__name__.removeprefix("check_"), case) in gkc.NOT_APPLICABLE:
        pytest.skip(gkc.NOT_APPLICABLE[(door, fn.__name__.removeprefix("check_"), case)])
    entry = gkc.DispatchEntryPoints() if door == "dispatch" else gkc.WrapperEntryPoints()
    for check in _as_list(fn(torch.bfloat16, case, numerics.Target("cuda", entry))):
        assert check.ok, check


@requires_cuda
def test_torch_ops_dispatch_pinned_gather_to_the_kernel():
    """The transfer engine's call: pinned host pool, ids on the GPU, out on the GPU."""
    import plugins  # noqa: F401  (defines the ops, registers the kernels)

    pool = torch.randn(32, 2, 16, 64).pin_memory()
    ids = torch.randint(0, 32, (2, 8), device="cuda")
    out = torch.ops.lookahead.block_gather(pool, ids)
    assert out.is_cuda
    torch.testing.assert_close(out.cpu(), plugins.reference.block_gather_ref(pool, ids.cpu()), rtol=0, atol=0)


@requires_cuda
def test_gather_of_minus_one_is_a_zero_row_from_pinned_memory():
    """The fixed-capacity lists' unused entries: -1 reads nothing and writes zeros."""
    import plugins  # noqa: F401
    plugins.ensure_cuda_kernels()
    pool = torch.randn(32, 2, 16, 64).pin_memory()
    ids = torch.tensor([[3, -1, 31, -1], [-1, 0, 7, 7]], device="cuda")
    out = torch.ops.lookahead.block_gather(pool, ids)
    torch.testing.assert_close(out.cpu(), plugins.reference.block_gather_ref(pool, ids.cpu()), rtol=0, atol=0)
    assert not out[0, 1].any() and not out[1, 0].any()


@requires_cuda
def test_top_k_reads_strided_summary_views_in_place():
    """The runtime scores [:lanes, :blocks] views of its summary tables: the kernel strides through
    them and agrees with the reference on the same views."""
    import plugins  # noqa: F401
    plugins.ensure_cuda_kernels()
    g = torch.Generator().manual_seed(5)
    lo = torch.randn(4, 40, 2, 64, generator=g)
    hi = lo + torch.rand(4, 40, 2, 64, generator=g)
    kmin, kmax = lo.cuda()[:3, :29], hi.cuda()[:3, :29]
    assert not kmin.is_contiguous()
    q = torch.randn(3, 2, 8, 64, generator=g).cuda()
    valid = torch.rand(3, 2, 29, generator=g).cuda() > 0.2
    idx, scores = torch.ops.lookahead.block_topk(q, kmin, kmax, valid, 6, "sum")
    ref_idx, ref_scores = plugins.reference.block_topk_ref(q.cpu(), kmin.cpu(), kmax.cpu(), valid.cpu(), 6, "sum")
    atol, rtol = plugins.reference.TOLERANCES[torch.float32]
    torch.testing.assert_close(scores.cpu(), ref_scores, atol=atol, rtol=rtol)
    assert torch.equal(idx.cpu(), ref_idx)


@requires_cuda
def test_kv_storage_dtypes_are_widened_and_mixed_dtypes_refused():
    """16-bit K/V under fp32 queries (an engine whose kv_dtype differs from its dtype) are widened by
    the CUDA key's wrapper; the bindings refuse any call whose float inputs differ in dtype (a
    launcher reads one dtype: the values would be garbage)."""
    import plugins  # noqa: F401
    from plugins.cuda import loader
    plugins.ensure_cuda_kernels()
    g = torch.Generator().manual_seed(6)
    B, R, H, KVH, N, E, D = 1, 2, 8, 2, 48, 2, 128
    q = torch.randn(B, R, H, D, generator=g).cuda()
    k, v = (torch.randn(B, KVH, N, D, generator=g).cuda().to(torch.bfloat16) for _ in range(2))
    ke, ve = (torch.randn(B, KVH, E, D, generator=g).cuda().to(torch.bfloat16) for _ in range(2))
    mask = torch.ones(B, KVH, N, dtype=torch.bool, device="cuda")
    emask = torch.ones(B, R, E, dtype=torch.bool, device="cuda")
    out = torch.ops.lookahead.lookahead_attention(q, k, v, mask, ke, ve, emask, D ** -0.5)
    want = lookahead_attention_ref(q.cpu(), k.cpu(), v.cpu(), mask.cpu(), ke.cpu(), ve.cpu(), emask.cpu(), D ** -0.5)
    atol, rtol = plugins.reference.TOLERANCES[torch.float32]
    torch.testing.assert_close(out.cpu(), want, atol=atol, rtol=rtol)
    with pytest.raises(RuntimeError, match="dtype"):
        loader.load_extension().lookahead_attention_out(q, k, v, mask, ke, ve, emask, D ** -0.5, torch.empty_like(q))


# --- the checks themselves, on CPU ------------------------------------------------------------

class TorchEntryPoints:
    """The extension's entry points written with the torch ops on CPU (attention: the reference,
    since the torch implementation asks for finite padding and the checks put NaN there)."""

    @staticmethod
    def block_gather_out(src, block_ids, out):
        out.copy_(torch.ops.lookahead.block_gather(src, block_ids))

    block_topk_out = staticmethod(gkc.DispatchEntryPoints.block_topk_out)

    @staticmethod
    def update_summaries(kmin, kmax, keys, block_ids, block_offsets):
        torch.ops.lookahead.update_summaries(kmin, kmax, keys, block_ids, block_offsets)

    @staticmethod
    def lookahead_attention_out(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale, out):
        out.copy_(lookahead_attention_ref(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale))

    plan_slots_out = staticmethod(gkc.DispatchEntryPoints.plan_slots_out)
    copy_blocks = staticmethod(gkc.DispatchEntryPoints.copy_blocks)


CPU = numerics.Target("cpu", TorchEntryPoints())


@pytest.mark.parametrize("fn, case", CASES, ids=CASE_IDS)
def test_checks_pass_a_correct_implementation(fn, case):
    import plugins  # noqa: F401  (defines torch.ops.lookahead)

    for check in _as_list(fn(torch.bfloat16, case, CPU)):
        assert check.ok, check


class LeavesOneElement(TorchEntryPoints):
    @staticmethod
    def block_gather_out(src, block_ids, out):
        keep = out[-1, -1, -1, -1].clone()
        TorchEntryPoints.block_gather_out(src, block_ids, out)
        out[-1, -1, -1, -1] = keep


class TiesToTheHigherId(TorchEntryPoints):
    """Selects on the blocks in reverse order: equal scores then go to the higher id."""

    @staticmethod
    def block_topk_out(q, kmin, kmax, valid, k, group_max, indices, scores):
        num_blocks = kmin.shape[1]
        q, valid = gkc.as_rows(q, kmin, valid)
        flipped = (torch.flip(kmin, [1]), torch.flip(kmax, [1]), torch.flip(valid, [-1]))
        got_indices, got_scores = torch.ops.lookahead.block_topk(q, *flipped, k, "max" if group_max else "sum")
        got_indices, got_scores = got_indices.view(indices.shape), got_scores.view(scores.shape)
        ids = torch.where(got_indices >= 0, num_blocks - 1 - got_indices, num_blocks).sort(-1).values
        indices.copy_(ids.masked_fill(ids == num_blocks, -1))
        scores.copy_(torch.flip(got_scores, [-1]))


class VictimTiesToTheHigherSlot(TorchEntryPoints):
    """A plan whose victims among equally old slots go to the higher slot (the rule: the lower)."""

    @staticmethod
    def plan_slots_out(block, last_used, slot_of, lanes, want, scores, cap, step, slots, blocks, valid):
        flip = lambda t: torch.flip(t, [-1])                                      # noqa: E731
        fb, fl = flip(block).contiguous(), flip(last_used).contiguous()
        got = torch.ops.lookahead.plan_slots(fb, fl, slot_of, lanes, want, scores, cap, step)
        K = block.shape[-1]
        block.copy_(flip(fb))
        last_used.copy_(flip(fl))
        slot_of.copy_(torch.where(slot_of >= 0, K - 1 - slot_of, -1))
        for out, g in zip((slots, blocks, valid), (K - 1 - got[0], got[1], got[2])):
            out.copy_(g)


CPU_DOOR_CASES = [(fn, case) for fn, case in CASES if fn is not numerics.check_lookahead_attention]


@pytest.mark.parametrize("door", ["dispatch", "wrappers"])
@pytest.mark.parametrize("fn, case", CPU_DOOR_CASES, ids=[i for (fn, _), i in zip(CASES, CASE_IDS)
                                                          if fn is not numerics.check_lookahead_attention])
def test_kernel_check_doors_pass_on_cpu(fn, case, door):
    """bench.gpu_kernels' torch.ops and wrapper doors, on CPU over the torch implementations (the
    attention checks' NaN padding is outside the torch implementation's contract: CUDA only)."""
    import plugins  # noqa: F401

    entry = gkc.DispatchEntryPoints() if door == "dispatch" else gkc.WrapperEntryPoints()
    for check in _as_list(fn(torch.bfloat16, case, numerics.Target("cpu", entry))):
        assert check.ok, check


def test_checks_catch_an_unwritten_element():
    import plugins  # noqa: F401

    check = numerics.check_block_gather(torch.float32, "device", numerics.Target("cpu", LeavesOneElement()))
    assert not check.ok and "NaN" in check.detail


def test_checks_catch_ties_resolved_the_wrong_way():
    import plugins  # noqa: F401

    scores_check, indices_check = numerics.check_block_topk(torch.float32, "ties",
                                                            numerics.Target("cpu", TiesToTheHigherId()))
    assert scores_check.ok and not indices_check.ok


def test_checks_catch_a_plan_that_breaks_ties_the_other_way():
    import plugins  # noqa: F401

    check = numerics.check_plan_slots(torch.float32, "decode", numerics.Target("cpu", VictimTiesToTheHigherSlot()))
    assert not check.ok and "differ" in check.detail


@requires_nvcc
def test_plan_kernel_rule_on_the_host_equals_the_reference(compiled):
    """plan_slots.cu's per-thread code (`plan_one`), run on the host through the library's host
    entry, against the reference and the torch implementation: the kernel's rule is tested here,
    where no GPU is; the GPU machine runs the kernel itself (check_plan_slots)."""
    import ctypes

    lib = ctypes.CDLL(str(compiled / "liblookahead_kernels.so"))
    lib.lookahead_kv_plan_slots_host.restype = ctypes.c_int

    class HostEntry(TorchEntryPoints):
        @staticmethod
        def plan_slots_out(block, last_used, slot_of, lanes, want, scores, cap, step, slots, blocks, valid):
            ptr = lambda t: ctypes.c_void_p(t.data_ptr())                         # noqa: E731
            args = [block, last_used, slot_of, lanes.contiguous(), want.contiguous(), scores.contiguous(),
                    slots, blocks, valid]
            rc = lib.lookahead_kv_plan_slots_host(*map(ptr, args), *map(ctypes.c_int64, (
                want.shape[0], block.shape[1], block.shape[2], want.shape[2], scores.shape[2], slot_of.shape[2],
                cap, step)))
            assert rc == 0, rc

    for case in ("decode", "seed"):
        for seed in range(3):
            check = numerics.check_plan_slots(torch.float32, case, numerics.Target("cpu", HostEntry()), seed=seed)
            assert check.ok, check
    # and the launcher's argument checks: top_k past kLookaheadPlanMaxSlots, num_want past top_k
    z = ctypes.c_void_p(0)
    assert lib.lookahead_kv_plan_slots_host(*[z] * 9, *map(ctypes.c_int64, (1, 1, 2048, 4, 9, 9, 1, 1))) != 0
    assert lib.lookahead_kv_plan_slots_host(*[z] * 9, *map(ctypes.c_int64, (1, 1, 8, 9, 9, 9, 1, 1))) != 0


@requires_nvcc
@pytest.mark.parametrize("case", ["device", "host"])
def test_copy_kernel_code_on_the_host_equals_the_reference(compiled, case):
    """copy_blocks.cu's per-thread code (`copy_one`, each vector width the strides allow), run on
    the host through the library's host entry: a pool in either layout, skipped entries."""
    import ctypes

    lib = ctypes.CDLL(str(compiled / "liblookahead_kernels.so"))

    class HostEntry(TorchEntryPoints):
        @staticmethod
        def copy_blocks(src_k, src_v, dst_k, dst_v, blocks, src_heads, lanes, dst_heads, slots, valid):
            es = src_k.element_size()
            index = [t.contiguous() for t in (blocks, src_heads, lanes, dst_heads, slots, valid)]
            rc = lib.lookahead_kv_copy_blocks_host(
                *(ctypes.c_void_p(t.data_ptr()) for t in (src_k, src_v, dst_k, dst_v, *index)),
                *map(ctypes.c_int64, (blocks.numel(), src_k.shape[0], src_k.stride(0) * es, src_k.stride(1) * es,
                                      dst_k.stride(0) * es, dst_k.stride(1) * es, dst_k.stride(2) * es,
                                      src_k.shape[2] * src_k.shape[3] * es)))
            assert rc == 0, rc

    for dtype in (torch.float32, torch.bfloat16):
        check = numerics.check_copy_blocks(dtype, case, numerics.Target("cpu", HostEntry()))
        assert check.ok, check


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the numerics tests exercise the real registration")
def test_loader_claims_the_cuda_dispatch_key(monkeypatch):
    """register_cuda_kernels() puts a kernel on the CUDA key of every op (CPU torch accepts it)."""
    import plugins  # noqa: F401
    from plugins.cuda import loader

    monkeypatch.setattr(loader, "load_extension", lambda: None)
    loader.register_cuda_kernels.__wrapped__()   # bypass the once-per-process cache
    for name in loader.KERNELS:
        assert "\nCUDA: registered" in torch._C._dispatch_dump(f"lookahead::{name}")


class _RecordingExtension:
    """A stand-in for the extension: records what the loader's wrappers hand each entry point."""

    def __init__(self):
        self.calls = []

    def block_topk_out(self, q, kmin, kmax, valid, k, group_max, indices, scores):
        self.calls.append(("block_topk", kmin, kmax))

    def update_summaries(self, kmin, kmax, keys, block_ids, block_offsets):
        self.calls.append(("update_summaries", keys))

    def lookahead_attention_out(self, q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale, out):
        self.calls.append(("lookahead_attention", k, v, k_extra, v_extra))


def test_loader_reads_summary_views_in_place_and_widens_kv_storage(monkeypatch):
    """The CUDA wrappers (the CUDA key of torch.ops.lookahead) pass the runtime's [:lanes, :blocks]
    summary views to the top-K kernel as they are (no per-layer copy), copy only a layout the kernel
    cannot stride through, and widen 16-bit KV storage under fp32 queries (the kernels read one dtype)."""
    from plugins.cuda import loader
    ext = _RecordingExtension()
    monkeypatch.setattr(loader, "load_extension", lambda: ext)
    table = torch.randn(4, 10, 2, 64)                     # [lanes, max_blocks, KVH, D]
    kmin, kmax = table[:3, :7], (table + 1)[:3, :7]       # the view the runtime scores
    assert not kmin.is_contiguous()
    q, valid = torch.randn(3, 4, 64), torch.ones(3, 7, dtype=torch.bool)
    loader._block_topk(q, kmin, kmax, valid, 2)
    _, got_min, got_max = ext.calls[-1]
    assert got_min.data_ptr() == kmin.data_ptr() and got_min.stride() == kmin.stride()
    assert got_max.data_ptr() == kmax.data_ptr()
    dims_last = torch.randn(3, 7, 64, 2).transpose(2, 3)  # [3, NB, KVH, D] with D strided: not readable in place
    loader._block_topk(q, dims_last, dims_last, valid, 2)
    assert ext.calls[-1][1].is_contiguous() and ext.calls[-1][1].data_ptr() != dims_last.data_ptr()
    torch.testing.assert_close(ext.calls[-1][1], dims_last, rtol=0, atol=0)

    keys = torch.randn(5, 2, 64, dtype=torch.bfloat16)
    loader._update_summaries(torch.zeros(8, 2, 64), torch.zeros(8, 2, 64), keys, torch.zeros(5, dtype=torch.long),
                             torch.arange(5))
    assert ext.calls[-1][1].dtype == torch.float32 and torch.equal(ext.calls[-1][1], keys.float())
    q = torch.randn(1, 2, 4, 64)
    k = torch.randn(1, 2, 6, 64, dtype=torch.float16)
    extra = torch.randn(1, 2, 2, 64, dtype=torch.float16)
    loader._lookahead_attention(q, k, k, torch.ones(1, 2, 6, dtype=torch.bool), extra, extra,
                                torch.ones(1, 2, 2, dtype=torch.bool), 0.125)
    assert all(t.dtype == torch.float32 for t in ext.calls[-1][1:])
    assert torch.equal(ext.calls[-1][1], k.float())
