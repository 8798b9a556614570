"""One Llama-family model definition (llama, qwen2, mistral without sliding window, qwen3 dense).

Attention is delegated: every layer calls `attn.forward(layer_idx, q, k, v)` on the step's
`AttentionBackend`, which stores K/V and computes attention the way the current mode wants
(dense paged, or lookahead sparse). The model never sees a cache. Every kernel it calls (the
projections, the norms, the fused decode step) is an entry of its `ops`, the engine's kernel
table (runtime/ops.py).

Weight-only int8 (an engine.yaml `quantization:` section): the quantized roles' modules are
`Int8Linear` / `Int8Embedding`, whose `.weight` is an `Int8Weight` (qweight int8 [N, K], scale
fp32 [N] or [N, K // G]) instead of a tensor; the quantized engine's table (`select_ops(...,
quantized=True)`) takes it like any weight.

The fp32 modules and their path are unchanged.

The projections run through `model.projections` (runtime/projections.py): every weight bound to its
kernels, and its packed copies made, when the weights load, not on a first prompt.

`load_model(manifest, device, ops)` builds the model an engine dir describes: weights read from
weights.safetensors, or, for a `random_weights:` recipe, generated on `device` tensor by tensor.
"""
from __future__ import annotations

import copy

import math
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .engine_dir import WEIGHTS, Manifest, expected_shapes
from .errors import EngineDirError
from .ops import Ops, dequantize_int8, int8_group_size, select_ops
from .projections import LayerProjections, Projections, step_projection
from .rope import RotaryEmbedding


