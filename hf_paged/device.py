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

import array
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .blocks import BufferSpec, packing

Buffers = Sequence[torch.Tensor]
"""A page's buffers: :class:`PageBuffers` from a backend, or any sequence of tensors."""

Event = Any
"""A backend's copy-completion handle: a stream event, or ``None`` for a copy that already completed."""

_ARRAY_CODES = {torch.int64: "q", torch.float32: "f"}
"""The ``array`` type code of each dtype :meth:`SyncBackend.pinned_tensor` converts through one."""

_FAKE = torch._C._TorchDispatchModeKey.FAKE

class PageBuffers(Sequence[torch.Tensor]):
    """A page's buffers packed in one uint8 ``block`` (see :func:`packing`): one allocation and one copy move a page,
    whatever its format's buffers. The view of each buffer is made when it is first asked for (a kernel that takes
    addresses needs none).

    Args:
        block: the block (exactly the packed bytes, on the host or the device).
        specs: the buffers.
        offsets: each buffer's byte offset in the block, :func:`packing`'s (worked out here when not given).
    """

    __slots__ = ("__weakref__", "_addresses", "_views", "block", "offsets", "specs")

    def __init__(
        self, block: torch.Tensor, specs: tuple[BufferSpec, ...], offsets: tuple[int, ...] | None = None
    ) -> None:
        self.block = block
        self.specs = specs
        self.offsets = packing(specs)[0] if offsets is None else offsets
        self._views: list[torch.Tensor | None] = [None] * len(specs)
        self._addresses: tuple[Callable[[torch.Tensor], int], list[int]] | None = None

    def addresses(self, address_of: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr) -> list[int]:
        """The address of each buffer: the block's, read by ``address_of``, plus its offset (worked out once for
        each ``address_of``; a block keeps its memory)."""
        cached = self._addresses
        if cached is None or cached[0] is not address_of:
            base = address_of(self.block)
            cached = self._addresses = (address_of, [base + offset for offset in self.offsets])
        return cached[1]

    def __len__(self) -> int:
        return len(self.specs)

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[torch.Tensor, ...]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if isinstance(index, slice):
            return tuple(self[position] for position in range(*index.indices(len(self.specs))))
        view = self._views[index]
        if view is None:
            numel, dtype = self.specs[index]
            offset = self.offsets[index]
            view = self._views[index] = self.block[offset : offset + numel * dtype.itemsize].view(dtype)
        return view

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[index] for index in range(len(self.specs)))

    def __repr__(self) -> str:
        return f"PageBuffers({list(self.specs)}, {self.block.device})"

    def same_layout(self, other: Buffers) -> bool:
        """Whether ``other`` is a :class:`PageBuffers` of the same buffers: one block copy moves it."""
        return isinstance(other, PageBuffers) and other.specs == self.specs


def copy_buffers(dst: Buffers, src: Buffers, non_blocking: bool = False) -> None:
    """Copy ``src`` into ``dst``: one copy of their blocks where both are :class:`PageBuffers` of one layout, else
    buffer by buffer."""
    if isinstance(dst, PageBuffers) and isinstance(src, PageBuffers) and dst.specs == src.specs:
        if not isinstance(dst.block, FakeTensor):  # a memory plan's fake blocks hold no values: nothing moves
            dst.block.copy_(src.block, non_blocking=non_blocking)
        return
    for target, source in zip(dst, src, strict=True):
        target.copy_(source, non_blocking=non_blocking)


def zero_buffers(buffers: Buffers) -> None:
    """Fill ``buffers`` with zeros (a :class:`PageBuffers`' block in one call)."""
    if isinstance(buffers, PageBuffers):
        buffers.block.zero_()
        return
    for buffer in buffers:
        buffer.zero_()


