"""The paged optimizers compute the same updates as references written elsewhere or from the papers."""

from __future__ import annotations

import pytest
import torch
from conftest import decay_groups, make_mlp, regression_batches, train

import hf_paged


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("budget", [None, 4096])
def test_adamw_matches_torch_adamw_fp32(budget):
    """fp32 state runs torch's fused AdamW kernel per page: bitwise its result, and close to the for-loop one.

    The for-loop implementation rounds differently; over 100 steps the gap depends on the CPU's vector
    width (about 1e-6 relative on AVX-512 machines), so it is held to 1e-5.
    """
    batches = regression_batches(100)
    model = make_mlp()
    optimizer = hf_paged.PagedAdamW(decay_groups(model), lr=1e-2, page_size=4096, device_budget=budget)
    train(model, optimizer, batches)
    assert optimizer.paging_stats()["pages_total"] > 1
    fused, single_tensor = make_mlp(), make_mlp()
    train(fused, torch.optim.AdamW(decay_groups(fused), lr=1e-2, fused=True), batches)
    train(single_tensor, torch.optim.AdamW(decay_groups(single_tensor), lr=1e-2, foreach=False), batches)
    for param, expected, loop_expected in zip(model.parameters(), fused.parameters(), single_tensor.parameters()):
        assert torch.equal(param, expected)
        assert relative_error(param, loop_expected) < 1e-5


def test_adamw_state_matches_torch_adamw():
    batches = regression_batches(20)
    reference = make_mlp()
    torch_optimizer = torch.optim.AdamW(decay_groups(reference), lr=1e-2, foreach=False)
    train(reference, torch_optimizer, batches)
    model = make_mlp()
    optimizer = hf_paged.PagedAdamW(decay_groups(model), lr=1e-2, page_size=4096)
    train(model, optimizer, batches)
    ours, theirs = optimizer.state_dict()["state"], torch_optimizer.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for index in theirs:
        assert ours[index]["step"] == theirs[index]["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert ours[index][key].shape == theirs[index][key].shape
            assert relative_error(ours[index][key], theirs[index][key]) < 1e-6


def reference_adamw_low_precision(model: torch.nn.Module, groups: list[dict], batches, lr: float) -> None:
    """AdamW for low-precision parameters: fp32 copy of each parameter and fp32 state, rounded back every step."""
    states = {}
    for inputs, targets in batches:
        for param in model.parameters():
            param.grad = None
        torch.nn.functional.mse_loss(model(inputs).float(), targets.float()).backward()
        with torch.no_grad():
            for group in groups:
                for param in group["params"]:
                    master = torch.nn.Parameter(param.float())
                    master.grad = param.grad.float()
                    inner = torch.optim.AdamW([master], lr=lr, weight_decay=group["weight_decay"], foreach=False)
                    if param in states:
                        inner.state[master] = states[param]
                    inner.step()
                    states[param] = inner.state[master]
                    param.copy_(master)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_adamw_low_precision_params_match_fp32_update_reference(dtype):
    batches = regression_batches(50, dtype=dtype)
    reference = make_mlp(dtype=dtype)
    reference_adamw_low_precision(reference, decay_groups(reference), batches, lr=1e-2)
    model = make_mlp(dtype=dtype)
    train(model, hf_paged.PagedAdamW(decay_groups(model), lr=1e-2, page_size=4096, device_budget=4096), batches)
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert param.dtype == dtype
        assert relative_error(param, expected) < 1e-3


def reference_lion(model: torch.nn.Module, groups: list[dict], batches, lr: float, betas: tuple[float, float]) -> None:
    """Lion as in Chen et al. (2023), Algorithm 2, with decoupled weight decay."""
    beta1, beta2 = betas
    momentum = {param: torch.zeros_like(param) for param in model.parameters()}
    for inputs, targets in batches:
        for param in model.parameters():
            param.grad = None
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        with torch.no_grad():
            for group in groups:
                for param in group["params"]:
                    grad, m = param.grad, momentum[param]
                    update = torch.sign(beta1 * m + (1 - beta1) * grad)
                    param.mul_(1 - lr * group["weight_decay"]).sub_(lr * update)
                    momentum[param] = beta2 * m + (1 - beta2) * grad


@pytest.mark.parametrize("budget", [None, 4096])
def test_lion_matches_paper_reference(budget):
    batches = regression_batches(100)
    reference = make_mlp()
    reference_lion(reference, decay_groups(reference), batches, lr=1e-3, betas=(0.9, 0.99))
    model = make_mlp()
    train(model, hf_paged.PagedLion(decay_groups(model), lr=1e-3, page_size=4096, device_budget=budget), batches)
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert relative_error(param, expected) < 1e-5


def test_lr_scheduler_and_group_hyperparameters_apply():
    batches = regression_batches(30)
    reference = make_mlp()
    torch_optimizer = torch.optim.AdamW(decay_groups(reference), lr=1e-2, foreach=False)
    torch_scheduler = torch.optim.lr_scheduler.LambdaLR(torch_optimizer, lambda step: 1 / (1 + step))
    model = make_mlp()
    optimizer = hf_paged.PagedAdamW(decay_groups(model), lr=1e-2, page_size=4096)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    for (inputs, targets) in batches:
        for net, opt, sched in ((reference, torch_optimizer, torch_scheduler), (model, optimizer, scheduler)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(inputs), targets).backward()
            opt.step()
            sched.step()
    assert optimizer.param_groups[0]["lr"] == torch_optimizer.param_groups[0]["lr"]
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert relative_error(param, expected) < 1e-6
