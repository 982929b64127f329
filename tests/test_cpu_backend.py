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
    for batch in regression_batches(6):
        train(model, optimizer, [batch])
        host_buffers |= {id(buffers) for page in optimizer._store.pages if (buffers := page.host) is not None}
    assert optimizer.paging_stats()["page_outs"] >= 5 * (pages - 2)
    assert len(host_buffers) <= pages + 2  # fresh buffers for every page out would give one set per page out
