"""Paging on a simulated stream device: copies on worker threads, one stream per direction, blocks reused at once.

The same invariants as tests/test_paging.py (bitwise equal to an unlimited budget, device bytes never above
the budget) and the state_dict / evict / set_device_budget behaviour, under the ordering a CUDA device needs;
and stores broken in the ways that ordering forbids fail them.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, regression_batches, train
from test_paging import PAGE_SIZE, STEPS, assert_same_result, unlimited
from test_state_dict import roundtrip
from test_swapped_tensors import train_with_swaps

from hf_paged.store import PageState, PageStore
from hf_paged.testing import SimulatedStreamBackend, simulated_streams


def build(name: str, **paging):
    model = make_mlp()
    return model, OPTIMIZERS[name](decay_groups(model), **optimizer_kwargs(name, **paging))


def test_simulated_copies_run_in_order_per_stream_and_each_direction_on_its_own():
    backend = SimulatedStreamBackend(delay=0.2)
    try:
        host = (torch.arange(4.0),)
        first, second = backend.empty_device([(4, torch.float32)]), backend.empty_device([(4, torch.float32)])
        assert torch.isnan(first[0]).all()
        to_device = backend.copy_to_device(first, host)
        again = backend.copy_to_device(second, first)
        assert not backend.is_done(to_device)
        back = backend.copy_to_host((torch.zeros(4),), (torch.ones(4),))
        backend.order_after(back)
        assert not backend.is_done(again)  # the write-back did not queue behind both page-ins
        backend.order_after(again)
        assert backend.is_done(to_device) and torch.equal(second[0], host[0])
        backend.release(first)
        assert backend.empty_device([(4, torch.float32)])[0] is first[0] and torch.isnan(first[0]).all()
        assert backend.hazards == []
    finally:
        backend.close()


@pytest.mark.parametrize("completion", ["timed", "waited", "instant"])
def test_a_copy_is_seen_complete_when_it_has_run_only_once_waited_for_or_always(completion):
    """``completion="timed"`` reports a copy complete once its thread has run it, ``"waited"`` only once the host has
    waited for it (or ordered the compute stream after it), ``"instant"`` at the first query, whenever it ran."""
    backend = SimulatedStreamBackend(delay=0.05, completion=completion)
    try:
        host, device = (torch.zeros(4),), backend.empty_device([(4, torch.float32)])
        device[0].fill_(1.0)
        write_back = backend.copy_to_host(host, device)
        if completion == "waited":
            assert not backend.is_done(write_back)
        if completion == "instant":  # the query waits for the copy, which has then run
            assert backend.is_done(write_back) and torch.equal(host[0], torch.ones(4))
        write_back.done.wait()
        assert torch.equal(host[0], torch.ones(4))
        assert backend.is_done(write_back) is (completion != "waited")
        backend.wait(write_back)
        assert backend.is_done(write_back)
        page_in = backend.copy_to_device(device, (torch.full((4,), 2.0),))
        page_in.done.wait()
        assert backend.is_done(page_in) is (completion != "waited")
        backend.order_after(page_in)
        assert backend.is_done(page_in) and torch.equal(device[0], torch.full((4,), 2.0))
        assert backend.hazards == []
    finally:
        backend.close()


def test_an_unknown_completion_is_refused_with_the_settings_allowed():
    with pytest.raises(ValueError, match="completion must be one of 'timed', 'waited', 'instant', got 'eager'"):
        SimulatedStreamBackend(completion="eager")


CASES = [(1, 0), (2, 1), (3, 3)]


@pytest.mark.parametrize("budget_pages, prefetch", CASES)
def test_paging_on_simulated_streams_is_bitwise_invariant_and_within_budget(optimizer_name, budget_pages, prefetch):
    reference_model, reference_optimizer = unlimited(optimizer_name)
    budget = budget_pages * PAGE_SIZE
    with simulated_streams() as backends:
        model, optimizer = build(optimizer_name, device_budget=budget, prefetch=prefetch)
        store = optimizer._store
        store.add_observer(lambda operation, page: _assert_within(store.device_bytes, budget))
        train(model, optimizer, regression_batches(STEPS))
        assert_same_result(model, optimizer, reference_model, reference_optimizer)
    (backend,) = backends
    assert backend.hazards == []
    assert 0 < backend.peak_device_bytes <= budget
    assert backend.device_bytes == store.device_bytes
    if budget < reference_optimizer.paging_stats()["device_bytes"]:
        assert optimizer.paging_stats()["page_outs"] > 0
    assert backend.host_waits["to_device"] == 0  # page-ins are ordered on the device, never waited for


def _assert_within(device_bytes: int, budget: int) -> None:
    assert device_bytes <= budget


def test_set_device_budget_evict_and_lowered_budget_on_simulated_streams(optimizer_name):
    reference_model, reference_optimizer = unlimited(optimizer_name)
    batches = regression_batches(STEPS)
    with simulated_streams(delay=2e-4) as backends:
        model, optimizer = build(optimizer_name, prefetch=2)
        train(model, optimizer, batches[:2])
        full = optimizer.paging_stats()
        optimizer.set_device_budget(PAGE_SIZE)
        assert optimizer.paging_stats()["device_bytes"] <= PAGE_SIZE
        assert backends[0].device_bytes <= PAGE_SIZE
        train(model, optimizer, batches[2:3])
        assert backends[0].peak_device_bytes == full["device_bytes"]  # the budget was lowered, never exceeded
        freed = optimizer.evict()
        after = optimizer.paging_stats()
        assert after["device_bytes"] == 0 and backends[0].device_bytes == 0 and freed > 0
        assert after["host_bytes"] == full["device_bytes"]
        optimizer.set_device_budget(2 * PAGE_SIZE)
        train(model, optimizer, batches[3:4])
        optimizer.evict(PAGE_SIZE)
        optimizer.set_device_budget(None)
        train(model, optimizer, batches[4:])
        assert_same_result(model, optimizer, reference_model, reference_optimizer)
    assert backends[0].hazards == []


@pytest.mark.parametrize("name", ["PagedAdamW", "PagedAdamW8bit"])
def test_state_dict_and_resume_on_simulated_streams(name):
    batches = regression_batches(STEPS)
    reference_model, reference_optimizer = unlimited(name)
    with simulated_streams() as backends:
        model, optimizer = build(name, device_budget=PAGE_SIZE, prefetch=1)
        train(model, optimizer, batches[:3])
        saved_model, saved = roundtrip(model.state_dict()), roundtrip(optimizer.state_dict())
        resumed_model = make_mlp(seed=7)
        resumed_model.load_state_dict(saved_model)
        resumed = OPTIMIZERS[name](
            decay_groups(resumed_model), **optimizer_kwargs(name, device_budget=2 * PAGE_SIZE, prefetch=2)
        )
        resumed.load_state_dict(saved)
        train(resumed_model, resumed, batches[3:])
        assert_same_result(resumed_model, resumed, reference_model, reference_optimizer)
    assert all(backend.hazards == [] for backend in backends)


def test_host_bytes_report_the_rounded_pinned_blocks_really_held():
    with simulated_streams(round_host=True):
        model, optimizer = build("PagedAdamW8bit", device_budget=PAGE_SIZE, prefetch=1)
        train(model, optimizer, regression_batches(2))
        store = optimizer._store
        held = {
            page.host[0].untyped_storage().data_ptr(): page.host[0].untyped_storage().nbytes()
            for page in store.pages
            if page.host is not None
        }
        assert optimizer.paging_stats()["host_bytes"] == sum(held.values())
        assert sum(held.values()) > sum(page.nbytes for page in store.pages if page.host is not None)


def test_a_streamed_step_reuses_its_blocks_rather_than_allocating_two_per_page(monkeypatch):
    """Issue 36: a step that streams tens of pages through a budget of a few keeps the device block of each page it
    writes back for the next page it brings in, and the host block of each page brought in for the next write-back:
    a few allocations per step, not one of each per page streamed. What it kept it gives back at its end: the store
    holds its pages' blocks only, as the backend counts them, under the budget."""
    budget = 4 * PAGE_SIZE
    batches = regression_batches(4)
    with simulated_streams() as backends:
        model = make_mlp(hidden=256)
        optimizer = OPTIMIZERS["PagedAdamW8bit"](
            decay_groups(model), **optimizer_kwargs("PagedAdamW8bit", device_budget=budget, prefetch=2)
        )
        train(model, optimizer, batches[:2])
        (backend,) = backends
        made: list[str] = []
        for name in ("empty_device", "empty_host"):
            monkeypatch.setattr(backend, name, _counted(getattr(backend, name), name, made))
        page_ins = optimizer.paging_stats()["page_ins"]
        train(model, optimizer, batches[2:])
        streamed = (optimizer.paging_stats()["page_ins"] - page_ins) / 2
        assert streamed >= 20
        assert made.count("empty_device") / 2 <= 4 and made.count("empty_host") / 2 <= 6, (made, streamed)
        stats = optimizer.paging_stats()
        assert backend.device_bytes == stats["device_bytes"] <= budget
        assert stats["host_bytes"] == sum(page.host_nbytes for page in optimizer._store.pages if page.host is not None)
    assert backend.hazards == []


