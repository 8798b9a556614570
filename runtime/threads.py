"""Thread settings a process that runs an engine starts with: set when `runtime` is imported before torch.

OpenMP's idle workers spin before they sleep. libgomp's default spin (300,000 pauses, ~8 ms on the
2-core dev VM) starved the transfer thread and anything else on the cores (5-12x slowdowns measured
on 2 cores); never spinning (OMP_WAIT_POLICY=PASSIVE) wakes the workers from sleep at every parallel
region, which took most of what a second thread gives the decode step's ~200 back-to-back kernel
calls. A short spin (GOMP_SPINCOUNT=10000, ~0.3 ms there) keeps them awake through a step and lets
them sleep between steps.

libgomp (loaded by `import torch`; the C kernels in plugins/cpu, built with -fopenmp, share it) reads
the variable once, when it loads. So it is set before anything imports torch: by `import runtime`
when torch is not loaded yet (the README's `from runtime.engine import Engine` as written), by the
launchers (`prepare_threads()`: the scripts, `python -m runtime`, the Triton model, the Dynamo
worker), and the supervisor passes it in tritonserver's environment; a child process started after
it inherits it. Either variable set by the user wins. A process that imported torch first runs
libgomp's default spin: `spin_setting()` says so, `Engine.describe()` reports it and the engine warns
once at load (docs/SETTINGS.md: set it before importing torch).
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Mapping, MutableMapping, TypeVar

T = TypeVar("T")

SPIN_VAR = "GOMP_SPINCOUNT"
POLICY_VAR = "OMP_WAIT_POLICY"
SPIN_DEFAULT = "10000"


def thread_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The variables `env` still needs: {} when the user chose a spin count or a wait policy."""
    if SPIN_VAR in env or POLICY_VAR in env:
        return {}
    return {SPIN_VAR: SPIN_DEFAULT}


def prepare_threads(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Give `env` (os.environ by default) the short OpenMP spin unless it has a setting; returns what it set.

    Call it before torch is imported: libgomp reads the variable only when it loads.
    """
    env = os.environ if env is None else env
    added = thread_settings(env)
    env.update(added)
    return added


_state = {"set_before_torch": False}


def prepare_threads_on_import() -> None:
    """`import runtime`'s part: the short spin, where torch (and so libgomp) is not loaded yet."""
    import sys
    if "torch" not in sys.modules and prepare_threads():
        _state["set_before_torch"] = True


def spin_setting(env: Mapping[str, str] | None = None) -> str:
    """What the process's libgomp spins with, in words (for `Engine.describe()`); starts with
    "default" where it runs libgomp's default spin, which starves other threads on a busy CPU."""
    env = os.environ if env is None else env
    if POLICY_VAR in env or (SPIN_VAR in env and not _state["set_before_torch"] and env[SPIN_VAR] != SPIN_DEFAULT):
        return f"yours ({', '.join(f'{k}={env[k]}' for k in (SPIN_VAR, POLICY_VAR) if k in env)})"
    if SPIN_VAR in env:
        return f"{SPIN_VAR}={env[SPIN_VAR]}"
    return (f"default: torch was loaded before runtime, and neither {SPIN_VAR} nor {POLICY_VAR} is set "
            f"(set {SPIN_VAR}={SPIN_DEFAULT} before importing torch, or import runtime first)")


def off_main_thread(factory: Callable[[], T], name: str = "engine-build") -> T:
    """`factory()` run on a short-lived thread of its own, its result (or exception) returned here.

    For whatever builds an engine that another thread will step (a server's loop thread): libgomp
    keeps a pool of OpenMP workers for every thread that ran a parallel region, for that thread's
    life, and once it manages more threads than there are cores it stops spinning between parallel
    regions for every team (a sleep and a wake-up per kernel call). An engine loaded on the main
    thread left its pool there, and a decode step on the loop thread ran 1.6x slower (measured on 2
    cores); built here, the pool ends with the thread and the loop thread's team is the only one.
    Also the way to run an engine's steps on a thread of their own, as a server does.
    """
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = factory()
        except BaseException as e:          # re-raised in the caller's thread
            box["error"] = e
    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]

