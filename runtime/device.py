"""Where an engine's tensors live: the `device` setting, resolved once, and the one-copy move of
a step's host-built metadata, and the one seam through which the host reads device data
(`to_host`, counted in `HOST_SYNCS`)."""
from __future__ import annotations

import collections
import threading

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
    """Host-built step metadata onto `device`: the same tensors on CPU; on a GPU, all of them
    packed into one pinned host buffer and moved in one asynchronous copy (called once per step,
    never per layer). The results are views of that one device buffer, with the shapes and dtypes
    of `tensors`. No host sync: the pinned buffer is torch's caching host allocator's, which keeps
    it until the copy has run."""
    if device.type == "cpu":
        return tensors
    return staged_copy(device, tensors, pin=True)


def staged_copy(device: torch.device, tensors, pin: bool) -> tuple[torch.Tensor, ...]:
    """`to_device`'s packing: host tensors into one (pinned) byte buffer, one copy to `device`,
    views back (tests run it on CPU with pin=False). Tensors not in host memory pass as they are."""
    host = [t for t in tensors if t.device.type == "cpu"]
    flat = [t.detach().contiguous().reshape(-1) for t in host]
    offsets, total = [], 0
    for t in flat:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 8) * 8        # 8-byte aligned: any dtype views back
    staging = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=pin)
    for t, off in zip(flat, offsets):
        if t.numel():
            staging[off: off + t.numel() * t.element_size()].copy_(t.view(torch.uint8))
    moved = staging.to(device, non_blocking=True) if pin else staging.to(device)
    views = iter([moved[off: off + t.numel() * t.element_size()].view(t.dtype).view(src.shape)
                  for t, off, src in zip(flat, offsets, host)])
    return tuple(next(views) if t.device.type == "cpu" else t for t in tensors)


# ---- the one seam for device -> host reads --------------------------------------------------------------
class HostSyncs:
    """Every read of device data by the host goes through `to_host`, which counts it here, by
    reason. On a GPU each one is a round trip that stalls the host until the device has caught
    up; on CPU the same calls are counted, so a CPU test sees how many a GPU step would make
    (tests/test_host_syncs.py). `HOST_SYNCS` is the process's counter (the step loop's thread and
    the transfer engine's alike)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()

    def note(self, why: str) -> None:
        with self._lock:
            self.counts[why] += 1

    def total(self) -> int:
        return sum(self.counts.values())

    def snapshot(self) -> collections.Counter[str]:
        with self._lock:
            return collections.Counter(self.counts)


HOST_SYNCS = HostSyncs()


def to_host(t: torch.Tensor, why: str) -> torch.Tensor:
    """`t` in host memory: the one seam through which the runtime reads device data (`why` says
    what for; counted in `HOST_SYNCS`). On CPU it is `t` itself. Under
    `torch.cuda.set_sync_debug_mode("error")` this read is allowed: it is the sanctioned one (in
    "warn" mode it is reported like any other)."""
    HOST_SYNCS.note(why)
    if t.device.type == "cpu":
        return t
    if t.device.type == "cuda" and torch.cuda.get_sync_debug_mode() == 2:
        torch.cuda.set_sync_debug_mode(0)
        try:
            return t.cpu()
        finally:
            torch.cuda.set_sync_debug_mode(2)
    return t.cpu()


def host_list(t: torch.Tensor, why: str) -> list:
    """`t.tolist()` through the seam."""
    return to_host(t, why).tolist()
