"""The modeled-link transfer engine (runtime/transfer/link.py) and the hidden-share formula."""
from __future__ import annotations

import math

import pytest

from runtime.transfer.overlap import hidden_share, share_or_none


def test_hidden_share_formula():
    # 10 s of copies alone; the real run is 2 s slower than the satisfied one: 8 of 10 hidden.
    assert hidden_share(12.0, 10.0, 10.0) == pytest.approx(0.8)
    assert hidden_share(10.0, 10.0, 4.0) == pytest.approx(1.0)      # all hidden
    assert hidden_share(14.0, 10.0, 4.0) == pytest.approx(0.0)      # nothing hidden


def test_hidden_share_clamped():
    assert hidden_share(9.0, 10.0, 4.0) == 1.0     # real faster than satisfied: noise
    assert hidden_share(30.0, 10.0, 4.0) == 0.0    # exposed more than the copies took


@pytest.mark.parametrize("args", [(1.0, 1.0, 0.0), (1.0, 1.0, -1.0), (None, 1.0, 1.0),
                                  (1.0, None, 1.0), (1.0, 1.0, None), (math.nan, 1.0, 1.0),
                                  (1.0, 1.0, math.inf)])
def test_hidden_share_undefined_is_nan(args):
    assert math.isnan(hidden_share(*args))
    assert share_or_none(hidden_share(*args)) is None


def test_share_or_none_keeps_numbers():
    assert share_or_none(0.5) == 0.5
    assert share_or_none(0.0) == 0.0


# ---- the modeled link --------------------------------------------------------------------------------
import torch  # noqa: E402

from runtime.errors import ConfigError  # noqa: E402
from runtime.transfer import (LinkTransferEngine, SyncTransferEngine, ThreadTransferEngine,  # noqa: E402
                              make_transfer_engine)
from runtime.transfer.base import CopyJob  # noqa: E402
from runtime.transfer.link import parse_link_spec  # noqa: E402
from runtime.internals import Internals

KVH, NB, BS, D = 2, 8, 4, 8            # one layer's pool: heads, blocks, block size, head dim
UNIT = 2 * BS * D * 4                  # bytes of one (block, head) unit, K and V, fp32: 256
MS = 1e-3
GBPS = UNIT / MS / 1e9                 # one unit takes exactly 1 ms on the link
LAT_US = 100.0                         # + 0.1 ms a job
EXACT = dict(abs=1e-12)


class FakeClock:
    """Time moves only when the engine sleeps (or a test advances it)."""

    def __init__(self) -> None:
        self.t, self.sleeps, self.reads = 0.0, [], 0

    def now(self) -> float:
        self.reads += 1
        return self.t

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(seconds)
        self.t += seconds


def pool():
    g = torch.Generator().manual_seed(0)
    src_k, src_v = (torch.randn(NB, KVH, BS, D, generator=g) for _ in range(2))
    dst_k, dst_v = (torch.full((2, KVH, 6, BS, D), float("nan")) for _ in range(2))
    return src_k, src_v, dst_k, dst_v


def job(tensors, units: int, first_slot: int = 0) -> CopyJob:
    """`units` (block, head) units: blocks 0.. of head 0 into lane 0's slots first_slot.."""
    src_k, src_v, dst_k, dst_v = tensors
    n = torch.arange(units)
    z = torch.zeros(units, dtype=torch.long)
    return CopyJob(src_k, src_v, dst_k, dst_v, (n, z), (z, z, n + first_slot))


@pytest.fixture
def link():
    clock = FakeClock()
    eng = LinkTransferEngine(GBPS, LAT_US, inner=SyncTransferEngine(), clock=clock)
    return eng, clock, pool()


def test_background_jobs_are_delivered_in_order_one_at_a_time(link):
    eng, clock, t = link
    a, b, c = (eng.submit(job(t, n)) for n in (1, 2, 1))
    # delivery = max(submit, previous delivery) + latency + bytes / bandwidth
    assert [x.deliver_at for x in (a, b, c)] == pytest.approx([1.1 * MS, 3.2 * MS, 4.3 * MS], **EXACT)
    assert not c.done()
    eng.wait(c)
    assert clock.t == pytest.approx(4.3 * MS, **EXACT)
    assert clock.sleeps == pytest.approx([4.3 * MS], **EXACT)    # one sleep, no polling
    assert eng.wait_s == pytest.approx(4.3 * MS, **EXACT)
    assert a.done() and b.done() and c.done()
    eng.wait(a)                                                   # already delivered: no wait
    assert eng.wait_s == pytest.approx(4.3 * MS, **EXACT) and len(clock.sleeps) == 1


def test_an_idle_link_starts_a_job_at_its_submit_time(link):
    eng, clock, t = link
    eng.wait(eng.submit(job(t, 1)))
    clock.t = 5 * MS
    later = eng.submit(job(t, 1))
    assert later.deliver_at == pytest.approx(6.1 * MS, **EXACT)
    eng.wait(later)
    assert eng.wait_s == pytest.approx(1.1 * MS + 1.1 * MS, **EXACT)


