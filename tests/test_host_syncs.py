"""No host sync on the decode step's path (issue 16, item 2).

Every device-to-host read of the runtime goes through one seam, `runtime.device.to_host` (counted
in `HOST_SYNCS`). A decode step makes exactly one: the sampled token ids. Three checks say so:

- the seam's count per decode step, on CPU through the same code paths as on a GPU;
- `HostReads`, a torch function mode that sees every host-reading tensor call a step makes
  (`.item()`, `.tolist()`, `bool(t)`, `int(t)`, `nonzero`, a boolean-mask index, `bincount`, ...)
  outside the seam: on a GPU each of those would be a sync;
- a static check of the decode-path modules for the spellings of a host read outside the seam;

and, on CUDA, `torch.cuda.set_sync_debug_mode("error")` around decode steps.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from gpu_skips import cuda_missing, requires_cuda
from runtime.device import HOST_SYNCS, host_list, staged_copy
from runtime.engine import Engine
from runtime.lookahead.metrics import LookaheadMetrics
from runtime.observe import Observer
from runtime.sampling import SamplingParams
from runtime.transfer import CopyJob, SyncTransferEngine
from runtime.internals import Internals
from tiny_engine import SMALL_LOOKAHEAD, make_tiny_engine, random_prompts

ROOT = Path(__file__).resolve().parents[1]
TOKEN_IDS = "sampled token ids"

CONFIGS = {
    "resident-urgent": dict(residency="resident", miss_policy="urgent"),
    "resident-drop": dict(residency="resident", miss_policy="drop"),
    "pingpong-urgent": dict(residency="pingpong", miss_policy="urgent"),
    "pingpong-drop": dict(residency="pingpong", miss_policy="drop"),
    "draft-none": dict(residency="resident", miss_policy="urgent", draft="none"),
    "prompt-lookup-drop": dict(residency="resident", miss_policy="drop", draft="prompt_lookup"),
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("tiny_sync"), seed=4)


# ---- the runtime detector ---------------------------------------------------------------------------
_T = torch.Tensor
# tensor calls that read a tensor's values on the host (on a GPU: a sync)
READS = {_T.item, _T.tolist, _T.__bool__, _T.__int__, _T.__float__, _T.__index__, _T.numpy, _T.cpu,
         _T.nonzero, torch.nonzero, _T.argwhere, torch.argwhere, _T.masked_select, torch.masked_select,
         _T.unique, torch.unique, torch.unique_consecutive, _T.bincount, torch.bincount, _T.equal, torch.equal,
         _T.allclose, torch.allclose, torch.repeat_interleave}
# where a host read is no sync, (file, function or None for all of the file's):
EXEMPT = (
    ("runtime/device.py", None),                # the seam itself
    ("runtime/lookahead/step_plan.py", None),   # the plan builders: host lists -> host tensors, then moved
    ("plugins/cpu/", None),                     # the CPU kernels' wrappers: host tensors only
    # the op's torch implementation, which the CPU path calls directly (plugins.direct); on a GPU
    # torch.ops.lookahead.update_summaries dispatches to its CUDA kernel (plugins/cuda), which
    # reads nothing back. Its torch.unique would be a sync there: see the report of issue 16.
    ("plugins/summaries.py", "_update_summaries_impl"),
)


def _exempt() -> bool:
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename.replace("\\", "/")
        if "/tests/" in path:
            return False                    # the test's own code, above the engine: not exempt
        if any(part in path and name in (None, f.f_code.co_name) for part, name in EXEMPT):
            return True
        f = f.f_back
    return False


def _mask_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 0 for i in items)


def _list_index(index) -> bool:
    """A Python list among the indices: on a GPU it is uploaded synchronously first."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, list) for i in items)