class SyncBackend:
    """Backend whose copies complete before they return (CPU, and devices without streams).

    A page's buffers on either side are one block (:class:`PageBuffers`), so that moving a page is one copy.
    """

    pins_host_memory = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def empty_host(self, specs: Sequence[BufferSpec]) -> PageBuffers:
        """Uninitialised host buffers, one block."""
        specs = tuple(specs)
        offsets, nbytes = packing(specs)
        return PageBuffers(torch.empty(nbytes, dtype=torch.uint8), specs, offsets)

    def host_nbytes(self, specs: Sequence[BufferSpec]) -> int:
        """Bytes of host memory that :meth:`empty_host` of ``specs`` holds: its block's."""
        return packing(tuple(specs))[1]

    def empty_device(self, specs: Sequence[BufferSpec]) -> PageBuffers:
        """Uninitialised device buffers, one block."""
        specs = tuple(specs)
        offsets, nbytes = packing(specs)
        return PageBuffers(torch.empty(nbytes, dtype=torch.uint8, device=self.device), specs, offsets)

    def release(self, buffers: Buffers) -> None:
        """Give device ``buffers`` back; the caller has ordered the compute stream after every copy of them.

        The allocator may hand their memory to the next allocation at once, as PyTorch's caching allocator does.
        """

    def pinned_tensor(self, values: Sequence[int] | Sequence[float], dtype: torch.dtype) -> torch.Tensor:
        """A new 1-D host tensor of ``values`` that :meth:`to_device` copies without the host waiting: in pinned
        memory where this backend pins host memory. int64 and fp32 values are converted in one call (an ``array``,
        three times faster than ``torch.tensor`` from a list) and, where this backend pins, copied into a pinned
        tensor (not under ``FakeTensorMode``, whose tensors cannot share memory)."""
        code = _ARRAY_CODES.get(dtype)
        if code is None or not values or torch._C._get_dispatch_mode(_FAKE) is not None:
            return torch.tensor(values, dtype=dtype, pin_memory=self.pins_host_memory)
        host = torch.frombuffer(array.array(code, values), dtype=dtype)
        if not self.pins_host_memory:
            return host
        return self.pinned_empty(host.shape, dtype).copy_(host)

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A new uninitialised host tensor that :meth:`to_device` copies without the host waiting."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.pins_host_memory)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A copy on the device of ``host``, a tensor of :meth:`pinned_tensor` or :meth:`pinned_empty`, queued on the
        compute stream: later kernels read it, and the host does not wait. ``host`` may be dropped at once (the
        caching host allocator keeps pinned memory until the copies that read it have run)."""
        return host.to(self.device, copy=True)

    def copy_into(self, device: torch.Tensor, host: torch.Tensor) -> None:
        """Copy ``host``, a tensor of :meth:`pinned_tensor` or :meth:`pinned_empty`, into ``device``, a tensor on the
        device of as many elements, on the compute stream, as :meth:`to_device` copies."""
        device.copy_(host)

    def copy_to_device(self, dst: Buffers, src: Buffers) -> Event:
        """Copy host ``src`` into device ``dst`` after the compute work queued so far; return its event."""
        copy_buffers(dst, src)
        return None

    def copy_to_host(self, dst: Buffers, src: Buffers) -> Event:
        """Copy device ``src`` into host ``dst`` after the compute work queued so far; return its event."""
        copy_buffers(dst, src)
        return None

    def is_done(self, event: Event) -> bool:
        """Whether the copy behind ``event`` has completed."""
        return True

    def wait(self, event: Event) -> float:
        """Block the host until ``event`` completes; return the seconds waited."""
        return 0.0

    def order_after(self, event: Event) -> None:
        """Make later compute work on the device wait for ``event`` (the host does not wait)."""


def pinned_block_bytes(specs: Sequence[BufferSpec]) -> int:
    """Bytes of the one pinned block that holds buffers of ``specs`` (:func:`packing`).

    PyTorch's caching host allocator rounds a pinned allocation up to the next power of two
    (``CachingHostAllocator.h``, ``PowerOf2Ceil``), so the block is requested at that size: what is
    requested is what is held, whatever ``pinned_max_round_threshold`` says.
    """
    packed = packing(tuple(specs))[1]
    return 1 << max(packed - 1, 0).bit_length()


def pinned_page_buffers(specs: Sequence[BufferSpec], pin_memory: bool) -> PageBuffers:
    """Host buffers of ``specs`` in one block of :func:`pinned_block_bytes` (pinned with ``pin_memory``)."""
    specs = tuple(specs)
    offsets, nbytes = packing(specs)
    block = torch.empty(pinned_block_bytes(specs), dtype=torch.uint8, pin_memory=pin_memory)
    return PageBuffers(block[:nbytes], specs, offsets)


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

    def empty_host(self, specs: Sequence[BufferSpec]) -> PageBuffers:
        return pinned_page_buffers(specs, pin_memory=True)

    def host_nbytes(self, specs: Sequence[BufferSpec]) -> int:
        return pinned_block_bytes(specs)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def copy_into(self, device: torch.Tensor, host: torch.Tensor) -> None:
        device.copy_(host, non_blocking=True)

    def copy_to_device(self, dst: Buffers, src: Buffers) -> Event:
        return self._copy_on(self._to_device_stream, dst, src)

    def copy_to_host(self, dst: Buffers, src: Buffers) -> Event:
        return self._copy_on(self._to_host_stream, dst, src)

    def _copy_on(self, stream: Any, dst: Buffers, src: Buffers) -> Event:
        stream.wait_stream(self._module.current_stream(self.device))
        with self._module.stream(stream):
            copy_buffers(dst, src, non_blocking=True)
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


def has_streams(device: torch.device) -> bool:
    """Whether ``device``'s PyTorch module has streams and events (CUDA, XPU): copies to it run from pinned host memory
    without the host waiting."""
    if device.type in ("cpu", "meta"):
        return False
    module = torch.get_device_module(device.type)
    return all(hasattr(module, name) for name in ("Stream", "Event", "current_stream", "stream"))


def values_to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of ``values`` on ``device``, copied from pinned host memory without the host waiting where
    ``device`` has streams (a copy from pageable memory would wait for the device); on the CPU, made there."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    pinned = has_streams(device)
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=pinned)


BackendFactory = Callable[[torch.device], SyncBackend]

_backend_factory: BackendFactory | None = None
"""Where set (by :mod:`hf_paged.testing`), the factory :func:`backend_for` uses instead of its own choice."""


def backend_for(device: torch.device) -> SyncBackend:
    """Return the backend for ``device``: streams where its PyTorch module has them, else synchronous."""
    if _backend_factory is not None:
        return _backend_factory(device)
    if device.type == "cpu":
        return SyncBackend(device)
    return StreamBackend(device) if has_streams(device) else SyncBackend(device)


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
