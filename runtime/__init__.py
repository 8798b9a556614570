"""Lookahead-KV runtime: model execution, KV tiers, policies, transfer engine, scheduler, engine API."""
from .config import LookaheadConfig, ModelConfig
from .errors import CapacityError, ConfigError, EngineDirError, LookaheadError, RequestError

__all__ = ["LookaheadConfig", "ModelConfig", "LookaheadError", "ConfigError", "EngineDirError",
           "RequestError", "CapacityError"]
