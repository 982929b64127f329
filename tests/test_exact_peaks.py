"""The automatic budget predicts from exact peaks only, also when the device's peak counter is never reset."""

from __future__ import annotations

import torch

import hf_paged
from hf_paged.budget import AutoBudget
from hf_paged.memory import MemoryProbe

from memory_utils import GIB, ScriptedMemory

MIB = 2**20


def test_probe_tells_exact_peaks_from_sampled_ones():
    memory = ScriptedMemory(level=1 * GIB)
    memory.spike(8 * GIB, after=1 * GIB)
    probe = MemoryProbe("cpu", memory=memory, reset_peaks=False)
    probe.mark("phase")
    memory.spike(4 * GIB, after=2 * GIB)
    assert probe.peak("phase") == 2 * GIB and probe.exact_peak("phase") is None  # below the earlier high
    memory.spike(9 * GIB, after=1 * GIB)
    assert probe.exact_peak("phase") == 9 * GIB  # a new high is the phase's peak
    memory.spike(5 * GIB, after=1 * GIB)
    assert probe.exact_peak("phase") == 9 * GIB  # and stays exact
    resetting = MemoryProbe("cpu", memory=memory)
    resetting.mark("phase")
    memory.spike(3 * GIB, after=1 * GIB)
    resetting.mark("other")  # folds the first phase's peak before resetting for the second
    memory.spike(2 * GIB, after=1 * GIB)
    assert resetting.exact_peak("phase") == 3 * GIB and resetting.exact_peak("other") == 2 * GIB


def test_sampled_peaks_neither_enter_the_prediction_nor_expire_the_last_exact_one():
    budget = AutoBudget(safety_margin=0.0, window=2, capacity=10 * GIB)
    assert budget.resting_budget() is None  # nothing observed: leave the budget
    budget.observe(None)
    assert budget.predicted_peak is None and budget.resting_budget() == 0  # a step, but its peak unknown
    budget.observe(6 * GIB)
    budget.observe(None)
    budget.observe(None)
    budget.observe(None)
    assert budget.predicted_peak == 6 * GIB  # out of the window, but the last exact one
    budget.observe(3 * GIB)
    budget.observe(None)
    assert budget.predicted_peak == 3 * GIB  # a newer exact peak replaces it
    budget.observe(5 * GIB)
    budget.observe(4 * GIB)
    assert budget.predicted_peak == 5 * GIB and budget.resting_budget() == 5 * GIB


def test_auto_budget_with_a_peak_counter_never_reset_keeps_room_for_the_true_peak():
    """Defect: with ``reset_peaks=False`` (the Trainer's ``skip_memory_metrics=False``) steady-state steps
    measured parameters and gradients without activations, and after ``window`` steps the budget between
    steps grew into the memory the forward/backward needs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 64))
    window, usable, weights = 3, 1 * GIB, 100 * MIB
    # A CUDA-like counter: levels include the optimizer state on the device, the high-water mark is global.
    memory = ScriptedMemory(total=usable, level=weights)
    probe = MemoryProbe("cpu", memory=memory, reset_peaks=False)
    optimizer = hf_paged.PagedAdamW(
        model.parameters(), page_size="16KiB", device_budget=AutoBudget(safety_margin=0.0, window=window, probe=probe)
    )
    for step in range(3 * window):
        activations = 700 * MIB if step == 0 else 500 * MIB  # a long first batch, then shorter ones
        state = optimizer.paging_stats()["device_bytes"]
        memory.spike(weights + activations + state, after=weights + state)
        model(torch.randn(4, 128)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert optimizer.device_budget <= usable - weights - 500 * MIB, step  # room for the next forward/backward
        assert optimizer.paging_stats()["device_bytes"] <= optimizer.device_budget


def test_auto_budget_without_any_exact_peak_keeps_no_state_between_steps():
    """An earlier high (an evaluation, another run) hides every later peak from a counter never reset."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 64))
    memory = ScriptedMemory(total=1 * GIB, level=100 * MIB)
    memory.spike(1 * GIB - MIB, after=100 * MIB)
    probe = MemoryProbe("cpu", memory=memory, reset_peaks=False)
    optimizer = hf_paged.PagedAdamW(
        model.parameters(), page_size="16KiB", device_budget=AutoBudget(safety_margin=0.0, probe=probe)
    )
    for _ in range(3):
        state = optimizer.paging_stats()["device_bytes"]
        memory.spike(700 * MIB + state, after=100 * MIB + state)
        model(torch.randn(4, 128)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert optimizer.device_budget == 0 and optimizer.paging_stats()["device_bytes"] == 0
