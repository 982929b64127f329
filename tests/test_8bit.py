"""8-bit state: fidelity against fp32 AdamW and bitsandbytes, bytes per parameter, codec round trips."""

from __future__ import annotations

import pytest
import torch
from conftest import deviation, train

import hf_paged
from hf_paged.codecs import Blockwise8bitCodec, to_blocks

STEPS = 200


def student(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 4)
    )


def teacher_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A regression task: targets from a fixed random teacher network."""
    torch.manual_seed(7)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        return [
            (inputs, teacher(inputs)) for inputs in (torch.randn(128, 32, generator=generator) for _ in range(STEPS))
        ]


def fit(make_optimizer) -> tuple[torch.nn.Module, float, float]:
    """Train the student; return it with its first and final (mean of the last 20 steps) loss."""
    model = student()
    losses = train(model, make_optimizer(model.parameters()), teacher_batches())
    return model, losses[0], sum(losses[-20:]) / 20


@pytest.fixture(scope="module")
def fp32_run():
    return fit(lambda params: torch.optim.AdamW(params, lr=1e-3))


def test_adamw8bit_final_loss_within_5_percent_of_fp32(fp32_run):
    _, first, reference_loss = fp32_run
    _model, _, loss = fit(
        lambda params: hf_paged.PagedAdamW8bit(params, lr=1e-3, device_budget="1MiB", page_size="256KiB")
    )
    assert reference_loss < 0.5 * first
    assert abs(loss - reference_loss) <= 0.05 * reference_loss


def test_adamw8bit_deviates_from_fp32_no_more_than_bitsandbytes(fp32_run):
    bnb = pytest.importorskip("bitsandbytes")
    reference, _, _ = fp32_run
    ours, _, _ = fit(lambda params: hf_paged.PagedAdamW8bit(params, lr=1e-3))
    theirs, _, _ = fit(lambda params: bnb.optim.AdamW8bit(params, lr=1e-3))
    assert deviation(ours, reference) <= deviation(theirs, reference)
    assert deviation(ours, reference) > 0


def test_lion8bit_tracks_lion(fp32_run):
    _, first, _ = fp32_run
    _, _, loss = fit(lambda params: hf_paged.PagedLion(params, lr=1e-4))
    _, _, loss8 = fit(lambda params: hf_paged.PagedLion8bit(params, lr=1e-4))
    assert loss < 0.5 * first
    assert abs(loss8 - loss) <= 0.05 * loss


def test_adamw8bit_state_bytes_per_parameter():
    params = [torch.nn.Parameter(torch.zeros(1024, 1024)) for _ in range(4)]
    optimizer = hf_paged.PagedAdamW8bit(params)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    stats = optimizer.paging_stats()
    assert stats["device_bytes"] / sum(param.numel() for param in params) <= 2.04


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("block_size", [16, 256])
def test_codec_round_trip_error(signed, block_size):
    codec = Blockwise8bitCodec(block_size, signed)
    torch.manual_seed(0)
    numel = 10 * block_size + 3
    values = torch.randn(numel) * torch.logspace(-6, 0, numel)
    values = values if signed else values.square()
    blocks = to_blocks(values, block_size)
    codes = torch.zeros(blocks.shape, dtype=codec.code_dtype)
    scales = torch.zeros(blocks.shape[0])
    codec.encode(blocks, (codes, scales))
    decoded = codec.decode((codes, scales)).view(-1)[:numel]
    assert torch.equal(scales, blocks.abs().amax(dim=1))
    codes = codes.view(-1)
    relative = (decoded - values).abs() / values.abs().clamp_min(1e-30)
    large = values.abs() >= 0.1 * scales.repeat_interleave(block_size)[:numel]
    assert relative[large].max() < (0.03 if signed else 0.02)
    if not signed:
        assert torch.equal(decoded == 0, values == 0)
    assert torch.equal(codes[numel:], torch.zeros_like(codes[numel:]))


def test_zero_block_decodes_to_zero():
    codec = Blockwise8bitCodec(64, signed=False)
    codes, scales = torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2)
    values = torch.stack([torch.zeros(64), torch.rand(64)])
    codec.encode(values, (codes, scales))
    assert scales[0] == 0 and torch.equal(codec.decode((codes, scales))[0], torch.zeros(64))


def test_blocks_with_a_subnormal_scale_encode_to_zero_codes():
    """The reciprocal of a subnormal scale overflows; the codes must not come from casting infinities."""
    from hf_paged.codecs import Blockwise4bitCodec, inverse_scales

    scales = torch.tensor([0.0, 1e-39, 1e-30])
    inverse = inverse_scales(scales)
    assert torch.isfinite(inverse).all() and inverse[0] == inverse[1] == 0 and inverse[2] == 1 / scales[2]
    values = (torch.rand(2, 64, generator=torch.Generator().manual_seed(0)) - 0.5) * torch.tensor([[1e-39], [1.0]])
    for codec in (Blockwise8bitCodec(64, True), Blockwise4bitCodec(64, True)):
        encoded = tuple(torch.empty(n, dtype=dtype) for n, dtype in codec.buffer_specs(128))
        segment = codec.select(encoded, 0, 128)
        codec.encode(values, segment)
        decoded = codec.decode(segment)
        assert torch.equal(decoded[0], torch.zeros(64)) and decoded[1].abs().max() > 0
