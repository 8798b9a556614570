"""The fused dense decode step (plugins/cpu/decode.c): one C call runs a decode step through every
layer, where the Python path makes ~200 kernel calls and ~3,000 torch ops.

    dec = FusedDecoder(dims, embed, layers, final_norm, cos, sin, pool_k, pool_v)   # once, at load
    hidden = dec.run(tokens, positions, slot_blocks, slot_offsets, run_starts, lens)  # per step

Sparse mode binds its `BlockSelection` too (`selection=`): `run` then attends each row to the keys
it selects (decode.c select_keys). A lookahead step keeps its own attention: `run_layers(tokens,
positions, attend)` runs every layer's other stages in C, two calls a layer around `attend`.

`FusedDecoder` collects, once, the pointers of every layer's weights (fp32 ones through the packed
copies `ops.packed_weight` keeps for `plugins.cpu.linear`, int8 ones as stored), the pool's K/V of
each layer and the RoPE tables, into C structs; a step then only passes its metadata. The tensors
stay referenced here; their version counters are checked every step, and a weight changed in place
is re-bound (re-packed) before the step runs. `run` returns None where the step is not one the C
path takes (checked in C before anything is written): the caller runs its Python path.

Every stage is bit-identical to the Python path's (the same kernels in the same order, the small
ops rounded as torch rounds them), SiLU included where torch's own exp can be used:
- `silu="auto"` (the default): one call a step. SiLU uses torch's vector exp (Sleef's, exported by
  libtorch_cpu) with torch's loop split, where `silu_binding` finds that this reproduces
  `F.silu(gate) * up` bit for bit on a probe (`exact`); else common.h's exp (within a few ulp);
- `silu="own"`: common.h's exp always (what "auto" falls back to);
- `silu="torch"`: each layer's SiLU * up by torch between two C calls (two calls a layer; tests).

`LookaheadLayer` (below) is the other fused entry: one decode layer of the lookahead backend per
C call (plugins/cpu/lookahead_layer.c), the attention `run_layers` leaves to the backend.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import torch
import torch.nn.functional as F

from . import abi, prefill
from .abi import (DECLINED, Layer as _Layer, LayerCall as _Call, LayerTensors as _Tensors, Linear as _Linear,
                  Model as _Model, Step as _Step, Work as _Work)
from .loader import avx512_library, library
from .ops import (KV_DTYPES, MAX_EXTRA_KEYS, MAX_GROUP_ROWS, MAX_INT8_ROWS, MAX_LINEAR_ROWS, block_tables,
                  int8_group_size, int8_kernel_group, packed_weight, runs_or_tables, traced)

# the Python path's C linears take this many rows, and decode.c a step of at most LKV_MAX_ROWS
MAX_ROWS = min(MAX_LINEAR_ROWS, MAX_INT8_ROWS, abi.MAX_ROWS)
MAX_KV_ROW = abi.MAX_KV_ROW                         # lkv_abi.h LKV_MAX_KV_ROW
_version = attrgetter("_version")


@dataclass(frozen=True)
class Dims:
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    eps: float
    scale: float


# fp32 [N, K], or (qweight int8 [N, K], scale fp32 [N] or [N, K // G]: ops.int8_group_size)
Weight = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors: each projection an fp32 [N, K] tensor or (qweight, scale);
    q_norm / k_norm: each q / k head's RMSNorm weight [head_dim] (qwen3), or None."""
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    wqkv: Weight
    wqkv_bias: torch.Tensor | None
    wo: Weight
    w13: Weight
    w2: Weight
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def unsupported(dims: Dims, embed, layers: list[LayerWeights], final_norm: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, w8a8: bool = False) -> str | None:
    """Why these tensors cannot take the fused step (None: they can): the conditions under which
    the Python path calls exactly the C kernels decode.c calls (fp32 CPU tensors, packable fp32 or
    int8 projections, D % 32 == 0, the pool contiguous in a kernel dtype, ...). w8a8: the int8
    projections take the W8A8 kernel (decode precision int8), which must then run in C."""
    if library() is None:
        return "no CPU kernels"
    d = dims
    qkv_n = (d.heads + 2 * d.kv_heads) * d.head_dim
    if d.hidden % 8 or d.head_dim % 32 or d.kv_heads < 1 or d.heads % d.kv_heads \
            or d.heads // d.kv_heads > MAX_GROUP_ROWS or d.kv_heads * d.head_dim > MAX_KV_ROW:
        return f"shapes (hidden {d.hidden}, heads {d.heads}/{d.kv_heads}, head_dim {d.head_dim})"
    if len(layers) != d.num_layers:
        return "layer count"

    def fp32(t, shape) -> bool:
        return (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
                and tuple(t.shape) == shape)

    def int8_ok(q, s, n, k) -> bool:       # s: [n] or [n, k // G] (ops.int8_group_size)
        if not (q.dtype == torch.int8 and q.device.type == "cpu" and tuple(q.shape) == (n, k)
                and fp32(s, tuple(s.shape))):
            return False
        try:
            return int8_group_size(q, s) > 0
        except ValueError:
            return False

    def weight_ok(w, n, k) -> bool:
        if isinstance(w, torch.Tensor):
            return fp32(w, (n, k)) and n % 8 == 0
        q, s = w
        return (int8_ok(q, s, n, k) and int8_kernel_group(q, s) is not None
                and (not w8a8 or prefill.w8a8_supported(torch.empty(1, k), q, s)))

    if w8a8 and any(isinstance(lw.wqkv, torch.Tensor) for lw in layers):
        return "decode precision int8 needs int8 projections"
    if isinstance(embed, torch.Tensor):
        if not (fp32(embed, (d.vocab, d.hidden)) and embed.is_contiguous()):
            return "embedding"
    elif not (int8_ok(embed[0], embed[1], d.vocab, d.hidden) and embed[0].is_contiguous()
              and embed[1].is_contiguous()):
        return "embedding"
    for i, lw in enumerate(layers):
        shapes = {"wqkv": (qkv_n, d.hidden), "wo": (d.hidden, d.heads * d.head_dim),
                  "w13": (2 * d.inter, d.hidden), "w2": (d.hidden, d.inter)}
        for name, (n, k) in shapes.items():
            if not weight_ok(getattr(lw, name), n, k):
                return f"layers.{i}.{name}"
        if lw.wqkv_bias is not None and not (fp32(lw.wqkv_bias, (qkv_n,)) and lw.wqkv_bias.is_contiguous()):
            return f"layers.{i}.wqkv.bias"
        if not all(fp32(t, (d.hidden,)) and t.is_contiguous() for t in (lw.attn_norm, lw.mlp_norm)):
            return f"layers.{i} norms"
        qk = (lw.q_norm, lw.k_norm)
        if qk != (None, None) and not all(fp32(t, (d.head_dim,)) and t.is_contiguous() for t in qk):
            return f"layers.{i} q/k norms"
    if not (fp32(final_norm, (d.hidden,)) and final_norm.is_contiguous()):
        return "final norm"
    if not all(t.dtype == torch.float32 and t.is_contiguous() and t.dim() == 2 and t.shape[1] == d.head_dim
               and t.device.type == "cpu" for t in (cos, sin)) or cos.shape != sin.shape:
        return "rope tables"
    if (pool_k.dtype not in KV_DTYPES or pool_v.dtype != pool_k.dtype or pool_k.shape != pool_v.shape
            or pool_k.device.type != "cpu" or pool_v.device.type != "cpu"
            or not pool_k.is_contiguous() or not pool_v.is_contiguous() or pool_k.dim() != 5
            or tuple(pool_k.shape[i] for i in (0, 1, 4)) != (d.num_layers, d.kv_heads, d.head_dim)):
        return f"KV pool ({pool_k.dtype}, {tuple(pool_k.shape)})"
    return None


