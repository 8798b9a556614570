"""Lookahead-KV runtime: model execution, KV tiers, policies, transfer engine, scheduler, engine API."""
import os

# On CPU the step loop and the transfer thread both run torch ops; OpenMP's default spin-waiting
# idle threads then steal the cores the other one needs (5-12x slowdowns measured on 2 cores).
# Only takes effect when runtime is imported before torch; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .config import LookaheadConfig, ModelConfig
from .errors import CapacityError, ConfigError, EngineDirError, LookaheadError, RequestError

__all__ = ["LookaheadConfig", "ModelConfig", "LookaheadError", "ConfigError", "EngineDirError",
           "RequestError", "CapacityError"]
