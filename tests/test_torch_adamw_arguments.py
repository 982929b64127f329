"""A call written for ``torch.optim.AdamW`` runs with the paged AdamWs: its other arguments (``amsgrad``, ``maximize``,
``foreach``, ``capturable``, ``differentiable``, ``fused``) are taken where they leave the update as the paged step
has it, and refused by name where they would change it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_paged

CLASSES = [hf_paged.PagedAdamW, hf_paged.PagedAdamW8bit, hf_paged.PagedAdamW4bit]
TORCH_DEFAULTS = {
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}


def _params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(96, 96, generator=generator))]


def _stepped(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    (param,) = optimizer.param_groups[0]["params"]
    param.grad = torch.full_like(param, 0.5)
    optimizer.step()
    return param.detach().clone()


@pytest.mark.parametrize("optimizer_class", CLASSES, ids=lambda cls: cls.__name__)
def test_torch_adamws_arguments_at_their_defaults_step_as_without_them(optimizer_class) -> None:
    written_for_torch = optimizer_class(_params(), 1e-3, (0.9, 0.999), 1e-8, 1e-2, False, **TORCH_DEFAULTS)
    plain = optimizer_class(_params(), 1e-3, (0.9, 0.999), 1e-8, 1e-2)
    assert torch.equal(_stepped(written_for_torch), _stepped(plain))
    for implementation in ({"foreach": True}, {"fused": True}, {"foreach": False, "fused": False}):
        optimizer_class(_params(), **implementation)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"amsgrad": True}, ValueError, r"amsgrad=True is not supported: \w+ has no AMSGrad variant"),
        ({"maximize": True}, ValueError, r"maximize=True is not supported: \w+ minimizes the loss"),
        ({"capturable": True}, ValueError, "capturable=True is not supported: .* a CUDA graph cannot capture"),
        ({"differentiable": True}, ValueError, r"differentiable=True is not supported"),
        ({"foreach": "yes"}, TypeError, "foreach must be None, True or False, got 'yes'"),
        ({"fused": 1}, TypeError, "fused must be None, True or False, got 1"),
    ],
)
@pytest.mark.parametrize("optimizer_class", CLASSES, ids=lambda cls: cls.__name__)
def test_torch_adamws_arguments_that_change_the_step_are_refused(optimizer_class, options, error, message) -> None:
    with pytest.raises(error, match=message):
        optimizer_class(_params(), **options)


@pytest.mark.parametrize("optimizer_class", CLASSES, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("option", ["capturable", "differentiable"])
def test_a_torch_state_dict_whose_groups_set_them_is_refused_by_name(optimizer_class, option) -> None:
    saved = torch.optim.AdamW(_params()).state_dict()
    saved["param_groups"][0][option] = True
    optimizer = optimizer_class(_params())
    with pytest.raises(ValueError, match=f"param group 0 of state_dict: {option}=True is not supported"):
        optimizer.load_state_dict(saved)
    assert not optimizer.param_groups[0].get(option, False)


@pytest.mark.parametrize("optimizer_class", [*CLASSES, hf_paged.PagedLion8bit], ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("as_array", [torch.tensor, np.array], ids=["tensor", "array"])
def test_betas_as_a_tensor_or_array_of_two_step_as_the_pair(optimizer_class, as_array) -> None:
    """torch.optim.AdamW reads betas as a sequence, so a 1-D tensor or array of two is a pair too."""
    betas = (0.9, 0.99)
    given = as_array(betas) if as_array is np.array else as_array(betas, dtype=torch.float64)
    assert torch.equal(
        _stepped(optimizer_class(_params(), betas=given)), _stepped(optimizer_class(_params(), betas=betas))
    )
    torch.optim.AdamW(_params(), betas=given)  # the reference takes it too
