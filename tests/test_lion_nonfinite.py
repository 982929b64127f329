"""A NaN gradient element and Lion's momentum: the momentum is stored as zero, with fp32 state as with 8-bit state.

Lion's direction of a NaN momentum is ``sign(nan) = 0``, so a NaN kept in fp32 momentum froze its parameter element
for good, silently, while 8-bit momentum stored it as zero (README, "non-finite gradients").
"""

from __future__ import annotations

import itertools

import pytest
import torch

import hf_paged
from hf_paged import native

BAD = (1, 5)
"""The gradient element that is NaN at the first step."""
LR = 1e-3
STEPS = 4


@pytest.fixture(params=["eager", "host"])
def kernels(request, monkeypatch):
    if request.param == "host" and native.build_failure() is not None:
        pytest.skip("host kernels unavailable")
    monkeypatch.setenv("HF_PAGED_NATIVE", "1" if request.param == "host" else "0")
    return request.param


def gradients() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A 4x256 parameter and its gradients for :data:`STEPS` steps, the first with a NaN at :data:`BAD`."""
    generator = torch.Generator().manual_seed(0)
    param = torch.randn(4, 256, generator=generator)
    grads = [torch.randn(4, 256, generator=generator) * 1e-2 for _ in range(STEPS)]
    grads[0][BAD] = float("nan")
    return param, grads


def momentum(optimizer) -> torch.Tensor:
    """The optimizer's momentum, decoded (8-bit codes times their block's scale)."""
    state = optimizer.state_dict()["state"][0]
    if "exp_avg" in state:
        return state["exp_avg"]
    codes = state["exp_avg_codes"].float().reshape(-1, 128) / 127
    return (codes * codes.abs() * state["exp_avg_scales"].reshape(-1, 1)).reshape(4, 256)


@pytest.mark.parametrize("name", ["PagedLion", "PagedLion8bit"])
def test_a_nan_gradient_stores_zero_momentum_and_the_element_moves_again(kernels, name):
    init, grads = gradients()
    param = torch.nn.Parameter(init.clone())
    kwargs = {"block_size": 128, "min_8bit_size": 64} if name.endswith("8bit") else {}
    optimizer = getattr(hf_paged, name)([param], lr=LR, **kwargs)
    trajectory = []
    for step, grad in enumerate(grads):
        param.grad = grad.clone()
        optimizer.step()
        trajectory.append(param.detach()[BAD].item())
        if step == 0:
            assert momentum(optimizer)[BAD].item() == 0.0  # stored as zero, not NaN
            assert momentum(optimizer).isfinite().all()
    assert trajectory[0] == init[BAD].item()  # sign(nan) = 0: no move at the bad step
    moves = [abs(after - before) for before, after in itertools.pairwise(trajectory)]
    assert all(move == pytest.approx(LR, rel=1e-3) for move in moves), moves  # not frozen: lr a step
    assert param.isfinite().all()


def test_fp32_momentum_follows_bitsandbytes_lion_with_nan_stored_as_zero(kernels):
    """bitsandbytes' 32-bit Lion (which keeps the NaN) with the NaN momentum element set to zero after the bad step:
    the parameters bitwise, every step."""
    bnb = pytest.importorskip("bitsandbytes")
    init, grads = gradients()
    reference = torch.nn.Parameter(init.clone())
    expected = bnb.optim.Lion([reference], lr=LR, betas=(0.9, 0.99), weight_decay=0.1, optim_bits=32)
    param = torch.nn.Parameter(init.clone())
    optimizer = hf_paged.PagedLion([param], lr=LR, betas=(0.9, 0.99), weight_decay=0.1)
    for step, grad in enumerate(grads):
        reference.grad, param.grad = grad.clone(), grad.clone()
        expected.step()
        optimizer.step()
        if step == 0:
            state = expected.state[reference]["state1"]
            assert state[BAD].isnan()
            state.nan_to_num_(nan=0.0)
        assert torch.equal(param, reference), step