class AttentionBackend(Protocol):
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] (post-RoPE) -> out [T, H, D]."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        """The norm through the table's entry (a model's layers run their bound kernel instead:
        runtime/projections.py)."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return ops.rms_norm(x, self.weight, self.eps)      # one C call, or F.rms_norm
        return self.upcast(x)

    def upcast(self, x: torch.Tensor) -> torch.Tensor:
        """A 16-bit model's norm: computed in fp32, scaled in x's dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class Int8Weight(NamedTuple):
    """A weight-only int8 matrix: W[n, k] ~= qweight[n, k] * scale[n, k // G] (symmetric), with G
    the inputs per scale: K (one per output channel, scale [N]) or a group of G (scale [N, K // G]),
    read from the scale's shape. What a quantized module's `.weight` is; `ops.linear` of a quantized
    engine takes it."""

    qweight: torch.Tensor      # [N, K] int8
    scale: torch.Tensor        # [N] or [N, K // G] float32

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def group_size(self) -> int:
        return int8_group_size(self.qweight, self.scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scale, dtype)


class _Int8Buffers(nn.Module):
    """The buffers of a quantized weight: `qweight` [N, K] int8 and `scale` fp32, whose layout ([N],
    or [N, K // G]) is the loaded state dict's: its scale is checked against qweight's shape and
    taken as it is (G = K // scale.shape[-1])."""

    def __init__(self, n: int, k: int):
        super().__init__()
        self.register_buffer("qweight", torch.empty(n, k, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(n, dtype=torch.float32))

    @property
    def weight(self) -> Int8Weight:
        return Int8Weight(self.qweight, self.scale)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        scale = state_dict.get(prefix + "scale")
        if isinstance(scale, torch.Tensor) and scale.shape != self.scale.shape:
            try:
                int8_group_size(self.qweight, scale)
            except ValueError:
                raise EngineDirError(
                    f"{prefix}scale has shape {list(scale.shape)}, but {prefix}qweight {list(self.qweight.shape)} "
                    "needs [N] (per output channel) or [N, K // G] with G dividing K: rebuild the engine") from None
            self.scale = torch.empty(scale.shape, dtype=self.scale.dtype, device=self.scale.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Int8Linear(_Int8Buffers):
    """nn.Linear's place for a quantized projection: buffers `qweight` [out, in] int8 and `scale`
    [out] or [out, in // G] fp32 (the state dict's `<name>.qweight`, `<name>.scale`), an fp32
    `bias` or None."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(out_features, in_features)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None


class Int8Embedding(_Int8Buffers):
    """nn.Embedding's place for a quantized table: a lookup dequantizes only the rows it reads
    (scale [vocab] or [vocab, dim // G]). Tied, its `.weight` (the same qweight and scales) is
    also the logits' projection."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__(num_embeddings, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows, s = self.qweight[tokens].to(torch.float32), self.scale[tokens]     # [*, dim], [*] | [*, dim // G]
        if self.scale.dim() == 1:
            return rows * s.unsqueeze(-1)
        return (rows.unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1)).flatten(-2)


def _linear(cfg_quantized: frozenset[str], role: str, in_f: int, out_f: int, bias: bool = False) -> nn.Module:
    return Int8Linear(in_f, out_f, bias) if role in cfg_quantized else nn.Linear(in_f, out_f, bias=bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, quantized: frozenset[str] = frozenset()):
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        q = quantized
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.wqkv = _linear(q, "wqkv", cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.wo = _linear(q, "wo", cfg.q_size, cfg.hidden_size)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.w13 = _linear(q, "w13", cfg.hidden_size, 2 * cfg.intermediate_size)
        self.w2 = _linear(q, "w2", cfg.intermediate_size, cfg.hidden_size)
        # qwen3: an RMSNorm over each head of q and of k, after the projection, before RoPE
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
            rope_tables: tuple[torch.Tensor, torch.Tensor] | None, linear,
            proj: LayerProjections) -> tuple[torch.Tensor, ...]:
        """The attention's inputs of the residual stream x [T, hidden]: rmsnorm -> wqkv (+ bias)
        -> each q and k head's RMSNorm (qk_norm) -> RoPE of q and k: q [T, H, D], k and v
        [T, KVH, D]. The one place the Python path applies them (plugins/cpu/decode.c's
        project_qkv is its C twin)."""
        c, T = self.cfg, x.shape[0]
        qkv = linear(proj.attn_norm(x), proj.wqkv)                          # [T, q + 2kv] (+ bias)
        # q and k are adjacent in qkv: one rotation covers both heads' sets (half the small ops)
        qk = qkv[:, : c.q_size + c.kv_size].view(T, c.num_heads + c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([_head_norm(proj.q_norm, qk[:, : c.num_heads]),
                            _head_norm(proj.k_norm, qk[:, c.num_heads:])], dim=1)
        qk = rope.apply(qk, positions, rope_tables)
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads:]                    # [T, H, D], [T, KVH, D]
        v = qkv[:, c.q_size + c.kv_size:].reshape(T, c.num_kv_heads, c.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                attn: AttentionBackend, rope_tables: tuple[torch.Tensor, torch.Tensor] | None,
                linear, proj: LayerProjections) -> torch.Tensor:
        """linear: the step's projection (`projections.step_projection`), applied to this layer's
        bound projections `proj` (its norms are bound there too)."""
        c, T = self.cfg, x.shape[0]
        q, k, v = self.qkv(x, positions, rope, rope_tables, linear, proj)
        o = attn.forward(self.layer_idx, q, k, v)                           # [T, H, D]
        x = x + linear(o.reshape(T, c.q_size), proj.wo)
        gate, up = linear(proj.mlp_norm(x), proj.w13).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, proj.w2)


def _head_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """`norm` (a bound RMSNorm kernel) over the last dim of heads x [T, n, D]: as rows [T * n, D]
    (what the kernel takes, and what decode.c normalises)."""
    T, n, D = x.shape
    return norm(x.reshape(T * n, D)).view(T, n, D)


class LlamaModel(nn.Module):
    """tokens [T] + positions [T] -> hidden [T, hidden]; `logits(hidden)` -> [N, vocab].

    `device` is where the RoPE tables (and, unless `empty`, the parameters) are made; `ops` the
    implementations its projections call (default: `select_ops(device, dtype, quantized=...)`).
    `quantized`: the roles (engine_dir.QUANTIZABLE) held as int8 (`Int8Linear`, `Int8Embedding`);
    such a model is built `empty` and loaded with `load_weights`, in float32.
    `max_positions`: the RoPE tables' positions, the longest sequence it will run (an engine's
    max_model_len; None: the model's max_position_embeddings); `with_positions` makes more.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 empty: bool = False, ops: Ops | None = None, quantized: Any = (), max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        q = frozenset(quantized or ())
        if q and (dtype != torch.float32 or not empty):
            raise ValueError("an int8 model computes in float32 and is built empty (load_weights fills it)")
        self.quantized = q
        self.weights_version = 0           # load_weights counts here (runner.DenseRunner re-binds its fused step)
        self.ops = ops or select_ops(torch.device(device), dtype, quantized=bool(q))
        # empty=True: parameters on the meta device (no init cost); load_weights assigns real ones
        with torch.device("meta" if empty else device):
            self.embed_tokens = (Int8Embedding(cfg.vocab_size, cfg.hidden_size) if "embed_tokens" in q
                                 else nn.Embedding(cfg.vocab_size, cfg.hidden_size))
            self.layers = nn.ModuleList(DecoderLayer(cfg, i, q) for i in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = (None if cfg.tie_word_embeddings
                            else _linear(q, "lm_head", cfg.hidden_size, cfg.vocab_size))
        if not empty:
            self.to(device=device, dtype=dtype)
        self.rope = self._rope(max_positions or cfg.max_position_embeddings, dtype, device)
        self.projections: Projections | None = None        # bound when the weights are real
        if not empty:
            self.bind_kernels()

    def bind_kernels(self) -> Projections:
        """Bind every projection to this model's table (runtime/projections.py): kernels chosen and
        packed copies made now, once, not on a first prompt. Runs when the weights load or move
        (`load_weights`, `.to()`) and on a twin with another table (`with_ops`)."""
        self.__dict__["projections"] = Projections.bind(self)
        return self.projections

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)                  # .to(), .float(), ...: tensors replaced
        if self.__dict__.get("projections") is not None:
            self.bind_kernels()
        return out

    def _rope(self, max_positions: int, dtype: torch.dtype, device: str | torch.device) -> RotaryEmbedding:
        c = self.cfg
        return RotaryEmbedding(c.head_dim, min(max_positions, c.max_position_embeddings), c.rope_theta,
                               c.rope_scaling, dtype, device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                batch=None, prompt: bool = False) -> torch.Tensor:
        """batch: the step's `StepBatch`, whose prompt-chunk rows take the kernel table's prefill
        projections (`projections.step_projection`); prompt: every row is a prompt's (a prefill
        outside an engine: the builder's checks); neither: every row takes the decode kernels."""
        x = self.embed_tokens(tokens)
        tables = self.rope.tables(positions)
        linear, proj = step_projection(batch, prompt), self.projections
        for layer, p in zip(self.layers, proj.layers):
            x = layer(x, positions, self.rope, attn, tables, linear, p)
        return proj.norm(x)

    def with_ops(self, ops: Ops) -> "LlamaModel":
        """This model (its weights and layers shared, not copied) computing with the table `ops`."""
        twin = copy.copy(self)
        twin.__dict__["ops"] = ops
        if self.projections is not None:
            twin.bind_kernels()
        return twin

    def with_positions(self, max_positions: int) -> "LlamaModel":
        """This model, or where its RoPE tables hold fewer than `max_positions` (capped at
        max_position_embeddings) a twin sharing its weights with tables that long (an engine with a
        longer max_model_len over a loaded model: `Engine.sibling`)."""
        if min(max_positions, self.cfg.max_position_embeddings) <= self.rope.max_positions:
            return self
        twin = copy.copy(self)
        twin.__dict__["rope"] = self._rope(max_positions, self.rope.cos.dtype, self.rope.cos.device)
        return twin

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # every row's logits alike, prompt or decode: the decode kernel (the table's decode_linear or linear)
        return self.projections.head.decode(hidden).float()

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def fused_decoder(self, pool_k: torch.Tensor, pool_v: torch.Tensor, scale: float,
                      silu: str = "auto", selection=None) -> tuple[Any, str | None]:
        """(the fused dense decode step over this model and a KV pool's K/V, None) when this model
        takes it, else (None, why). The fused step (the table's `fused_decoder`: one C call a
        step) runs what `forward` runs over `attention_dense.DenseStep` on a decode step, for an
        fp32 CPU model on a C kernel table (a torch, checked or test's own table has none, so
        every call still goes through its entries)."""
        c, bind = self.cfg, self.ops.fused_decoder
        if bind is None or self.device.type != "cpu":
            return None, f"ops {self.ops.name or 'custom'} on {self.device.type}"
        if not (type(self.norm) is RMSNorm and type(self.embed_tokens) in (nn.Embedding, Int8Embedding)
                and all(type(layer) is DecoderLayer for layer in self.layers)):
            return None, "modules other than the model's own"
        if getattr(self.embed_tokens, "max_norm", None) is not None:
            return None, "embedding max_norm"

        def weight(m: nn.Module):
            w = m.weight
            return w if isinstance(w, torch.Tensor) else (w.qweight, w.scale)
        layers = [(layer.attn_norm.weight, layer.mlp_norm.weight, weight(layer.wqkv), layer.wqkv.bias,
                   weight(layer.wo), weight(layer.w13), weight(layer.w2),
                   *((layer.q_norm.weight, layer.k_norm.weight) if layer.q_norm is not None else ()))
                  for layer in self.layers]
        eps = {m.eps for m in self.modules() if isinstance(m, RMSNorm)}
        if len(eps) != 1:
            return None, "RMSNorm eps differ"
        dims = dict(num_layers=c.num_layers, hidden=c.hidden_size, heads=c.num_heads, kv_heads=c.num_kv_heads,
                    head_dim=c.head_dim, inter=c.intermediate_size, vocab=c.vocab_size, eps=eps.pop(), scale=scale)
        return bind(dims, weight(self.embed_tokens), layers, self.norm.weight, self.rope.cos, self.rope.sin,
                    pool_k, pool_v, silu=silu, selection=selection, w8a8=self.ops.decode == "int8")

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load runtime-layout tensors (see engine_dir.WEIGHT_LAYOUT); strict on names and shapes.
        The parameters take the tensors' device (load them where the model runs)."""
        self.load_state_dict(tensors, strict=True, assign=True)
        self.weights_version += 1          # new tensors: a fused decoder bound to the old ones re-binds
        self.bind_kernels()

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
               max_positions: int | None = None) -> "LlamaModel":
        """A model with small random weights, for unit tests and GPU timing in a real shape."""
        g = torch.Generator().manual_seed(seed)
        m = cls(cfg, dtype=dtype, max_positions=max_positions)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
        m.bind_kernels()                   # the packed copies of the weights as they are now
        return m


def random_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype,
                   device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """The runtime-layout tensors of a random model (engine_dir RANDOM_INITS "normal_fan_in":
    weights ~ N(0, 1/fan_in), norms ~ 1 + 0.1 N(0, 1), biases ~ N(0, 1/fan_in)), made one at a time
    directly on `device` in `dtype`: nothing passes through host memory on a GPU. The values are a
    function of (cfg, seed, dtype, device type): CPU and CUDA generators differ."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, shape in expected_shapes(cfg).items():
        t = torch.randn(shape, generator=g, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.mul_(0.1).add_(1.0)
        else:
            t.mul_(1.0 / math.sqrt(shape[-1] if len(shape) > 1 else cfg.hidden_size))
        yield name, t


def load_model(manifest: Manifest, device: str | torch.device = "cpu", ops: Ops | None = None,
               dtype: torch.dtype | None = None, max_positions: int | None = None) -> LlamaModel:
    """The model of an engine dir (`load_manifest` has checked it), on `device`, in eval mode
    without gradients: weights.safetensors read straight to `device`, or the `random_weights`
    recipe generated there. max_positions: its RoPE tables' (the engine's max_model_len; None:
    engine.yaml's)."""
    from safetensors.torch import load_file

    dtype = dtype or getattr(torch, manifest.dtype)
    quantized = (manifest.quantization or {}).get("quantized", ())
    model = LlamaModel(manifest.model, dtype=dtype, device=device, empty=True, ops=ops, quantized=quantized,
                       max_positions=max_positions or manifest.lookahead.max_model_len)
    if manifest.random_weights is not None:
        model.load_weights(dict(random_weights(manifest.model, int(manifest.random_weights["seed"]), dtype, device)))
    else:
        model.load_weights(load_file(str(Path(manifest.path) / WEIGHTS), device=str(device)))
    return model.eval().requires_grad_(False)