def _counted(allocate, name: str, made: list[str]):
    def counted(specs):
        made.append(name)
        return allocate(specs)

    return counted


# Broken stores: each breaks one ordering rule CUDA needs, and the invariance check catches it. ---------


class ReleasesBeforeWriteBack(PageStore):
    """Frees the device slot of a written-back page without waiting for its write-back to complete."""

    def _finish_page_out(self, page, wait: bool) -> None:
        super()._finish_page_out(page, wait=False)


class UsesPageBeforeCopyLands(PageStore):
    """Hands out a page as resident without ordering the compute stream after its copy."""

    def _finish_page_in(self, page) -> None:
        if page.state is PageState.PAGING_IN:
            page.host, page.event = None, None
            self._set_state(page, PageState.RESIDENT)
        self._lru.move_to_end(page.index)


class WaitsForEveryPageIn(PageStore):
    """The store before per-direction ordering: the host waits for every page-in (correct but slow)."""

    def _finish_page_in(self, page) -> None:
        if page.state is PageState.PAGING_IN:
            self.backend.wait(page.event)
        super()._finish_page_in(page)


def run_with_store(store_class, name: str, delay: float):
    with simulated_streams(delay=delay) as backends:
        model, optimizer = build(name, device_budget=PAGE_SIZE, prefetch=1)
        (store,) = optimizer._store.stores.values()
        store.__class__ = store_class
        train(model, optimizer, regression_batches(STEPS))
        optimizer.state_dict()
    return model, optimizer, backends[0]


