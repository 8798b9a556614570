"""The dense runtime on the real default model (SmolLM2-135M-Instruct) against transformers.

Both sides get the same token ids (our tokenizer's), run in fp32 and decode greedily with EOS
ignored, so any difference is a numerics or cache bug, not a tokenizer or stopping rule.
The reference is the builder's cached fp32 Hugging Face dir that the engine was built from.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.engine import Engine
from runtime.engine_dir import load_manifest
from runtime.sampling import SamplingParams

pytestmark = pytest.mark.real_model

NEW_TOKENS = 32
PROMPTS = [
    "The three most important inventions of the nineteenth century were",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: Why is the sky blue during the day but red at sunset, and why do clouds look white or "
    "grey?\nAnswer:",
]
# A ~200-token document for the chunked-prefill check (chunks of 16 cross many block boundaries).
LONG_PROMPT = (
    "Harbor towns grew around trade. Ships brought grain, timber and salt; warehouses lined the quay, "
    "and the tide table decided the working day. When the railway arrived, the harbor lost much of its "
    "freight, but fishing boats, ferries and summer visitors kept the waterfront busy. The old customs "
    "house became a museum, the rope walk a row of small shops, and the lighthouse keeper's cottage a "
    "school for sailors. Every spring the town still holds a fair on the quay, with music, boat races "
    "and a market where farmers from the valley sell cheese, honey and apples. Visitors who stay for a "
    "week learn the rhythm of the place: early mornings at the fish auction, long afternoons on the "
    "breakwater, and evenings in the square, where the older residents tell stories about storms, "
    "shipwrecks and the winter the harbor froze. Asked what makes the town special, most of them say"
)


def reference_hf_dir(engine_dir: Path) -> Path:
    """The fp32 Hugging Face dir the engine was built from (the builder's cache for a GGUF source)."""
    source = load_manifest(engine_dir, verify_checksums=False).source
    if source["kind"] == "hf_dir":
        return Path(source["path"])
    from builder.gguf_cache import cached_hf_dir
    (name, sha256), = source["sha256"].items()
    return cached_hf_dir(Path(source["path"]), sha256, log=print)


@pytest.fixture(scope="module")
def hf_model(default_engine_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(reference_hf_dir(default_engine_dir),
                                                              dtype=torch.float32)
    return model.eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        # eos_token_id=None: no EOS stopping and no EOS suppression, like ignore_eos on our side
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def ours_alone(default_engine) -> dict[str, list[int]]:
    """Our greedy tokens for each prompt of PROMPTS, each run alone."""
    ids = [default_engine.tokenizer.encode(text) for text in PROMPTS]
    return {text: default_engine.generate([p], greedy(NEW_TOKENS))[0].token_ids for text, p in zip(PROMPTS, ids)}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def first_token_logits(engine: Engine, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Greedy tokens of `ids`, and the logits the first of them was sampled from."""
    seen: list[torch.Tensor] = []
    run = engine.runner.run

    def spy(work, **kw):
        logits = run(work, **kw)
        seen.extend(v.clone() for v in logits.values())
        return logits

    engine.runner.run = spy
    try:
        tokens = engine.generate([ids], greedy(4))[0].token_ids
    finally:
        del engine.runner.run
    return seen[0], tokens


def test_dense_greedy_equals_transformers(default_engine, hf_model, ours_alone):
    for text in PROMPTS:
        ids = default_engine.tokenizer.encode(text)
        ours = ours_alone[text]
        theirs = hf_greedy(hf_model, ids, NEW_TOKENS)
        assert len(theirs) == NEW_TOKENS
        assert ours == theirs, f"prompt {text[:40]!r}: first difference at token " \
                               f"{next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)}"


def test_first_token_logits_close_to_transformers(default_engine, hf_model):
    ids = default_engine.tokenizer.encode(LONG_PROMPT)
    ours, _ = first_token_logits(default_engine.sibling(prefill_precision="float32"), ids)
    with torch.inference_mode():
        theirs = hf_model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    # fp32 with a different summation order (fused qkv / gate-up): ~1e-5 relative to |logit| ~ 30
    assert (ours - theirs).abs().max().item() < 1e-3 * theirs.abs().max().item()


def test_chunked_prefill_equals_one_shot(default_engine_dir, default_engine):
    ids = default_engine.tokenizer.encode(LONG_PROMPT)
    assert 180 <= len(ids) <= 260
    chunked = Engine.from_dir(default_engine_dir, verify_checksums=False, prefill_chunk=16,
                              max_batch_size=1, max_model_len=512)
    logits_16, tokens_16 = first_token_logits(chunked, ids)
    logits_all, tokens_all = first_token_logits(default_engine, ids)   # prefill_chunk 512: one shot
    assert tokens_16 == tokens_all
    assert (logits_16 - logits_all).abs().max().item() < 1e-4


def test_batched_prompts_of_different_lengths_equal_alone(default_engine, ours_alone):
    prompts = [default_engine.tokenizer.encode(text) for text in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    together = default_engine.generate(prompts, greedy(NEW_TOKENS))
    assert [c.token_ids for c in together] == [ours_alone[text] for text in PROMPTS]
