"""Non-finite and huge gradients and blockwise state, against torch.optim.AdamW.

One gradient element of 1e22 overflows its weighted square, (1 - beta2) g g, to infinity. torch.optim.AdamW then
keeps that element's parameter for good (its steps are m / inf = 0) and every other one finite. The blockwise states
once took the infinity as their block's scale, so that every other element of the block decoded 0 x inf = NaN for
good; then they stored it as the largest fp32 value and read that back, so that the element's later steps were
m / sqrt(3.4e38), about lr g / 1.8e19: it moved by 3 at 1e24 and by 3e6 at 1e30. A non-negative state now reads it
back as infinity.
"""

from __future__ import annotations

import math

import pytest
import torch

import hf_paged
from hf_paged import native
from hf_paged.codecs import Blockwise4bitCodec, Blockwise8bitCodec
from hf_paged.kernels import HostKernel, SegmentKernel
from hf_paged.optim.adamw import adamw_scalars, adamw_update_
from hf_paged.optim.lion import lion_update_

QUANTIZED = ["PagedAdamW8bit", "PagedAdamW4bit", "PagedLion8bit"]


def train_with_one_bad_gradient(optimizer_class, bad_value: float | None, steps: int = 5):
    """A 4x256 parameter stepped ``steps`` times; at the first step gradient element (1, 5), in the third block of
    128, is ``bad_value`` (``None``: left as drawn)."""
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4, 256, generator=generator))
    kwargs = {"lr": 1e-3}
    if optimizer_class is not torch.optim.AdamW:
        size_key = "min_4bit_size" if "4bit" in optimizer_class.__name__ else "min_8bit_size"
        kwargs |= {"block_size": 128, size_key: 64}
    optimizer = optimizer_class([param], **kwargs)
    for step in range(steps):
        param.grad = torch.randn(4, 256, generator=generator) * 1e-2
        if step == 0 and bad_value is not None:
            param.grad[1, 5] = bad_value
        optimizer.step()
    return param.detach(), optimizer


def saved_state(optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state_dict()["state"].values() for value in state.values()]


def other_blocks(param: torch.Tensor) -> torch.Tensor:
    """The elements outside the bad element's block of 128."""
    flat = param.reshape(-1)
    return torch.cat([flat[:256], flat[384:]])


@pytest.fixture(params=["torch", "native", "triton"])
def kernels(request, monkeypatch):
    """The kernel family of the optimizers' CPU pages (``HF_PAGED_KERNELS``): the PyTorch kernels, the C++ host kernels
    or the Triton kernels under Triton's interpreter."""
    if request.param == "native":
        if native.build_failure() is not None:
            pytest.skip("host kernels unavailable")
        monkeypatch.setenv("HF_PAGED_NATIVE", "1")
    if request.param == "triton":
        import test_triton_kernels  # noqa: F401  (skips where Triton cannot run under its interpreter)

        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HF_PAGED_KERNELS", request.param)
    return request.param


@pytest.mark.parametrize("name", QUANTIZED)
def test_an_overflowed_gradient_leaves_parameters_and_scales_finite_as_in_torch(kernels, name):
    reference, _ = train_with_one_bad_gradient(torch.optim.AdamW, 1e22)
    assert reference.isfinite().all()
    param, optimizer = train_with_one_bad_gradient(getattr(hf_paged, name), 1e22)
    assert param.isfinite().all(), f"{(~param.isfinite()).sum()} non-finite parameters"
    assert all(value.float().isfinite().all() for value in saved_state(optimizer))
    clean, _ = train_with_one_bad_gradient(getattr(hf_paged, name), None)
    assert torch.equal(other_blocks(param), other_blocks(clean))  # blocks are independent


FLOAT32_MAX = torch.finfo(torch.float32).max
HUGE = [1e20, 1e22, 1e24, 1e26, 1e30, FLOAT32_MAX, math.inf]
"""Gradient magnitudes below and above the overflow of torch's (1 - beta2) g g, at sqrt(FLOAT32_MAX / (1 - beta2)):
about 5.8e20 with beta2 = 0.999."""

