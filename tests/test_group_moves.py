"""A tensor moved to another param group after its first step keeps its pages (and its state) and is updated with
its new group's hyperparameters, as ``torch.optim.AdamW`` updates it (issue 26, point 1)."""

from __future__ import annotations

import pytest
import torch
from conftest import decay_groups, make_mlp, optimizer_kwargs, regression_batches, train

import hf_paged

ADAMW = {
    "PagedAdamW": hf_paged.PagedAdamW,
    "PagedAdamW8bit": hf_paged.PagedAdamW8bit,
    "PagedAdamW4bit": hf_paged.PagedAdamW4bit,
}
BUDGETS = {"no budget": None, "one page": 4096}


def move_to_new_groups(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """Move the last bias to a new group with ``lr=0.0`` and the middle weight to one with other hyperparameters;
    return the tensors moved."""
    params = list(model.parameters())
    frozen, retuned = params[-1], params[2]
    for group in optimizer.param_groups:
        group["params"] = [param for param in group["params"] if param is not frozen and param is not retuned]
    optimizer.add_param_group({"params": [frozen], "lr": 0.0})
    optimizer.add_param_group({"params": [retuned], "lr": 3e-2, "betas": (0.8, 0.99), "weight_decay": 0.3})
    return frozen, retuned


def train_with_a_move(name: str, budget) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    model = make_mlp()
    if name == "torch AdamW":
        optimizer = torch.optim.AdamW(decay_groups(model), lr=1e-2, fused=True)
    else:
        optimizer = ADAMW[name](decay_groups(model), **optimizer_kwargs(name, device_budget=budget))
    batches = regression_batches(4)
    train(model, optimizer, batches[:1])
    frozen, _ = move_to_new_groups(optimizer, model)
    frozen_before = frozen.detach().clone()
    train(model, optimizer, batches[1:])
    return model, optimizer, frozen_before


@pytest.mark.parametrize("budget", sorted(BUDGETS))
def test_paged_adamw_after_a_group_move_matches_torch_adamw_bitwise(budget):
    """fp32 state runs PyTorch's fused AdamW kernel, as ``torch.optim.AdamW(fused=True)`` does: bitwise equal."""
    model, optimizer, _ = train_with_a_move("PagedAdamW", BUDGETS[budget])
    reference_model, reference, _ = train_with_a_move("torch AdamW", None)
    assert len({id(group) for group in optimizer.param_groups}) == 4
    for param, expected in zip(model.parameters(), reference_model.parameters(), strict=True):
        assert torch.equal(param, expected)
    saved, expected_saved = optimizer.state_dict()["state"], reference.state_dict()["state"]
    for index, entry in expected_saved.items():
        for key, value in entry.items():
            assert torch.equal(saved[index][key], value), (index, key)


@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("name", sorted(ADAMW))
def test_a_tensor_moved_to_a_group_with_lr_zero_is_left_unchanged(name, budget):
    model, _, frozen_before = train_with_a_move(name, BUDGETS[budget])
    reference_model, _, _ = train_with_a_move("torch AdamW", None)
    assert torch.equal(list(reference_model.parameters())[-1], frozen_before)  # the reference leaves it as it was
    assert torch.equal(list(model.parameters())[-1], frozen_before)
