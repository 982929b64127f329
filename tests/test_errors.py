"""Bad input gets a clear error naming the argument, and leaves the optimizer's state as it was."""

from __future__ import annotations

import pytest
import torch
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, regression_batches, train

import hf_paged


def make(name: str, params=None, **overrides):
    kwargs = {**optimizer_kwargs(name), **overrides}
    return OPTIMIZERS[name](params if params is not None else make_mlp().parameters(), **kwargs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"lr": -1.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"lr": float("inf")}, "lr"),
        ({"betas": (1.0, 0.9)}, r"betas\[0\]"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\]"),
        ({"betas": (0.9,)}, "betas"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"page_size": "lots"}, "page_size"),
        ({"page_size": "-4KiB"}, "page_size"),
        ({"device_budget": "2 parsecs"}, "device_budget"),
        ({"device_budget": 100}, "device_budget"),
        ({"prefetch": -1}, "prefetch"),
        ({"compiled": "yes"}, "compiled"),
    ],
)
def test_bad_hyperparameters_name_the_argument(optimizer_name, overrides, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make(optimizer_name, **overrides)


@pytest.mark.parametrize("name", ["PagedAdamW", "PagedAdamW8bit", "PagedAdamW4bit", "PagedAdEMAMix"])
@pytest.mark.parametrize("eps", [-1e-8, float("-inf"), float("nan"), "1e-8"])
def test_bad_eps(name, eps):
    """What torch.optim.AdamW refuses (0 and infinity it takes: tests/test_eps.py)."""
    with pytest.raises(ValueError, match="eps must be a number >= 0"):
        make(name, eps=eps)


@pytest.mark.parametrize("name", ["PagedAdamW8bit", "PagedLion8bit", "PagedAdEMAMix8bit"])
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"page_size": 32, "block_size": 64}, "smaller than one block"),
        ({"page_size": 4096 + 64, "block_size": 128}, "multiple of block_size"),
        ({"block_size": 100}, "block_size"),
        ({"block_size": 8}, "block_size"),
        ({"min_8bit_size": -1}, "min_8bit_size"),
    ],
)
def test_bad_8bit_layout(name, overrides, message):
    with pytest.raises(ValueError, match=message):
        make(name, **overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"page_size": 32, "block_size": 64}, "smaller than one block"),
        ({"page_size": 4096 + 64, "block_size": 128}, "multiple of block_size"),
        ({"block_size": 96}, "block_size must be a power of two"),
        ({"block_size": 8}, "block_size must be an integer >= 16"),
        ({"block_size": 8192}, "block_size must be a power of two from 16 to 4096"),
        ({"block_size": 128.0}, "block_size must be an integer"),
        ({"min_4bit_size": -1}, "min_4bit_size must be an integer >= 0"),
        ({"min_4bit_size": 4096.0}, "min_4bit_size must be an integer"),
        ({"min_4bit_size": True}, "min_4bit_size must be an integer"),
    ],
)
@pytest.mark.parametrize("name", ["PagedAdamW4bit", "PagedAdEMAMix4bit"])
def test_bad_4bit_layout(name, overrides, message):
    with pytest.raises(ValueError, match=message):
        make(name, **overrides)


def test_32bit_page_must_hold_state(optimizer_name):
    with pytest.raises(ValueError, match="page_size"):
        make(optimizer_name, page_size=3, **({"block_size": 16} if optimizer_name.endswith("8bit") else {}))


def test_non_floating_point_parameters(optimizer_name):
    with pytest.raises(TypeError, match=r"has dtype torch.int64; \w+ supports fp32, bf16 and fp16 parameters"):
        make(optimizer_name, params=[torch.zeros(4, dtype=torch.int64)])


def test_parameters_on_the_meta_device(optimizer_name):
    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, device="meta"))]
    with pytest.raises(ValueError, match="meta device"):
        make(optimizer_name, params=params)


