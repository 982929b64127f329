"""Device backends: allocation, copies between host and device, and their ordering for one device.

This is the only module that touches stream, event and memory-statistics APIs. Two backends exist:

* :class:`StreamBackend` for accelerators whose PyTorch module has streams and events (CUDA, XPU):
  host buffers are pinned, copies run on one side stream per direction, and events order them with the
  compute stream.
* :class:`SyncBackend` for the CPU and devices without streams: copies are plain synchronous copies.
  On a CPU-only machine the "device" pool is ordinary CPU memory, so the page store above runs the same
  eviction, prefetch and write-back logic and tests cover it without an accelerator.

:func:`memory_for` gives the memory figures of a device (allocated, reserved, peak, free, total) with one
interface: :class:`AcceleratorMemory` from the device's PyTorch module, :class:`HostMemory` for the CPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
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

    def host_nbytes(self, specs: Sequence[BufferSpec]) -> int:
        """Bytes of host memory that :meth:`empty_host` of ``specs`` really holds."""
        return sum(numel * dtype.itemsize for numel, dtype in specs)

    def empty_device(self, specs: Sequence[BufferSpec]) -> Buffers:
        """Uninitialised device buffers."""
        return tuple(torch.empty(numel, dtype=dtype, device=self.device) for numel, dtype in specs)

    def release(self, buffers: Buffers) -> None:
        """Give device ``buffers`` back; the caller has ordered the compute stream after every copy of them.

        The allocator may hand their memory to the next allocation at once, as PyTorch's caching allocator does.
        """

    def copy_to_device(self, dst: Buffers, src: Buffers) -> Event:
        """Copy host ``src`` into device ``dst`` after the compute work queued so far; return its event."""
        return self._copy(dst, src)

    def copy_to_host(self, dst: Buffers, src: Buffers) -> Event:
        """Copy device ``src`` into host ``dst`` after the compute work queued so far; return its event."""
        return self._copy(dst, src)

    def _copy(self, dst: Buffers, src: Buffers) -> Event:
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
        """Make later compute work on the device wait for ``event`` (the host does not wait)."""


_HOST_ALIGNMENT = 64
"""Bytes to which each buffer of a packed pinned block is aligned."""


def pinned_block_bytes(specs: Sequence[BufferSpec]) -> int:
    """Bytes of the one pinned block that holds buffers of ``specs``, each aligned to 64 bytes.

    PyTorch's caching host allocator rounds a pinned allocation up to the next power of two
    (``CachingHostAllocator.h``, ``PowerOf2Ceil``), so the block is requested at that size: what is
    requested is what is held, whatever ``pinned_max_round_threshold`` says.
    """
    packed = sum(-(-numel * dtype.itemsize // _HOST_ALIGNMENT) * _HOST_ALIGNMENT for numel, dtype in specs)
    return 1 << max(packed - 1, 0).bit_length()


def carve(block: torch.Tensor, specs: Sequence[BufferSpec]) -> Buffers:
    """Views of the uint8 ``block`` as consecutive buffers of ``specs``, each aligned to 64 bytes."""
    buffers, offset = [], 0
    for numel, dtype in specs:
        nbytes = numel * dtype.itemsize
        buffers.append(block[offset : offset + nbytes].view(dtype))
        offset += -(-nbytes // _HOST_ALIGNMENT) * _HOST_ALIGNMENT
    return tuple(buffers)


class StreamBackend(SyncBackend):
    """Backend for an accelerator with streams: pinned host buffers, one copy stream per direction.

    GPUs have a copy engine per direction, so write-backs do not queue behind prefetches. Each copy waits
    for the compute work queued before it; the compute stream waits for a copy only through
    :meth:`order_after`, never through the host.

    Stream safety of freed memory: device buffers are allocated on the compute stream and the store
    releases one only after the compute stream has been ordered after every copy that used it (a
    page-in through :meth:`order_after`, a write-back through the host having seen it complete), so
    PyTorch's caching allocator may reuse the block at once without ``record_stream``. Pinned host
    blocks may be dropped while a copy still uses them: ``copy_(non_blocking=True)`` records an event
    on the copy stream with the caching host allocator, which reuses the block only after it.
    """

    pins_host_memory = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._module = torch.get_device_module(device.type)
        with self._module.device(device):
            self._to_device_stream = self._module.Stream()
            self._to_host_stream = self._module.Stream()

    def empty_host(self, specs: Sequence[BufferSpec]) -> Buffers:
        return carve(torch.empty(pinned_block_bytes(specs), dtype=torch.uint8, pin_memory=True), specs)

    def host_nbytes(self, specs: Sequence[BufferSpec]) -> int:
        return pinned_block_bytes(specs)

    def copy_to_device(self, dst: Buffers, src: Buffers) -> Event:
        return self._copy_on(self._to_device_stream, dst, src)

    def copy_to_host(self, dst: Buffers, src: Buffers) -> Event:
        return self._copy_on(self._to_host_stream, dst, src)

    def _copy_on(self, stream: Any, dst: Buffers, src: Buffers) -> Event:
        stream.wait_stream(self._module.current_stream(self.device))
        with self._module.stream(stream):
            for target, source in zip(dst, src):
                target.copy_(source, non_blocking=True)
            event = self._module.Event()
            event.record(stream)
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


BackendFactory = Callable[[torch.device], SyncBackend]

_backend_factory: BackendFactory | None = None
"""Where set (by :mod:`hf_paged.testing`), the factory :func:`backend_for` uses instead of its own choice."""


def backend_for(device: torch.device) -> SyncBackend:
    """Return the backend for ``device``: streams where its PyTorch module has them, else synchronous."""
    if _backend_factory is not None:
        return _backend_factory(device)
    if device.type == "cpu":
        return SyncBackend(device)
    module = torch.get_device_module(device.type)
    if all(hasattr(module, name) for name in ("Stream", "Event", "current_stream", "stream")):
        return StreamBackend(device)
    return SyncBackend(device)


class HostMemory:
    """Memory figures of this process on the host (the CPU "device"), in bytes.

    Resident set and its high-water mark come from ``/proc/self/status`` (``VmRSS``, ``VmHWM``) and the mark
    is reset through ``/proc/self/clear_refs``; where ``/proc`` is missing, ``psutil`` gives the resident
    set and the peak is left to sampling (``peak()`` returns ``None``).
    """

    _STATUS = "/proc/self/status"
    _CLEAR_REFS = "/proc/self/clear_refs"

    def __init__(self) -> None:
        self._has_proc = os.path.exists(self._STATUS)
        if not self._has_proc:
            try:
                import psutil
            except ImportError as error:
                raise RuntimeError(
                    "measuring host memory needs /proc/self/status or psutil: pip install psutil"
                ) from error
            self._process = psutil.Process()
        self.can_reset_peak = self._has_proc and os.access(self._CLEAR_REFS, os.W_OK)

    def _status_kib(self, key: str) -> int:
        with open(self._STATUS) as status:
            for line in status:
                if line.startswith(key):
                    return int(line.split()[1])
        raise RuntimeError(f"{self._STATUS} has no {key} line")

    def resident(self) -> int:
        """The process's resident set."""
        if self._has_proc:
            return self._status_kib("VmRSS:") * 1024
        return self._process.memory_info().rss

    allocated = resident
    reserved = resident

    def peak(self) -> int | None:
        """The resident set's high-water mark since the last reset, ``None`` where it is not kept."""
        return self._status_kib("VmHWM:") * 1024 if self._has_proc else None

    def reset_peak(self) -> None:
        """Start the high-water mark afresh at the current resident set."""
        with open(self._CLEAR_REFS, "w") as clear_refs:
            clear_refs.write("5")

    def total(self) -> int:
        """Physical memory of the machine."""
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            import psutil

            return psutil.virtual_memory().total

    def free(self) -> int:
        """Memory available to new allocations without swapping."""
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        import psutil

        return psutil.virtual_memory().available


