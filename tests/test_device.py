"""The device is explicit: every tensor a step touches lives on the engine's device, read at the
seams (the ops object, the transfer engine, the step plan, the engine's own tensors). On CPU the
same checks run through the same code paths as on CUDA."""
from __future__ import annotations

import pytest
import torch

from gpu_skips import requires_cuda
from runtime.device import resolve_device
from runtime.engine import Engine
from runtime.errors import ConfigError
from runtime.observe import Observer
from runtime.ops import select_ops
from runtime.sampling import SamplingParams
from runtime.transfer import SyncTransferEngine
from runtime.internals import Internals
from tiny_engine import make_tiny_engine

LOOKAHEAD = dict(mode="lookahead", block_size=4, recent_window=8, num_sink_blocks=1, top_k=6)
MODES = {"dense": dict(block_size=4), "resident": dict(LOOKAHEAD, residency="resident"),
         "pingpong": dict(LOOKAHEAD, residency="pingpong")}
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("tiny_dev"), seed=5)


def tensors_in(value):
    """The tensors in an argument: itself, or those in a tuple/list."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_in(v)


class DeviceCheck:
    """Wraps every op so that each call asserts its tensor arguments are on `device`."""

    def __init__(self, device: torch.device):
        self.device, self.calls = device, {}

    def __call__(self, name, fn):
        def checked(*args, **kwargs):
            for t in tensors_in([*args, *kwargs.values()]):
                assert t.device == self.device, f"{name}: an argument on {t.device}, not {self.device}"
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return checked


class InlineTransfer(SyncTransferEngine):
    """Copies inline; on a GPU after the compute queued so far (it copies on the host's stream)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def submit(self, job, urgent=False):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return super().submit(job, urgent)


class SeamCheck(Observer):
    """Reads the step plans and asserts each copy goes from the host pool (pinned for a GPU)
    into device-tier slots (the on_plan and on_copy hooks)."""

    def __init__(self, device: torch.device):
        self.device, self.plans, self.copies = device, [], 0

    def on_plan(self, plan):
        self.plans.append(plan)

    def on_copy(self, job, urgent):
        for t in (job.dst_k, job.dst_v, *job.src_index, *job.dst_index):
            assert t.device == self.device, f"copy job tensor on {t.device}"
        for t in (job.src_k, job.src_v):
            assert t.device.type == "cpu" and t.is_pinned() == (self.device.type == "cuda")
        self.copies += 1


def engine_tensors(engine):
    """(name, tensor) for everything the engine and its backend hold, the host pool aside."""
    yield from engine.model.named_parameters()
    yield "rope.cos", engine.model.rope.cos
    yield "rope.sin", engine.model.rope.sin
    attn = engine.runner.attn
    parts = ("tier", "summaries", "residency", "metrics")
    owners = [(attn, "attn")] + [(getattr(attn, p, None), p) for p in parts]
    owners.append((getattr(getattr(attn, "residency", None), "slots", None), "slots"))
    for owner, prefix in owners:
        for name, value in (vars(owner) if owner is not None else {}).items():
            if isinstance(value, torch.Tensor) and value is not getattr(attn, "pool", None):
                yield f"{prefix}.{name}", value


def plan_tensors(plan):
    """The step plan's tensors that layers read (the host pool's write indices aside)."""
    for obj in (plan.batch, plan, plan.decode, *plan.prefill):
        for name, value in (vars(obj) if obj is not None else {}).items():
            if name not in ("pool_blocks", "pool_offsets"):
                yield from ((name, t) for t in tensors_in(value))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
def test_every_tensor_a_step_touches_is_on_the_engine_device(tiny_dir, mode, device):
    dev = resolve_device(device)
    check = DeviceCheck(dev)
    ops = select_ops(dev, torch.float32, "checked").wrapped(check, "device-checked")
    lookahead = mode != "dense"
    transfer = InlineTransfer(dev) if lookahead else None
    engine = Engine.from_dir(tiny_dir, device=device, internals=Internals(ops=ops, transfer=transfer), **MODES[mode])
    assert engine.device == dev and engine.ops is ops
    seams = engine.observe(SeamCheck(dev))
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    engine.add_request(list(range(1, 90)), params)
    engine.add_request(list(range(7, 60)), SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    plans = seams.plans
    expected_ops = {"linear"} | ({"block_topk", "lookahead_attention", "update_summaries"} if lookahead else set())
    assert expected_ops <= set(check.calls)
    for name, t in engine_tensors(engine):
        assert t.device == dev, f"{name} is on {t.device}"
    pool = engine.pool
    if lookahead:
        assert pool.device.type == "cpu" and pool.k.is_pinned() == (dev.type == "cuda")   # the host tier
        assert transfer.jobs == seams.copies > 0          # every job was checked
        assert any(p.decode is not None for p in plans)
        for plan in plans:
            for name, t in plan_tensors(plan):
                assert t.device == dev, f"step plan {name} is on {t.device}"
            assert plan.pool_blocks.device == pool.device
    else:
        assert pool.device == dev                   # dense: the whole cache on the device
    engine.close()


def test_default_device_is_cuda_when_torch_has_one():
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_config_error_naming_device(tiny_dir):
    with pytest.raises(ConfigError) as err:
        Engine.from_dir(tiny_dir, device="cuda")
    msg = str(err.value)
    assert msg.startswith("device: ") and "\n" not in msg and "no CUDA device" in msg


@pytest.mark.parametrize("bad", ["tpu", "gpu0", "meta"])
def test_an_unknown_device_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="^device: "):
        resolve_device(bad)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_step_draws_all_its_rows_in_one_pass(tiny_dir, mode, monkeypatch):
    """The emitted rows and lookahead's draft rows are drawn together: one sampling pass (one
    device-to-host copy of ids) per step, and no draft is left undrawn."""
    import runtime.engine as engine_mod
    passes = []
    real = engine_mod.sample_rows
    monkeypatch.setattr(engine_mod, "sample_rows", lambda logits, draws: (passes.append(len(draws)),
                                                                          real(logits, draws))[1])
    engine = Engine.from_dir(tiny_dir, device="cpu", **MODES[mode])
    engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=5, temperature=0.7, seed=1, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        before = len(passes)
        engine.step()
        steps += 1
        assert len(passes) - before <= 1
        assert engine.runner.take_draws() is None
    rows = 1 if mode == "dense" else 2           # a decode step: the real row and its draft row
    assert passes[-2] == rows and len(passes) == steps
    engine.close()
