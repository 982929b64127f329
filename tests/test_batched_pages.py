"""Pages that are all resident are updated as one batch: one fused AdamW call per param group and device."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from conftest import decay_groups, make_mlp, regression_batches, train


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
    train(model, optimizer, regression_batches(1))  # the first step lays out the pages and brings them in, one by one
    assert len(fused_calls) == optimizer.paging_stats()["pages_total"] > 2
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


def test_streamed_pages_are_updated_one_by_one(fused_calls):
    model = make_mlp()
    optimizer = hf_paged.PagedAdamW(decay_groups(model), lr=1e-2, page_size=4096, device_budget=3 * 4096, prefetch=1)
    train(model, optimizer, regression_batches(2))
    assert optimizer.paging_stats()["page_outs"] > 0
    assert len(fused_calls) == 2 * optimizer.paging_stats()["pages_total"]
