"""4-bit state: fidelity against fp32 AdamW and torchao's AdamW4bit, bytes per parameter, codec round trips."""

from __future__ import annotations

import copy
import io
import sys
from pathlib import Path

import pytest
import torch
from conftest import decay_groups, deviation, make_mlp, regression_batches, train

import hf_paged
from hf_paged.codecs import Blockwise4bitCodec, to_blocks
from hf_paged.optim.state_format import rows_shorter_than_block

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fidelity

STEPS = 200


def fit(make_optimizer) -> tuple[torch.nn.Module, float, float]:
    """The task of ``benchmarks/fidelity.py`` (which prints the figures these tests bound): the trained student, its
    first and its final (mean of the last 20 steps) loss."""
    return fidelity.fit(make_optimizer, STEPS)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The 200-step runs are small matrix products: one thread each avoids oversubscribing a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fp32_run():
    return fit(lambda params: torch.optim.AdamW(params, lr=1e-3))


@pytest.fixture(scope="module")
def ours_run():
    return fit(lambda params: hf_paged.PagedAdamW4bit(params, lr=1e-3, device_budget="256KiB", page_size="64KiB"))


def test_adamw4bit_final_loss_within_5_percent_of_fp32(fp32_run, ours_run):
    _, first, reference_loss = fp32_run
    _, _, loss = ours_run
    assert reference_loss < 0.05 * first
    assert abs(loss - reference_loss) <= 0.05 * reference_loss


def test_adamw4bit_deviates_from_fp32_no_more_than_torchao(fp32_run, ours_run, monkeypatch):
    torchao_optim = pytest.importorskip("torchao.optim")
    reference, _, reference_loss = fp32_run
    ours, _, loss = ours_run
    # torchao compiles its update with torch.compile; run the same function eagerly to keep the test fast
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)
    theirs, _, their_loss = fit(lambda params: torchao_optim.AdamW4bit(params, lr=1e-3))
    assert deviation(ours, reference) <= deviation(theirs, reference)
    assert abs(loss - reference_loss) <= abs(their_loss - reference_loss)
    assert deviation(ours, reference) > 0


def test_adamw4bit_state_bytes_per_parameter_in_memory_and_saved():
    params = [torch.nn.Parameter(torch.zeros(1024, 1024)) for _ in range(4)]
    optimizer = hf_paged.PagedAdamW4bit(params)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    numel = sum(param.numel() for param in params)
    assert optimizer.paging_stats()["device_bytes"] / numel <= 1.07
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    assert buffer.tell() / numel <= 1.07
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)["state"]
    assert state[0]["exp_avg_packed_codes"].dtype == torch.uint8
    assert state[0]["exp_avg_packed_codes"].numel() == params[0].numel() // 2
    assert state[0]["exp_avg_sq_scales"].dtype == torch.float32
    assert state[0]["exp_avg_sq_scales"].numel() == params[0].numel() // 128


def reference_levels(signed: bool) -> torch.Tensor:
    """The 4-bit maps written as value tables: signed q|q|/49 for q in [-7, 7]; unsigned ((q+1)/16)^4."""
    if signed:
        return torch.tensor([q * abs(q) / 49 for q in range(-7, 8)])
    return torch.tensor([((q + 1) / 16) ** 4 for q in range(16)])


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("block_size", [16, 128])
def test_codec_rounds_to_the_nearest_level_and_packs_two_codes_per_byte(signed, block_size):
    codec = Blockwise4bitCodec(block_size, signed)
    torch.manual_seed(0)
    numel = 10 * block_size + 3
    values = torch.randn(numel) * torch.logspace(-6, 0, numel)
    values = values if signed else values.square()
    blocks = to_blocks(values, block_size)
    packed = torch.zeros(blocks.shape[0], block_size // 2, dtype=torch.uint8)
    scales = torch.zeros(blocks.shape[0])
    codec.encode(blocks, (packed, scales))
    decoded = codec.decode((packed, scales))
    assert torch.equal(scales, blocks.abs().amax(dim=1))
    levels = reference_levels(signed)
    normalized = blocks / scales.unsqueeze(1)
    # signed: nearest in value; non-negative: nearest in the square-root domain, Adam's denominator's (ties are
    # measure-zero here)
    distance = (normalized.unsqueeze(-1) - levels) if signed else (normalized.unsqueeze(-1).sqrt() - levels.sqrt())
    nearest = levels[distance.abs().argmin(dim=-1)]
    assert torch.allclose(decoded, nearest * scales.unsqueeze(1), rtol=1e-6, atol=0)
    if not signed:
        assert (decoded > 0).all()  # the second moment's map excludes zero
    # byte i of a block holds element i in its low nibble and element i + block_size / 2 in its high one;
    # code c stands for level c
    codes = torch.cat([packed & 15, packed >> 4], dim=1)
    assert torch.equal(decoded, levels[codes.long()] * scales.unsqueeze(1))


def test_zero_block_decodes_to_zero():
    for signed in (True, False):
        codec = Blockwise4bitCodec(64, signed)
        packed, scales = torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2)
        codec.encode(torch.stack([torch.zeros(64), torch.rand(64)]), (packed, scales))
        assert scales[0] == 0 and torch.equal(codec.decode((packed, scales))[0], torch.zeros(64))


