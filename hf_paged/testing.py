"""Test facilities: a simulated stream device on the CPU, so that CI exercises the ordering CUDA needs.

:class:`SimulatedStreamBackend` behaves like :class:`~hf_paged.device.StreamBackend` on a GPU, with the
host thread as the compute stream:

* copies run on a worker thread per direction (host to device, device to host), in order per stream,
  each ``delay`` seconds after the one before; an event completes when its copy has run;
* :meth:`~SimulatedStreamBackend.order_after` blocks the host (the compute stream) until the event's copy
  has run, as a stream wait blocks later kernels;
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
  stream, writes garbage into its destination. Each such hazard is also listed in ``hazards``.

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

import torch

from . import device as device_module
from .device import Buffers, BufferSpec, SyncBackend, carve, pinned_block_bytes


def _storages(buffers: Buffers) -> set[int]:
    return {buffer.untyped_storage().data_ptr() for buffer in buffers}


def _poison(buffers: Buffers) -> None:
    for buffer in buffers:
        if buffer.is_floating_point():
            buffer.fill_(float("nan"))
        else:
            buffer.view(torch.uint8).fill_(0xA5)


@dataclass(eq=False)
class SimulatedEvent:
    """Completion of one simulated copy between ``host`` buffers (held) and ``device`` buffers (held weakly)."""

    stream: str
    host: Buffers
    device: tuple[weakref.ref, ...]
    storages: frozenset[int]
    """Storages of every buffer the copy touches (the device's as they were when it was queued)."""
    done: threading.Event = field(default_factory=threading.Event)
    observed: bool = False
    """Whether the store has waited for it, seen it complete, or ordered the compute stream after it."""
    garbage: bool = False
    """Whether its destination is undefined (a hazard touched it)."""

    def touches(self, storages: set[int]) -> bool:
        return not self.storages.isdisjoint(storages)

    def live_device(self) -> Buffers | None:
        """The device buffers, or ``None`` where one of them has been collected."""
        buffers = tuple(ref() for ref in self.device)
        return None if any(buffer is None for buffer in buffers) else buffers

    def destination(self) -> Buffers:
        """The buffers the copy writes that are still alive."""
        if self.stream == "to_host":
            return self.host
        return tuple(buffer for buffer in (ref() for ref in self.device) if buffer is not None)


def _collected(backend_ref: weakref.ref, storage: int, nbytes: int) -> None:
    backend = backend_ref()
    if backend is not None:
        backend._collected(storage, nbytes)


class SimulatedStreamBackend(SyncBackend):
    """A stream device simulated on the CPU (see the module docstring).

    Args:
        device: the device the store believes it uses (a CPU device).
        delay: seconds each copy takes on its stream.
        round_host: round host allocations up as PyTorch's caching host allocator rounds pinned memory
            (one block per page, a power of two), so ``host_bytes`` accounting is exercised.
    """

    pins_host_memory = False

    def __init__(self, device: torch.device | str = "cpu", delay: float = 5e-4, round_host: bool = False) -> None:
        super().__init__(torch.device(device))
        self.delay = delay
        self.round_host = round_host
        self.hazards: list[str] = []
        self.host_waits: defaultdict[str, int] = defaultdict(int)
        """Calls of :meth:`wait` per stream."""
        self.device_bytes = 0
        """Bytes of device blocks handed out and not released."""
        self.peak_device_bytes = 0
        self._free: defaultdict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
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

    def empty_host(self, specs: Sequence[BufferSpec]) -> Buffers:
        if self.round_host:
            buffers = carve(torch.empty(pinned_block_bytes(specs), dtype=torch.uint8), specs)
        else:
            buffers = super().empty_host(specs)
        _poison(buffers)
        return buffers

    def host_nbytes(self, specs: Sequence[BufferSpec]) -> int:
        return pinned_block_bytes(specs) if self.round_host else super().host_nbytes(specs)

    def empty_device(self, specs: Sequence[BufferSpec]) -> Buffers:
        buffers = []
        for numel, dtype in specs:
            free = self._free[(numel, dtype)]
            if free:
                buffer = free.pop()
            else:
                buffer = torch.empty(numel, dtype=dtype)
                _poison((buffer,))
                storage = buffer.untyped_storage()
                weakref.finalize(storage, _collected, weakref.ref(self), storage.data_ptr(), storage.nbytes())
            buffers.append(buffer)
            self.device_bytes += numel * dtype.itemsize
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        return tuple(buffers)

    def release(self, buffers: Buffers) -> None:
        storages = _storages(buffers)
        with self._lock:
            for event in self._unobserved:
                if event.touches(storages):
                    self._hazard(event, "a buffer of it was released")
            _poison(buffers)
        for buffer in buffers:
            self._free[(buffer.numel(), buffer.dtype)].append(buffer)
            self.device_bytes -= buffer.numel() * buffer.dtype.itemsize

    # Copies and events -----------------------------------------------------------------------------

    def copy_to_device(self, dst: Buffers, src: Buffers) -> SimulatedEvent:
        return self._enqueue("to_device", host=src, device=dst)

    def copy_to_host(self, dst: Buffers, src: Buffers) -> SimulatedEvent:
        return self._enqueue("to_host", host=dst, device=src)

    def _enqueue(self, stream: str, host: Buffers, device: Buffers) -> SimulatedEvent:
        if self._closed:
            raise RuntimeError("this SimulatedStreamBackend is closed: its streams run no more copies")
        storages = _storages(host) | _storages(device)
        event = SimulatedEvent(stream, host, tuple(weakref.ref(buffer) for buffer in device), frozenset(storages))
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
        if event is None:
            return True
        if not event.done.is_set():
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
def simulated_streams(delay: float = 5e-4, round_host: bool = False) -> Iterator[list[SimulatedStreamBackend]]:
    """Within the block, every new page store gets a :class:`SimulatedStreamBackend`.

    Yields the list of backends created so far (for their ``hazards`` and ``peak_device_bytes``); they are
    closed on exit.
    """
    backends: list[SimulatedStreamBackend] = []

    def factory(device: torch.device) -> SimulatedStreamBackend:
        backend = SimulatedStreamBackend(device, delay=delay, round_host=round_host)
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
