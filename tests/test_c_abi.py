"""The C ABI of the CPU kernels (plugins/cpu/lkv_abi.h, abi.c, abi.py, loader.py; issue 42 items 2, 4):

- the descriptor each built library exports (lkv_abi_describe) equals the ctypes mirror: every
  struct's size and alignment, every field's offset and size, the storage codes, the return codes
  and the limits; the wrappers' constants are the mirror's;
- a wrong mirror (a field's type or presence changed, a limit changed) raises abi.AbiMismatch
  naming the struct and field when the loader opens the library, and nothing is loaded;
- each return code maps to its typed exception, whose message says what failed; the kernels'
  wrappers raise them (not MemoryError for every code);
- decode's W8A8 projections report their failures (a scratch too small, a CPU without VNNI)
  instead of leaving the logits unwritten; the AVX-512 entries check the CPU (quantize_rows
  included) and the int32 accumulation bound;
- the split build: the base library holds no AVX-512 code, and a compiler that fails on the
  AVX-512 library loses only it (a WARNING with the compiler's message), the base kernels load.
"""
from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from builder.quantize import DEFAULT_GROUP_SIZE, quantize_weights
from plugins import cpu
from plugins.cpu import abi, bookkeeping, fused, loader, ops, prefill
from runtime.config import LookaheadConfig, ModelConfig
from runtime.engine import Engine
from runtime.engine_dir import TOKENIZER_DIR, WEIGHTS, write_manifest
from runtime.model import LlamaModel
from tiny_engine import TINY, byte_tokenizer

pytestmark = [pytest.mark.skipif(not cpu.available(), reason=f"plugins.cpu: {loader.unavailable_reason()}"),
              pytest.mark.usefixtures("one_thread")]

NO_VNNI = pytest.mark.skipif(prefill.int8_dot_products(), reason="this CPU has AVX512_VNNI: nothing to refuse")
VNNI = pytest.mark.skipif(not prefill.int8_dot_products(), reason="this CPU has no AVX512_VNNI")


@pytest.fixture
def fresh_loader():
    """The loader as in a new process (nothing loaded yet); its state put back afterwards."""
    saved = dict(loader._state)
    loader._state.clear()
    yield loader
    loader._state.clear()
    loader._state.update(saved)


def libraries() -> dict[str, ctypes.CDLL]:
    return {"base": loader.library(), "avx512": loader.avx512_library()}


# ---- the descriptor and the mirror ----------------------------------------------------------------

@pytest.mark.parametrize("which", ["base", "avx512"])
def test_the_descriptor_matches_the_mirror(which):
    lib = libraries()[which]
    if lib is None:
        pytest.skip(f"the {which} library did not build: {loader.avx512_unavailable_reason()}")
    described = abi.describe(lib)
    assert described == abi.mirror()
    abi.verify(lib, which)                                          # what the loader ran
    # every struct the wrappers fill, every field of each
    for name, cls in abi.STRUCTS.items():
        assert described[f"struct:{name}"] == (ctypes.sizeof(cls), ctypes.alignment(cls))
        assert {k.split(".", 1)[1] for k in described if k.startswith(f"field:{name}.")} == \
            {f for f, *_ in cls._fields_}
    assert {k for k in described if k.startswith("code:")} == {f"code:{s.c_name}" for s in abi.Status}
    # the wrappers' constants are the mirror's
    assert ops.KV_DTYPES == {torch.float32: described["storage:LKV_KV_F32"][0],
                             torch.float16: described["storage:LKV_KV_F16"][0],
                             torch.bfloat16: described["storage:LKV_KV_BF16"][0]}
    assert (ops.MAX_EXTRA_KEYS, ops.MAX_GROUP_ROWS, fused.MAX_KV_ROW) == (
        described["limit:LKV_MAX_EXTRA_KEYS"][0], described["limit:LKV_MAX_GROUP_ROWS"][0],
        described["limit:LKV_MAX_KV_ROW"][0])
    assert fused.MAX_ROWS <= described["limit:LKV_MAX_ROWS"][0]
    # the int32 bound: G products of |q + 128| <= 255 and |w| <= 128 per W8A8 group sum
    g = described["limit:LKV_W8A8_MAX_GROUP"][0]
    assert g * 255 * 128 <= 2 ** 31 - 1 < (g + 1) * 255 * 128


