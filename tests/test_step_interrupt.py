"""A prompt-only step stops between layers once every request in it is aborted (`Engine.step`,
`runtime/step.py`'s `Interruptible`), and leaves the engine exactly as an abort at a step's end.

Each test aborts from inside the forward (a pre-hook on a decoder layer plays the other thread or
the client) and counts the layers that ran; afterwards the same prompt, through the same engine
(its prefix cache holding what the interrupted request had named), must give a fresh engine's
tokens, and every KV block is free again.
"""
from __future__ import annotations

import pytest

import runtime.engine as engine_mod
from runtime.engine import Engine
from runtime.sampling import SamplingParams
from tiny_engine import SMALL_LOOKAHEAD, make_tiny_engine, random_prompts

LAYERS = 4
CHUNK = 16
MODES = {"dense": {}, "sparse": dict(mode="sparse", block_size=4, top_k=4, recent_window=8, num_sink_blocks=1),
         "lookahead": dict(SMALL_LOOKAHEAD, top_k=4)}
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("tiny4"), seed=4, num_layers=LAYERS)


class Layers:
    """Counts the decoder layers entered; `at(layer, step, fn)` calls fn when `layer` is entered
    during the engine's `step`-th prompt step (0-based) of the watched request."""

    def __init__(self, engine: Engine):
        self.entered: list[int] = []
        self.steps = 0
        self.trigger = None
        self.hooks = [layer.register_forward_pre_hook(self._hook(i)) for i, layer in enumerate(engine.model.layers)]

    def _hook(self, i: int):
        def pre(module, args):
            if i == 0:
                self.steps += 1
            self.entered.append(i)
            if self.trigger and self.trigger[0] == i and self.trigger[1] == self.steps - 1:
                self.trigger[2]()
        return pre

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def run_to_end(engine: Engine, **step_kw) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step(**step_kw)
    return outs


def fresh_tokens(tiny_dir, mode: str, ids: list[int]) -> list[int]:
    return Engine.from_dir(tiny_dir, prefill_chunk=CHUNK, **MODES[mode]).generate([ids], GREEDY)[0].token_ids


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("at_step", [0, 2])
def test_an_abort_from_another_thread_stops_the_prefill_step_at_the_next_layer(tiny_dir, mode, at_step):
    """abort() lands while layer 1 of the request's `at_step`-th prompt chunk runs: layers 2.. of
    that chunk never run, the request ends aborted with no token, the chunk is not counted, and
    the engine (its prefix cache included: at_step 2 has named two chunks' blocks) serves the same
    prompt as a fresh engine does."""
    ids = random_prompts(5 * CHUNK + 3, seed=at_step)[0]
    engine = Engine.from_dir(tiny_dir, prefill_chunk=CHUNK, **MODES[mode])
    free = engine.allocator.num_free
    layers = Layers(engine)
    rid = engine.add_request(ids, GREEDY)
    layers.trigger = (1, at_step, lambda: engine.abort(rid))
    outs = run_to_end(engine)
    layers.remove()
    assert layers.entered == [0, 1, 2, 3] * at_step + [0, 1], layers.entered
    assert [(o.finish_reason, o.new_token_ids) for o in outs if o.finished] == [("abort", [])]
    stats = engine.stats()
    assert stats["interrupted_steps"] == 1 and stats["prompt_tokens"] == at_step * CHUNK
    assert stats["aborted_requests"] == 1 and stats["output_tokens"] == 0
    assert engine.allocator.num_free == free
    again = engine.generate([ids], GREEDY)[0]
    assert again.token_ids == fresh_tokens(tiny_dir, mode, ids)
    assert engine.allocator.num_free == free


def test_the_interrupt_callback_is_asked_with_the_steps_request_ids(tiny_dir, monkeypatch):
    monkeypatch.setattr(engine_mod, "INTERRUPT_POLL_S", 0.0)
    engine = Engine.from_dir(tiny_dir, prefill_chunk=4 * CHUNK)
    a, b = (engine.add_request(p, GREEDY, request_id=r) for p, r in zip(random_prompts(40, 50, seed=3), "ab"))
    asked = []

    def interrupt(rids):
        asked.append(list(rids))
        return len(asked) == 3          # the third question, at layer 2 of the first step
    layers = Layers(engine)
    outs = engine.step(interrupt=interrupt)
    layers.remove()
    assert asked == [["a", "b"]] * 3 and layers.entered == [0, 1, 2]
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("a", "abort"), ("b", "abort")]
    assert not engine.has_unfinished() and engine.stats()["interrupted_steps"] == 1


def test_a_step_is_not_interrupted_while_one_of_its_requests_still_wants_it(tiny_dir):
    """Two prompts in one step, one aborted mid-step: the step runs to its end and the other
    request's tokens are a solo run's."""
    p, q = random_prompts(30, 40, seed=8)
    engine = Engine.from_dir(tiny_dir, prefill_chunk=4 * CHUNK)
    engine.add_request(p, GREEDY, request_id="stays")
    engine.add_request(q, GREEDY, request_id="goes")
    layers = Layers(engine)
    layers.trigger = (1, 0, lambda: engine.abort("goes"))
    outs = run_to_end(engine)
    layers.remove()
    assert layers.entered[:LAYERS] == list(range(LAYERS)) and engine.stats()["interrupted_steps"] == 0
    done = {o.request_id: o for o in outs if o.finished}
    assert done["goes"].finish_reason == "abort"
    assert [t for o in outs if o.request_id == "stays" for t in o.new_token_ids] == fresh_tokens(tiny_dir, "dense", p)


def test_a_step_with_decode_rows_is_never_interrupted(tiny_dir, monkeypatch):
    """A decode row is milliseconds: a step holding one runs whole, even when the callback says
    stop (only prompt-only steps ask it)."""
    monkeypatch.setattr(engine_mod, "INTERRUPT_POLL_S", 0.0)
    engine = Engine.from_dir(tiny_dir, prefill_chunk=CHUNK)
    engine.add_request(random_prompts(8, seed=1)[0], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()                                   # its prompt: it decodes from now on
    engine.add_request(random_prompts(3 * CHUNK, seed=2)[0], GREEDY)
    asked = []
    outs = engine.step(interrupt=lambda rids: asked.append(rids) or True)
    assert not asked and engine.stats()["interrupted_steps"] == 0 and len(outs) == 1
