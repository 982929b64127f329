"""``eps``: every value ``torch.optim.AdamW`` accepts (``0 <= eps``, infinity included) works in every AdamW optimizer
and host kernel family as in torch, also from a torch state dict saved with it (the Triton kernels:
tests/test_triton_kernels.py)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import decay_groups, make_mlp, regression_batches, train

import hf_paged
from hf_paged import native

OPTIMIZERS = {
    "PagedAdamW": lambda params, eps: hf_paged.PagedAdamW(params, lr=1e-2, eps=eps),
    "PagedAdamW8bit": lambda params, eps: hf_paged.PagedAdamW8bit(params, lr=1e-2, eps=eps),
    "PagedAdamW4bit": lambda params, eps: hf_paged.PagedAdamW4bit(params, lr=1e-2, eps=eps),
    "PagedAdamW4bit-rank1": lambda params, eps: hf_paged.PagedAdamW4bit(
        params, lr=1e-2, eps=eps, normalization="rank1", block_size=64
    ),
}


@pytest.fixture(params=["eager", "host"])
def kernels(request, monkeypatch):
    if request.param == "host" and native.build_failure() is not None:
        pytest.skip("host kernels unavailable")
    monkeypatch.setenv("HF_PAGED_NATIVE", "1" if request.param == "host" else "0")
    return request.param


def trained(make, eps: float, steps: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """A 256x256 parameter (rank-1 eligible with blocks of 64) before and after ``steps`` steps of gradients that
    are never zero, so that every second moment stays positive."""
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(256, 256, generator=generator))
    start = param.detach().clone()
    optimizer = make([param], eps)
    for _ in range(steps):
        param.grad = torch.randn(256, 256, generator=generator) * 1e-2 + 1e-3
        optimizer.step()
    return start, param.detach()


def deviation(eps: float, make) -> float:
    """How far ``make``'s optimizer ends from torch.optim.AdamW's, relative to how far torch's moved."""
    start, expected = trained(lambda params, eps: torch.optim.AdamW(params, lr=1e-2, eps=eps), eps)
    _, actual = trained(make, eps)
    assert actual.isfinite().all()
    return ((actual - expected).norm() / (expected - start).norm()).item()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_eps_zero_steps_as_torch(kernels, name):
    """eps = 0 (no zero division while v > 0): as close to torch.optim.AdamW(eps=0) as the default eps is to torch's
    (8-bit and 4-bit state: the quantization's deviation, the same with either eps)."""
    zero, default = deviation(0.0, OPTIMIZERS[name]), deviation(1e-8, OPTIMIZERS[name])
    assert zero <= default * 1.01 + 1e-6, (zero, default)
    assert zero < {"PagedAdamW": 1e-6, "PagedAdamW8bit": 0.02}.get(name, 0.25)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_eps_infinity_only_decays_as_torch(kernels, name):
    """eps = inf: m / inf = 0, so a step only decays the parameters, bitwise as torch.optim.AdamW."""
    _, expected = trained(lambda params, eps: torch.optim.AdamW(params, lr=1e-2, eps=eps), math.inf)
    _, actual = trained(OPTIMIZERS[name], math.inf)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("cls", [hf_paged.PagedAdamW, hf_paged.PagedAdamW8bit, hf_paged.PagedAdamW4bit])
def test_a_torch_state_dict_saved_with_eps_zero_loads_and_steps_as_torch(cls):
    batches = regression_batches(8)
    reference = make_mlp()
    torch_optimizer = torch.optim.AdamW(decay_groups(reference), lr=1e-2, eps=0.0)
    train(reference, torch_optimizer, batches[:4])
    saved_model, saved_optimizer = reference.state_dict(), torch_optimizer.state_dict()
    model = make_mlp(seed=5)
    model.load_state_dict(saved_model)
    optimizer = cls(decay_groups(model), lr=1e-2, page_size=4096)
    optimizer.load_state_dict(saved_optimizer)
    assert [group["eps"] for group in optimizer.param_groups] == [0.0, 0.0]
    train(reference, torch_optimizer, batches[4:])
    train(model, optimizer, batches[4:])
    tolerance = {hf_paged.PagedAdamW: 1e-6, hf_paged.PagedAdamW8bit: 2e-2, hf_paged.PagedAdamW4bit: 0.1}[cls]
    for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert param.isfinite().all()
        assert ((param - expected).norm() / expected.norm()).item() < tolerance


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_eps_zero_and_a_zero_gradient_give_nan_as_torch(kernels, name):
    """eps = 0 at the first step of an element whose gradient is zero: 0 / 0, NaN, as in torch; nowhere else."""
    param = torch.nn.Parameter(torch.ones(256, 256))
    reference = torch.nn.Parameter(torch.ones(256, 256))
    grad = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    grad[0, 3] = 0.0
    for tensor, optimizer in (
        (param, OPTIMIZERS[name]([param], 0.0)),
        (reference, torch.optim.AdamW([reference], eps=0.0)),
    ):
        tensor.grad = grad.clone()
        optimizer.step()
    assert reference[0, 3].isnan() and reference.isnan().sum() == 1
    assert torch.equal(param.isnan(), reference.isnan())