def _replaced(cls: type[ctypes.Structure], field: str, new: tuple | None) -> type[ctypes.Structure]:
    """`cls` with `field` retyped (new: (name, type)) or dropped (None)."""
    fields = [(new if new is not None else None) if f[0] == field else f for f in cls._fields_]
    return type(cls.__name__, (ctypes.Structure,), {"_fields_": [f for f in fields if f is not None]})


@pytest.mark.parametrize("struct, field, new", [
    ("LkvLinear", "int8", ("int8", ctypes.c_int32)),                # a field's type (size, then offsets)
    ("LkvWork", "xq_len", None),                                     # a field the mirror lacks
    ("LkvLayerCall", "scale", ("scale", ctypes.c_double)),
])
def test_a_wrong_mirror_raises_at_load(fresh_loader, monkeypatch, struct, field, new):
    monkeypatch.setitem(abi.STRUCTS, struct, _replaced(abi.STRUCTS[struct], field, new))
    with pytest.raises(abi.AbiMismatch) as err:
        loader.library()
    assert (err.value.struct, err.value.field, err.value.library) == (struct, field, "base")
    assert f"{struct}.{field}" in str(err.value)
    assert "lib" not in loader._state                # nothing loaded: never a silent fallback to torch
    with pytest.raises(abi.AbiMismatch):
        loader.library()                             # and every later ask says so again


def test_a_wrong_constant_raises_at_load(fresh_loader, monkeypatch):
    monkeypatch.setitem(abi.LIMITS, "LKV_W8A8_MAX_GROUP", 1 << 20)
    with pytest.raises(abi.AbiMismatch, match="LKV_W8A8_MAX_GROUP") as err:
        loader.avx512_library()
    assert (err.value.struct, err.value.field) == ("limit", "LKV_W8A8_MAX_GROUP")
    monkeypatch.setitem(abi.LIMITS, "LKV_W8A8_MAX_GROUP", abi.W8A8_MAX_GROUP)
    monkeypatch.setitem(abi.STORAGE, "LKV_KV_BF16", 3)
    with pytest.raises(abi.AbiMismatch, match="LKV_KV_BF16"):
        loader.library()


# ---- return codes ------------------------------------------------------------------------------------

EXPECTED = {
    abi.Status.NOMEM: (abi.KernelOutOfMemory, MemoryError, "out of memory"),
    abi.Status.ARG: (abi.KernelArgumentError, ValueError, "refused its arguments"),
    abi.Status.DECLINED: (abi.KernelDeclined, abi.KernelError, "declined"),
    abi.Status.ISA: (abi.UnsupportedISA, abi.KernelError, "lacks the instructions"),
    abi.Status.RANGE: (abi.KernelIndexError, IndexError, "out of range"),
    abi.Status.SCRATCH: (abi.ScratchTooSmall, abi.KernelError, "scratch"),
    abi.Status.LIMIT: (abi.KernelLimitError, ValueError, "above the kernel's limit"),
}


@pytest.mark.parametrize("status", [s for s in abi.Status if s != abi.Status.OK], ids=lambda s: s.c_name)
def test_each_return_code_maps_to_its_typed_error(status):
    cls, builtin, words = EXPECTED[status]
    err = abi.error(int(status), "the kernel under test", "what it was given")
    assert type(err) is cls and isinstance(err, builtin) and isinstance(err, abi.KernelError)
    assert err.code == status and err.kernel == "the kernel under test"
    msg = str(err)
    assert msg.startswith("the kernel under test (CPU kernel): ") and words in msg and status.c_name in msg
    assert msg.endswith(": what it was given")
    with pytest.raises(cls, match="the kernel under test"):
        abi.raise_for(int(status), "the kernel under test")


