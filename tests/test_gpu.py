"""Parity, paging invariance and the budget on CUDA: pinned host pages, copies on a side stream."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, regression_batches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = torch.device("cuda")


def train_on(model, optimizer, batches):
    for inputs, targets in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs.to(DEVICE)), targets.to(DEVICE)).backward()
        optimizer.step()


def run(name: str, **paging):
    model = make_mlp().to(DEVICE)
    optimizer = OPTIMIZERS[name](decay_groups(model), **optimizer_kwargs(name, **paging))
    train_on(model, optimizer, regression_batches(6))
    return model, optimizer


def test_adamw_matches_torch_adamw_on_cuda():
    batches = regression_batches(50)
    reference = make_mlp().to(DEVICE)
    train_on(reference, torch.optim.AdamW(decay_groups(reference), lr=1e-2, foreach=False), batches)
    model = make_mlp().to(DEVICE)
    train_on(model, hf_paged.PagedAdamW(decay_groups(model), lr=1e-2, page_size=4096, device_budget=4096), batches)
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert ((param - expected).norm() / expected.norm()).item() < 1e-6


@pytest.mark.parametrize("prefetch", [0, 2])
def test_paging_is_invariant_and_within_budget_on_cuda(optimizer_name, prefetch):
    reference_model, reference = run(optimizer_name)
    model = make_mlp().to(DEVICE)
    budget = 2 * 4096
    optimizer = OPTIMIZERS[optimizer_name](decay_groups(model), **optimizer_kwargs(optimizer_name, device_budget=budget, prefetch=prefetch))
    optimizer._store.add_observer(lambda operation, page: _check_budget(optimizer, budget))
    train_on(model, optimizer, regression_batches(6))
    for param, expected in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(param, expected)
    stats = optimizer.paging_stats()
    assert stats["page_outs"] > 0 and stats["device_bytes"] <= budget
    pages = optimizer._store.pages
    assert any(page.host is not None and page.host[0].is_pinned() for page in pages)
    saved = optimizer.state_dict()
    assert all(value.device.type == "cpu" for entry in saved["state"].values() for value in entry.values())
    assert_state_equal(saved, reference.state_dict())


def _check_budget(optimizer, budget):
    assert optimizer._store.device_bytes <= budget


def assert_state_equal(state_a, state_b):
    for index, entry in state_a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, state_b["state"][index][key]), (index, key)


def test_cuda_probe_peaks_and_the_global_peak_left_alone():
    from hf_paged.memory import MemoryProbe

    probe = MemoryProbe(DEVICE, reset_peaks=False)
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEVICE)
    del big
    global_peak = torch.cuda.max_memory_allocated(DEVICE)
    probe.mark("phase")
    small = torch.empty(16 * 2**20, dtype=torch.uint8, device=DEVICE)
    probe.sample()
    del small
    assert probe.peak("phase") >= torch.cuda.memory_allocated(DEVICE) + 16 * 2**20
    assert torch.cuda.max_memory_allocated(DEVICE) == global_peak  # the Trainer's figure is intact
    exact = MemoryProbe(DEVICE)
    exact.mark("phase")
    spike = torch.empty(64 * 2**20, dtype=torch.uint8, device=DEVICE)
    del spike
    assert exact.peak("phase") >= torch.cuda.memory_allocated(DEVICE) + 64 * 2**20
    assert exact.capacity == torch.cuda.mem_get_info(DEVICE)[1]


def test_auto_budget_on_cuda_matches_unlimited():
    reference, _ = run("PagedAdamW8bit")
    auto, optimizer = run("PagedAdamW8bit", device_budget="auto")
    assert optimizer.auto_budget.probe.device == torch.device("cuda", torch.cuda.current_device())
    for mine, theirs in zip(auto.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