class AcceleratorMemory:
    """Memory figures of one accelerator from its PyTorch module, in bytes.

    CUDA and XPU expose allocated, reserved, a resettable peak and free/total; MPS exposes allocated
    (``current_allocated_memory``), the driver's total (``driver_allocated_memory``) and a recommended
    maximum, and keeps no peak, so :meth:`peak` returns ``None`` there. ``module`` replaces the device's
    PyTorch module (``torch.cuda`` ...), for tests.
    """

    def __init__(self, device: torch.device, module: Any = None) -> None:
        module = module if module is not None else getattr(torch, device.type, None)
        if module is None or not getattr(module, "is_available", lambda: False)():
            raise RuntimeError(
                f"cannot measure memory of device {str(device)!r}: PyTorch reports no {device.type} device on "
                "this machine (torch memory calls would silently return 0)"
            )
        self._module = module
        if device.index is not None:
            self._index = device.index
        else:
            self._index = module.current_device() if hasattr(module, "current_device") else 0
        self._allocator = hasattr(module, "memory_allocated")
        self.can_reset_peak = hasattr(module, "reset_peak_memory_stats")

    def allocated(self) -> int:
        """Bytes held by tensors."""
        if self._allocator:
            return self._module.memory_allocated(self._index)
        return self._module.current_allocated_memory()

    def reserved(self) -> int:
        """Bytes held by PyTorch's caching allocator (tensors and cached blocks)."""
        if hasattr(self._module, "memory_reserved"):
            return self._module.memory_reserved(self._index)
        return self._module.driver_allocated_memory()

    def peak(self) -> int | None:
        """Peak of :meth:`allocated` since the last reset, ``None`` where PyTorch keeps none."""
        if hasattr(self._module, "max_memory_allocated"):
            return self._module.max_memory_allocated(self._index)
        return None

    def reset_peak(self) -> None:
        """Start the peak afresh at the current allocation (PyTorch's global peak of this device)."""
        self._module.reset_peak_memory_stats(self._index)

    def total(self) -> int:
        """The device memory this process may allocate: the device's, times the per-process memory fraction.

        ``torch.cuda.set_per_process_memory_fraction`` caps the caching allocator at the fraction of the
        device's memory; the cap is read back through ``get_per_process_memory_fraction``.
        """
        if hasattr(self._module, "mem_get_info"):
            return int(self._module.mem_get_info(self._index)[1] * self._fraction())
        return self._module.recommended_max_memory()

    def free(self) -> int:
        """Device memory free for this process: not in use by any process and within its memory fraction
        (or, without a driver query, total minus reserved)."""
        if hasattr(self._module, "mem_get_info"):
            free = self._module.mem_get_info(self._index)[0]
            if self._fraction() < 1.0:
                free = min(free, max(0, self.total() - self.reserved()))
            return free
        return max(0, self.total() - self.reserved())

    def _fraction(self) -> float:
        get_fraction = getattr(self._module, "get_per_process_memory_fraction", None)
        return 1.0 if get_fraction is None else get_fraction(self._index)


def memory_for(device: torch.device) -> HostMemory | AcceleratorMemory:
    """Return the memory figures of ``device``: the host process for the CPU, else the accelerator's."""
    return HostMemory() if device.type == "cpu" else AcceleratorMemory(device)
