"""Build the CUDA kernels as a torch extension and make them the CUDA kernels of `torch.ops.lookahead.*`.

`plugins/__init__.py` calls `register_cuda_kernels()` once, and only when
`torch.cuda.is_available()`; importing this module is safe anywhere (it touches no CUDA API).
The extension is built from the same `.cu` files as `scripts/compile_kernels.sh` and the
TensorRT plugins, with `torch.utils.cpp_extension.load`, once per process and cached on disk
(`$LOOKAHEAD_CUDA_BUILD_DIR`, default `build/torch_ext/` in the repository), so only the first
process on a machine pays the ~1 minute compile.

Pinned host memory. The transfer engine reads blocks straight from the host KV pool with::

    out = torch.ops.lookahead.block_gather(host_pool, block_ids)   # host_pool: pinned CPU tensor
                                                                    # block_ids: int64 on the GPU

The dispatcher picks the CUDA kernel because one argument (``block_ids``) is a CUDA tensor; the
kernel reads the pool through its device-mapped (UVA) address with 16-byte loads, on the current
stream, and returns ``out`` on ``block_ids``' device. The host pool must be contiguous and pinned
(``pin_memory()`` or ``torch.empty(..., pin_memory=True)``). The public wrapper
``plugins.block_gather`` checks that src and block_ids share a device, so this mixed-device call
goes through ``torch.ops`` directly (the runtime's transfer engine is its one caller).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

KERNEL_DIR = Path(__file__).resolve().parent
SOURCES = ("block_gather.cu", "block_topk.cu", "update_summaries.cu", "lookahead_attention.cu",
           "torch_bindings.cpp")
EXTENSION_NAME = "lookahead_kv_cuda"
# As in scripts/compile_kernels.sh; torch adds the arch of the visible GPU (or
# TORCH_CUDA_ARCH_LIST) and its no-implicit-half-conversion defines.
CUDA_FLAGS = ("-O3", "-std=c++17")
# Head dims the attention kernel is instantiated for; others use the torch implementation.
ATTENTION_HEAD_DIMS = (64, 128, 256)


def build_dir() -> Path:
    """Where the extension is built and cached: `$LOOKAHEAD_CUDA_BUILD_DIR` or `<repo>/build/torch_ext`."""
    return Path(os.environ.get("LOOKAHEAD_CUDA_BUILD_DIR", KERNEL_DIR.parents[1] / "build" / "torch_ext"))


@functools.cache
def load_extension():
    """The compiled extension module (built on first call in a process, from the on-disk cache after)."""
    from torch.utils import cpp_extension

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(KERNEL_DIR / s) for s in SOURCES],
        extra_include_paths=[str(KERNEL_DIR)],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=list(CUDA_FLAGS),
        build_directory=str(out),
        verbose=False,
    )


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, contiguous with a 16-byte-aligned start (the attention kernel moves K/V in 16-byte vectors)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _block_gather(src: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    device = block_ids.device if block_ids.is_cuda else src.device
    num_kv_heads, n = block_ids.shape
    out = torch.empty((num_kv_heads, n, src.shape[2], src.shape[3]), dtype=src.dtype, device=device)
    # A host src must stay as it is (a .contiguous() copy would not be pinned); the kernel checks.
    src = src if not src.is_cuda else src.contiguous()
    load_extension().block_gather_out(src, block_ids.to(device).contiguous(), out)
    return out


def _block_topk(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, valid: torch.Tensor,
                k: int, group_score: str = "sum") -> tuple[torch.Tensor, torch.Tensor]:
    if q.dim() == 4:    # R rows per sequence: one kernel launch per row
        outs = [_block_topk(q[:, r], kmin, kmax, valid[:, r], k, group_score) for r in range(q.shape[1])]
        return torch.stack([o[0] for o in outs], 1), torch.stack([o[1] for o in outs], 1)
    B, num_blocks, num_kv_heads, _ = kmin.shape
    indices = torch.empty((B, num_kv_heads, k), dtype=torch.int64, device=q.device)
    scores = torch.empty((B, num_kv_heads, num_blocks), dtype=torch.float32, device=q.device)
    load_extension().block_topk_out(q.contiguous(), kmin.contiguous(), kmax.contiguous(), valid.contiguous(),
                                    k, group_score == "max", indices, scores)
    return indices, scores


def _update_summaries(kmin: torch.Tensor, kmax: torch.Tensor, keys: torch.Tensor, block_ids: torch.Tensor,
                      block_offsets: torch.Tensor) -> None:
    if not (kmin.is_contiguous() and kmax.is_contiguous()):
        # In place on a strided view: fold into dense copies, then write them back.
        dense_min, dense_max = kmin.contiguous(), kmax.contiguous()
        _update_summaries(dense_min, dense_max, keys, block_ids, block_offsets)
        kmin.copy_(dense_min)
        kmax.copy_(dense_max)
        return
    load_extension().update_summaries(kmin, kmax, keys.contiguous(), block_ids.contiguous(),
                                      block_offsets.contiguous())


def _lookahead_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_mask: torch.Tensor,
                         k_extra: torch.Tensor, v_extra: torch.Tensor, extra_mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    if q.shape[-1] not in ATTENTION_HEAD_DIMS:  # e.g. the tiny test models (head_dim 16)
        from ..attention import _lookahead_attention_impl
        return _lookahead_attention_impl(q, k, v, kv_mask, k_extra, v_extra, extra_mask, scale)
    q = q.contiguous()
    out = torch.empty_like(q)
    load_extension().lookahead_attention_out(q, _aligned(k), _aligned(v), kv_mask.contiguous(), _aligned(k_extra),
                                             _aligned(v_extra), extra_mask.contiguous(), float(scale), out)
    return out


KERNELS = {
    "block_gather": _block_gather,
    "block_topk": _block_topk,
    "update_summaries": _update_summaries,
    "lookahead_attention": _lookahead_attention,
}


@functools.cache
def register_cuda_kernels() -> None:
    """Build the extension (first call) and register its kernels for the CUDA dispatch key.

    Call only where ``torch.cuda.is_available()``; the ops must already be defined (importing
    ``plugins`` defines them). Idempotent: later calls return at once.
    """
    load_extension()
    for name, fn in KERNELS.items():
        torch.library.register_kernel(f"lookahead::{name}", "cuda", fn)
