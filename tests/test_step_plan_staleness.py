"""The step plan (hf_paged/optim/plan.py) must not go stale: whatever changes between steps — a parameter's memory
or strides, a step count written behind the plan's back, budgets, hyperparameters — the steps match
``torch.optim.AdamW`` on the same gradients as they would without a plan kept from the step before."""

from __future__ import annotations

import pytest
import torch

import hf_paged


def twins(name: str = "PagedAdamW", size: int = 16, **options) -> tuple:
    """A paged optimizer and ``torch.optim.AdamW``, each over its own copy of one square parameter."""
    start = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
    paged_param, torch_param = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    paged = getattr(hf_paged, name)([paged_param], lr=1e-2, weight_decay=0.1, compiled=False, **options)
    reference = torch.optim.AdamW([torch_param], lr=1e-2, weight_decay=0.1)
    return paged_param, torch_param, paged, reference


def step_both(paged_param, torch_param, paged, reference, seed: int) -> None:
    grad = torch.randn(paged_param.shape, generator=torch.Generator().manual_seed(seed))
    paged_param.grad, torch_param.grad = grad.clone(), grad.clone()
    paged.step()
    reference.step()


OPTIMIZERS = [("PagedAdamW", {}), ("PagedAdamW8bit", {"min_8bit_size": 1})]


@pytest.mark.parametrize(("name", "options"), OPTIMIZERS, ids=[name for name, _ in OPTIMIZERS])
def test_a_parameter_given_new_strides_on_the_same_memory_is_updated_through_them(name, options):
    """``param.set_`` to a transposed view of its own storage (same storage, offset, dtype and shape): the plan's
    flat view of the old strides would pair each gradient element with the transposed parameter element."""
    paged_param, torch_param, paged, reference = twins(name, **options)
    for seed in range(2):
        step_both(paged_param, torch_param, paged, reference, seed)
    with torch.no_grad():
        for param in (paged_param, torch_param):
            param.set_(param.untyped_storage(), 0, param.shape, (1, param.shape[0]))
    for seed in range(2, 4):
        step_both(paged_param, torch_param, paged, reference, seed)
    tolerance = 1e-6 if name == "PagedAdamW" else 2e-3
    torch.testing.assert_close(paged_param.detach(), torch_param.detach(), rtol=0, atol=tolerance)


@pytest.mark.parametrize("write", ["data_copy", "data_assign", "fill"])
def test_a_step_count_written_between_steps_sets_the_next_bias_correction(write):
    """DeepSpeed's ZeRO restores a base optimizer's state with ``state[p][key].data.copy_(saved)``, which leaves
    the count's version as it was; ``count.data = ...`` gives it new memory. The step after either must read the
    count written, not the one the plan advanced."""
    paged_param, torch_param, paged, reference = twins()
    for seed in range(3):
        step_both(paged_param, torch_param, paged, reference, seed)
    with torch.no_grad():
        for optimizer, param in ((paged, paged_param), (reference, torch_param)):
            count = optimizer.state[param]["step"]
            if write == "data_copy":
                count.data.copy_(torch.tensor(1.0))
            elif write == "data_assign":
                count.data = torch.tensor(1.0)
            else:
                count.fill_(1.0)
    for seed in range(3, 5):
        step_both(paged_param, torch_param, paged, reference, seed)
    assert float(paged.state[paged_param]["step"]) == float(reference.state[torch_param]["step"]) == 3.0
    torch.testing.assert_close(paged_param.detach(), torch_param.detach(), rtol=0, atol=1e-6)