def test_4bit_and_8bit_state_dicts_are_told_apart_and_load_into_each_other():
    batches = regression_batches(8)
    model = make_mlp()
    four = hf_paged.PagedAdamW4bit(decay_groups(model), lr=1e-2, page_size=4096, block_size=64, min_4bit_size=256)
    train(model, four, batches)
    saved = four.state_dict()
    # the 64 x 64 matrix in 4-bit codes; the first layer's rows (20 elements) are shorter than a block: 8-bit codes
    assert "exp_avg_packed_codes" in saved["state"][1] and "exp_avg_codes" not in saved["state"][1]
    assert "exp_avg_codes" in saved["state"][0] and "exp_avg_packed_codes" not in saved["state"][0]
    exact = hf_paged.PagedAdamW(decay_groups(model), lr=1e-2, page_size=4096)
    exact.load_state_dict(saved)
    again = hf_paged.PagedAdamW4bit(decay_groups(model), lr=1e-2, page_size=4096, block_size=64, min_4bit_size=256)
    again.load_state_dict(exact.state_dict())
    eight = hf_paged.PagedAdamW8bit(decay_groups(model), lr=1e-2, page_size=4096, block_size=128, min_8bit_size=256)
    eight.load_state_dict(saved)
    exact_state, again_state, eight_state = (optimizer.state_dict()["state"] for optimizer in (exact, again, eight))
    assert "exp_avg_codes" in eight_state[0]
    for index, entry in exact_state.items():
        for name in ("exp_avg", "exp_avg_sq"):
            # decoding to fp32 and encoding again gives the same codes and scales back
            for key in (f"{name}_packed_codes", f"{name}_codes", f"{name}_scales"):
                if key in saved["state"][index]:
                    assert torch.equal(again_state[index][key], saved["state"][index][key]), (index, key)
            if f"{name}_codes" in eight_state[index]:
                numel = entry[name].numel()
                codec = hf_paged.codecs.Blockwise8bitCodec(128, name == "exp_avg")
                codes = to_blocks(eight_state[index][f"{name}_codes"].reshape(-1), 128)
                values = codec.decode((codes, eight_state[index][f"{name}_scales"])).reshape(-1)[:numel]
                assert ((values - entry[name].reshape(-1)).abs().max() / entry[name].abs().max()).item() < 0.05


@pytest.mark.parametrize(
    "shape, narrow",
    [
        ((256, 32), True),
        ((32, 256), False),
        ((128, 128), False),
        ((64, 3, 3, 3), True),
        ((4096,), False),
        ((0, 8), False),
    ],
)
def test_rows_shorter_than_a_block_are_told_by_shape(shape, narrow):
    assert rows_shorter_than_block(shape, 128) is narrow


