"""Each architecture and RoPE scaling the runtime runs equals transformers on every path (issue 40
item 2): a tiny random Hugging Face checkpoint (tests/builder_fixtures.py) is built into an engine
dir by the builder (which checks its own prompts against transformers on the torch layers), and an
engine then decodes a 70-token prompt greedily. Its logits, the prompt's last (prefill) and every
decode step's, and its tokens are compared with transformers' greedy extension of the same prompt
(builder.verify's reference): within LOGIT_TOL of the largest logit, the same tokens, in dense mode
and in lookahead mode with K covering every block, on the torch kernel table and on the C one
(whose decode steps run the fused C step, or layers, which must then have run).

The cases: llama and qwen2 with YaRN (qwen2 with every YaRN field set), qwen3 (q/k RMSNorm per
head; head_dim 32 with hidden 64 and 4 heads: q is wider than the residual stream) untied, and tied
with YaRN and an explicit attention factor. The prompt runs past YaRN's original context (64), where
its interpolated frequencies matter. A prefill at bfloat16 (the prefill kernels' precision; their
torch formulation where the CPU lacks the units) is checked on the prompt's logits alone.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from builder import BuildConfig, build
from builder.verify import _load_reference, _reference_greedy
from plugins import cpu
from runtime.engine import Engine
from runtime.internals import Internals
from runtime.observe import Observer
from runtime.sampling import SamplingParams
from tiny_engine import SMALL_LOOKAHEAD, random_prompts

from builder_fixtures import write_checkpoint

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
CASES = {
    "llama-yarn": ("llama", dict(head_dim=32, rope_parameters=YARN)),
    "qwen2-yarn-every-field": ("qwen2", dict(head_dim=32, rope_parameters=dict(
        YARN, beta_fast=16.0, beta_slow=2.0, truncate=False, mscale=0.9, mscale_all_dim=0.7))),
    "qwen3": ("qwen3", dict(head_dim=32)),
    "qwen3-tied-yarn": ("qwen3", dict(head_dim=32, tie_word_embeddings=True,
                                      rope_parameters=dict(YARN, attention_factor=1.3))),
}
PROMPT_LEN, DECODE = 70, 8
LOGIT_TOL = 1e-4           # x the largest |logit|: fp32 reassociation only (builder/verify.py: 1e-3)
BF16_TOL = 0.05            # bf16 products, fp32 sums: ~4e-3 relative per product (verify.py's bf16: 0.15)
MODES = {"dense": dict(mode="dense"), "lookahead": dict(SMALL_LOOKAHEAD, top_k=64)}   # K >= every block of 78 tokens


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor, torch.Tensor]]:
    """Per case: (engine dir, transformers' greedy sequence [T + DECODE], its logits [T + DECODE, V])."""
    root, out = tmp_path_factory.mktemp("arch"), {}
    prompt = torch.tensor(random_prompts(PROMPT_LEN, seed=3, vocab=128)[0])
    for name, (arch, overrides) in CASES.items():
        src = write_checkpoint(root / f"src-{name}", arch, seed=len(out) + 11, **overrides)
        result = build(BuildConfig(model=str(src), output=root / name), log=lambda line: None)
        assert result.report["verification"]["passed"]
        seq, logits = _reference_greedy(_load_reference(src), prompt, DECODE)
        out[name] = (root / name, seq, logits)
    return out


pytestmark = pytest.mark.usefixtures("one_thread")


class Emitted(Observer):
    """The logits of every emitted row, in order (one sequence)."""

    def __init__(self):
        self.logits: list[torch.Tensor] = []

    def on_step_end(self, logits):
        self.logits += [v.clone() for v in logits.values()]


def decode(engine_dir: Path, prompt: list[int], max_tokens: int, impl: str = "auto",
           **kw) -> tuple[list[int], torch.Tensor, Engine]:
    eng = Engine.from_dir(engine_dir, internals=Internals(impl=impl), **kw)
    rec = eng.observe(Emitted())
    tokens = eng.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids
    return tokens, torch.stack(rec.logits), eng


@pytest.mark.parametrize("impl", ["torch", "c"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_equal_transformers(built, case, mode, impl):
    if impl == "c" and not cpu.available():
        pytest.skip("no CPU kernels")
    path, seq, ref = built[case]
    ours_tokens, ours, eng = decode(path, seq[:PROMPT_LEN].tolist(), DECODE + 1, impl=impl,
                                    prefill_precision="float32", **MODES[mode])
    ref = ref[PROMPT_LEN - 1:]                                   # the prompt's last position on
    assert ours_tokens == seq[PROMPT_LEN:].tolist() + [int(ref[-1].argmax())]
    scale = ref.abs().max().item()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=0, atol=LOGIT_TOL * scale)
    if impl == "c":                         # the decode steps ran in C (the fused step, or layers)
        assert eng.runner.fused is not None and eng.runner.fused.steps >= DECODE, eng.runner.fused_reason


@pytest.mark.parametrize("impl", ["torch", "c"])
@pytest.mark.parametrize("case", ["qwen3", "qwen3-tied-yarn"])
def test_bf16_prefill_is_close_to_transformers(built, case, impl):
    if impl == "c" and not cpu.available():
        pytest.skip("no CPU kernels")
    path, seq, ref = built[case]
    # the build verified what its host resolves; bf16 is held to transformers here instead
    _, ours, eng = decode(path, seq[:PROMPT_LEN].tolist(), 1, impl=impl, prefill_precision="bfloat16",
                          allow_unverified_precision=True)
    assert eng.ops.prefill == "bfloat16" and eng.ops.prefill_linear is not None
    scale = ref[PROMPT_LEN - 1].abs().max().item()
    torch.testing.assert_close(ours[0], ref[PROMPT_LEN - 1], rtol=0, atol=BF16_TOL * scale)
