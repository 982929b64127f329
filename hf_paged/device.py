"""Device backends: allocation, copies between host and device, and their ordering for one device.

This is the only module that touches stream and event APIs. Two backends exist:

* :class:`StreamBackend` for accelerators whose PyTorch module has streams and events (CUDA, XPU):
  host buffers are pinned, copies run on a side stream, and events order them with the compute stream.
* :class:`SyncBackend` for the CPU and devices without streams: copies are plain synchronous copies.
  On a CPU-only machine the "device" pool is ordinary CPU memory, so the page store above runs the same
  eviction, prefetch and write-back logic and tests cover it without an accelerator.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

BufferSpec = tuple[int, torch.dtype]
"""A buffer to allocate: its number of elements and dtype."""

Buffers = tuple[torch.Tensor, ...]

Event = Any
"""A backend's copy-completion handle: a stream event, or ``None`` for a copy that already completed."""


class SyncBackend:
    """Backend whose copies complete before they return (CPU, and devices without streams)."""

    pins_host_memory = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def empty_host(self, specs: Sequence[BufferSpec]) -> Buffers:
        """Uninitialised host buffers."""
        return tuple(torch.empty(numel, dtype=dtype) for numel, dtype in specs)

    def empty_device(self, specs: Sequence[BufferSpec]) -> Buffers:
        """Uninitialised device buffers."""
        return tuple(torch.empty(numel, dtype=dtype, device=self.device) for numel, dtype in specs)

    def copy(self, dst: Buffers, src: Buffers) -> Event:
        """Copy each of ``src`` into ``dst`` after the work queued so far; return the completion event."""
        for target, source in zip(dst, src):
            target.copy_(source)
        return None

    def is_done(self, event: Event) -> bool:
        """Whether the copy behind ``event`` has completed."""
        return True

    def wait(self, event: Event) -> float:
        """Block the host until ``event`` completes; return the seconds waited."""
        return 0.0

    def order_after(self, event: Event) -> None:
        """Make later compute work on the device wait for ``event``."""


class StreamBackend(SyncBackend):
    """Backend for an accelerator with streams: pinned host buffers and copies on a side stream."""

    pins_host_memory = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._module = torch.get_device_module(device.type)
        with self._module.device(device):
            self._copy_stream = self._module.Stream()

    def empty_host(self, specs: Sequence[BufferSpec]) -> Buffers:
        return tuple(torch.empty(numel, dtype=dtype, pin_memory=True) for numel, dtype in specs)

    def copy(self, dst: Buffers, src: Buffers) -> Event:
        compute_stream = self._module.current_stream(self.device)
        self._copy_stream.wait_stream(compute_stream)
        with self._module.stream(self._copy_stream):
            for target, source in zip(dst, src):
                target.copy_(source, non_blocking=True)
            event = self._module.Event()
            event.record(self._copy_stream)
        return event

    def is_done(self, event: Event) -> bool:
        return event is None or event.query()

    def wait(self, event: Event) -> float:
        if self.is_done(event):
            return 0.0
        start = time.perf_counter()
        event.synchronize()
        return time.perf_counter() - start

    def order_after(self, event: Event) -> None:
        if event is not None:
            self._module.current_stream(self.device).wait_event(event)


def backend_for(device: torch.device) -> SyncBackend:
    """Return the backend for ``device``: streams where its PyTorch module has them, else synchronous."""
    if device.type == "cpu":
        return SyncBackend(device)
    module = torch.get_device_module(device.type)
    if all(hasattr(module, name) for name in ("Stream", "Event", "current_stream", "stream")):
        return StreamBackend(device)
    return SyncBackend(device)