@pytest.mark.parametrize("store_class", [ReleasesBeforeWriteBack, UsesPageBeforeCopyLands])
def test_broken_stores_fail_the_invariance_check(store_class):
    reference_model, reference_optimizer = unlimited("PagedAdamW")
    model, optimizer, backend = run_with_store(store_class, "PagedAdamW", delay=5e-3)
    assert backend.hazards
    with pytest.raises(AssertionError):
        assert_same_result(model, optimizer, reference_model, reference_optimizer)


class DropsDeviceBufferBeforeWriteBack(PageStore):
    """Drops the device buffer of a page being written back without ``release`` and without waiting: on CUDA,
    where ``release`` does nothing, its block is freed there while the write-back still reads it."""

    def _finish_page_out(self, page, wait: bool) -> None:
        self._outgoing.remove(page)
        page.device, page.event = None, None
        self._set_state(page, PageState.HOST)


class DropsDeviceBufferAfterWriteBack(PageStore):
    """Waits for the write-back, then drops the device buffer without ``release``: correct on CUDA (the block is
    freed when its last reference drops, after the host has seen the copy complete)."""

    def _finish_page_out(self, page, wait: bool) -> None:
        self.stats.stall_seconds += self.backend.wait(page.event)
        self._outgoing.remove(page)
        page.device, page.event = None, None
        self._set_state(page, PageState.HOST)