def selection_unsupported(sel, dims: Dims, pool_k: torch.Tensor) -> str | None:
    """Why sparse mode's selection cannot run in the fused step (None: it can, or there is none)."""
    if sel is None:
        return None
    shape = (dims.num_layers, pool_k.shape[2], dims.kv_heads, dims.head_dim)
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and tuple(t.shape) == shape
               for t in (sel.kmin, sel.kmax)):
        return f"selection summaries (expected fp32 {shape} on CPU, contiguous)"
    if sel.block_size != pool_k.shape[3] or sel.top_k < 1:
        return "selection geometry"
    return None


def bind(dims: dict, embed, layers: list[tuple], final_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         pool_k: torch.Tensor, pool_v: torch.Tensor, silu: str = "auto", selection=None, w8a8: bool = False):
    """The kernel table's `fused_decoder` entry: (a FusedDecoder over these tensors, None), or
    (None, why) where the fused step does not take them. dims: `Dims`' fields by name; layers:
    each layer's `LayerWeights` fields, in order. w8a8: the int8 projections compute as
    `prefill.linear_w8a8` (the table's `decode_linear` at decode precision int8)."""
    d, lws = Dims(**dims), [LayerWeights(*t) for t in layers]
    why = (unsupported(d, embed, lws, final_norm, cos, sin, pool_k, pool_v, w8a8)
           or selection_unsupported(selection, d, pool_k))
    if why is not None:
        return None, why
    return FusedDecoder(d, embed, lws, final_norm, cos, sin, pool_k, pool_v, silu=silu, selection=selection,
                        w8a8=w8a8), None