def test_every_code_has_its_own_error_and_unknown_codes_are_named():
    assert len({type(abi.error(int(s), "k")) for s in abi.Status if s != abi.Status.OK}) == len(abi.Status) - 1
    err = abi.error(-99, "k")
    assert type(err) is abi.KernelError and err.code == -99 and "unknown return code -99" in str(err)
    with pytest.raises(ValueError, match="not an error"):
        abi.error(0, "k")


def test_wrappers_raise_the_typed_errors():
    """Codes from the kernels themselves, through their wrappers: block_topk's refused k, an
    out-of-range copy, an unknown storage code."""
    q, kmin = torch.randn(1, 1, 2, 16), torch.randn(1, 4, 2, 16)
    with pytest.raises(abi.KernelArgumentError, match=r"block_topk \(CPU kernel\).*k must be in \[1, NB=4\], got 5"):
        ops.block_topk(q, kmin, kmin + 1, torch.ones(1, 1, 4, dtype=torch.bool), 5, "max")
    src, dst = torch.zeros(4, 2, 4, 16), torch.zeros(1, 2, 3, 4, 16)
    idx = lambda *xs: torch.tensor(xs)                               # noqa: E731
    with pytest.raises(abi.KernelIndexError, match=r"copy_blocks \(CPU kernel\): an index was out of range"):
        bookkeeping.copy_blocks(src, src, dst, dst, (idx(9), idx(0)), (idx(0), idx(0), idx(0)))
    keys = torch.zeros(2, 2, 16)
    rc = loader.library().lkv_update_summaries(kmin.data_ptr(), kmin.data_ptr(), keys.data_ptr(),
                                               torch.zeros(2, dtype=torch.long).data_ptr(),
                                               torch.zeros(2, dtype=torch.long).data_ptr(), 2, 2, 16, 4, 7, 0, 1)
    assert rc == abi.Status.ARG


# ---- ISA and limits ----------------------------------------------------------------------------------

@NO_VNNI
def test_the_avx512_entries_check_the_cpu():
    """On a CPU without AVX-512 BF16 / VNNI every entry that would run it returns LKV_ERR_ISA (or no
    tiles: nothing executed, no SIGILL), quantize_rows included, and its wrapper raises UnsupportedISA."""
    lib = loader.avx512_library()
    x = torch.randn(2, 64)
    y = torch.empty(2, 32)
    xq, sx = torch.empty(2 * 16, dtype=torch.int32), torch.empty(2)
    wq, wsc, wsum = torch.zeros(16 * 32, dtype=torch.int32), torch.zeros(32), torch.zeros(32, dtype=torch.int32)
    p = lambda t: t.data_ptr()                                       # noqa: E731
    assert lib.lkv_quantize_rows(p(x), 64, 2, 64, 64, p(xq), p(sx), 1) == abi.Status.ISA
    assert lib.lkv_gemm_w8a8(p(x), 64, 2, 64, 64, p(wq), p(wsc), p(wsum), 32, None, p(y), 32, 1) == abi.Status.ISA
    assert lib.lkv_gemm_w8a8_scratch(p(x), 64, 2, 64, 64, p(wq), p(wsc), p(wsum), 32, None, p(y), 32, 1,
                                     p(xq), p(sx)) == abi.Status.ISA
    if not prefill.bf16_dot_products():
        assert lib.lkv_gemm_bf16(p(x), 64, 2, 64, p(wq), 32, None, p(y), 32, 1) == abi.Status.ISA
        assert lib.lkv_prefill_bf16_tiles() is None                 # prefill attention's tiles: none to run
    with pytest.raises(abi.UnsupportedISA, match=r"quantize_rows \(CPU kernel\)"):
        prefill.quantize_rows(x, 64)


