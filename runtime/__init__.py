"""Lookahead-KV runtime: model execution, KV tiers, policies, transfer engine, scheduler, engine API.

Importing it sets no environment variable: the thread settings are the launcher's (runtime/threads.py).
"""
from .config import LookaheadConfig, ModelConfig
from .errors import CapacityError, ConfigError, EngineDirError, LookaheadError, RequestError

__all__ = ["LookaheadConfig", "ModelConfig", "LookaheadError", "ConfigError", "EngineDirError",
           "RequestError", "CapacityError"]
