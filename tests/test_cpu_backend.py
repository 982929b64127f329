"""The CPU backend keeps released page buffers for the next page of their shape, and no more than two of each."""

from __future__ import annotations

import torch
from conftest import decay_groups, make_mlp, regression_batches, train

import hf_paged
from hf_paged.device import CPUBackend, backend_for

SPECS = [(1024, torch.uint8), (4, torch.float32)]


def test_released_buffers_serve_the_next_allocation_of_their_shape():
    backend = backend_for(torch.device("cpu"))
    assert isinstance(backend, CPUBackend)
    device_buffers, host_buffers = backend.empty_device(SPECS), backend.empty_host(SPECS)
    backend.release(device_buffers)
    backend.release_host(host_buffers)
    assert backend.empty_device(SPECS) is device_buffers
    assert backend.empty_host(SPECS) is host_buffers
    other_shape = backend.empty_device([(512, torch.uint8), (2, torch.float32)])
    assert other_shape is not device_buffers and [b.numel() for b in other_shape] == [512, 2]


def test_at_most_two_sets_of_one_shape_are_kept():
    backend = CPUBackend(torch.device("cpu"))
    released = [backend.empty_host(SPECS) for _ in range(4)]
    for buffers in released:
        backend.release_host(buffers)
    taken = [backend.empty_host(SPECS) for _ in range(4)]
    assert sum(any(buffers is kept for kept in released) for buffers in taken) == 2


def test_a_streamed_step_pages_through_reused_host_buffers():
    model = make_mlp()
    optimizer = hf_paged.PagedAdamW(decay_groups(model), lr=1e-2, page_size=4096, device_budget=2 * 4096, prefetch=1)
    pages = optimizer.paging_stats()["pages_total"]
    host_buffers = set()
    steps = 6
    for batch in regression_batches(steps):
        train(model, optimizer, [batch])
        host_buffers |= {id(buffers) for page in optimizer._store.pages if (buffers := page.host) is not None}
    assert optimizer.paging_stats()["page_outs"] >= (steps - 1) * (pages - 2)
    # Fresh buffers for every page out would give a set per page out; kept ones are freed at the end of a step.
    assert len(host_buffers) <= pages + 2 * steps


def test_kept_buffers_are_freed_when_the_step_ends():
    model = make_mlp()
    optimizer = hf_paged.PagedAdamW(decay_groups(model), lr=1e-2, page_size=4096, device_budget=2 * 4096, prefetch=1)
    (backend,) = (store.backend for store in optimizer._store.stores.values())
    kept_during_steps = []
    original = backend.release_host

    def release_host(buffers):
        original(buffers)
        kept_during_steps.append(backend.kept_bytes)

    backend.release_host = release_host
    train(model, optimizer, regression_batches(3))
    assert max(kept_during_steps) > 0
    assert backend.kept_bytes == 0  # between steps the budget alone bounds the memory the pages hold
