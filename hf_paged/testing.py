"""Test facilities: a simulated stream device on the CPU, so that CI exercises the ordering CUDA needs.

:class:`SimulatedStreamBackend` behaves like :class:`~hf_paged.device.StreamBackend` on a GPU, with the
host thread as the compute stream:

* copies run on a worker thread per direction (host to device, device to host), in order per stream,
  each ``delay`` seconds after the one before; an event completes when its copy has run;
* :meth:`~SimulatedStreamBackend.order_after` blocks the host (the compute stream) until the event's copy
  has run, as a stream wait blocks later kernels;
* :meth:`~SimulatedStreamBackend.is_done` reports a copy complete once it has run, as an event query does, so what a
  store does next (the copies it starts ahead, the blocks it reuses, and so what it allocates) follows the threads'
  timing. Two other settings of ``completion`` make it follow the program alone, so that two runs of one program
  allocate alike: ``"waited"`` reports only the copies the host waited for or ordered the compute stream after, as
  if every copy took longer than the host's work; ``"instant"`` has every copy run before the store asks (the host
  waits for it there), as if copies took no time beside the host's work;
* a released device block goes back to a free list and is handed to the next allocation of its size at
  once, as PyTorch's caching allocator does; its content is overwritten (NaN, or 0xA5 bytes) on release
  and fresh blocks, host buffers included, start so, as the next owner's data would;
* a copy holds its device buffers weakly: on CUDA, ``release`` does nothing and a device block is freed
  when its last reference drops, whatever a side stream still does with it. A device buffer collected
  without ``release`` counts as freed, and the copy skips it. Host buffers are held until the copy has run,
  as the caching host allocator keeps a pinned block until the copies queued on it have run;
* where a copy and the compute stream are not ordered as CUDA needs, the result is undefined there, and
  here it is made wrong: a copy whose event the store never waited for, saw complete, or ordered the
  compute stream after, and whose device buffer is released, collected, or used by a copy on the other
  stream, writes garbage into its destination. Each such hazard is also listed in ``hazards``;
* it knows which host memory is pinned (its host buffers, :meth:`~SimulatedStreamBackend.pinned_tensor`,
  :meth:`~SimulatedStreamBackend.pinned_empty`) and which memory is the device's (its device buffers and what
  :meth:`~SimulatedStreamBackend.to_device` copies there, :meth:`~SimulatedStreamBackend.holds`): a copy to the
  device from pageable memory, which on CUDA makes the host wait, is listed in ``pageable_copies``.

Select it with :func:`simulated_streams`; every page store built inside the block uses it.

What it cannot show: compute work here finishes before the host moves on, so a copy that forgot to wait
for the compute stream (``wait_stream`` in :class:`~hf_paged.device.StreamBackend`) still reads finished
updates; the ``gpu`` tests cover that.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from . import device as device_module
from .blocks import packing
from .device import Buffers, BufferSpec, PageBuffers, SyncBackend, pinned_block_bytes, pinned_page_buffers


def _tensors(buffers: Buffers) -> tuple[torch.Tensor, ...]:
    """The tensors that hold ``buffers``: a :class:`~hf_paged.device.PageBuffers`' block, or the buffers."""
    return (buffers.block,) if isinstance(buffers, PageBuffers) else tuple(buffers)


def _storages(buffers: Buffers) -> set[int]:
    return {tensor.untyped_storage().data_ptr() for tensor in _tensors(buffers)}


def _poison(tensors: Sequence[torch.Tensor]) -> None:
    """Overwrite ``tensors`` as the next owner's data would: NaN, or 0xFF bytes (NaN in a block's fp32 buffers)."""
    for tensor in tensors:
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        else:
            tensor.view(torch.uint8).fill_(0xFF)