def test_a_device_buffer_collected_while_its_copy_is_pending_is_a_hazard():
    backend = SimulatedStreamBackend(delay=0.05)
    try:
        device = backend.empty_device([(4, torch.float32)])
        page_in = backend.copy_to_device(device, (torch.arange(4.0),))
        del device  # CUDA frees the block here; the copy writes into memory the allocator may hand out again
        assert backend.hazards and backend.device_bytes == 0
        backend.order_after(page_in)
        hazards = len(backend.hazards)
        device = backend.empty_device([(4, torch.float32)])
        backend.order_after(backend.copy_to_device(device, (torch.ones(4),)))
        host = (torch.zeros(4),)
        write_back = backend.copy_to_host(host, device)
        del device  # the write-back reads a freed block
        assert len(backend.hazards) == hazards + 1
        backend.wait(write_back)
        assert torch.isnan(host[0]).all()  # garbage, not the page's values
        device = backend.empty_device([(4, torch.float32)])
        backend.wait(backend.copy_to_host(host, device))
        del device  # the host has seen the copy complete: freeing the block is safe
        assert len(backend.hazards) == hazards + 1 and backend.device_bytes == 0
    finally:
        backend.close()


def test_a_device_buffer_dropped_without_release_before_its_write_back_completes_is_caught():
    reference_model, reference_optimizer = unlimited("PagedAdamW")
    model, optimizer, backend = run_with_store(DropsDeviceBufferBeforeWriteBack, "PagedAdamW", delay=5e-3)
    assert any("last reference dropped" in hazard for hazard in backend.hazards)
    with pytest.raises(AssertionError):
        assert_same_result(model, optimizer, reference_model, reference_optimizer)


def test_a_device_buffer_dropped_without_release_after_its_write_back_is_freed_as_on_cuda():
    reference_model, reference_optimizer = unlimited("PagedAdamW")
    model, optimizer, backend = run_with_store(DropsDeviceBufferAfterWriteBack, "PagedAdamW", delay=5e-4)
    assert_same_result(model, optimizer, reference_model, reference_optimizer)
    assert backend.hazards == [] and optimizer.paging_stats()["page_outs"] > 0
    assert backend.device_bytes == optimizer.paging_stats()["device_bytes"]


def test_the_optimizer_frees_device_buffers_only_after_their_copies(optimizer_name):
    """Swapped-out tensors whose pages are freed, a load, eviction, budget changes and the optimizer dropped at the
    end: no device buffer is released or collected while a copy uses it, and every one is freed in the end."""
    batches = regression_batches(STEPS)
    with simulated_streams(delay=2e-3) as backends:
        model, optimizer = build(optimizer_name, device_budget=PAGE_SIZE, prefetch=2)
        train(model, optimizer, batches[:2])
        train_with_swaps(model, optimizer, batches[2:4])
        optimizer.load_state_dict(optimizer.state_dict())
        optimizer.set_device_budget(3 * PAGE_SIZE)
        train(model, optimizer, batches[4:5])
        optimizer.evict(PAGE_SIZE)
        optimizer.set_device_budget(PAGE_SIZE)
        train_with_swaps(model, optimizer, batches[5:])
        (backend,) = backends
        assert backend.device_bytes == optimizer.paging_stats()["device_bytes"] > 0
        del optimizer
        gc.collect()
        assert backend.device_bytes == 0
    assert backend.hazards == []


def test_host_waits_for_page_ins_are_caught():
    reference_model, reference_optimizer = unlimited("PagedAdamW")
    start = time.perf_counter()
    model, optimizer, backend = run_with_store(WaitsForEveryPageIn, "PagedAdamW", delay=1e-4)
    assert time.perf_counter() - start < 30
    assert_same_result(model, optimizer, reference_model, reference_optimizer)
    assert backend.hazards == [] and backend.host_waits["to_device"] > 0
