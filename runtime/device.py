"""Where an engine's tensors live: the `device` setting, resolved once, and the one-copy move of
a step's host-built metadata."""
from __future__ import annotations

import torch

from .errors import ConfigError


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """None: CUDA when torch has a GPU, else CPU. "cuda" without one is a ConfigError."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError("device", f"{device!r} is not a device ({e})", "use cpu or cuda[:N]") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device", f"{device!r} asked for, but torch sees no CUDA device",
                              "use device=cpu, or run on a machine with a GPU and a CUDA build of torch")
        index = 0 if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ConfigError("device", f"{device!r}: only {torch.cuda.device_count()} CUDA devices",
                              f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise ConfigError("device", f"{device!r} is not supported", "use cpu or cuda[:N]")
    return dev


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host-built step metadata onto `device`: the same tensors on CPU, else one asynchronous
    copy each (called once per step, never per layer)."""
    if device.type == "cpu":
        return tensors
    return tuple(t.to(device, non_blocking=True) for t in tensors)
