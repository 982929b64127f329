"""A param group dict replaced whole (``optimizer.param_groups = [{**group, "params": ...}]``) is checked as a group
whose ``params`` are replaced (tests/test_swapped_tensors.py): state cannot follow a tensor into another shape."""

from __future__ import annotations

import pytest
import torch
from conftest import OPTIMIZERS, decay_groups, make_mlp, regression_batches, train
from test_swapped_tensors import ZeroLike, make_optimizer, replace_groups, sharded_and_full


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_group_dicts_replaced_after_a_load_are_checked_too(name):
    sharded, full = sharded_and_full()
    optimizer = make_optimizer(name, decay_groups(full))
    train(full, optimizer, regression_batches(1))
    optimizer.load_state_dict(optimizer.state_dict())
    replace_groups(optimizer, dict(zip(full.parameters(), sharded.parameters(), strict=True)))
    with pytest.raises(RuntimeError, match=r"parameter 0 of param group 0 is a new tensor of shape \(32, 20\)"):
        train(sharded, optimizer, regression_batches(1))


@pytest.mark.parametrize("name", ["PagedAdamW", "PagedAdamW8bit"])
def test_zero_narrowing_the_groups_after_a_load_is_no_replacement(name):
    """DeepSpeed ZeRO stages 1 and 2 narrow ``param_groups`` to one of the optimizer's own groups around each step
    (after a load too, whose groups are the optimizer's own): the partitions of different shapes at position 0
    are no replacement."""
    model = make_mlp()
    engine = ZeroLike(model, name, 2)
    train(model, engine, regression_batches(2))
    engine.load_state_dict(engine.state_dict())
    train(model, engine, regression_batches(2, seed=3))
    assert engine.state_dict()["state"][1]["step"].item() == 4


def test_group_dicts_replaced_at_every_step_free_the_pages_of_the_tensors_dropped():
    """A loop that puts a new tensor in a new group dict at every step keeps the pages of the tensors listed, not of
    every tensor it ever listed, and trains as ``torch.optim.AdamW`` does."""
    results = {}
    for name in ("torch AdamW", "PagedAdamW"):
        model = make_mlp()
        optimizer = make_optimizer(name, decay_groups(model))
        train(model, optimizer, regression_batches(1))
        pages = []
        for seed in range(8):
            mapping = {param: param for param in model.parameters()}
            new = torch.nn.Parameter(model[2].weight.detach().clone())
            mapping[model[2].weight] = new
            model[2].weight = new
            replace_groups(optimizer, mapping)
            del mapping
            train(model, optimizer, regression_batches(1, seed=seed + 2))
            if name != "torch AdamW":
                pages.append(optimizer.paging_stats()["pages_total"])
        assert pages == pages[:1] * len(pages)
        results[name] = [param.detach().clone() for param in model.parameters()]
    for param, expected in zip(results["PagedAdamW"], results["torch AdamW"], strict=True):
        torch.testing.assert_close(param, expected)