class HostReads(TorchFunctionMode):
    """Records every host-reading tensor call made outside the exempt code, with where it was."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = func in READS
        if func is torch.repeat_interleave or func is _T.repeat_interleave:
            read = isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) \
                and "output_size" not in kwargs
        if func is torch.where and len(args) + len(kwargs) == 1:
            read = True
        if func in (_T.__getitem__, _T.__setitem__) and (_mask_index(args[1]) or _list_index(args[1])):
            read = True
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            read = True                     # a synchronous upload from pageable memory on a GPU
        if read and not _exempt():
            caller = sys._getframe(1)
            while caller is not None and "torch/" in caller.f_code.co_filename.replace("\\", "/"):
                caller = caller.f_back
            where = (f"{Path(caller.f_code.co_filename).relative_to(ROOT)}:{caller.f_lineno}"
                     if caller is not None and caller.f_code.co_filename.startswith(str(ROOT)) else "?")
            self.seen.append(f"{getattr(func, '__name__', func)} at {where}")
        return func(*args, **kwargs)


class DecodeSteps(Observer):
    """Whether each step is a decode-only step (its plan has decode lanes and no prefill)."""

    def __init__(self):
        self.last = None

    def on_plan(self, plan):
        self.last = plan.decode is not None and not plan.prefill


def run_counting(engine: Engine, prompts, params):
    """Drive the engine; per step: (decode-only?, seam reads by reason, host reads outside the seam)."""
    kind = engine.observe(DecodeSteps())
    for p in prompts:
        engine.add_request(p, params)
    steps = []
    while engine.has_unfinished():
        kind.last = None
        before = HOST_SYNCS.snapshot()
        with HostReads() as reads:
            engine.step()
        steps.append((kind.last, HOST_SYNCS.snapshot() - before, reads.seen))
    engine.close()
    return steps


# ---- the counts ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("plan_path", ["cpu_kernel", "torch"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_decode_step_reads_the_device_once_the_sampled_ids(tiny_dir, name, plan_path):
    """Through the seam: one read per decode step (the token ids), none elsewhere on the step's
    path. `torch`: the slot plan as it runs on a GPU (fixed-capacity lists, plan_torch). The
    copies run inline (SyncTransferEngine), on the thread the detector watches."""
    internals = Internals(transfer=SyncTransferEngine(), impl="auto" if plan_path == "cpu_kernel" else "torch")
    engine = Engine.from_dir(tiny_dir, device="cpu", internals=internals, top_k=3, max_batch_size=3, prefill_chunk=32,
                             **SMALL_LOOKAHEAD, **CONFIGS[name])
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=2, ignore_eos=True)
    steps = run_counting(engine, random_prompts(70, 45, 20, seed=3), params)
    decode = [(counts, seen) for is_decode, counts, seen in steps if is_decode]
    assert len(decode) >= 8
    for counts, seen in decode:
        assert dict(counts) == {TOKEN_IDS: 1}, counts
        assert seen == [], seen
    for _, counts, seen in steps:               # no step reads outside the seam, prefill included
        assert seen == [], seen


def test_a_dense_step_reads_the_device_once_the_sampled_ids(tiny_dir):
    engine = Engine.from_dir(tiny_dir, device="cpu", block_size=4, max_batch_size=3)
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=1, ignore_eos=True)
    steps = run_counting(engine, random_prompts(70, 45, 20, seed=3), params)
    assert len(steps) >= 6
    for _, counts, seen in steps:
        assert dict(counts) in ({TOKEN_IDS: 1}, {}) and seen == [], (counts, seen)


def test_metrics_are_read_when_asked_for_not_per_step(tiny_dir):
    engine = Engine.from_dir(tiny_dir, device="cpu", top_k=3, **SMALL_LOOKAHEAD)
    before = HOST_SYNCS.snapshot()
    done = engine.generate([random_prompts(60, seed=1)[0]], SamplingParams(max_tokens=6, ignore_eos=True))
    reads = HOST_SYNCS.snapshot() - before
    # the request's own metrics were read once, when generate made its Completion; the steps read none
    assert {why for why in reads if why.startswith("metrics")} == {"metrics (a request's, when read)"}
    assert reads["metrics (a request's, when read)"] == 1 and done[0].metrics["urgent_blocks"] >= 0
    before = HOST_SYNCS.snapshot()
    st = engine.stats()
    asked = HOST_SYNCS.snapshot() - before
    assert asked and all(why.startswith(("metrics", "transfer accounting")) for why in asked)
    assert st["urgent_blocks"] + st["prefetched_blocks"] > 0
    engine.close()


# ---- the checks can fail ---------------------------------------------------------------------------------
class ReadsScores(Observer):
    """The mistake, through the engine's seam: a host read per layer (an observer of scores)."""

    def on_scores(self, layer, rows, lanes, idx, scores):
        if scores.isfinite().any().item():
            pass


def test_the_detector_catches_a_host_read_in_the_step(tiny_dir):
    """An `.item()` slipped into the step's path is caught, and names where it is."""
    engine = Engine.from_dir(tiny_dir, device="cpu", top_k=3, **SMALL_LOOKAHEAD)
    engine.observe(ReadsScores())
    steps = run_counting(engine, random_prompts(40, seed=2), SamplingParams(max_tokens=4, ignore_eos=True))
    seen = [s for _, _, step in steps for s in step]
    assert seen and all(s.startswith("item at tests/test_host_syncs.py") for s in seen)


