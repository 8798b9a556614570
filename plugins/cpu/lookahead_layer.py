"""One decode layer of the lookahead backend per C call (plugins/cpu/lookahead_layer.c).

    layer = LookaheadLayer.bind(kmin, kmax, pool_k, pool_v, tier_k, tier_v, tier_mask, block, last_used,
                                slot_of, lane_blocks, pred, has_pred, heads=H, sel_start=S, group_max=True,
                                copy=transfer_engine.inline_kernel())
    res = layer.run(l, buf, q, k, v, out, cand, extra_mask, fetch, active, nb, k_sel, step, used_none,
                    used_adm, scale, true_idx, resident, predict_cap, pred_adm, urgent_adm)

`run` scores, admits, copies and attends one layer of lanes 0..n-1 (R = 1 row each without
look-ahead, 2 with the draft row; `active`: the lanes that decode), and with R = 2 records and
admits the draft's prediction: the kernels the backend's torch path calls for it, in its order
(runtime/lookahead/attention.py `_decode_torch`), so the result is that path's bit for bit. The
urgent copy is made with `copy`, the transfer engine's copy kernel (a C function address) handed
over at bind time: the layer decides nothing and moves no bytes of its own. The caller applies
the result (metrics, the prediction's copy jobs); `res` says how many blocks were copied urgently
(listed in `urgent_adm`) and in how many seconds, how many selected slots attention read, and
how many predicted blocks were admitted (listed in `pred_adm`).

The bound tensors are the backend's own (allocated once, never replaced), written in place by the
call; `bind` (the kernel table's `lookahead_layer` entry) checks their layouts once (None where
the C library or a layout does not apply: the caller keeps its path), and `run` checks the
call's tensors against them.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .abi import LayerCall as _Call, LayerTensors as _Tensors, raise_for
from .loader import library
from .ops import KV_DTYPES, MAX_EXTRA_KEYS, MAX_GROUP_ROWS, traced


@dataclass
class LayerResult:
    admitted: int              # blocks copied urgently host -> device tier (before attention), in urgent_adm
    copy_s: float              # seconds that copy took (the step waited for it)
    used: int                  # selected slots attention read (SlotTable.high of the buffer then)
    predicted: int             # the prediction's admissions (R = 2), in pred_adm[:, :predicted]


class LookaheadLayer:
    def __init__(self, tensors: tuple[torch.Tensor, ...], dims: _Tensors, scratch: list[torch.Tensor]):
        self._tensors, self._dims, self._scratch = tensors, dims, scratch
        # the urgent and the prediction's admission lists of each layer, for the caller to pass
        # as urgent_adm / pred_adm (valid until that layer's next call)
        self.lists = torch.empty(2, dims.layers, 4 * dims.lanes * dims.kv_heads * dims.top_k, dtype=torch.int64)
        self._call, self._lib = _Call(), library()
        self.calls = 0

    @classmethod
    def bind(cls, kmin: torch.Tensor, kmax: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
             tier_k: torch.Tensor, tier_v: torch.Tensor, tier_mask: torch.Tensor, block: torch.Tensor,
             last_used: torch.Tensor, slot_of: torch.Tensor, lane_blocks: torch.Tensor, pred: torch.Tensor,
             has_pred: torch.Tensor, *, heads: int, sel_start: int, group_max: bool,
             copy: int | None) -> "LookaheadLayer | None":
        """The backend's tensors (shapes in lookahead_layer.c's LkvLayerTensors) and the transfer
        engine's copy kernel (`copy`, a C function address: TransferEngine.inline_kernel) -> a bound
        layer, or None where the C path does not take them (no library or copy kernel, another
        device, dtype or layout)."""
        ts = (kmin, kmax, pool_k, pool_v, tier_k, tier_v, tier_mask, block, last_used, slot_of, lane_blocks, pred,
              has_pred)
        if library() is None or not copy or any(t.device.type != "cpu" or not t.is_contiguous() for t in ts):
            return None
        if pool_k.dim() != 5 or tier_k.dim() != 6 or kmin.dim() != 4 or block.dim() != 4:
            return None
        L, kvh, nblocks, bs, D = pool_k.shape
        bufs, lanes, _, slots, _, _ = tier_k.shape
        K, mb = block.shape[-1], lane_blocks.shape[-1]
        ok = (pool_k.dtype in KV_DTYPES and all(t.dtype == pool_k.dtype for t in (pool_v, tier_k, tier_v))
              and pool_v.shape == pool_k.shape and tier_v.shape == tier_k.shape
              and tier_k.shape[2:] == (kvh, slots, bs, D) and bufs == L
              and kmin.dtype == kmax.dtype == torch.float32 and kmin.shape == kmax.shape == (L, lanes * mb, kvh, D)
              and tier_mask.dtype == torch.bool and tier_mask.shape == (lanes, kvh, slots, bs)
              and all(t.dtype == torch.int64 for t in (block, last_used, slot_of, lane_blocks, pred))
              and block.shape == last_used.shape == (bufs, lanes, kvh, K) and slot_of.shape == (bufs, lanes, kvh, mb + 1)
              and lane_blocks.shape == (lanes, mb) and pred.shape == (L, lanes, kvh, K)
              and has_pred.dtype == torch.bool and has_pred.shape == (L, lanes)
              and 0 <= sel_start and sel_start + K <= slots and heads % kvh == 0
              and 2 * (heads // kvh) <= MAX_GROUP_ROWS and D % 32 == 0 and (bs * D) % 2 == 0)
        if not ok:
            return None
        f32, i64 = dict(dtype=torch.float32), dict(dtype=torch.int64)
        rows = lanes * kvh
        u8, T = dict(dtype=torch.uint8), sel_start + K       # T: the draft row's own table (S + K blocks)
        scratch = [torch.empty(2 * rows * mb, **f32), torch.empty(rows * K, **f32), torch.empty(2 * rows * K, **i64),
                   torch.empty(rows * K, **i64), torch.empty(2 * rows * K, **i64),
                   torch.arange(lanes, **i64), torch.empty(rows * slots * bs, **u8),
                   torch.empty(rows * T, **i64), torch.empty(rows * T * bs, **u8), torch.empty(lanes * 2, **u8),
                   torch.empty(lanes * heads * D, **f32), torch.empty(lanes * heads * D, **f32)]
        dims = _Tensors(*(t.data_ptr() for t in ts), L, lanes, kvh, heads, D, bs, mb, K, sel_start, slots, nblocks,
                        pool_k.element_size(), KV_DTYPES[pool_k.dtype], int(group_max),
                        *(t.data_ptr() for t in scratch), copy)
        return cls(ts, dims, scratch)

    def run(self, layer: int, buf: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            cand: torch.Tensor, extra_mask: torch.Tensor, fetch: torch.Tensor, active: torch.Tensor, nb: int,
            k_sel: int, step: int, used_none: int, used_adm: int, scale: float, true_idx: torch.Tensor,
            resident: torch.Tensor, predict_cap: int, pred_adm: torch.Tensor,
            urgent_adm: torch.Tensor, draft_fixed: torch.Tensor | None = None,
            draft_stored: torch.Tensor | None = None) -> LayerResult:
        """One layer of n lanes, R rows each: q [n*R, H, D], k, v [n*R, KVH, D] (fp32, this step's
        rows, lane-major), out like q (written); cand [n, R, MB] bool, extra_mask [n, R, R] bool,
        fetch [n] bool (lanes whose real-row misses are copied now), active [n] bool (lanes that
        decode: the others' rows are computed and ignored); written: true_idx [n, KVH, K] int64,
        resident [n, KVH, K] bool, urgent_adm and (R = 2) pred_adm [4, n*KVH*K] int64.
        draft_fixed [n, sel_start] int64 and draft_stored [n] int64 (R = 2; None: the draft row
        attends the device tier, as the real row does): the draft row attends its own top-K from
        the host pool after these logical blocks of its lane (-1 padded), the first
        draft_stored[b] tokens of lane b visible (LookaheadAttention's `draft_attention` "own")."""
        d = self._dims
        R = extra_mask.shape[1] if extra_mask.dim() == 3 else 0
        n = q.shape[0] // max(R, 1)
        K = d.top_k
        if not (R in (1, 2) and 0 < n <= d.lanes and q.shape == (n * R, d.heads, d.head_dim)
                and k.shape == v.shape == (n * R, d.kv_heads, d.head_dim) and out.shape == q.shape
                and all(t.dtype == torch.float32 and t.is_contiguous() for t in (q, k, v, out))
                and cand.dtype == extra_mask.dtype == fetch.dtype == resident.dtype == torch.bool
                and cand.shape[0] >= n and cand.shape[1] == R and cand.shape[2] == d.max_blocks and cand.stride(2) == 1
                and extra_mask.shape == (n, R, R) and extra_mask.is_contiguous() and R <= MAX_EXTRA_KEYS
                and fetch.shape == active.shape == (n,) and fetch.is_contiguous() and active.is_contiguous()
                and active.dtype == torch.bool
                and true_idx.dtype == pred_adm.dtype == urgent_adm.dtype == torch.int64
                and true_idx.shape == resident.shape == (n, d.kv_heads, K)
                and all(t.is_contiguous() for t in (true_idx, resident, pred_adm, urgent_adm))
                and min(pred_adm.numel(), urgent_adm.numel()) >= 4 * n * d.kv_heads * K
                and 1 <= k_sel <= nb <= d.max_blocks
                and (draft_fixed is None or (R == 2 and draft_stored is not None
                                             and draft_fixed.shape == (n, d.sel_start) and draft_stored.shape == (n,)
                                             and draft_fixed.dtype == draft_stored.dtype == torch.int64
                                             and draft_fixed.is_contiguous() and draft_stored.is_contiguous()))):
            raise ValueError("LookaheadLayer.run: arguments outside the bound layout (see its docstring)")
        c = self._call
        c.layer, c.buf, c.n, c.rows, c.nb, c.k_sel, c.step = layer, buf, n, R, nb, k_sel, step
        c.used_none, c.used_adm, c.nthreads = used_none, used_adm, torch.get_num_threads()
        c.q, c.kx, c.vx = q.data_ptr(), k.data_ptr(), v.data_ptr()
        # the extra keys as the Python path hands them: [n, KVH, R, D] views of the rows
        c.xksb, c.xksh, c.xkse = R * k.stride(0), k.stride(1), k.stride(0)
        c.xvsb, c.xvsh, c.xvse = R * v.stride(0), v.stride(1), v.stride(0)
        c.cand, c.cand_sb, c.cand_sr = cand.data_ptr(), cand.stride(0), cand.stride(1)
        c.extra_mask, c.fetch, c.active = extra_mask.data_ptr(), fetch.data_ptr(), active.data_ptr()
        c.scale, c.out = scale, out.data_ptr()
        c.true_idx, c.resident = true_idx.data_ptr(), resident.data_ptr()
        c.predict_cap, c.pred_adm, c.urgent_adm = predict_cap, pred_adm.data_ptr(), urgent_adm.data_ptr()
        c.draft_fixed = draft_fixed.data_ptr() if draft_fixed is not None else None
        c.draft_stored = draft_stored.data_ptr() if draft_fixed is not None else None
        with traced("lookahead_layer"):
            rc = self._lib.lkv_lookahead_layer(ctypes.byref(self._dims), ctypes.byref(c))
        if rc != 0:
            raise_for(rc, "the lookahead layer")
        self.calls += 1
        return LayerResult(c.admitted, c.copy_s, c.used, c.predicted)
