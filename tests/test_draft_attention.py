"""What a lookahead step's draft row attends (runtime/lookahead/attention.py `resolve_draft_attention`).

"own" (a CPU engine's default): the draft row attends its lane's sink and window blocks and its own
top-K, read from the host pool, plus the step's rows its extra-mask row shows, so that when the
draft token is right it computes the next step's real row ahead. "tier" (a GPU's): the device tier
the real row attends. Checked on fresh random tiny models:
- the torch layer's "own" draft rows equal a plain softmax over exactly those keys, recomputed
  here from the host pool (fp32 and fp16 KV, 1 and 3 sequences);
- the C layer equals the torch layer bit for bit under "tier" as well (the existing comparisons in
  test_fused_lookahead.py run "own");
- the choice changes only what the draft row computes: under resident/urgent (the real row
  attends exactly its top-K) the real tokens are the same, the predictions are not;
- the default by device, the knob's refusal of an unknown value, and `describe()`.
"""
from __future__ import annotations

import pytest
import torch

from plugins import cpu
from runtime.engine import Engine
from runtime.internals import Internals
from runtime.lookahead.attention import LookaheadAttention, lane_rows, resolve_draft_attention
from test_fused_lookahead import GREEDY, MODES, check_equal, dirs, run  # noqa: F401  (dirs: the fixture)
from tiny_engine import SMALL_LOOKAHEAD, random_prompts

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no CPU kernels")


def lookahead(d, fused: bool = True, draft_attention: str | None = None, **kw) -> Engine:
    kw = {**SMALL_LOOKAHEAD, "top_k": 4, "max_batch_size": 4, **kw}
    kw.pop("mode")
    return Engine.from_dir(d, mode="lookahead", internals=Internals(fused=fused, draft_attention=draft_attention),
                           **kw)


def reference_draft_rows(attn: LookaheadAttention, layer: int, idx, qd, k, v, d, k_sel: int) -> torch.Tensor:
    """[n, H, D]: each decoding lane's draft row as a plain softmax over its sink and window blocks
    and its own top-K (a set: order does not matter here), the first c - 1 tokens of the host pool,
    plus the step's real and draft rows as its extra-mask row shows; fp64."""
    pool, bs = attn.pool, attn.layout.block_size
    kvh, H, D = attn.kvh, qd.shape[2], qd.shape[3]
    group = H // kvh
    k_rows, v_rows = lane_rows(k, d), lane_rows(v, d)             # [n, 2, KVH, D]
    out = torch.zeros(d.num_lanes, H, D, dtype=torch.float64)
    for i in range(d.num_lanes):
        if not bool(d.lane_active[i]):
            continue
        stored = int(d.draft_stored[i])
        c = d.context_lens[d.lane_list.index(i)]
        assert stored == c - 1
        for h in range(kvh):
            fixed = [b for b in d.draft_fixed[i].tolist() if b >= 0]
            own = [b for b in idx[i, 1, h, :k_sel].tolist() if b >= 0]
            assert not set(fixed) & set(own)            # the candidates exclude sink and window
            logical = sorted(set(fixed) | set(own))
            host = attn.residency.lane_blocks[i, logical]
            keys = pool.k[layer, h, host].reshape(-1, D).double()
            vals = pool.v[layer, h, host].reshape(-1, D).double()
            pos = (torch.tensor(logical)[:, None] * bs + torch.arange(bs)).reshape(-1)
            keys, vals = keys[pos < stored], vals[pos < stored]
            seen = d.extra_mask[i, 1]
            keys = torch.cat([keys, k_rows[i, :, h][seen].double()])
            vals = torch.cat([vals, v_rows[i, :, h][seen].double()])
            q = qd[i, 1, h * group:(h + 1) * group].double()
            w = torch.softmax(q @ keys.T * attn.scale, dim=-1)
            out[i, h * group:(h + 1) * group] = w @ vals
    return out


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_own_draft_rows_are_a_softmax_over_their_own_blocks(dirs, monkeypatch, kv_dtype, batch):
    torch.set_num_threads(1)
    seen = []
    orig = LookaheadAttention._attend_own

    def tap(self, layer, o, idx, qd, k, v, d, k_sel):
        orig(self, layer, o, idx, qd, k, v, d, k_sel)
        seen.append((o[:, 1].double(), reference_draft_rows(self, layer, idx, qd, k, v, d, k_sel), d.lane_active))

    monkeypatch.setattr(LookaheadAttention, "_attend_own", tap)
    eng = lookahead(dirs["fp32"], fused=False, kv_dtype=kv_dtype, **MODES["resident-urgent"])
    assert eng.runner.attn.draft_attention == "own"
    eng.generate(random_prompts(*([90] if batch == 1 else [90, 23, 61]), seed=batch + 5), GREEDY)
    assert len(seen) >= 5 * len(eng.model.layers)
    for got, want, active in seen:
        torch.testing.assert_close(got[active], want[active], rtol=0, atol=2e-5)


