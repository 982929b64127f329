"""Out-of-memory recovery with state on several devices: the device that ran out learns, from its own state
(issue 30, point 3).

On the CPU the last two layers' state lives on the pseudo device ``"cpu:1"``, as ``device_map="auto"`` puts the last
layers on a second GPU, and each device's memory is scripted (tests/memory_utils.py), so an out-of-memory error can be
charged to one device: by its message (CUDA's "GPU 1 has a total capacity ..."), or by that device's memory alone
having run full.
"""

from __future__ import annotations

import pytest
import torch
from conftest import decay_groups, make_mlp, optimizer_kwargs, regression_batches

import hf_paged
from hf_paged.budget import AutoBudget
from hf_paged.memory import MemoryProbe
from hf_paged.optim.base import PagedOptimizer
from hf_paged.recovery import device_out_of_memory

from memory_utils import GIB, ScriptedMemory

MIB = 2**20
SECOND = "cpu:1"
NAMED = (
    "CUDA out of memory. Tried to allocate 64.00 MiB. GPU 1 has a total capacity of 1.00 GiB of which 0 bytes is free"
)


@pytest.fixture
def two_devices(monkeypatch):
    """A model whose last two layers' state lives on ``"cpu:1"``, and a scripted memory for each device."""
    model = make_mlp()
    on_second = {id(param) for param in [*model[2].parameters(), *model[4].parameters()]}
    monkeypatch.setattr(
        PagedOptimizer, "_state_device", lambda self, param: SECOND if id(param) in on_second else "cpu"
    )
    memories = {device: ScriptedMemory(total=GIB, level=100 * MIB) for device in ("cpu", SECOND)}
    for device, memory in memories.items():
        monkeypatch.setitem(hf_paged.memory._probes, device, MemoryProbe(device, memory=memory))
    return model, memories


def train_with_recovery(model, optimizer, fail_at: int | None, fail) -> list[dict]:
    """Three steps of two micro-batches through OOMRecovery; micro-batch ``fail_at`` (counted over the run) calls
    ``fail()`` and raises what it returns once. Returns each device's predicted peak before and after each step's
    micro-batches."""
    recovery = hf_paged.OOMRecovery(optimizer, retries=2)
    calls = [0]

    def forward_backward(inputs, targets):
        calls[0] += 1
        loss = torch.nn.functional.mse_loss(model(inputs), targets) / 2
        loss.backward()
        if calls[0] == fail_at:
            raise fail()

    predicted = []
    batches = regression_batches(6)
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        predicted.append({device: auto.predicted_peak for device, auto in optimizer.auto_budgets.items()})
        with recovery.window(step):
            for inputs, targets in batches[2 * step : 2 * step + 2]:
                recovery.run(forward_backward, inputs, targets)
        predicted.append({device: auto.predicted_peak for device, auto in optimizer.auto_budgets.items()})
        optimizer.step()
    return predicted


@pytest.mark.parametrize("charged_by", ["message", "memory"])
def test_the_device_that_ran_out_learns_from_its_own_state(two_devices, charged_by):
    model, memories = two_devices
    optimizer = hf_paged.PagedAdamW8bit(decay_groups(model), **optimizer_kwargs("PagedAdamW8bit", device_budget="auto"))
    held = {}

    def fail():
        stats = optimizer.paging_stats()["devices"]
        held.update({device: stats[device]["device_bytes"] for device in stats})
        if charged_by == "message":
            return torch.OutOfMemoryError(NAMED)
        memories[SECOND].spike(GIB - MIB, after=100 * MIB)  # only the second device ran full
        return torch.OutOfMemoryError("injected")

    predicted = train_with_recovery(model, optimizer, 4, fail)  # step 1, second micro-batch
    assert held["cpu"] > 0 and held[SECOND] > 0
    before, after = predicted[2], predicted[3]  # around step 1's micro-batches
    # the second device learns that the step needs its whole capacity besides its own state
    assert after[SECOND] == GIB - held[SECOND]
    assert before[SECOND] < GIB // 2
    assert after["cpu"] == before["cpu"] < GIB // 2  # the first device learns nothing from it
    stats = optimizer.paging_stats()["devices"]
    assert stats[SECOND]["device_bytes"] == 0 < stats["cpu"]["device_bytes"]

    reference = make_mlp()
    reference_optimizer = hf_paged.PagedAdamW8bit(
        decay_groups(reference), **optimizer_kwargs("PagedAdamW8bit", device_budget="auto")
    )
    train_with_recovery(reference, reference_optimizer, None, None)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)


def test_an_out_of_memory_message_names_its_device():
    devices = ["cuda:0", "cuda:1"]
    assert device_out_of_memory(torch.OutOfMemoryError(NAMED), devices) == "cuda:1"
    older = "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.20 GiB allocated)"
    assert device_out_of_memory(torch.OutOfMemoryError(older), devices) == "cuda:0"
    assert device_out_of_memory(RuntimeError("CUDA error: out of memory"), devices) is None
    assert device_out_of_memory(torch.OutOfMemoryError(NAMED), ["cuda:0"]) is None


def test_a_budget_made_after_the_window_opened_learns_from_the_level_now(two_devices):
    """A device whose automatic budget (and probe) came after the window opened has no window peak: it learns from
    the allocation now, and the recovery goes on."""
    model, _memories = two_devices
    optimizer = hf_paged.PagedAdamW8bit(decay_groups(model), **optimizer_kwargs("PagedAdamW8bit", device_budget="auto"))
    late = AutoBudget(probe=MemoryProbe(SECOND, memory=ScriptedMemory(total=GIB, level=100 * MIB)))
    held = {}

    def fail():
        if not held:
            optimizer.set_device_budget({"cpu": "auto", SECOND: late})
            held.update(optimizer.paging_stats()["devices"][SECOND])
        return torch.OutOfMemoryError(NAMED)

    predicted = train_with_recovery(model, optimizer, 4, fail)
    assert predicted[3][SECOND] == GIB - held["device_bytes"]


def test_an_out_of_memory_error_in_the_step_reports_the_other_bytes_of_the_device_that_ran_out(two_devices):
    """A recovery inside ``step()`` reports what the device named by the error holds besides its optimizer state
    (it reported the first device's allocation minus the state of every device)."""
    model, memories = two_devices
    memories[SECOND].set_level(300 * MIB)
    optimizer = hf_paged.PagedAdamW8bit(decay_groups(model), **optimizer_kwargs("PagedAdamW8bit"))
    reported = []
    optimizer.on_oom_recovery = reported.append
    batches = regression_batches(2)
    for step, (inputs, targets) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        if step == 1:
            stream = optimizer._store.stream

            def fail_once(*args, original=stream, **kwargs):
                optimizer._store.stream = original
                raise torch.OutOfMemoryError(NAMED)

            optimizer._store.stream = fail_once
        optimizer.step()
    (recovery,) = reported
    assert recovery.phase == "optimizer step"
    assert recovery.other_bytes == 300 * MIB  # its state went back to the host: all it holds is other memory
