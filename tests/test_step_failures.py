"""A step that fails part way (an allocation that fails while pages stream in) leaves no page in flight, so
``evict()`` frees every device byte and the next step fits its budget (issue 19, first point, in part)."""

from __future__ import annotations

import pytest
import torch
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, regression_batches, train

from hf_paged.store import PageState
from hf_paged.testing import simulated_streams


def failing_allocation(store, at: int) -> None:
    """Make the ``at``-th device allocation of ``store`` (counted from 1) raise ``torch.OutOfMemoryError``."""
    calls = [0]
    empty_device = store.backend.empty_device

    def allocate(specs):
        calls[0] += 1
        if calls[0] == at:
            raise torch.OutOfMemoryError("injected: page allocation")
        return empty_device(specs)

    store.backend.empty_device = allocate


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_failed_page_allocation_leaves_no_page_in_flight(name):
    with simulated_streams():
        model = make_mlp()
        optimizer = OPTIMIZERS[name](decay_groups(model), **optimizer_kwargs(name, device_budget=4 * 4096))
        train(model, optimizer, regression_batches(1))
        optimizer.evict()
        (store,) = optimizer._store.stores.values()
        failing_allocation(store, at=3)  # the second page prefetched while the first is updated
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            train(model, optimizer, regression_batches(1))
        assert not [page for page in store.pages if page.state is PageState.PAGING_IN]
        optimizer.evict()
        stats = optimizer.paging_stats()
        assert stats["device_bytes"] == 0 and stats["pages_resident"] == 0
        optimizer.set_device_budget(4096)  # one page streamed at a time
        train(model, optimizer, regression_batches(1))
        assert optimizer.paging_stats()["device_bytes"] <= 4096