def test_the_detector_sees_the_implicit_reads():
    with HostReads() as reads:
        t = torch.arange(6)
        if t.sum():                        # bool(t)
            pass
        t[t > 2] = 0                        # a boolean-mask index: nonzero underneath
        torch.bincount(t)
        host_list(t, "test")                # through the seam: not a finding
        t[[0, 2]] = 1                       # a Python list index: an upload
        torch.tensor([1, 2], device=t.device)
    assert [s.split(" ")[0] for s in reads.seen] == ["__bool__", "__setitem__", "bincount", "__setitem__", "tensor"]


# ---- the static check --------------------------------------------------------------------------------------
DECODE_PATH = ["runtime/lookahead/attention.py", "runtime/lookahead/residency.py",
               "runtime/lookahead/step_plan.py", "runtime/lookahead/runner.py", "runtime/lookahead/metrics.py",
               "runtime/lookahead/device_tier.py", "runtime/lookahead/summaries.py", "runtime/sampling.py",
               "runtime/kv_pool.py", "runtime/transfer/base.py", "runtime/transfer/thread.py"]
# how a host read is spelled: a method that reads values, or a Python conversion of a tensor
HOST_READ = re.compile(r"\.(item|tolist|numpy|cpu|nonzero|argwhere|masked_select|unique|bincount)\("
                       r"|\b(int|bool|float)\((?![\"'])"
                       r"|\b(if|elif|while|assert|not|and|or)\b.*\.(any|all)\(\)")   # a tensor's truth
# lines of those modules that match and are no device read, each with its reason
ALLOWED = {
    "runtime/lookahead/residency.py": ["float(\"inf\")"],          # a constant
    "runtime/sampling.py": ["float(\"-inf\")", "isinstance(self.temperature, (int, float))",
                            "isinstance(self.top_p, (int, float))", "not isinstance(self.max_tokens, int)",
                            "not isinstance(self.top_k, int)", "not isinstance(self.seed, int)"],  # request checks
}


def host_reads_in(text: str, allowed: list[str]) -> list[str]:
    """Lines of `text` that spell a host read (comments and docstrings aside) and are not allowed."""
    found, in_doc = [], False
    for n, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        if code.count('"""') == 1:
            in_doc = not in_doc
            continue
        if in_doc or code.strip().startswith('"""'):
            continue
        if HOST_READ.search(code) and not any(a in code for a in allowed):
            found.append(f"{n}: {line.strip()}")
    return found


@pytest.mark.parametrize("module", DECODE_PATH)
def test_the_decode_path_reads_the_device_only_through_the_seam(module):
    found = host_reads_in((ROOT / module).read_text(), ALLOWED.get(module, []))
    assert found == [], f"{module}: host reads outside runtime.device.to_host:\n" + "\n".join(found)


def test_the_static_check_catches_a_slipped_item():
    source = (ROOT / "runtime/lookahead/residency.py").read_text()
    broken = source.replace("        return self.tickets.pop(layer, [])",
                            "        n = int(self.has_pred.sum())\n        return self.tickets.pop(layer, [])")
    assert broken != source
    assert host_reads_in(source, ALLOWED["runtime/lookahead/residency.py"]) == []
    assert len(host_reads_in(broken, ALLOWED["runtime/lookahead/residency.py"])) == 1
    assert host_reads_in("x = t.item()\ny = lst.any()\n", []) == ["1: x = t.item()"]


# ---- the pieces the GPU path runs, on CPU ----------------------------------------------------------------
def test_step_metadata_is_packed_into_one_buffer_and_viewed_back():
    ts = [torch.arange(5), torch.tensor([True, False, True]), torch.zeros(0, 3, dtype=torch.long), torch.tensor(7),
          torch.ones(2, 3).expand(4, 2, 3), torch.rand(3, 2).t()]
    out = staged_copy(torch.device("cpu"), ts, pin=False)
    for a, b in zip(ts, out):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert len({b.untyped_storage().data_ptr() for b in out if b.numel()}) == 1      # one buffer, one copy


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])      # the C copy, the torch copy
def test_a_fixed_capacity_copy_job_moves_only_its_valid_entries(kv_dtype):
    src = torch.randn(6, 2, 4, 3).to(kv_dtype)                                # [blocks, KVH, bs, D]
    dst_k, dst_v = (torch.full((2, 2, 3, 4, 3), 9.0, dtype=kv_dtype) for _ in range(2))
    valid = torch.tensor([True, False, True, False])
    job = CopyJob(src, src, dst_k, dst_v, (torch.tensor([5, 0, 2, 0]), torch.tensor([1, 0, 0, 1])),
                  (torch.tensor([1, 0, 0, 1]), torch.tensor([1, 0, 0, 1]), torch.tensor([2, 0, 1, 1])), valid=valid)
    engine = SyncTransferEngine()
    engine.submit(job)
    assert torch.equal(dst_k[1, 1, 2], src[5, 1]) and torch.equal(dst_v[0, 0, 1], src[2, 0])
    assert (dst_k[0, 0, 0] == 9).all() and (dst_k[1, 1, 1] == 9).all()         # skipped: untouched
    assert engine.h2d_bytes == 2 * job.unit_bytes and job.nbytes == 4 * job.unit_bytes