def test_a_wrong_block_in_the_own_set_is_caught(dirs, monkeypatch):
    """The reference can fail: a draft row attending one block fewer than its own set differs."""
    torch.set_num_threads(1)
    diffs = []
    orig = LookaheadAttention._attend_own

    def tap(self, layer, o, idx, qd, k, v, d, k_sel):
        orig(self, layer, o, idx, qd, k, v, d, k_sel)
        fewer = idx.clone()
        fewer[:, 1, :, 0] = -1                          # each head's first own block left out
        want = reference_draft_rows(self, layer, fewer, qd, k, v, d, k_sel)
        diffs.append(float((o[:, 1].double() - want)[d.lane_active].abs().max()))

    monkeypatch.setattr(LookaheadAttention, "_attend_own", tap)
    eng = lookahead(dirs["fp32"], fused=False, **MODES["resident-urgent"])
    eng.generate(random_prompts(120, seed=3), GREEDY)
    assert max(diffs) > 1e-3


@pytest.mark.parametrize("mode", ["resident-urgent", "resident-drop"])
def test_c_layer_equals_torch_layer_under_tier(dirs, mode):
    torch.set_num_threads(1)
    prompts = random_prompts(70, 23, 51, seed=4)
    kw = dict(kv_dtype="float16", **MODES[mode])
    ref_eng = lookahead(dirs["int8"], False, "tier", **kw)
    ref_tokens, ref = run(ref_eng, prompts)
    eng = lookahead(dirs["int8"], True, "tier", **kw)
    tokens, got = run(eng, prompts)
    assert eng.runner.attn.draft_attention == ref_eng.runner.attn.draft_attention == "tier"
    check_equal(eng, ref_eng, got, ref, tokens, ref_tokens)


def test_the_choice_changes_only_the_prediction(dirs):
    """resident/urgent: the real row attends exactly its top-K whatever was predicted, so the real
    tokens are the same under both; what the draft row attends changes its prediction."""
    torch.set_num_threads(1)
    prompts = random_prompts(150, 60, seed=9)
    out, preds = {}, {}
    for choice in ("own", "tier"):
        eng = lookahead(dirs["fp32"], True, choice, top_k=3, **MODES["resident-urgent"])
        assert eng.runner.attn.c_layer is not None
        out[choice] = [c.token_ids for c in eng.generate(prompts, GREEDY)]
        preds[choice] = eng.runner.attn.residency.pred.clone()
        assert eng.describe()["draft_attention"].startswith(choice + ": chosen")
    assert out["own"] == out["tier"]
    assert not torch.equal(preds["own"], preds["tier"])


def test_the_default_is_by_device(dirs):
    eng = lookahead(dirs["fp32"])
    assert eng.runner.attn.draft_attention == "own"
    assert eng.describe()["draft_attention"].startswith("own: the host pool is in cpu memory")
    pool = eng.runner.attn.pool
    meta = type("Pool", (), {"k": torch.empty(1, device="meta")})()
    assert resolve_draft_attention(None, meta, torch.device("cpu"))[0] == "tier"
    assert resolve_draft_attention(None, pool, torch.device("cpu"))[0] == "own"
    with pytest.raises(ValueError, match="draft_attention"):
        resolve_draft_attention("dense", pool, torch.device("cpu"))
    none = lookahead(dirs["fp32"], **MODES["sparse-ondemand"])
    assert none.describe()["draft_attention"] == "no draft row"
    with pytest.raises(TypeError, match="internals"):
        Engine.from_dir(dirs["fp32"], mode="lookahead", draft_attention="tier")