@VNNI
def test_w8a8_refuses_a_group_past_the_int32_bound():
    lib, G = loader.avx512_library(), abi.W8A8_MAX_GROUP + 3          # a multiple of 4
    x = torch.zeros(1, G)
    xq, sx = torch.empty(G // 4, dtype=torch.int32), torch.empty(1)
    assert lib.lkv_quantize_rows(x.data_ptr(), G, 1, G, G, xq.data_ptr(), sx.data_ptr(), 1) == abi.Status.LIMIT


def test_w8a8_supported_checks_the_int32_bound(monkeypatch):
    """The Python side asks the same bound before taking the kernel (whatever this CPU has)."""
    monkeypatch.setattr(prefill, "int8_dot_products", lambda: True)
    K = abi.W8A8_MAX_GROUP + 3                                                # a multiple of 4
    per_channel = (torch.zeros(4, K, dtype=torch.int8), torch.ones(4))        # G = K: past the bound
    grouped = (torch.zeros(4, K, dtype=torch.int8), torch.ones(4, K // 4))    # G = 4
    assert not prefill.w8a8_supported(torch.zeros(1, K), *per_channel)
    assert prefill.w8a8_supported(torch.zeros(1, K), *grouped)


# ---- decode's W8A8 projections -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def int8_engine_dir(tmp_path_factory) -> Path:
    """A tiny random engine with int8 projections grouped by 64 (the W8A8 layout), head_dim 32."""
    path = tmp_path_factory.mktemp("cabi") / "int8"
    cfg = ModelConfig(**{**TINY, "head_dim": 32})
    qstate, section = quantize_weights(dict(LlamaModel.random(cfg, seed=3).state_dict()), cfg,
                                       group_size=DEFAULT_GROUP_SIZE)
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in qstate.items()}, str(path / WEIGHTS))
    (path / TOKENIZER_DIR).mkdir()
    byte_tokenizer().save(str(path / TOKENIZER_DIR / "tokenizer.json"))
    write_manifest(path, name="tiny-int8", model=cfg, dtype="float32", lookahead=LookaheadConfig(),
                   source={"kind": "random", "seed": 3}, versions={}, quantization=section)
    return path


def _w8a8_decoder(path: Path):
    """An engine's fused decoder, and one bound to the same tensors with the W8A8 projections
    (what decode precision int8 binds; built here whatever the CPU, to reach decode.c's path)."""
    eng = Engine.from_dir(path, block_size=4)
    dec = eng.runner.fused
    assert dec is not None, eng.runner.fused_reason
    return eng, fused.FusedDecoder(dec.dims, *dec._src, w8a8=True)


def _step():
    t = lambda *xs: torch.tensor(xs, dtype=torch.long)               # noqa: E731
    return t(5), t(9), t(2), t(1), [0], [10]             # one row: token 5 at position 9, its run from block 0


def test_decode_reports_a_short_w8a8_scratch(int8_engine_dir, monkeypatch):
    """The W8A8 scratch is the work struct's (sized by fused.py, allocated once): a size too small
    (forced here through the sizing hook) is reported by the step, not written past or ignored."""
    monkeypatch.setattr(fused.FusedDecoder, "_w8a8_scratch_sizes", staticmethod(lambda layers: (0, 0)))
    eng, dec = _w8a8_decoder(int8_engine_dir)
    assert dec._w8a8_scratch[0].numel() == 0
    with torch.inference_mode():
        with pytest.raises(abi.ScratchTooSmall, match=r"the fused decode step \(CPU kernel\)"):
            dec.run(*_step())
        with pytest.raises(abi.ScratchTooSmall, match="fused decode layers"):
            dec.run_layers(_step()[0], _step()[1], lambda layer, q, k, v: torch.zeros_like(q))
    assert dec.steps == 0


def test_decode_sizes_its_w8a8_scratch_once(int8_engine_dir):
    eng, dec = _w8a8_decoder(int8_engine_dir)
    xq, sx = dec._w8a8_scratch
    d = dec.dims
    k_max = max(d.hidden, d.heads * d.head_dim, d.inter)            # the widest projection input
    assert xq.numel() == fused.MAX_ROWS * k_max // 4 and sx.numel() == fused.MAX_ROWS * k_max // 64
    assert dec._model.w8a8 == ctypes.cast(loader.avx512_library().lkv_gemm_w8a8_scratch, ctypes.c_void_p).value
    plain = eng.runner.fused
    assert plain._w8a8_scratch[0].numel() == 0 and plain._model.w8a8 is None


@NO_VNNI
def test_decode_reports_a_cpu_without_vnni(int8_engine_dir):
    """Bound to the W8A8 projections on a CPU without VNNI (bind() itself never does this), the
    step raises UnsupportedISA instead of returning logits the GEMM never wrote."""
    _, dec = _w8a8_decoder(int8_engine_dir)
    with torch.inference_mode(), pytest.raises(abi.UnsupportedISA, match="fused decode step"):
        dec.run(*_step())


# ---- the split build ---------------------------------------------------------------------------------

def test_the_libraries_are_built_apart():
    base, wide = loader.library(), loader.avx512_library()
    assert {p.name for p in loader.BASE.sources} & {"gemm.c"} == set()
    assert not hasattr(base, "lkv_gemm_bf16") and not hasattr(base, "lkv_prefill_bf16_tiles")
    if wide is not None:
        assert hasattr(wide, "lkv_gemm_w8a8") and hasattr(wide, "lkv_prefill_bf16_tiles")
        assert not hasattr(wide, "lkv_decode") and not hasattr(wide, "lkv_prefill_attention")
    if shutil.which("objdump"):             # the base library runs on any AVX2 CPU: no 512-bit register in it
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", base._name], capture_output=True, text=True,
                             check=True).stdout
        assert "zmm" not in asm