ADAMW_STATES = {
    "8bit": (hf_paged.PagedAdamW8bit, {"block_size": 128, "min_8bit_size": 64}, (256,)),
    "4bit": (hf_paged.PagedAdamW4bit, {"block_size": 128, "min_4bit_size": 64}, (256,)),
    "4bit-rank1": (
        hf_paged.PagedAdamW4bit,
        {"block_size": 16, "min_4bit_size": 64, "normalization": "rank1"},
        (64, 64),
    ),
}
"""AdamW's quantized states by layout kind: the optimizer, its arguments and the parameter's shape (two blocks of 128;
rank-1 state takes a matrix whose statistics cost no more than block scales: 64 x 64 in blocks of 16)."""

HUGE_ELEMENT = 5
DECAY = 1 - 1e-3 * 1e-2
"""What a step of lr 1e-3 multiplies a parameter by before its update (weight decay 1e-2, the default)."""


def train_with_one_huge_gradient(state: str | None, shape: tuple[int, ...], magnitude: float | None, steps: int = 6):
    """``steps`` steps of lr 1e-3 on a zero parameter of ``shape`` by ``state``'s optimizer (``None``:
    ``torch.optim.AdamW``), all gradients 0.01 but element 5's at the second step, ``magnitude`` (``None``: 0.01).
    The parameter, flat, and the optimizer."""
    param = torch.nn.Parameter(torch.zeros(shape))
    if state is None:
        optimizer = torch.optim.AdamW([param], lr=1e-3)
    else:
        optimizer_class, kwargs, _ = ADAMW_STATES[state]
        optimizer = optimizer_class([param], lr=1e-3, **kwargs)
    for step in range(steps):
        param.grad = torch.full(shape, 0.01)
        if step == 1 and magnitude is not None:
            param.grad.view(-1)[HUGE_ELEMENT] = magnitude
        optimizer.step()
    if state is not None:
        assert optimizer._layout[param].kind == state
    return param.detach().reshape(-1), optimizer


@pytest.mark.parametrize("magnitude", HUGE, ids=str)
@pytest.mark.parametrize("state", sorted(ADAMW_STATES))
def test_a_huge_gradient_moves_its_element_as_little_as_in_torch(kernels, monkeypatch, state, magnitude):
    """After 6 steps the element is torch.optim.AdamW's: moved by its later steps m / sqrt(v) where (1 - beta2) g g
    stays finite (1e20), by none of them where it overflows (m / inf = 0), NaN for an infinite gradient (inf / inf);
    each kernel family's parameter and state bitwise the PyTorch kernels' (the Triton kernels' where the CPU's lerp
    is one fused multiply-add: without one, PyTorch's lerp rounds apart by an ulp, which tests/test_triton_kernels.py
    bounds)."""
    shape = ADAMW_STATES[state][2]
    reference, _ = train_with_one_huge_gradient(None, shape, magnitude)
    param, optimizer = train_with_one_huge_gradient(state, shape, magnitude)
    torch.testing.assert_close(param[HUGE_ELEMENT], reference[HUGE_ELEMENT], rtol=1e-5, atol=0, equal_nan=True)
    if kernels == "triton":
        from hf_paged.kernels.triton_kernels import lerp_rounds_once  # imported under the interpreter (the fixture)

        if not lerp_rounds_once():
            pytest.skip("without a fused multiply-add, PyTorch's lerp rounds apart by an ulp (test_triton_kernels.py)")
    if kernels != "torch":
        monkeypatch.setenv("HF_PAGED_KERNELS", "torch")
        expected, expected_optimizer = train_with_one_huge_gradient(state, shape, magnitude)
        torch.testing.assert_close(param, expected, rtol=0, atol=0, equal_nan=True)
        for value, expected_value in zip(saved_state(optimizer), saved_state(expected_optimizer), strict=True):
            assert torch.equal(value, expected_value)