def test_fixed_capacity_counts_match_exact_counts():
    exact, padded = LookaheadMetrics(1, num_lanes=3), LookaheadMetrics(1, num_lanes=3)
    exact.add_blocks(True, torch.tensor([0, 2]))
    exact.add_blocks(False, torch.tensor([1, 1, 2]))
    padded.add_blocks(True, torch.tensor([0, 1, 2, 2]), torch.tensor([True, False, True, False]))
    padded.add_blocks(False, torch.tensor([1, 1, 2, 0]), torch.tensor([True, True, True, False]))
    assert (padded.urgent_blocks, padded.prefetched_blocks) == (exact.urgent_blocks, exact.prefetched_blocks) == (2, 3)
    assert [padded.take_lane(i) for i in range(3)] == [exact.take_lane(i) for i in range(3)]


# ---- on CUDA: torch's own sync detector ----------------------------------------------------------------
@requires_cuda
@pytest.mark.parametrize("name", ["resident-urgent", "pingpong-drop", "draft-none"])
def test_cuda_decode_steps_pass_sync_debug_mode_error(tiny_dir, name):
    """Decode steps under torch.cuda.set_sync_debug_mode("error"): any synchronizing CUDA call
    but the seam's one read raises. Prefill steps (and the first decode step after them) run
    outside it. The engine's own transfer engine: CUDA streams, through cuda-python."""
    from runtime.transfer.cuda import unavailable_reason
    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    engine = Engine.from_dir(tiny_dir, device="cuda", top_k=3, max_batch_size=2, **SMALL_LOOKAHEAD, **CONFIGS[name])
    kind = engine.observe(DecodeSteps())
    for p in random_prompts(70, 45, seed=3):
        engine.add_request(p, SamplingParams(max_tokens=8, temperature=0.7, seed=2, ignore_eos=True))
    checked = 0
    while engine.has_unfinished():
        if kind.last:                   # the previous step decoded only: so will this one
            before = HOST_SYNCS.snapshot()
            torch.cuda.set_sync_debug_mode("error")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            counts = HOST_SYNCS.snapshot() - before
            assert dict(counts) == {TOKEN_IDS: 1}, counts
            checked += 1
        else:
            engine.step()
    assert checked >= 4
    engine.close()


def test_the_cuda_check_says_why_it_skips():
    reason = cuda_missing()
    assert reason is None or "CUDA" in reason


def test_the_plan_moves_in_one_copy_and_decodes_the_same(tiny_dir, monkeypatch):
    """The GPU path's one upload per step, run on CPU: every tensor a layer reads is a view of
    the step's one packed buffer (the host pool's write indices stay apart), and the tokens
    and bytes are those of the unmoved plan."""
    from runtime.lookahead import step_plan

    class Plans(Observer):
        def __init__(self):
            self.plans = []

        def on_plan(self, plan):
            self.plans.append(plan)

    def run(pack: bool):
        if pack:
            monkeypatch.setattr(step_plan, "MOVE", lambda device, *ts: staged_copy(device, ts, pin=False))
        engine = Engine.from_dir(tiny_dir, device="cpu", internals=Internals(transfer=SyncTransferEngine()), top_k=3, max_batch_size=2,
                                 **SMALL_LOOKAHEAD, residency="pingpong", miss_policy="drop")
        plans = engine.observe(Plans())
        out = engine.generate(random_prompts(50, 30, seed=5), SamplingParams(max_tokens=8, ignore_eos=True))
        st = engine.stats()
        engine.close()
        monkeypatch.undo()
        return [o.token_ids for o in out], st["h2d_bytes"], st["urgent_blocks"], plans.plans

    tokens, h2d, urgent, _ = run(False)
    tokens_p, h2d_p, urgent_p, plans = run(True)
    assert (tokens_p, h2d_p, urgent_p) == (tokens, h2d, urgent)
    for plan in plans:
        storages = set()
        for part in (plan.batch, plan, plan.decode, *plan.prefill):
            for name, value in (vars(part) if part is not None else {}).items():
                if isinstance(value, torch.Tensor) and value.numel() and name not in step_plan.HOST_FIELDS:
                    storages.add(value.untyped_storage().data_ptr())
        assert len(storages) == 1, len(storages)
