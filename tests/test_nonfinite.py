"""Non-finite gradients and blockwise state: a non-finite value never leaves a block's scale non-finite.

One gradient element of 1e20 overflows its squared gradient to infinity. torch.optim.AdamW then keeps that
element's parameter (its step is m / inf = 0) and every other one finite; the blockwise states used to take the
infinity as their block's scale, so that every other element of the block decoded 0 x inf = NaN for good.
"""

from __future__ import annotations

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


@pytest.fixture(params=["eager", "host"])
def kernels(request, monkeypatch):
    if request.param == "host" and native.build_failure() is not None:
        pytest.skip("host kernels unavailable")
    monkeypatch.setenv("HF_PAGED_NATIVE", "1" if request.param == "host" else "0")
    return request.param


@pytest.mark.parametrize("name", QUANTIZED)
def test_an_overflowed_gradient_leaves_parameters_and_scales_finite_as_in_torch(kernels, name):
    reference, _ = train_with_one_bad_gradient(torch.optim.AdamW, 1e20)
    assert reference.isfinite().all()
    param, optimizer = train_with_one_bad_gradient(getattr(hf_paged, name), 1e20)
    assert param.isfinite().all(), f"{(~param.isfinite()).sum()} non-finite parameters"
    assert all(value.float().isfinite().all() for value in saved_state(optimizer))
    clean, _ = train_with_one_bad_gradient(getattr(hf_paged, name), None)
    assert torch.equal(other_blocks(param), other_blocks(clean))  # blocks are independent


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
    """The scale is the block's largest finite magnitude: NaN is stored as zero, an infinity as the largest
    finite magnitude's code, and the other values as they would be without them."""
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
    assert decoded.isfinite().all()
    expected_first_row = codec.decode(clean_segment)[0].clone()
    four_bit_second_moment = isinstance(codec, Blockwise4bitCodec) and not codec.signed
    # NaN is stored as zero, which the 4-bit non-negative map lacks: its smallest level
    expected_first_row[4] = bad_segment[1][0] * (1 / 16) ** 4 if four_bit_second_moment else 0.0
    torch.testing.assert_close(decoded[0], expected_first_row, rtol=0, atol=0)
    assert decoded[1, 9] == largest_finite
