"""Measurements of paging on an accelerator: pinned copy bandwidth, streaming efficiency, a device memory limit.

Used by ``optimizer_step.py``; the efficiency formula is a pure function so that tests can check it on a CPU.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

import torch

COPY_BYTES = 256 * 2**20
"""Bytes of each timed copy."""
COPY_REPEATS = 5
"""Timed copies each way."""


@dataclass(frozen=True)
class Bandwidth:
    """Copy bandwidth between pinned host memory and the device, in bytes per second each way."""

    to_device: float
    to_host: float


def copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, repeats: int = COPY_REPEATS) -> Bandwidth:
    """The median bandwidth of ``repeats`` copies of ``nbytes`` bytes each way, pinned host memory, timed with events.

    One untimed copy each way comes first, so that the first timing does not include lazy setup.
    """
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def median_seconds(destination: torch.Tensor, source: torch.Tensor) -> float:
        destination.copy_(source, non_blocking=True)
        seconds = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            destination.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        return statistics.median(seconds)

    with torch.cuda.device(device):
        to_device = nbytes / median_seconds(on_device, host)
        to_host = nbytes / median_seconds(host, on_device)
    return Bandwidth(to_device=to_device, to_host=to_host)


def transfer_seconds(bytes_to_device: float, bytes_to_host: float, bandwidth: Bandwidth) -> float:
    """Seconds the copies of a step need at least: the slower direction, since each has its own copy stream
    (and copy engine) and the two directions overlap each other."""
    return max(bytes_to_device / bandwidth.to_device, bytes_to_host / bandwidth.to_host)


def streaming_efficiency(
    step_seconds: float,
    unlimited_seconds: float,
    bytes_to_device: float,
    bytes_to_host: float,
    bandwidth: Bandwidth,
) -> float:
    """A budgeted step's time over its lower bound: ``step / max(unlimited step, transfer_seconds(...))``.

    The bound is the step without paging or the copies alone, whichever is longer: the step of a perfect
    overlap of copies and updates. 1.0 is perfect overlap; 2.0 is copies and updates fully serialized when
    the two take equally long. Bytes are those of one step.
    """
    return step_seconds / max(unlimited_seconds, transfer_seconds(bytes_to_device, bytes_to_host, bandwidth))


@contextlib.contextmanager
def memory_limit(device: torch.device, headroom: int) -> Iterator[float]:
    """Limit PyTorch's caching allocator on ``device`` to what it reserves now plus ``headroom`` bytes; yields
    the fraction of the device's memory that this is.

    ``torch.cuda.set_per_process_memory_fraction`` caps the memory the allocator reserves (cached blocks
    included, so the cache is emptied first) at a fraction of the device's total memory; the fraction is back
    at 1.0 on leaving, whatever happens inside.
    """
    index = torch.cuda.current_device() if device.index is None else device.index  # the setter needs an index
    torch.cuda.empty_cache()
    allowed = torch.cuda.memory_reserved(index) + headroom
    fraction = min(1.0, allowed / torch.cuda.get_device_properties(index).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    try:
        yield fraction
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