def test_urgent_jobs_jump_the_queue_after_the_job_on_the_link(link):
    eng, clock, t = link
    a = eng.submit(job(t, 2))                    # 0 -> 2.1 ms: on the link at 1 ms
    b = eng.submit(job(t, 1))                    # queued: 2.1 -> 3.2
    clock.t = 1 * MS
    u1 = eng.submit(job(t, 1), urgent=True)      # after a, before b
    assert u1.deliver_at == pytest.approx(3.2 * MS, **EXACT)
    assert b.deliver_at == pytest.approx(4.3 * MS, **EXACT)      # pushed back by u1
    u2 = eng.submit(job(t, 1), urgent=True)      # urgent among urgent: in order
    assert u2.deliver_at == pytest.approx(4.3 * MS, **EXACT)
    assert b.deliver_at == pytest.approx(5.4 * MS, **EXACT)
    assert a.deliver_at == pytest.approx(2.1 * MS, **EXACT)      # not preempted
    eng.wait(u2)
    assert clock.t == pytest.approx(4.3 * MS, **EXACT)
    assert not b.done()
    assert eng.free_at == pytest.approx(5.4 * MS, **EXACT)


def test_an_urgent_job_never_overtakes_a_started_background_job(link):
    eng, clock, t = link
    eng.submit(job(t, 2))                        # 0 -> 2.1
    b = eng.submit(job(t, 1))                    # 2.1 -> 3.2
    clock.t = 2.5 * MS                           # b is on the link
    u = eng.submit(job(t, 1), urgent=True)
    assert u.deliver_at == pytest.approx(4.3 * MS, **EXACT)
    assert b.deliver_at == pytest.approx(3.2 * MS, **EXACT)


def test_a_waiter_sees_its_delivery_pushed_back(link):
    """A background ticket's delivery moves later when an urgent job goes first; a wait honours
    the new time (the wait loop re-reads it)."""
    eng, clock, t = link
    eng.submit(job(t, 1))                        # 0 -> 1.1
    b = eng.submit(job(t, 1))                    # 1.1 -> 2.2
    clock.t = 0.5 * MS
    eng.submit(job(t, 3), urgent=True)           # 1.1 -> 4.2; b -> 5.3
    eng.wait(b)
    assert clock.t == pytest.approx(5.3 * MS, **EXACT)


def test_the_copy_is_the_inner_engines(link):
    eng, clock, t = link
    eng.wait(eng.submit(job(t, 3, first_slot=2)))
    src_k, src_v, dst_k, dst_v = t
    assert torch.equal(dst_k[0, 0, 2:5], src_k[0:3, 0]) and torch.equal(dst_v[0, 0, 2:5], src_v[0:3, 0])
    assert torch.isnan(dst_k[0, 0, :2]).all() and torch.isnan(dst_k[1]).all()


def test_accounting_bytes_jobs_and_link_time(link):
    eng, clock, t = link
    for n, urgent in ((1, False), (2, True), (3, False)):
        eng.wait(eng.submit(job(t, n), urgent=urgent))
    assert eng.h2d_bytes == 6 * UNIT
    assert (eng.jobs, eng.urgent_jobs, eng.link_jobs) == (3, 1, 3)
    assert eng.transfer_s == pytest.approx(6 * MS + 3 * 0.1 * MS, **EXACT)   # the link's busy time
    assert eng.wait_s == pytest.approx(6.3 * MS, **EXACT)
    empty = eng.submit(job(t, 0))                # nothing to move: no link time, done at once
    assert empty.done() and eng.link_jobs == 3 and eng.jobs == 4


def test_an_inline_urgent_copy_waits_for_the_link(link):
    """The fused layer's inline copy (account_inline): submitted `seconds` before it reports,
    delivered by the link, and its caller sleeps until then; the stall is both."""
    eng, clock, t = link
    clock.t = 10 * MS
    eng.account_inline(2, urgent=True, seconds=0.5 * MS, unit_bytes=UNIT)
    # submitted at 9.5 ms on an idle link: delivered at 9.5 + 0.1 + 2 = 11.6 ms
    assert clock.t == pytest.approx(11.6 * MS, **EXACT)
    assert eng.wait_s == pytest.approx(0.5 * MS + 1.6 * MS, **EXACT)
    assert (eng.h2d_bytes, eng.jobs, eng.urgent_jobs) == (2 * UNIT, 1, 1)
    assert eng.transfer_s == pytest.approx(2.1 * MS, **EXACT)
    b = eng.submit(job(t, 1))                    # the link was free again at 11.6
    assert b.deliver_at == pytest.approx(12.7 * MS, **EXACT)