@dataclass(eq=False)
class SimulatedEvent:
    """Completion of one simulated copy between ``host`` buffers (held) and ``device`` buffers (held weakly)."""

    stream: str
    host: tuple[torch.Tensor, ...]
    device: tuple[tuple[weakref.ref, int, torch.Size, tuple[int, ...], torch.dtype], ...]
    """The tensors copied, a page's blocks (one copy) or its buffers one by one: the host's, and where each device
    tensor lies (its storage held weakly: a view elsewhere keeps a storage alive, as on CUDA)."""
    storages: frozenset[int]
    """Storages of every buffer the copy touches (the device's as they were when it was queued)."""
    done: threading.Event = field(default_factory=threading.Event)
    observed: bool = False
    """Whether the store has waited for it, seen it complete, or ordered the compute stream after it."""
    garbage: bool = False
    """Whether its destination is undefined (a hazard touched it)."""

    def touches(self, storages: set[int]) -> bool:
        return not self.storages.isdisjoint(storages)

    def live_device(self) -> tuple[torch.Tensor, ...] | None:
        """The device tensors, or ``None`` where the storage of one of them has been freed."""
        tensors = self._device_tensors()
        return None if any(tensor is None for tensor in tensors) else tuple(tensors)

    def destination(self) -> tuple[torch.Tensor, ...]:
        """The tensors the copy writes that are still alive."""
        if self.stream == "to_host":
            return self.host
        return tuple(tensor for tensor in self._device_tensors() if tensor is not None)

    def _device_tensors(self) -> list[torch.Tensor | None]:
        tensors = []
        for storage_ref, offset, shape, stride, dtype in self.device:
            storage = storage_ref()
            tensors.append(
                None if storage is None else torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
            )
        return tensors


def _located(tensor: torch.Tensor) -> tuple[weakref.ref, int, torch.Size, tuple[int, ...], torch.dtype]:
    """Where ``tensor`` lies, its storage held weakly."""
    return weakref.ref(tensor.untyped_storage()), tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype


def _collected(backend_ref: weakref.ref, storage: int, nbytes: int) -> None:
    backend = backend_ref()
    if backend is not None:
        backend._collected(storage, nbytes)


Completion = Literal["timed", "waited", "instant"]
"""When a store's query sees a simulated copy complete (see :class:`SimulatedStreamBackend`'s ``completion``)."""


