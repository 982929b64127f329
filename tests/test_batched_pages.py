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


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_fp32_parameters_beside_bf16_ones_on_a_page_take_the_fused_call(fused_calls, monkeypatch, kernels):
    """An fp32 parameter keeps torch.optim.AdamW(fused=True)'s result bitwise when a bf16 parameter shares its page:
    the page's fp32 tensors take the fused call, its others the rule kernels, each as on a page of its own (the whole
    page once took the rule kernels, an ulp off the fused result)."""
    monkeypatch.setenv("HF_PAGED_KERNELS", kernels)
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(64, 300, generator=generator), torch.randn(100, generator=generator).bfloat16()

    def fit(make_optimizer, tensors):
        params = [torch.nn.Parameter(tensor.clone()) for tensor in tensors]
        optimizer = make_optimizer(params)
        for step in range(3):
            for param in params:
                param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(step)).to(param.dtype)
            optimizer.step()
        return [param.detach() for param in params], optimizer

    (fp32, bf16), optimizer = fit(lambda params: hf_paged.PagedAdamW(params, lr=1e-2), [weight, bias])
    assert optimizer.paging_stats()["pages_total"] == 1
    assert fused_calls == [1, 1, 1]
    (expected_fp32,), _ = fit(lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True), [weight])
    assert torch.equal(fp32, expected_fp32)
    (expected_bf16,), _ = fit(lambda params: hf_paged.PagedAdamW(params, lr=1e-2), [bias])
    assert torch.equal(bf16, expected_bf16)