def test_a_failed_avx512_compile_keeps_the_base_kernels(fresh_loader, monkeypatch, caplog):
    """A compiler that fails on the AVX-512 library (mocked: its compile raises with the
    compiler's message) loses only it: a WARNING carrying that message, the base kernels load and
    run, the prefill GEMMs report no units and prefill attention takes its AVX2 path."""
    real = loader.build_library
    message = "cc1: error: unrecognized argument in option '-mavx512bf16'"

    def build(spec, cc):
        if spec is loader.AVX512:
            raise loader.CompileError(f"{cc} failed on the avx512 library: {message}")
        return real(spec, cc)

    monkeypatch.setattr(loader, "build_library", build)
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        base = loader.library()
    assert base is not None and loader.unavailable_reason() is None
    assert loader.avx512_library() is None and message in loader.avx512_unavailable_reason()
    warnings = [r for r in caplog.records if r.name == loader.__name__ and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and message in warnings[0].getMessage() and "AVX-512" in warnings[0].getMessage()
    assert not prefill.bf16_dot_products() and not prefill.int8_dot_products()
    # the base kernels run: an RMSNorm, and prefill attention (its AVX2 path) against its torch formulation
    x, w = torch.randn(3, 64), torch.randn(64)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (64,), w, 1e-6))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 32, generator=g)
    k, v = torch.randn(2, 3, 4, 32, generator=g), torch.randn(2, 3, 4, 32, generator=g)
    out = prefill.prefill_attention(q, k, v, [2, 0], 7, 32 ** -0.5)
    assert out is not None
    ref = prefill.prefill_attention_torch(q, k, v, [2, 0], 7, 32 ** -0.5)
    assert (out - ref).abs().max() <= 2e-2 * v.abs().max()


def test_a_failed_base_compile_is_a_warning_too(fresh_loader, monkeypatch, caplog):
    def build(spec, cc):
        raise loader.CompileError(f"{cc} failed on the {spec.name} library: boom")

    monkeypatch.setattr(loader, "build_library", build)
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        assert loader.library() is None and loader.avx512_library() is None
    assert "boom" in loader.unavailable_reason()
    assert sum(r.levelno == logging.WARNING for r in caplog.records if r.name == loader.__name__) == 2
