"""Capacity honours torch.cuda.set_per_process_memory_fraction (a fake CUDA module on the CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_paged.device import AcceleratorMemory
from hf_paged.memory import MemoryProbe

GIB = 2**30


def fake_cuda(fraction: float, free: int, reserved: int) -> SimpleNamespace:
    """What torch.cuda reports for an 80 GiB device with ``fraction`` set for this process."""
    return SimpleNamespace(
        is_available=lambda: True,
        current_device=lambda: 0,
        memory_allocated=lambda index: reserved,
        memory_reserved=lambda index: reserved,
        reset_peak_memory_stats=lambda index: None,
        mem_get_info=lambda index: (free, 80 * GIB),
        get_per_process_memory_fraction=lambda index: fraction,
    )


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_capacity_and_free_honour_the_per_process_memory_fraction(monkeypatch, fraction):
    monkeypatch.delenv("HF_PAGED_DEVICE_CAPACITY", raising=False)
    memory = AcceleratorMemory(torch.device("cuda", 0), module=fake_cuda(fraction, free=70 * GIB, reserved=10 * GIB))
    probe = MemoryProbe("cuda:0", memory=memory)
    assert probe.capacity == int(80 * GIB * fraction)
    assert probe.free() == min(70 * GIB, int(80 * GIB * fraction) - 10 * GIB)
    assert MemoryProbe("cuda:0", capacity="8GiB", memory=memory).capacity == 8 * GIB