def torch_vector_exp() -> int | None:
    """The address of torch's own 8-wide exp (Sleef's, exported by libtorch_cpu), or None."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        return ctypes.cast(lib.Sleef_expf8_u10avx2, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


_silu_bindings: dict[int, tuple[int | None, int]] = {}


def silu_binding(inter: int) -> tuple[int | None, int]:
    """(exp, chunk) with which decode.c's SiLU * up equals torch's `F.silu(gate) * up` bit for bit,
    found by trying torch's vector exp with its vector loop's two widths (AVX-512: 32 elements,
    AVX2: 16) on a probe of rows of `inter` and of 48 (where the widths' scalar tails differ) over
    the range SiLU sees; (None, 0) when none matches (decode.c then uses common.h's exp)."""
    if inter not in _silu_bindings:
        found: tuple[int | None, int] = (None, 0)
        exp8, lib = torch_vector_exp(), library()
        if exp8 is not None and lib is not None:
            g = torch.Generator().manual_seed(0)
            special = torch.tensor([0.0, -0.0, 88.0, -88.0, 100.0, -100.0, 1e-30, -1e-30, 1e-40, -1e-40,
                                    0.5, -0.5, 20.0, -20.0, 87.5, -103.9])
            probes = []
            for rows, n in ((16, inter), (64, 48)):
                gu = torch.randn(rows, 2 * n, generator=g) * torch.tensor([0.01, 0.3, 1.0, 4.0, 30.0])[
                    torch.randint(0, 5, (rows, 2 * n), generator=g)]
                gu.view(-1)[: special.numel()] = special
                with torch.no_grad():
                    probes.append((gu, torch.mul(F.silu(gu[:, :n]), gu[:, n:])))
            for chunk in (32, 16):
                ok = True
                for gu, want in probes:
                    act = torch.empty_like(want)
                    lib.lkv_silu_mul(gu.data_ptr(), act.data_ptr(), gu.shape[0], want.shape[1], exp8, chunk)
                    ok = ok and torch.equal(act, want)
                if ok:
                    found = (exp8, chunk)
                    break
        _silu_bindings[inter] = found
    return _silu_bindings[inter]


class FusedDecoder:
    """A model's dense decode step in C, bound once to its weights, RoPE tables and KV pool.
    `steps` counts the steps it ran; `exact`: its steps are bit-identical to the Python path's."""

    def __init__(self, dims: Dims, embed, layers: list[LayerWeights], final_norm: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, silu: str = "auto",
                 selection=None, w8a8: bool = False):
        """Tensors `bind` has checked (`unsupported`). selection: sparse mode's `BlockSelection` (its
        summaries over this pool's blocks): each layer's attention sees the keys it selects.
        w8a8: int8 projections through the W8A8 kernel on their packed copies."""
        if silu not in ("auto", "own", "torch"):
            raise ValueError(f"silu: 'auto', 'own' or 'torch', got {silu!r}")
        self.dims, self.silu, self._lib = dims, silu, library()
        # "auto": torch's exp where it reproduces F.silu bit for bit here, else common.h's ("own")
        self._exp8, self._silu_chunk = silu_binding(dims.inter) if silu == "auto" else (None, 0)
        self.exact = silu == "torch" or self._exp8 is not None      # bit-identical to the Python path
        self._src = (embed, layers, final_norm, cos, sin, pool_k, pool_v)
        self.selection, self.w8a8 = selection, w8a8
        self.steps = 0
        self._rows, self._mask = 0, torch.empty(0, dtype=torch.uint8)
        self._sel_nb, self._sel = (0, 0), None      # sparse mode's scratch, for (rows, blocks)
        self._bind()

    def _watched(self) -> list[torch.Tensor]:
        embed, layers, final_norm, cos, sin, pool_k, pool_v = self._src
        # not the pool: its contents change every step (read where they lie), its storage never
        out = [final_norm, cos, sin, *((embed,) if isinstance(embed, torch.Tensor) else embed)]
        for lw in layers:
            out += [t for t in (lw.attn_norm, lw.mlp_norm, lw.wqkv_bias, lw.q_norm, lw.k_norm) if t is not None]
            for w in (lw.wqkv, lw.wo, lw.w13, lw.w2):
                out += [w] if isinstance(w, torch.Tensor) else list(w)
        return out

    def _bind(self) -> None:
        """The C structs over the tensors as they are now (fp32 weights re-packed if they changed)."""
        d = self.dims
        embed, layers, final_norm, cos, sin, pool_k, pool_v = self._src
        keep: list[torch.Tensor] = []        # what the structs point into

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            keep.append(t)
            return t.data_ptr()

        def lin(w, bias=None) -> _Linear:
            if isinstance(w, torch.Tensor):
                return _Linear(ptr(packed_weight(w)), None, ptr(bias), w.shape[0], w.shape[1], 0)
            q, s = w[0].contiguous(), w[1].contiguous()
            packed = (*map(ptr, prefill.packed_w8a8(q, s)), int8_group_size(q, s)) if self.w8a8 else (None,) * 3 + (0,)
            return _Linear(ptr(q), ptr(s), ptr(bias), q.shape[0], q.shape[1], 1, int8_kernel_group(q, s), *packed)

        arr = (_Layer * d.num_layers)()
        for i, lw in enumerate(layers):
            arr[i] = _Layer(ptr(lw.attn_norm), ptr(lw.mlp_norm), lin(lw.wqkv, lw.wqkv_bias), lin(lw.wo), lin(lw.w13),
                            lin(lw.w2), ptr(pool_k[i]), ptr(pool_v[i]), ptr(lw.q_norm), ptr(lw.k_norm))
        q8 = not isinstance(embed, torch.Tensor)
        self._model = _Model(d.num_layers, d.hidden, d.heads, d.kv_heads, d.head_dim, d.inter, d.vocab,
                             pool_k.shape[2], pool_k.shape[3], cos.shape[0], KV_DTYPES[pool_k.dtype],
                             float(d.eps), float(d.scale), ptr(cos), ptr(sin), ptr(embed[0] if q8 else embed),
                             ptr(embed[1]) if q8 else None, ptr(final_norm), arr, self._exp8, self._silu_chunk,
                             int8_group_size(*embed) if q8 else 0, *self._selection_fields(ptr), self._w8a8_kernel())
        # W8A8: the quantized rows' scratch, once for the largest projection (decode.c checks it)
        xq_len, sx_len = self._w8a8_scratch_sizes(arr)
        self._w8a8_scratch = (torch.empty(xq_len, dtype=torch.int32), torch.empty(sx_len, dtype=torch.float32))
        self._layers, self._keep = arr, keep
        self.binds = getattr(self, "binds", 0) + 1          # once, unless a weight changed in place
        self._watch = self._watched()
        self._versions = list(map(_version, self._watch))

    def _w8a8_kernel(self) -> int | None:
        """The address of the AVX-512 library's lkv_gemm_w8a8_scratch, which decode.c calls for the
        projections bound packed (w8a8), or None (without w8a8: decode.c never calls it)."""
        lib = avx512_library() if self.w8a8 else None
        return None if lib is None else ctypes.cast(lib.lkv_gemm_w8a8_scratch, ctypes.c_void_p).value

    @staticmethod
    def _w8a8_scratch_sizes(layers) -> tuple[int, int]:
        """(xq words, sx floats) a W8A8 projection of MAX_ROWS rows needs at most over the bound
        layers (M * K / 4 and M * K / G; 0 without W8A8)."""
        lins = [getattr(layer, n) for layer in layers for n in ("wqkv", "wo", "w13", "w2")]
        lins = [lin for lin in lins if lin.wq8]
        return (max((MAX_ROWS * (lin.k // 4) for lin in lins), default=0),
                max((MAX_ROWS * (lin.k // lin.group8) for lin in lins if lin.group8 > 0), default=0))

    def _work(self, views: dict[str, torch.Tensor], out: torch.Tensor, mask, boff: torch.Tensor, sel) -> _Work:
        xq, sx = self._w8a8_scratch
        return _Work(*(views[n].data_ptr() for n in ("x", "h", "qkv", "q", "o", "t", "gu", "act")), out.data_ptr(),
                     mask, boff.data_ptr(), *sel, xq.data_ptr() if xq.numel() else None,
                     sx.data_ptr() if sx.numel() else None, xq.numel(), sx.numel())

    def _selection_fields(self, ptr) -> tuple:
        sel = self.selection
        if sel is None:
            return (None, None, 0, 0, 0, 0)
        return (ptr(sel.kmin), ptr(sel.kmax), sel.top_k, sel.layout.num_sink, sel.layout.num_window,
                int(sel.group_score == "max"))

    def _selection_scratch(self, B: int, N: int) -> tuple:
        """Sparse mode's scratch, per row of B, for up to N keys (decode.c: NBm blocks of N keys):
        block scores, top-K ids, candidates."""
        sel = self.selection
        if sel is None:
            return (None, None, None)
        nb = -(-N // sel.block_size)
        if (B, nb) != self._sel_nb:
            kvh = self.dims.kv_heads
            self._sel = (torch.empty(B * kvh * nb, dtype=torch.float32),
                         torch.empty(B * kvh * sel.top_k, dtype=torch.int64), torch.empty(B * nb, dtype=torch.uint8))
            self._sel_nb = (B, nb)
        return tuple(t.data_ptr() for t in self._sel)

    def _workspace(self, B: int, N: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """Scratch for B rows (kept while B stays) and a key mask of B x KVH x N bytes (grown)."""
        if self._rows != B:
            d = self.dims
            nq, nqkv = d.heads * d.head_dim, (d.heads + 2 * d.kv_heads) * d.head_dim
            sizes = {"x": d.hidden, "h": d.hidden, "qkv": nqkv, "q": nq, "o": nq, "t": d.hidden,
                     "gu": 2 * d.inter, "act": d.inter}
            flat = torch.empty(B * sum(sizes.values()), dtype=torch.float32)
            self._views, at = {}, 0
            for name, n in sizes.items():
                self._views[name] = flat[at: at + B * n].view(B, n)
                at += B * n
            self._boff, self._rows = torch.empty(B, dtype=torch.int64), B
        need = B * self.dims.kv_heads * N
        if self._mask.numel() < need:
            self._mask = torch.empty(max(need, 2 * self._mask.numel()), dtype=torch.uint8)
        return self._views, self._mask, self._boff

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slot_blocks: torch.Tensor,
            slot_offsets: torch.Tensor, run_starts: list[int] | None, lens: list[int],
            tables: list[list[int]] | None = None) -> torch.Tensor | None:
        """The step's hidden states after the final norm, [B, hidden] fp32, for B items of one token
        each (row b: tokens[b] at positions[b], stored at (slot_blocks[b], slot_offsets[b]),
        attending to the lens[b] keys from block run_starts[b] on, or with `tables` to the lens[b]
        keys of the blocks tables[b] lists, in order: run_starts is then not read); the int64 tensors [B] on CPU,
        contiguous. None when the C path does not take the step (nothing was written), or with
        autograd on (Engine.step runs in inference mode)."""
        B = len(lens)
        if not 0 < B <= MAX_ROWS or torch.is_grad_enabled():     # (with autograd the Python path runs)
            return None
        if list(map(_version, self._watch)) != self._versions:      # a weight changed in place: re-bind
            self._bind()
        N = max(lens)
        views, mask, boff = self._workspace(B, N)
        if tables is not None:                  # runs take the run entry (no per-key table lookup)
            run_starts, tables = runs_or_tables(tables, lens, self._model.block_size)
        meta = (ctypes.c_int64 * (2 * B))(*(run_starts or [0] * B), *lens)
        table = None if tables is None else block_tables(tables, lens, self._model.block_size)
        step = _Step(B, N, tokens.data_ptr(), positions.data_ptr(), slot_blocks.data_ptr(), slot_offsets.data_ptr(),
                     ctypes.addressof(meta), ctypes.addressof(meta) + 8 * B,
                     None if table is None else table.data_ptr(), 0 if table is None else table.shape[1])
        out = torch.empty(B, self.dims.hidden, dtype=torch.float32)
        work = self._work(views, out, mask.data_ptr(), boff, self._selection_scratch(B, N))
        lib, L, nt = self._lib, self.dims.num_layers, torch.get_num_threads()
        m, s, w = ctypes.byref(self._model), ctypes.byref(step), ctypes.byref(work)
        with traced("decode_step"):
            if self.silu != "torch":
                rc = lib.lkv_decode(m, s, w, 0, 3 * L + 2, nt)
            else:       # [E, A_0], torch's SiLU, [M_0, A_1], ..., [M_{L-1}, F]
                gu, act, I = views["gu"], views["act"], self.dims.inter
                rc, s0 = 0, 0
                for layer in range(L + 1):
                    s1 = 3 * layer + 2
                    rc = lib.lkv_decode(m, s, w, s0, s1, nt)
                    if rc != 0 or layer == L:
                        break
                    torch.mul(F.silu(gu[:, :I]), gu[:, I:], out=act)
                    s0 = s1 + 1
        if rc == DECLINED:
            return None
        if rc != 0:
            abi.raise_for(rc, "the fused decode step")
        self.steps += 1
        return out

    def run_layers(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor | None:
        """A step whose attention is another backend's (a lookahead decode step): every layer's
        other stages in C (decode.c's lkv_ext_*: the same kernels, order and rounding as the Python
        path), `attend(layer, q, k, v) -> o` in between, with q [B, H, D], k and v [B, KVH, D] fp32
        (k rotated; fresh tensors of this step, which the backend may keep) and o [B, H, D].
        Returns the hidden states after the final norm [B, hidden], or None where the C path does
        not take the step (nothing was run: the caller runs the model's Python path)."""
        B = tokens.numel()
        if not 0 < B <= MAX_ROWS or torch.is_grad_enabled() or self.silu == "torch":
            return None
        if list(map(_version, self._watch)) != self._versions:
            self._bind()
        d = self.dims
        views, _, boff = self._workspace(B, 1)
        step = _Step(B, 0, tokens.data_ptr(), positions.data_ptr(), None, None, None, None)
        out = torch.empty(B, d.hidden, dtype=torch.float32)
        work = self._work(views, out, None, boff, (None, None, None))
        lib, nt = self._lib, torch.get_num_threads()
        m, s, w = ctypes.byref(self._model), ctypes.byref(step), ctypes.byref(work)
        if lib.lkv_ext_begin(m, s, w) != 0:
            return None
        L, H, KVH, D = d.num_layers, d.heads, d.kv_heads, d.head_dim
        q = torch.empty(L, B, H, D, dtype=torch.float32)
        k = torch.empty(L, B, KVH, D, dtype=torch.float32)
        v = torch.empty(L, B, KVH, D, dtype=torch.float32)
        with traced("decode_layers"):
            for layer in range(L):
                rc = lib.lkv_ext_qkv(m, s, w, layer, q[layer].data_ptr(), k[layer].data_ptr(), v[layer].data_ptr(), nt)
                if rc != 0:
                    abi.raise_for(rc, "the fused decode layers (qkv)")
                o = attend(layer, q[layer], k[layer], v[layer])
                if o.dtype != torch.float32 or o.device.type != "cpu" or o.shape != (B, H, D):
                    raise ValueError(f"attend: expected o [{B}, {H}, {D}] float32 on CPU, "
                                     f"got {tuple(o.shape)} {o.dtype} on {o.device}")
                o = o.contiguous()
                rc = lib.lkv_ext_rest(m, s, w, layer, o.data_ptr(), nt)
                if rc != 0:
                    abi.raise_for(rc, "the fused decode layers (after attention)")
            lib.lkv_ext_end(m, s, w)
        self.steps += 1
        return out


# ---- the lookahead layer ---------------------------------------------------------------------------
#
# One decode layer of the lookahead backend per C call (plugins/cpu/lookahead_layer.c).
#
#     layer = LookaheadLayer.bind(kmin, kmax, pool_k, pool_v, tier_k, tier_v, tier_mask, block, last_used,
#                                 slot_of, lane_blocks, pred, has_pred, heads=H, sel_start=S, group_max=True,
#                                 copy=transfer_engine.inline_kernel())
#     res = layer.run(l, buf, q, k, v, out, cand, extra_mask, fetch, active, nb, k_sel, step, used_none,
#                     used_adm, scale, true_idx, resident, predict_cap, pred_adm, urgent_adm)
#
# `run` scores, admits, copies and attends one layer of lanes 0..n-1 (R = 1 row each without
# look-ahead, 2 with the draft row; `active`: the lanes that decode), and with R = 2 records and
# admits the draft's prediction: the kernels the backend's torch path calls for it, in its order
# (runtime/lookahead/attention.py `_decode_torch`), so the result is that path's bit for bit. The
# urgent copy is made with `copy`, the transfer engine's copy kernel (a C function address) handed
# over at bind time: the layer decides nothing and moves no bytes of its own. The caller applies
# the result (metrics, the prediction's copy jobs); `res` says how many blocks were copied urgently
# (listed in `urgent_adm`) and in how many seconds, how many selected slots attention read, and
# how many predicted blocks were admitted (listed in `pred_adm`).
#
# The bound tensors are the backend's own (allocated once, never replaced), written in place by the
# call; `bind` (the kernel table's `lookahead_layer` entry) checks their layouts once (None where
# the C library or a layout does not apply: the caller keeps its path), and `run` checks the
# call's tensors against them.


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
              and kmin.dtype == kmax.dtype == pool_k.dtype and kmin.shape == kmax.shape == (L, lanes * mb, kvh, D)
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
            abi.raise_for(rc, "the lookahead layer")
        self.calls += 1
        return LayerResult(c.admitted, c.copy_s, c.used, c.predicted)
