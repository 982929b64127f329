"""Paging never changes results, and the device never holds more optimizer state than the budget."""

from __future__ import annotations

import pytest
import torch
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, regression_batches, train
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PAGE_SIZE = 4096
STEPS = 6


def run(name: str, batches, **paging):
    model = make_mlp()
    optimizer = OPTIMIZERS[name](decay_groups(model), **optimizer_kwargs(name, **paging))
    train(model, optimizer, batches)
    return model, optimizer


def assert_same_result(model_a, optimizer_a, model_b, optimizer_b) -> None:
    for param_a, param_b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(param_a, param_b)
    state_a, state_b = optimizer_a.state_dict()["state"], optimizer_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        assert state_a[index].keys() == state_b[index].keys()
        for key in state_a[index]:
            assert torch.equal(state_a[index][key], state_b[index][key]), (index, key)


_unlimited_cache: dict[str, tuple] = {}


def unlimited(name: str):
    if name not in _unlimited_cache:
        _unlimited_cache[name] = run(name, regression_batches(STEPS))
    return _unlimited_cache[name]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_budget_of_one_page_gives_bitwise_same_result(name):
    model, optimizer = run(name, regression_batches(STEPS), device_budget=PAGE_SIZE, prefetch=0)
    reference_model, reference_optimizer = unlimited(name)
    assert_same_result(model, optimizer, reference_model, reference_optimizer)
    stats = optimizer.paging_stats()
    assert stats["page_outs"] > 0 and stats["page_ins"] > 0
    assert stats["device_bytes"] <= PAGE_SIZE


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    budget_pages=st.integers(min_value=1, max_value=12),
    prefetch=st.integers(min_value=0, max_value=4),
)
def test_any_budget_and_prefetch_give_bitwise_same_result(name, budget_pages, prefetch):
    reference_model, reference_optimizer = unlimited(name)
    budget = budget_pages * PAGE_SIZE
    model, optimizer = run(name, regression_batches(STEPS), device_budget=budget, prefetch=prefetch)
    assert_same_result(model, optimizer, reference_model, reference_optimizer)
    state_bytes = reference_optimizer.paging_stats()["device_bytes"]
    stats = optimizer.paging_stats()
    if budget < state_bytes:
        assert stats["page_outs"] > 0
    assert stats["device_bytes"] <= budget
    assert stats["device_bytes"] + stats["host_bytes"] == state_bytes


@pytest.mark.parametrize("name", ["PagedAdamW8bit", "PagedAdamW4bit"])
def test_counted_device_bytes_are_the_allocated_blocks_and_a_page_fits_its_size(name):
    """A page's block aligns each buffer to 16 bytes: with 16-element blocks its scales leave padding, which is
    counted against the budget and kept within ``page_size``."""
    page_size = 240
    model = make_mlp()
    kwargs = {**optimizer_kwargs(name), "page_size": page_size, "block_size": 16, "device_budget": 2 * page_size}
    optimizer = OPTIMIZERS[name](decay_groups(model), **kwargs)
    store = optimizer._store
    blocks = []

    def check(operation, page):
        (device_store,) = store.stores.values()
        slots = [slot for free in device_store._slots.values() for slot in free]
        held = [page.device for page in store.pages if page.device is not None] + slots
        allocated = sum(buffers.block.numel() for buffers in held)
        blocks.append(allocated)
        assert store.device_bytes == allocated, operation
        assert allocated <= optimizer.device_budget

    store.add_observer(check)
    train(model, optimizer, regression_batches(2))
    assert max(blocks) > 0
    assert all(page.nbytes <= page_size for page in store.pages)
    assert any(page.nbytes > sum(n * dtype.itemsize for n, dtype in page.specs) for page in store.pages)
    host_blocks = sum(page.host.block.numel() for page in store.pages if page.host is not None)
    assert optimizer.paging_stats()["host_bytes"] == host_blocks


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_device_bytes_never_exceed_budget(name, prefetch):
    budget = 2 * PAGE_SIZE
    model = make_mlp()
    optimizer = OPTIMIZERS[name](decay_groups(model), **optimizer_kwargs(name, device_budget=budget, prefetch=prefetch))
    observed = []
    last = [0]

    def check(operation, page):
        """Device bytes stay within the budget; right after the budget is lowered they never grow."""
        observed.append(operation)
        device_bytes = optimizer._store.device_bytes
        assert device_bytes <= optimizer.device_budget or device_bytes <= last[0], (operation, page.index)
        last[0] = device_bytes

    optimizer._store.add_observer(check)
    batches = regression_batches(8)
    train(model, optimizer, batches[:4])
    optimizer.set_device_budget(PAGE_SIZE)
    assert optimizer._store.device_bytes <= PAGE_SIZE
    train(model, optimizer, batches[4:])
    assert {"page_in", "page_out", "resident", "released"} <= set(observed)


def test_set_device_budget_and_evict_free_device_memory(optimizer_name):
    model = make_mlp()
    optimizer = OPTIMIZERS[optimizer_name](decay_groups(model), **optimizer_kwargs(optimizer_name))
    batches = regression_batches(4)
    train(model, optimizer, batches[:2])
    full = optimizer.paging_stats()
    assert full["host_bytes"] == 0 and full["page_outs"] == 0
    optimizer.set_device_budget(PAGE_SIZE)
    assert optimizer.paging_stats()["device_bytes"] <= PAGE_SIZE
    freed = optimizer.evict()
    after = optimizer.paging_stats()
    assert after["device_bytes"] == 0 and after["pages_resident"] == 0
    assert after["host_bytes"] == full["device_bytes"] and freed > 0
    optimizer.set_device_budget(None)
    train(model, optimizer, batches[2:3])
    back = optimizer.paging_stats()
    assert back["device_bytes"] == full["device_bytes"] and back["host_bytes"] == 0
    assert back["pages_resident"] == back["pages_total"]
    partial = optimizer.evict(1)
    assert 0 < partial <= optimizer._store.max_page_bytes


def test_evicting_between_steps_does_not_change_results(optimizer_name):
    batches = regression_batches(STEPS)
    model = make_mlp()
    optimizer = OPTIMIZERS[optimizer_name](decay_groups(model), **optimizer_kwargs(optimizer_name))
    for i, batch in enumerate(batches):
        train(model, optimizer, [batch])
        optimizer.evict() if i % 2 else optimizer.evict(PAGE_SIZE)
    reference_model, reference_optimizer = unlimited(optimizer_name)
    assert_same_result(model, optimizer, reference_model, reference_optimizer)


def test_parameters_without_gradients_are_left_alone(optimizer_name):
    model = make_mlp()
    frozen = model[0].weight
    before = frozen.detach().clone()
    optimizer = OPTIMIZERS[optimizer_name](decay_groups(model), **optimizer_kwargs(optimizer_name, device_budget=PAGE_SIZE))
    frozen.requires_grad_(False)
    train(model, optimizer, regression_batches(3))
    assert torch.equal(frozen, before)
    assert 0 not in optimizer.state_dict()["state"]