class SimulatedStreamBackend(SyncBackend):
    """A stream device simulated on the CPU (see the module docstring).

    Args:
        device: the device the store believes it uses (a CPU device).
        delay: seconds each copy takes on its stream.
        round_host: round host allocations up as PyTorch's caching host allocator rounds pinned memory
            (one block per page, a power of two), so ``host_bytes`` accounting is exercised.
        completion: when :meth:`is_done` sees a copy complete: ``"timed"``, once its thread has run it;
            ``"waited"``, only once the host has waited for it or ordered the compute stream after it; ``"instant"``,
            always (it waits for the copy first). The last two do not depend on when the copy threads run, for a
            test that counts what a step does in one run and acts on that count in another.
    """

    pins_host_memory = False

    def __init__(
        self,
        device: torch.device | str = "cpu",
        delay: float = 5e-4,
        round_host: bool = False,
        completion: Completion = "timed",
    ) -> None:
        if completion not in get_args(Completion):
            allowed = ", ".join(map(repr, get_args(Completion)))
            raise ValueError(f"completion must be one of {allowed}, got {completion!r}")
        super().__init__(torch.device(device))
        self.delay = delay
        self.round_host = round_host
        self.completion = completion
        self.hazards: list[str] = []
        self.host_waits: defaultdict[str, int] = defaultdict(int)
        """Calls of :meth:`wait` per stream."""
        self.pageable_copies: list[str] = []
        """Copies to the device whose source is not pinned host memory (each a host wait on CUDA)."""
        self._pinned: set[int] = set()
        """Storages (by address) of the live host memory this backend pinned."""
        self._device_storages: set[int] = set()
        """Storages (by address) of the live device memory this backend handed out."""
        self.device_bytes = 0
        """Bytes of device blocks handed out and not released."""
        self.peak_device_bytes = 0
        self._free: defaultdict[tuple[BufferSpec, ...], list[PageBuffers]] = defaultdict(list)
        self._unobserved: list[SimulatedEvent] = []
        self._lock = threading.RLock()  # a device buffer may be collected, and reported, while it is held
        self._closed = False
        self._queues = {name: queue.Queue() for name in ("to_device", "to_host")}
        self._workers = [
            threading.Thread(target=self._run, args=(jobs,), name=f"simulated-{name}-stream", daemon=True)
            for name, jobs in self._queues.items()
        ]
        for worker in self._workers:
            worker.start()

    # Allocation ------------------------------------------------------------------------------------

    def empty_host(self, specs: Sequence[BufferSpec]) -> PageBuffers:
        buffers = pinned_page_buffers(specs, pin_memory=False) if self.round_host else super().empty_host(specs)
        _poison(_tensors(buffers))
        self._follow(buffers.block, self._pinned)
        return buffers

    def pinned_tensor(self, values: Sequence[int] | Sequence[float], dtype: torch.dtype) -> torch.Tensor:
        return self._follow(super().pinned_tensor(values, dtype), self._pinned)

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return self._follow(super().pinned_empty(shape, dtype), self._pinned)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A copy of ``host`` in device memory; one from pageable memory is listed in :attr:`pageable_copies`."""
        if not self.is_pinned(host):
            self.pageable_copies.append(f"to_device from pageable memory: {host.dtype} of shape {tuple(host.shape)}")
        return self._follow(host.clone(), self._device_storages)

    def copy_into(self, device: torch.Tensor, host: torch.Tensor) -> None:
        """Copy ``host`` into ``device`` (this backend's device memory); a copy from pageable memory is listed in
        :attr:`pageable_copies`."""
        if not self.is_pinned(host):
            self.pageable_copies.append(f"copy_into from pageable memory: {host.dtype} of shape {tuple(host.shape)}")
        if not self.holds(device):
            raise ValueError("copy_into: the destination is not this backend's device memory")
        device.copy_(host)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in host memory this backend pinned."""
        return tensor.untyped_storage().data_ptr() in self._pinned

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in this backend's device memory (a page's buffers, or a copy :meth:`to_device`
        made)."""
        return tensor.untyped_storage().data_ptr() in self._device_storages

    @staticmethod
    def _follow(tensor: torch.Tensor, storages: set[int]) -> torch.Tensor:
        """Add ``tensor``'s storage to ``storages`` while it lives."""
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address not in storages:
            storages.add(address)
            weakref.finalize(storage, storages.discard, address)
        return tensor

    def host_nbytes(self, specs: Sequence[BufferSpec]) -> int:
        return pinned_block_bytes(specs) if self.round_host else super().host_nbytes(specs)

    def empty_device(self, specs: Sequence[BufferSpec]) -> PageBuffers:
        specs = tuple(specs)
        nbytes = packing(specs)[1]
        free = self._free[specs]
        if free:
            buffers = free.pop()
        else:
            buffers = super().empty_device(specs)
            _poison(_tensors(buffers))
            storage = buffers.block.untyped_storage()
            weakref.finalize(storage, _collected, weakref.ref(self), storage.data_ptr(), nbytes)
            self._follow(buffers.block, self._device_storages)
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        return buffers

    def release(self, buffers: Buffers) -> None:
        storages = _storages(buffers)
        with self._lock:
            for event in self._unobserved:
                if event.touches(storages):
                    self._hazard(event, "a buffer of it was released")
            _poison(_tensors(buffers))
        self._free[buffers.specs].append(buffers)
        self.device_bytes -= packing(buffers.specs)[1]

    # Copies and events -----------------------------------------------------------------------------

    def copy_to_device(self, dst: Buffers, src: Buffers) -> SimulatedEvent:
        for tensor in _tensors(src):
            if not self.is_pinned(tensor):
                self.pageable_copies.append(f"copy_to_device from pageable memory: {tensor.dtype} {tensor.numel()}")
        return self._enqueue("to_device", host=src, device=dst)

    def copy_to_host(self, dst: Buffers, src: Buffers) -> SimulatedEvent:
        return self._enqueue("to_host", host=dst, device=src)

    def _enqueue(self, stream: str, host: Buffers, device: Buffers) -> SimulatedEvent:
        if self._closed:
            raise RuntimeError("this SimulatedStreamBackend is closed: its streams run no more copies")
        storages = _storages(host) | _storages(device)
        # a page's blocks are copied in one piece, as the backends copy them; other buffers one by one
        host_tensors, device_tensors = (
            (_tensors(host), _tensors(device))
            if isinstance(device, PageBuffers) and device.same_layout(host)
            else (tuple(host), tuple(device))
        )
        event = SimulatedEvent(stream, host_tensors, tuple(map(_located, device_tensors)), frozenset(storages))
        with self._lock:
            for other in self._unobserved:
                if other.stream != stream and other.touches(storages):
                    self._hazard(other, f"a copy on the {stream} stream uses a buffer of it unordered")
                    event.garbage = True
            self._unobserved.append(event)
        self._queues[stream].put(event)
        return event

    def _run(self, jobs: queue.Queue) -> None:
        while (event := jobs.get()) is not None:
            time.sleep(self.delay)
            with self._lock:
                self._copy(event)  # a device buffer whose last reference it held is collected on return
                if event.garbage:
                    _poison(event.destination())
                event.done.set()

    @staticmethod
    def _copy(event: SimulatedEvent) -> None:
        """Run ``event``'s copy; a collected device buffer is not there to copy."""
        device = event.live_device()
        if device is not None:
            dst, src = (event.host, device) if event.stream == "to_host" else (device, event.host)
            for target, source in zip(dst, src):
                target.copy_(source)

    def _hazard(self, event: SimulatedEvent, what: str) -> None:
        """Record that ``event``'s copy is not ordered as CUDA needs; make its result garbage (lock held)."""
        self.hazards.append(f"{event.stream} copy not waited for: {what}")
        event.garbage = True
        if event.done.is_set():
            _poison(event.destination())

    def _collected(self, storage: int, nbytes: int) -> None:
        """A device buffer handed out and not released lost its last reference: CUDA frees its block here."""
        with self._lock:
            self.device_bytes -= nbytes
            for event in self._unobserved:
                if event.touches({storage}):
                    self._hazard(event, "a device buffer of it was freed (its last reference dropped)")

    def _observe(self, event: SimulatedEvent) -> None:
        with self._lock:
            if not event.observed:
                event.observed = True
                self._unobserved.remove(event)

    def is_done(self, event: SimulatedEvent | None) -> bool:
        if event is None or event.observed:
            return True
        if self.completion == "instant":
            event.done.wait()
        if self.completion == "waited" or not event.done.is_set():
            return False
        self._observe(event)
        return True

    def wait(self, event: SimulatedEvent | None) -> float:
        if event is None:
            return 0.0
        self.host_waits[event.stream] += 1
        if self.is_done(event):
            return 0.0
        start = time.perf_counter()
        event.done.wait()
        self._observe(event)
        return time.perf_counter() - start

    def order_after(self, event: SimulatedEvent | None) -> None:
        if event is not None:
            event.done.wait()
            self._observe(event)

    def close(self) -> None:
        """Finish the queued copies and stop the worker threads."""
        self._closed = True
        for jobs in self._queues.values():
            jobs.put(None)
        for worker in self._workers:
            worker.join()


@contextlib.contextmanager
def simulated_streams(
    delay: float = 5e-4, round_host: bool = False, completion: Completion = "timed"
) -> Iterator[list[SimulatedStreamBackend]]:
    """Within the block, every new page store gets a :class:`SimulatedStreamBackend` of these arguments.

    Yields the list of backends created so far (for their ``hazards`` and ``peak_device_bytes``); they are
    closed on exit.
    """
    backends: list[SimulatedStreamBackend] = []

    def factory(device: torch.device) -> SimulatedStreamBackend:
        backend = SimulatedStreamBackend(device, delay=delay, round_host=round_host, completion=completion)
        backends.append(backend)
        return backend

    previous = device_module._backend_factory
    device_module._backend_factory = factory
    try:
        yield backends
    finally:
        device_module._backend_factory = previous
        for backend in backends:
            backend.close()
