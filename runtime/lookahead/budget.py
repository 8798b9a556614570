"""`device_budget_bytes`: what one sequence may hold on the device in lookahead mode.

A sequence holds its KV working set (sink + window + K selected slots, per buffer) and its block
summaries (kmin/kmax for every block `max_model_len` can reach), both allocated per lane by
`LookaheadAttention`. The budget bounds their sum. `runtime/memory_plan.py` calls this before
anything is allocated, with the bytes it computed from the shapes.
"""
from __future__ import annotations

from ..config import LookaheadConfig
from ..errors import ConfigError
from .device_tier import SlotLayout


def check_device_budget(cfg: LookaheadConfig, working_set_bytes: int, summary_bytes: int) -> None:
    """Refuse a configuration whose per-sequence device bytes exceed `cfg.device_budget_bytes`,
    naming the largest `top_k` that fits, or saying that the fixed part cannot fit at all."""
    budget = cfg.device_budget_bytes
    need = working_set_bytes + summary_bytes
    if budget is None or cfg.mode != "lookahead" or need <= budget:
        return
    lay = SlotLayout.from_config(cfg)
    per_slot = working_set_bytes // lay.num_slots
    fixed = per_slot * lay.selected_start + summary_bytes        # what no top_k brings down
    if fixed >= budget:
        raise ConfigError("device_budget_bytes",
                          f"{budget} bytes cannot hold the sink and recent window with the block summaries "
                          f"({fixed} bytes, {summary_bytes} of them summaries)",
                          "raise the budget or lower num_sink_blocks/recent_window/max_model_len")
    raise ConfigError("device_budget_bytes",
                      f"top_k={cfg.top_k} needs {need} bytes per sequence ({summary_bytes} of them summaries)",
                      f"use top_k <= {(budget - fixed) // per_slot} or a budget >= {need}")