def test_an_inline_urgent_copy_longer_than_the_link_costs_no_extra_wait(link):
    eng, clock, t = link
    clock.t = 10 * MS
    eng.account_inline(1, urgent=True, seconds=3 * MS, unit_bytes=UNIT)   # link: 1.1 ms of the 3
    assert clock.sleeps == [] and eng.wait_s == pytest.approx(3 * MS, **EXACT)


def test_set_link_changes_the_jobs_scheduled_after_it(link):
    eng, clock, t = link
    a = eng.submit(job(t, 1))
    eng.set_link(2 * GBPS, 0.0)
    b = eng.submit(job(t, 2))
    assert a.deliver_at == pytest.approx(1.1 * MS, **EXACT)
    assert b.deliver_at == pytest.approx(2.1 * MS, **EXACT)
    eng.set_link(float("inf"), 0.0)              # the satisfied link: delivered with the copy
    c = eng.submit(job(t, 4))
    assert c.deliver_at == pytest.approx(2.1 * MS, **EXACT)
    assert eng.spec == "link:inf,0"


def test_occupy_is_link_time_without_a_copy_or_a_count(link):
    eng, clock, t = link
    x = eng.occupy(3 * UNIT)
    assert x.deliver_at == pytest.approx(3.1 * MS, **EXACT)
    assert (eng.h2d_bytes, eng.jobs) == (0, 0)
    eng.wait(x)
    assert clock.t == pytest.approx(3.1 * MS, **EXACT)


def test_the_real_clock_waits_until_the_delivery_and_surfaces_copy_errors():
    """With the thread engine and the real clock: a ticket is never done before its delivery time
    (a lower bound that holds however loaded the machine is), and a failed copy raises at wait."""
    t = pool()
    eng = LinkTransferEngine(UNIT / 20e-3 / 1e9, 0.0)          # one unit: 20 ms
    try:
        assert isinstance(eng.inner, ThreadTransferEngine)
        ticket = eng.submit(job(t, 1))
        eng.wait(ticket)
        assert eng.clock.now() >= ticket.deliver_at and ticket.done()
        assert eng.wait_s > 0 and eng.overshoot_s >= 0
        assert torch.equal(t[2][0, 0, 0], t[0][0, 0])
        bad = job(t, 1)
        bad.src_index = (torch.tensor([NB + 5]), torch.tensor([0]))
        with pytest.raises(Exception):
            eng.wait(eng.submit(bad))
    finally:
        eng.close()


@pytest.mark.parametrize("spec,gbps,us", [("link:4,10", 4.0, 10.0), ("link:0.5,0", 0.5, 0.0),
                                           ("link:inf,2.5", math.inf, 2.5)])
def test_link_spec(spec, gbps, us):
    assert parse_link_spec(spec) == (gbps, us)
    eng = make_transfer_engine(spec)
    try:
        assert isinstance(eng, LinkTransferEngine) and isinstance(eng.inner, ThreadTransferEngine)
        assert (eng.gbps, eng.latency_us) == (gbps, us)
    finally:
        eng.close()


@pytest.mark.parametrize("spec", ["link", "link:", "link:4", "link:4,10,1", "link:x,10", "link:4,y",
                                  "link:0,10", "link:-1,10", "link:nan,1", "link:4,-1", "link:4,inf",
                                  "linkage:4,10"])
def test_a_malformed_link_spec_is_a_config_error_naming_transfer(spec):
    with pytest.raises(ConfigError) as err:
        make_transfer_engine(spec)
    assert err.value.field == "transfer" and str(err.value).startswith("transfer: ")
    assert "link:GBPS,US" in str(err.value)


def test_engine_from_dir_runs_on_a_link(tmp_path):
    """`Engine.from_dir(transfer="link:...")`: the same tokens and bytes as the thread engine, the
    link's time in the stall, and its accounting adds up (link time = jobs x latency + bytes / bw)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_engine import SMALL_LOOKAHEAD, make_tiny_engine, random_prompts
    from runtime.engine import Engine
    from runtime.sampling import SamplingParams

    path = make_tiny_engine(tmp_path / "tiny", seed=3)
    prompts = random_prompts(40, 37, seed=1)
    out, stats = {}, {}
    for kind in ("thread", "link:0.002,50"):
        eng = Engine.from_dir(path, internals=Internals(transfer=kind), **SMALL_LOOKAHEAD, top_k=3, max_batch_size=2)
        try:
            out[kind] = [r.token_ids for r in eng.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))]
            stats[kind] = eng.stats()
            tr = eng.runner.attn.transfer
        finally:
            eng.close()
    assert isinstance(tr, LinkTransferEngine)
    assert out["link:0.002,50"] == out["thread"]
    assert stats["link:0.002,50"]["h2d_bytes"] == stats["thread"]["h2d_bytes"] > 0
    assert tr.transfer_s == pytest.approx(tr.link_jobs * 50e-6 + tr.h2d_bytes / 2e6, rel=1e-9)
    # every urgent job is waited for: at least its link time is stall
    assert stats["link:0.002,50"]["transfer_wait_s"] > stats["thread"]["transfer_wait_s"]
