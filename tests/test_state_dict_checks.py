"""Malformed or mismatched state dicts are refused with an error that names the parameter (or group) at fault and
what is expected, before anything changes; what ``torch.optim.AdamW`` saves still loads."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_paged

SMALL_STATE = {
    torch.optim.AdamW: {},
    hf_paged.PagedAdamW: {},
    hf_paged.PagedAdamW8bit: {"min_8bit_size": 0, "block_size": 16},
    hf_paged.PagedAdamW4bit: {"min_4bit_size": 0, "block_size": 16},
}
"""Keyword arguments that quantize every tensor's state."""


def stepped(optimizer_class: type, shapes: list[tuple[int, ...]], **kwargs) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer_class`` over parameters of ``shapes`` after one step."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    optimizer = optimizer_class(params, lr=1e-2, **kwargs)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()
    return optimizer


def assert_refused_and_unchanged(
    optimizer: torch.optim.Optimizer, state_dict: dict, error: type[Exception], message: str
) -> None:
    """Loading ``state_dict`` raises ``error`` matching ``message`` and leaves ``optimizer``'s state dict as it was."""
    before = optimizer.state_dict()
    with pytest.raises(error, match=message):
        optimizer.load_state_dict(state_dict)
    after = optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"] and after["state"].keys() == before["state"].keys()
    for index, entry in before["state"].items():
        assert entry.keys() == after["state"][index].keys()
        assert all(torch.equal(value, after["state"][index][key]) for key, value in entry.items()), index


@pytest.mark.parametrize(
    ("saving", "loading"),
    [
        (torch.optim.AdamW, hf_paged.PagedAdamW),
        (hf_paged.PagedAdamW, hf_paged.PagedAdamW),
        (hf_paged.PagedAdamW8bit, hf_paged.PagedAdamW8bit),
        (hf_paged.PagedAdamW, hf_paged.PagedAdamW4bit),
    ],
)
def test_state_of_another_shape_with_as_many_elements_is_refused(saving, loading):
    """State saved for a (64, 32) parameter does not load into a (32, 64) one (torch.optim.AdamW fails at its next
    step); it loaded, flattened, and trained on. A flat tensor of as many elements (ZeRO's flat partitions) loads."""
    saved = stepped(saving, [(64, 32), (32, 64)], **SMALL_STATE[saving]).state_dict()
    optimizer = stepped(loading, [(32, 64), (64, 32)], **SMALL_STATE[loading])
    key = "exp_avg_codes" if saving is hf_paged.PagedAdamW8bit else "exp_avg"
    assert_refused_and_unchanged(
        optimizer,
        saved,
        ValueError,
        rf"state '{key}' of parameter 0 has shape \(64, 32\), but the parameter loading it has shape \(32, 64\)",
    )
    flat = copy.deepcopy(saved)
    for entry in flat["state"].values():
        for name, value in entry.items():
            if name != "step" and value.numel() == 64 * 32:
                entry[name] = value.reshape(-1)
    optimizer.load_state_dict(flat)
    for param in (param for group in optimizer.param_groups for param in group["params"]):
        param.grad = torch.ones_like(param)
    optimizer.step()
