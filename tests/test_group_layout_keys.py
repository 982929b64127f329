"""What a param group may set of the state layout: its smallest quantized tensor (``min_8bit_size``,
``min_4bit_size``), never a block size or normalization other than the optimizer's, which fix the one page format of
its quantized state. A group's ``block_size`` was accepted, saved in the state dict and read back at load, where it no
longer matched the codes: the optimizer could not load its own checkpoint, nor be deep-copied or pickled."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import hf_paged


def _params(*shapes: tuple[int, ...]) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def _step(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()


@pytest.mark.parametrize(
    ("build", "group", "message"),
    [
        (hf_paged.PagedAdamW8bit, {"block_size": 64}, "block_size=64 differs from the optimizer's block_size=256"),
        (hf_paged.PagedAdamW4bit, {"block_size": 256}, "block_size=256 differs from the optimizer's block_size=128"),
        (hf_paged.PagedAdEMAMix8bit, {"block_size": 1000}, "block_size=1000 differs"),
        (hf_paged.PagedAdamW4bit, {"normalization": "rank1"}, "normalization='rank1' differs"),
        (hf_paged.PagedAdamW8bit, {"min_8bit_size": "4096"}, "min_8bit_size must be an integer >= 0"),
        (hf_paged.PagedAdamW4bit, {"min_4bit_size": -1}, "min_4bit_size must be an integer >= 0"),
    ],
)
def test_a_group_cannot_set_another_layout(build, group: dict, message: str) -> None:
    first, second = _params((64, 64), (32, 32))
    with pytest.raises(ValueError, match=f"param group 1: {message}"):
        build([{"params": [first]}, {"params": [second], **group}])
    optimizer = build([first])
    with pytest.raises(ValueError, match=f"param group 1: {message}"):
        optimizer.add_param_group({"params": [second], **group})
    assert len(optimizer.param_groups) == 1


def test_a_groups_own_smallest_quantized_tensor_is_kept_and_resumes() -> None:
    small, large = _params((40,), (64, 64))
    optimizer = hf_paged.PagedAdamW8bit(
        [{"params": [small], "min_8bit_size": 0, "block_size": 256}, {"params": [large]}]
    )
    _step(optimizer)
    saved = optimizer.state_dict()
    assert "exp_avg_codes" in saved["state"][0] and "exp_avg_codes" in saved["state"][1]
    for copied in (copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer))):
        assert torch.equal(copied.state_dict()["state"][0]["exp_avg_codes"], saved["state"][0]["exp_avg_codes"])
    again = hf_paged.PagedAdamW8bit([{"params": [small], "min_8bit_size": 0}, {"params": [large]}])
    again.load_state_dict(saved)
    assert torch.equal(again.state_dict()["state"][0]["exp_avg_codes"], saved["state"][0]["exp_avg_codes"])


def test_an_fp32_optimizer_takes_groups_copied_from_a_quantized_one() -> None:
    params = _params((64, 64))
    eight = hf_paged.PagedAdamW8bit(params, block_size=64)
    exact = hf_paged.PagedAdamW([dict(group) for group in eight.param_groups])
    _step(exact)
    assert exact.param_groups[0]["block_size"] == 64