def state_snapshot(model, optimizer):
    state = optimizer.state_dict()
    return (
        [param.detach().clone() for param in model.parameters()],
        {index: {key: value.clone() for key, value in entry.items()} for index, entry in state["state"].items()},
        [{key: value for key, value in group.items()} for group in state["param_groups"]],
    )


def assert_unchanged(before, after):
    for a, b in zip(before[0], after[0]):
        assert torch.equal(a, b)
    assert before[1].keys() == after[1].keys()
    for index in before[1]:
        for key in before[1][index]:
            assert torch.equal(before[1][index][key], after[1][index][key])
    assert before[2] == after[2]


def trained(name: str, **paging):
    model = make_mlp()
    optimizer = OPTIMIZERS[name](decay_groups(model), **optimizer_kwargs(name, **paging))
    train(model, optimizer, regression_batches(2))
    return model, optimizer


def test_sparse_gradient_leaves_state_unchanged(optimizer_name):
    model, optimizer = trained(optimizer_name, device_budget=4096)
    before = state_snapshot(model, optimizer)
    torch.nn.functional.mse_loss(model(torch.randn(4, 20)), torch.randn(4, 3)).backward()
    model[4].bias.grad = model[4].bias.grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        optimizer.step()
    assert_unchanged(before, state_snapshot(model, optimizer))


def test_bad_budget_calls_leave_state_unchanged(optimizer_name):
    model, optimizer = trained(optimizer_name)
    before = state_snapshot(model, optimizer)
    with pytest.raises(ValueError, match="budget"):
        optimizer.set_device_budget(10)
    with pytest.raises(ValueError, match="budget"):
        optimizer.set_device_budget("a lot")
    with pytest.raises(ValueError, match="nbytes"):
        optimizer.evict(-5)
    assert optimizer.device_budget is None
    assert_unchanged(before, state_snapshot(model, optimizer))


def test_bad_param_group_is_rejected_whole(optimizer_name):
    _model, optimizer = trained(optimizer_name)
    groups = len(optimizer.param_groups)
    with pytest.raises(ValueError, match="lr"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": -1.0})
    assert len(optimizer.param_groups) == groups


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda sd: sd["param_groups"].pop(),
        lambda sd: sd["param_groups"][0]["params"].pop(),
        lambda sd: sd["param_groups"][1].update(lr=-3.0),
        lambda sd: sd["state"][0].pop("step"),
        lambda sd: sd["state"].update({99: sd["state"][0]}),
        lambda sd: sd["state"][5].update({key: value[:1] for key, value in sd["state"][5].items() if key != "step"}),
        lambda sd: [sd["state"][0].pop(key) for key in list(sd["state"][0]) if key != "step"],
        lambda sd: sd.pop("state"),
    ],
)
def test_bad_state_dict_leaves_state_unchanged(optimizer_name, corrupt):
    model, optimizer = trained(optimizer_name, device_budget=8192)
    before = state_snapshot(model, optimizer)
    state_dict = optimizer.state_dict()
    for index in (0, 5):
        state_dict["state"][index]["step"] = torch.tensor(50.0)
    corrupt(state_dict)
    with pytest.raises(ValueError):
        optimizer.load_state_dict(state_dict)
    assert_unchanged(before, state_snapshot(model, optimizer))
    train(model, optimizer, regression_batches(1))


@pytest.mark.parametrize("name", ["PagedAdamW8bit", "PagedAdamW4bit"])
def test_saved_block_size_of_quantized_state_is_checked(name):
    model, optimizer = trained(name, device_budget=8192)
    before = state_snapshot(model, optimizer)
    state_dict = optimizer.state_dict()
    state_dict["param_groups"][0]["block_size"] = 48
    with pytest.raises(ValueError, match="block_size 48, expected a power of two"):
        optimizer.load_state_dict(state_dict)
    assert_unchanged(before, state_snapshot(model, optimizer))


def test_core_does_not_import_integrations():
    import subprocess
    import sys

    code = "import sys, hf_paged; print(sorted(m for m in ('transformers', 'peft', 'accelerate') if m in sys.modules))"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"
    assert hf_paged.PagedAdamW.__module__.startswith("hf_paged")
