"""Where an engine's tensors live: the `device` setting, resolved once, and the one-copy move of
a step's host-built metadata."""
from __future__ import annotations

import torch

from .errors import ConfigError

AUTO = "auto"
CHOICES = "cpu, cuda or cuda:N (auto: cuda when torch has a GPU, else cpu)"


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """None or "auto": CUDA when torch has a GPU, else CPU. "cuda" (index 0) or "cuda:N" without
    that GPU is a ConfigError naming `device`, one line with the fix, raised before anything loads."""
    if device is None or device == AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError("device", f"{device!r} is not a device", "use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device", f"{device!r} asked for, but torch sees no CUDA device",
                              "set device to cpu or auto, or run on a machine with a GPU and a CUDA build of torch")
        index = 0 if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ConfigError("device", f"{device!r}: only {torch.cuda.device_count()} CUDA devices",
                              f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise ConfigError("device", f"{device!r} is not supported", "use cpu, cuda, cuda:N or auto")
    return torch.device("cpu")


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host-built step metadata onto `device`: the same tensors on CPU, else one asynchronous
    copy each (called once per step, never per layer)."""
    if device.type == "cpu":
        return tensors
    return tuple(t.to(device, non_blocking=True) for t in tensors)
