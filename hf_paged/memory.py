"""The memory probe: capacity, allocation and peaks per phase of one device, with named marks.

A phase's peak is taken between :meth:`MemoryProbe.mark` and :meth:`MemoryProbe.peak` under one key, so
several users (the optimizer's automatic budget, the memory callback) measure overlapping phases of the
same device through one shared probe (:func:`probe_for`) without disturbing each other.

Peaks come from the device's own high-water mark (PyTorch's peak allocation on CUDA and XPU, ``VmHWM`` of
this process on the CPU). With ``reset_peaks=True`` the probe resets that mark at each :meth:`mark` and
folds what it saw into the other open marks first, so every key's peak is exact. With
``reset_peaks=False`` the global mark is left alone, for readers that rely on it (the Trainer's
``skip_memory_metrics=False`` reads ``torch.cuda.max_memory_allocated`` at the end of training): a phase
that sets a new high still gets its exact peak, otherwise its peak is the highest level the probe sampled
(at marks, :meth:`sample` and :meth:`peak`), which may miss the phase's transient peak. :meth:`exact_peak`
tells the two apart.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from .device import AcceleratorMemory, HostMemory, memory_for
from .sizes import parse_size

CAPACITY_ENV = "HF_PAGED_DEVICE_CAPACITY"
"""Environment variable that sets the capacity of every probed device, e.g. ``"8GiB"``."""


@dataclass
class _Mark:
    level: int
    """Highest level known since the mark, bytes."""
    baseline: int | None
    """The device's high-water mark when the mark was set, bytes."""
    resets: int
    """The probe's reset count when the mark was set."""
    exact: bool
    """Whether ``level`` is the device's high-water mark over the whole phase, not only sampled levels."""


class MemoryProbe:
    """Memory figures of one device, in bytes, and peaks between marks.

    Args:
        device: the device to measure; ``"cpu"`` measures this process's resident memory.
        capacity: the memory the device offers to this process (bytes or a string such as ``"24GiB"``);
            ``None`` reads ``HF_PAGED_DEVICE_CAPACITY`` and else the device's total memory times the
            process's memory fraction (``torch.cuda.set_per_process_memory_fraction``).
        reset_peaks: reset the device's global high-water mark at each mark (exact peaks); ``False``
            leaves it for other readers.
        memory: where the figures come from; ``None`` reads the device (see :func:`hf_paged.device.memory_for`).

    Raises:
        RuntimeError: for an accelerator PyTorch does not see (its memory calls would return 0).
    """

    def __init__(
        self,
        device: torch.device | str,
        capacity: int | str | None = None,
        reset_peaks: bool = True,
        memory: HostMemory | AcceleratorMemory | None = None,
    ) -> None:
        self.device = torch.device(device)
        self._memory = memory if memory is not None else memory_for(self.device)
        self.capacity = capacity
        self.reset_peaks = reset_peaks
        self._marks: dict[str, _Mark] = {}
        self._resets = 0

    @property
    def capacity(self) -> int:
        """The memory the device offers to this process."""
        if self._capacity is not None:
            return self._capacity
        from_env = os.environ.get(CAPACITY_ENV)
        if from_env:
            capacity = parse_size(from_env, CAPACITY_ENV)
            if capacity == 0:
                raise ValueError(f"{CAPACITY_ENV} must be more than 0 bytes, or unset for the device's total memory")
            return capacity
        return self._memory.total()

    @capacity.setter
    def capacity(self, capacity: int | str | None) -> None:
        self._capacity = None if capacity is None else parse_size(capacity, "capacity")
        if self._capacity == 0:
            raise ValueError("capacity must be more than 0 bytes, or None for the device's total memory")

    def allocated(self) -> int:
        """Bytes held by tensors (the resident set on the CPU)."""
        return self._memory.allocated()

    def reserved(self) -> int:
        """Bytes held by the allocator, tensors and cache (the resident set on the CPU)."""
        return self._memory.reserved()

    def free(self) -> int:
        """Device memory free for new allocations, as the driver (or the OS) reports it."""
        return self._memory.free()

    def host_resident(self) -> int:
        """This process's resident memory on the host."""
        return self._memory.resident() if self.device.type == "cpu" else _host().resident()

    def mark(self, key: str) -> None:
        """Start measuring the peak of phase ``key`` now (replacing an earlier mark of that key)."""
        self._fold()
        reset = self.reset_peaks and self._memory.can_reset_peak
        if reset:
            self._memory.reset_peak()
            self._resets += 1
        device_peak = self._memory.peak()
        self._marks[key] = _Mark(self._memory.allocated(), device_peak, self._resets, reset and device_peak is not None)

    def sample(self) -> None:
        """Record the current level in every open mark (improves peaks where the device keeps none)."""
        self._fold()

    def peak(self, key: str) -> int:
        """The highest allocation since :meth:`mark` of ``key``."""
        if key not in self._marks:
            raise KeyError(f"no mark {key!r}: call mark({key!r}) first")
        self._fold()
        return self._marks[key].level

    def exact_peak(self, key: str) -> int | None:
        """The highest allocation since :meth:`mark` of ``key`` if the device's high-water mark covers it.

        ``None`` when only sampled levels are known: without resets, a phase that stays below an earlier
        high; a device that keeps no high-water mark.
        """
        peak = self.peak(key)
        return peak if self._marks[key].exact else None

    def _fold(self) -> None:
        """Bring every mark's level up to the current level and, where it covers the mark, the device's peak."""
        level = self._memory.allocated()
        device_peak = self._memory.peak()
        for mark in self._marks.values():
            mark.level = max(mark.level, level)
            if device_peak is not None and (mark.resets < self._resets or device_peak > (mark.baseline or 0)):
                mark.level = max(mark.level, device_peak)
                # A new high since the mark, with no reset in between, is the phase's peak so far and after.
                mark.exact = mark.exact or mark.resets == self._resets


_probes: dict[str, MemoryProbe] = {}


def probe_for(device: torch.device | str) -> MemoryProbe:
    """The shared probe of ``device`` (one per device in this process)."""
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, getattr(torch, device.type).current_device())
    key = str(device)
    if key not in _probes:
        _probes[key] = MemoryProbe(device)
    return _probes[key]


@functools.cache
def _host() -> HostMemory:
    return HostMemory()
