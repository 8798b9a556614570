"""Lookahead-KV runtime: model execution, KV tiers, policies, transfer engine, scheduler, engine API."""
import os

# OpenMP's idle workers spin before they sleep. libgomp's default spin (300,000 pauses, ~8 ms on
# the 2-core dev VM) starved the transfer thread and anything else on the cores (5-12x slowdowns
# measured on 2 cores); never spinning (OMP_WAIT_POLICY=PASSIVE, our earlier default) wakes the
# workers from sleep at every parallel region, which took most of what a second thread gives the
# decode step's ~200 back-to-back kernel calls. A short spin, ~0.3 ms there, keeps them awake
# through a step and lets them sleep between steps. Either variable set explicitly wins.
# Only takes effect when runtime is imported before torch.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from .config import LookaheadConfig, ModelConfig
from .errors import CapacityError, ConfigError, EngineDirError, LookaheadError, RequestError

__all__ = ["LookaheadConfig", "ModelConfig", "LookaheadError", "ConfigError", "EngineDirError",
           "RequestError", "CapacityError"]
