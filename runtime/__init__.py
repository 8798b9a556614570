"""Lookahead-KV runtime: model execution, KV tiers, policies, transfer engine, scheduler, engine API.

Imported before torch, it gives the process OpenMP's short spin (GOMP_SPINCOUNT, unless you set it or
OMP_WAIT_POLICY): libgomp reads it once, when torch loads it (runtime/threads.py).
"""
from .threads import prepare_threads_on_import

prepare_threads_on_import()

from .config import LookaheadConfig, ModelConfig  # noqa: E402  (after the thread settings)
from .errors import CapacityError, ConfigError, EngineDirError, LookaheadError, RequestError

__all__ = ["LookaheadConfig", "ModelConfig", "LookaheadError", "ConfigError", "EngineDirError",
           "RequestError", "CapacityError"]