@pytest.mark.parametrize("magnitude", HUGE, ids=str)
@pytest.mark.parametrize("state", sorted(ADAMW_STATES))
def test_a_huge_gradient_leaves_the_rest_of_its_state_as_blockwise_scales_leave_it(state, magnitude):
    """Rank-1 state: every other element bitwise as without the huge gradient (the elements of its row and column
    take the other statistic as normalizer). Blockwise state: the other block bitwise as without it; the other
    elements of its block, whose second moments decode to at least 2.4e-10 (8-bit) or 1.5e-5 (4-bit) of the huge one
    from then on, take no step after it but the weight decay's. (In the default kernel family: every family's
    parameter is the PyTorch kernels', bitwise, see the test above.)"""
    shape = ADAMW_STATES[state][2]
    param, _ = train_with_one_huge_gradient(state, shape, magnitude)
    clean, _ = train_with_one_huge_gradient(state, shape, None)
    others = torch.arange(param.numel()) != HUGE_ELEMENT
    if state == "4bit-rank1":
        assert torch.equal(param[others], clean[others])
        return
    block = torch.arange(param.numel()) < 128
    assert torch.equal(param[~block], clean[~block])
    expected, _ = train_with_one_huge_gradient(state, shape, magnitude, steps=2)
    for _ in range(4):
        expected.mul_(DECAY)
    assert not torch.equal(expected[block & others], clean[block & others])
    assert torch.equal(param[block & others], expected[block & others])


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_nan_gradient_leaves_its_block_finite(kernels, name):
    """AdamW's parameter element becomes NaN, as in torch (Lion's does not: torch.sign(nan) is 0); the state
    stores NaN as zero, so the block's scale and every other element stay finite."""
    reference, _ = train_with_one_bad_gradient(torch.optim.AdamW, float("nan"))
    param, optimizer = train_with_one_bad_gradient(getattr(hf_paged, name), float("nan"))
    expected_nans = reference.isnan() if "AdamW" in name else torch.zeros_like(param, dtype=torch.bool)
    assert torch.equal(param.isnan(), expected_nans)
    assert all(value.float().isfinite().all() for value in saved_state(optimizer))
    clean, _ = train_with_one_bad_gradient(getattr(hf_paged, name), None)
    assert torch.equal(other_blocks(param), other_blocks(clean))
    bad_block = param.reshape(-1)[256:384]
    assert bad_block[~bad_block.isnan()].isfinite().all()


@pytest.mark.parametrize("bad_value", [math.inf, -math.inf])
def test_an_infinite_gradient_leaves_lion_s_momentum_zero_in_every_format(kernels, bad_value):
    """Lion stores an infinite momentum as zero, as a NaN one, in fp32 and 8-bit state alike: the element moves with
    its gradients again from the next step on (an 8-bit momentum once kept it as the block's largest code, read back
    as the largest fp32 value, and moved the element against its gradients for thousands of steps; an fp32 one
    stopped it for a step, inf - inf)."""
    params = {}
    for name in ("PagedLion", "PagedLion8bit"):
        param = torch.nn.Parameter(torch.zeros(2, 256))
        kwargs = {"min_8bit_size": 1, "block_size": 256} if name == "PagedLion8bit" else {}
        optimizer = getattr(hf_paged, name)([param], lr=1e-3, weight_decay=0.0, **kwargs)
        for step in range(4):
            param.grad = torch.full((2, 256), -1.0)
            if step == 0:
                param.grad[0, 5] = bad_value
            optimizer.step()
        assert all(value.float().isfinite().all() for value in saved_state(optimizer))
        params[name] = param.detach()
    first_step = -1e-3 * math.copysign(1.0, bad_value)
    torch.testing.assert_close(params["PagedLion"][0, 5], torch.tensor(first_step + 3e-3), rtol=1e-5, atol=0)
    torch.testing.assert_close(params["PagedLion"][1], torch.full((256,), 4e-3), rtol=1e-5, atol=0)
    assert torch.equal(params["PagedLion8bit"], params["PagedLion"])


