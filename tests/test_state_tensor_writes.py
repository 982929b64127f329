"""``set_state_tensor`` between steps: the next step updates the state written, as ``torch.optim.AdamW`` updates a
state replaced in ``optimizer.state`` (DeepSpeed's ``safe_set_full_optimizer_state`` writes paged state this way).

A write rests the page in host memory; the step plan kept views of the page's device buffers, which a write
released without telling it, so the step after a write updated the old buffers and lost the values written.
"""

from __future__ import annotations

import pytest
import torch

from hf_paged.optim import PagedAdamW, PagedAdamW8bit


@pytest.mark.parametrize("budget", [None, "4KiB"])
def test_a_step_after_set_state_tensor_uses_the_written_state(budget):
    torch.manual_seed(0)
    weights = [torch.randn(1000), torch.randn(40, 30)]
    paged_params = [torch.nn.Parameter(weight.clone()) for weight in weights]
    torch_params = [torch.nn.Parameter(weight.clone()) for weight in weights]
    paged = PagedAdamW(paged_params, lr=1e-2, weight_decay=0.0, page_size="4KiB", device_budget=budget)
    control = torch.optim.AdamW(torch_params, lr=1e-2, weight_decay=0.0)
    gradients = [[torch.randn_like(weight) for weight in weights] for _ in range(3)]
    for step, step_gradients in enumerate(gradients):
        for params in (paged_params, torch_params):
            for param, gradient in zip(params, step_gradients):
                param.grad = gradient.clone()
        paged.step()
        control.step()
        if step == 1:
            for paged_param, torch_param in zip(paged_params, torch_params):
                for name in ("exp_avg", "exp_avg_sq"):
                    written = paged.get_state_tensor(paged_param, name) * 1.5 + 1e-4
                    paged.set_state_tensor(paged_param, name, written)
                    control.state[torch_param][name].copy_(written)
    for paged_param, torch_param in zip(paged_params, torch_params):
        torch.testing.assert_close(paged_param.detach(), torch_param.detach(), rtol=1e-5, atol=1e-6)
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                paged.get_state_tensor(paged_param, name), control.state[torch_param][name], rtol=1e-5, atol=1e-9
            )


def test_a_step_after_set_state_tensor_updates_the_written_8bit_state():
    """8-bit state: the step after a write starts from the written values as the codec encoded them."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4096))
    optimizer = PagedAdamW8bit([param], lr=1e-2, weight_decay=0.0, page_size="4KiB", block_size=64, min_8bit_size=256)
    param.grad = torch.randn_like(param)
    optimizer.step()
    optimizer.set_state_tensor(param, "exp_avg", torch.zeros(4096))
    optimizer.set_state_tensor(param, "exp_avg_sq", torch.zeros(4096))
    gradient = torch.randn_like(param)
    param.grad = gradient.clone()
    optimizer.step()
    beta1 = optimizer.param_groups[0]["betas"][0]
    expected_first = (1 - beta1) * gradient
    torch.testing.assert_close(optimizer.get_state_tensor(param, "exp_avg"), expected_first, rtol=0.02, atol=1e-3)
