"""Pages are updated in batches: the resident ones in one, one fused AdamW call per param group and device; streamed
ones in batches of the pages whose copies were started together (the prefetch window)."""

from __future__ import annotations

import pytest
import torch
from conftest import decay_groups, make_mlp, regression_batches, train

import hf_paged


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """The number of tensors of each call of ``torch._fused_adamw_``, which still runs."""
    calls = []
    fused = torch._fused_adamw_

    def counting(params, *args, **kwargs):
        calls.append(len(params))
        return fused(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", counting)
    return calls


def test_resident_pages_take_one_fused_call_per_group(fused_calls):
    model = make_mlp()
    optimizer = hf_paged.PagedAdamW(decay_groups(model), lr=1e-2, page_size=4096)
    train(model, optimizer, regression_batches(1))  # the first step lays out the pages, new ones: one batch, no copies
    assert optimizer.paging_stats()["pages_total"] > 2 and len(fused_calls) == 2
    fused_calls.clear()
    train(model, optimizer, regression_batches(2))
    assert len(fused_calls) == 2 * 2  # per step: one call for the matrices' pages, one for the biases' page
    reference = make_mlp()
    train(
        reference,
        torch.optim.AdamW(decay_groups(reference), lr=1e-2, fused=True),
        regression_batches(1) + regression_batches(2),
    )
    for param, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected, rtol=0, atol=0)


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_streamed_pages_are_updated_a_prefetch_window_at_a_time(fused_calls, prefetch):
    """With a budget of five pages (the whole state is 12) each step streams its pages: at most one batch for the
    resident pages and one per ``prefetch`` streamed pages, each one fused call per param group in it."""
    model = make_mlp()
    optimizer = hf_paged.PagedAdamW(
        decay_groups(model), lr=1e-2, page_size=4096, device_budget=5 * 4096, prefetch=prefetch
    )
    train(model, optimizer, regression_batches(1))
    stats = optimizer.paging_stats()
    fused_calls.clear()
    train(model, optimizer, regression_batches(2)[1:])
    streamed = optimizer.paging_stats()["page_ins"] - stats["page_ins"]
    assert streamed > prefetch
    assert len(fused_calls) <= 2 * (-(-streamed // prefetch) + 1), (len(fused_calls), streamed)