def bad_gradients(blocks: int, block_size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    grads = [torch.randn(blocks, block_size, generator=generator) for _ in range(3)]
    grads[0][0, 3] = 1e20
    grads[0][1, 7] = float("inf")
    grads[0][2, 1] = float("-inf")
    grads[1][3, 2] = float("nan")
    return grads


@pytest.mark.parametrize("codec, block_size", [(Blockwise8bitCodec, 64), (Blockwise4bitCodec, 64)])
@pytest.mark.parametrize("rule_name", ["adamw", "lion"])
def test_host_kernels_store_non_finite_values_as_the_eager_kernels_do(rule_name, codec, block_size):
    if native.build_failure() is not None:
        pytest.skip("host kernels unavailable")
    rule, signed, scalars = {
        "adamw": (
            adamw_update_,
            (True, False),
            adamw_scalars({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}, 2),
        ),
        "lion": (lion_update_, (True,), {"lr": 1e-4, "decay": 1.0, "direction_weight": 0.1, "avg_weight": 0.01}),
    }[rule_name]
    codecs = tuple(codec(block_size, is_signed) for is_signed in signed)
    blocks = 8
    results = []
    for kernel in (
        HostKernel(rule_name, codecs, SegmentKernel(rule, codecs, False)),
        SegmentKernel(rule, codecs, False),
    ):
        param = torch.randn(blocks, block_size, generator=torch.Generator().manual_seed(6))
        encoded = []
        for state_codec in codecs:
            arrays = tuple(torch.zeros(n, dtype=dtype) for n, dtype in state_codec.buffer_specs(blocks * block_size))
            encoded.append(state_codec.select(arrays, 0, blocks * block_size))
        for grad in bad_gradients(blocks, block_size):
            kernel(param, grad, encoded, scalars)
        results.append((param, encoded))
    (param, encoded), (expected_param, expected_encoded) = results
    torch.testing.assert_close(param, expected_param, rtol=0, atol=0, equal_nan=True)
    for segment, expected_segment in zip(encoded, expected_encoded):
        for array, expected in zip(segment, expected_segment):
            assert torch.equal(array, expected)
        assert segment[1].isfinite().all()


@pytest.mark.parametrize(
    "codec",
    [
        Blockwise8bitCodec(64, True),
        Blockwise8bitCodec(64, False),
        Blockwise4bitCodec(64, True),
        Blockwise4bitCodec(64, False),
    ],
)
def test_a_block_with_non_finite_values_keeps_its_finite_ones(codec):
    """The scale is the block's largest finite magnitude: NaN is stored as zero, an infinity as the largest code
    with the largest fp32 value as scale (read back as infinity in a non-negative state, as the largest fp32 value in
    a signed one), and the other values as they would be without them."""
    values = torch.rand(2, 64, generator=torch.Generator().manual_seed(7)) + 0.5
    values = values if not codec.signed else values * torch.tensor([1.0, -1.0]).repeat(32)
    bad = values.clone()
    bad[0, 4], bad[1, 9] = float("nan"), float("inf")
    arrays = [tuple(torch.zeros(n, dtype=dtype) for n, dtype in codec.buffer_specs(128)) for _ in range(2)]
    clean_segment, bad_segment = (codec.select(array, 0, 128) for array in arrays)
    codec.encode(values, clean_segment)
    codec.encode(bad, bad_segment)
    largest_finite = torch.finfo(torch.float32).max
    assert bad_segment[1][0] == clean_segment[1][0] and bad_segment[1][1] == largest_finite
    decoded = codec.decode(bad_segment)
    assert decoded[0].isfinite().all()
    expected_first_row = codec.decode(clean_segment)[0].clone()
    four_bit_second_moment = isinstance(codec, Blockwise4bitCodec) and not codec.signed
    # NaN is stored as zero, which the 4-bit non-negative map lacks: its smallest level
    expected_first_row[4] = bad_segment[1][0] * (1 / 16) ** 4 if four_bit_second_moment else 0.0
    torch.testing.assert_close(decoded[0], expected_first_row, rtol=0, atol=0)
    assert decoded[1, 9] == (largest_finite if codec.signed else math.inf)
    assert decoded[1, torch.arange(64) != 9].isfinite().all()


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic rounding"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_nan_bf16_parameter_has_the_same_bits_in_every_family(kernels, compiled, stochastic):
    """A bf16 parameter element that becomes NaN (0 / 0 with eps = 0) is written as 0x7FC0 by every kernel family, as
    by the host and Triton kernels, rounded to nearest or stochastically (the PyTorch kernels once wrote ATen's
    conversion of it, 0xFFFF)."""
    param = torch.nn.Parameter(torch.randn(4, 256, generator=torch.Generator().manual_seed(0)).bfloat16())
    optimizer = hf_paged.PagedAdamW([param], lr=1e-2, eps=0.0, compiled=compiled, bf16_stochastic_round=stochastic)
    for _ in range(2):
        param.grad = torch.zeros_like(param)
        optimizer.step()
    assert param.isnan().all()
    assert param.detach().view(torch.int16).eq(0x7FC0).all()
