"""A tensor learning rate is read once per param group and step, never per page (issue 30, point 4).

Schedulers keep ``lr`` as a tensor for capturable optimizers, on the device; reading it (``float``, ``.item()``)
waits for the device, so a read per page would stall the host at every page and stop copies from overlapping.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import OPTIMIZERS, make_mlp, optimizer_kwargs, regression_batches
from torch.utils._python_dispatch import TorchDispatchMode

PAGE_SIZE = 4096
STEPS = 3


class ScalarReads(TorchDispatchMode):
    """Counts the reads of given tensors' values on the host (``aten._local_scalar_dense``: ``.item()``, ``float``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = {tensor.untyped_storage().data_ptr(): name for name, tensor in tensors.items()}
        self.reads: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            name = self.names.get(args[0].untyped_storage().data_ptr())
            if name is not None:
                self.reads[name] += 1
        return func(*args, **(kwargs or {}))


def groups(model: torch.nn.Module, lr):
    """Two groups as the Trainer builds them, each with its own ``lr`` (``lr(index)``)."""
    params = list(model.parameters())
    matrices = [param for param in params if param.ndim > 1]
    vectors = [param for param in params if param.ndim <= 1]
    return [
        {"params": matrices, "weight_decay": 0.1, "lr": lr(0)},
        {"params": vectors, "weight_decay": 0.0, "lr": lr(1)},
    ]


def run(name: str, lr, reads_per_step: list | None = None):
    """Train ``STEPS`` steps under a one-page budget; the last layer's bias first gets a gradient at the second
    step, so that its group holds two step counts from then on."""
    model = make_mlp()
    kwargs = optimizer_kwargs(name, device_budget=PAGE_SIZE, prefetch=1)
    kwargs.pop("lr")
    optimizer = OPTIMIZERS[name](groups(model, lr), **kwargs)
    late = model[4].bias
    for step, (inputs, targets) in enumerate(regression_batches(STEPS)):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        if step == 0:
            late.grad = None
        if reads_per_step is None:
            optimizer.step()
        else:
            lrs = {f"group {index}": group["lr"] for index, group in enumerate(optimizer.param_groups)}
            with ScalarReads(lrs) as counted:
                optimizer.step()
            reads_per_step.append(counted.reads)
    return model, optimizer


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_tensor_lr_is_read_once_per_group_and_step(name):
    base_lr = 1e-3 if "Lion" in name else 1e-2
    reads: list[Counter] = []
    model, optimizer = run(name, lambda index: torch.tensor(base_lr * (index + 1)), reads)
    assert optimizer.paging_stats()["page_outs"] > 0 and len(optimizer._store.pages) > 2
    assert reads == [Counter({"group 0": 1, "group 1": 1})] * STEPS
    # the same result as the float learning rates the tensors hold
    float_model, float_optimizer = run(name, lambda index: float(torch.tensor(base_lr * (index + 1))))
    for param_a, param_b in zip(model.parameters(), float_model.parameters()):
        assert torch.equal(param_a, param_b)
    state, float_state = optimizer.state_dict()["state"], float_optimizer.state_dict()["state"]
    for index in state:
        for key in state[index]:
            assert torch.equal(state[index][key], float_state[index][key]), (index, key)
