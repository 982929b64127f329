"""Malformed or mismatched state dicts are refused with an error that names the parameter (or group) at fault and
what is expected, before anything changes; what ``torch.optim.AdamW`` saves still loads."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

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


def _set_state(key: str, value: Callable[[dict], Any]) -> Callable[[dict], None]:
    """A change of a state dict: parameter 0's ``key`` set to ``value`` of its entry."""

    def change(state_dict: dict) -> None:
        entry = state_dict["state"][0]
        entry[key] = value(entry)

    return change


def _set_group_params(state_dict: dict) -> None:
    state_dict["param_groups"][0]["params"] = 5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set_state("step", lambda entry: "abc"), r"state of parameter 0 has step 'abc', expected a whole number >= 0"),
        (_set_state("step", lambda entry: None), r"state of parameter 0 has step None, expected a whole number >= 0"),
        (
            _set_state("step", lambda entry: torch.tensor([1.0, 2.0])),
            r"state of parameter 0 has step a tensor of shape \(2,\), expected a whole number >= 0 \(a number or a one",
        ),
        (_set_group_params, r"param group 0 of state_dict: params must be a list of parameter ids, got int"),
        (
            _set_state("exp_avg_sq_codes", lambda entry: entry["exp_avg_sq_codes"].int() + 300),
            r"state 'exp_avg_sq_codes' of parameter 0 has codes of dtype torch.int32 outside 0..255, expected torch",
        ),
        (
            _set_state("exp_avg_codes", lambda entry: entry["exp_avg_codes"].int() - 200),
            r"state 'exp_avg_codes' of parameter 0 has codes of dtype torch.int32 outside -128..127",
        ),
    ],
    ids=["step str", "step None", "step of two elements", "params an int", "codes above 255", "codes below -128"],
)
def test_malformed_state_dicts_are_refused_by_name(change, message):
    """A step that is not a whole number (or a one-element tensor of one), a group whose params are not a list, and
    8-bit codes of a wider integer dtype outside the codes' range are refused naming the parameter or group; they
    raised errors that named nothing ("could not convert string to float"), or the codes wrapped when cast."""
    optimizer = stepped(hf_paged.PagedAdamW8bit, [(8, 4), (4,)], **SMALL_STATE[hf_paged.PagedAdamW8bit])
    saved = optimizer.state_dict()
    malformed = copy.deepcopy(saved)
    change(malformed)
    error = TypeError if change is _set_group_params else ValueError
    assert_refused_and_unchanged(optimizer, malformed, error, message)


def test_codes_of_a_wider_integer_dtype_within_range_load():
    """8-bit codes saved as int32 (or int64) values within the codes' range load as the codes they are."""
    optimizer = stepped(hf_paged.PagedAdamW8bit, [(8, 4), (4,)], **SMALL_STATE[hf_paged.PagedAdamW8bit])
    saved = optimizer.state_dict()
    widened = copy.deepcopy(saved)
    for entry in widened["state"].values():
        for key in ("exp_avg_codes", "exp_avg_sq_codes"):
            entry[key] = entry[key].long()
    optimizer.load_state_dict(widened)
    for index, entry in optimizer.state_dict()["state"].items():
        assert all(torch.equal(value, saved["state"][index][key]) for key, value in entry.items()), index