@pytest.mark.parametrize(
    "four_bit_class, eight_bit_class",
    [(hf_paged.PagedAdamW4bit, hf_paged.PagedAdamW8bit), (hf_paged.PagedAdEMAMix4bit, hf_paged.PagedAdEMAMix8bit)],
)
def test_a_matrix_whose_rows_are_shorter_than_a_block_keeps_8bit_state(four_bit_class, eight_bit_class):
    """LoRA's adapters in a 4-bit optimizer: ``B`` (256 x 32, rows shorter than a block of 128) is updated bitwise as
    the 8-bit optimizer with blocks of 128 updates it, and saved in 8-bit codes; ``A`` (32 x 256) keeps 4-bit state;
    a group that names ``"4bit"`` keeps ``B`` 4-bit."""
    generator = torch.Generator().manual_seed(0)
    lora_a, lora_b = torch.randn(32, 256, generator=generator), torch.zeros(256, 32)
    grads = [(torch.randn(32, 256, generator=generator), torch.randn(256, 32, generator=generator)) for _ in range(4)]
    paging = {"lr": 1e-2, "page_size": "8KiB", "device_budget": "16KiB"}
    a, b, named_b, reference_b = (torch.nn.Parameter(t.clone()) for t in (lora_a, lora_b, lora_b, lora_b))
    optimizer = four_bit_class([{"params": [a, b]}, {"params": [named_b], "state_format": "4bit"}], **paging)
    reference = eight_bit_class([reference_b], block_size=128, **paging)
    for grad_a, grad_b in grads:
        a.grad, b.grad, named_b.grad, reference_b.grad = grad_a, grad_b.clone(), grad_b.clone(), grad_b.clone()
        optimizer.step()
        reference.step()
    assert [optimizer._layout[param].kind for param in (a, b, named_b)] == ["4bit", "8bit", "4bit"]
    assert torch.equal(b, reference_b) and not torch.equal(b, named_b)
    saved, expected = optimizer.state_dict()["state"], reference.state_dict()["state"][0]
    assert "exp_avg_packed_codes" in saved[0] and "exp_avg_packed_codes" in saved[2]
    assert saved[1].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(saved[1][key], value), key


def test_pages_too_small_for_an_8bit_block_keep_short_rows_4bit():
    """Blocks of 4096 in pages of 8 KiB hold a 4-bit block (4104 bytes) but not an 8-bit one: the optimizer is built
    as before the short-rows rule, and a matrix with rows shorter than a block keeps 4-bit state."""
    lora_b = torch.nn.Parameter(torch.randn(512, 32))
    optimizer = hf_paged.PagedAdamW4bit([lora_b], block_size=4096, page_size="8KiB")
    lora_b.grad = torch.randn_like(lora_b)
    optimizer.step()
    assert optimizer._layout[lora_b].kind == "4bit"


def test_short_rows_4bit_keeps_them_4bit_for_the_whole_optimizer():
    """``short_rows="4bit"``: a matrix with rows shorter than a block keeps 4-bit state; the setting is saved in the
    param groups (only where it is not the default, as torch.optim.AdamW's groups have no such key), survives a copy,
    and is refused per group or with another value."""
    lora_b = torch.nn.Parameter(torch.randn(512, 32))
    optimizer = hf_paged.PagedAdamW4bit([lora_b], short_rows="4bit")
    lora_b.grad = torch.randn_like(lora_b)
    optimizer.step()
    assert optimizer._layout[lora_b].kind == "4bit"
    assert optimizer.state_dict()["param_groups"][0]["short_rows"] == "4bit"
    assert copy.deepcopy(optimizer).short_rows == "4bit"
    assert "short_rows" not in hf_paged.PagedAdamW4bit([lora_b]).state_dict()["param_groups"][0]
    with pytest.raises(ValueError, match="short_rows must be one of '8bit', '4bit', got '2bit'"):
        hf_paged.PagedAdamW4bit([lora_b], short_rows="2bit")
    with pytest.raises(ValueError, match="short_rows='4bit' differs from the optimizer's short_rows='8bit'"):
        hf_paged.PagedAdamW4bit([{"params": [lora_b], "short_rows": "4bit"}])
    with pytest.raises(ValueError, match="short_rows='4bit' is for 4-bit state only"):
        hf_paged.PagedOptimizer.__init__(
            hf_paged.PagedAdamW8bit.__new__(hf_paged.PagedAdamW8bit), [], {}, eight_bit=True, short_rows="4bit"
        )
