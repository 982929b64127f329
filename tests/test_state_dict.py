"""Saving and loading: torch's layout, CPU tensors, exact resume under any budget, torch state dicts load."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, regression_batches, train
from test_paging import assert_same_result

import hf_paged
from hf_paged.codecs import to_blocks


def roundtrip(state_dict: dict, map_location=None) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True, map_location=map_location)


@pytest.mark.parametrize("first_budget, second_budget", [(None, 4096), (8192, None), (4096, 12288)])
def test_resume_is_bitwise_identical(optimizer_name, first_budget, second_budget):
    batches = regression_batches(10)
    reference_model = make_mlp()
    reference_optimizer = OPTIMIZERS[optimizer_name](decay_groups(reference_model), **optimizer_kwargs(optimizer_name))
    train(reference_model, reference_optimizer, batches)

    model = make_mlp()
    optimizer = OPTIMIZERS[optimizer_name](decay_groups(model), **optimizer_kwargs(optimizer_name, device_budget=first_budget))
    train(model, optimizer, batches[:4])
    saved_model = roundtrip(model.state_dict())
    saved_optimizer = roundtrip(optimizer.state_dict(), map_location="cpu")

    resumed_model = make_mlp(seed=123)
    resumed_model.load_state_dict(saved_model)
    resumed = OPTIMIZERS[optimizer_name](
        decay_groups(resumed_model), **optimizer_kwargs(optimizer_name, device_budget=second_budget, prefetch=1)
    )
    resumed.load_state_dict(saved_optimizer)
    train(resumed_model, resumed, batches[4:])
    assert_same_result(resumed_model, resumed, reference_model, reference_optimizer)


def test_state_dict_layout(optimizer_name):
    model = make_mlp()
    optimizer = OPTIMIZERS[optimizer_name](decay_groups(model), **optimizer_kwargs(optimizer_name, device_budget=4096))
    train(model, optimizer, regression_batches(3))
    state_dict = optimizer.state_dict()
    params = list(decay_groups(model)[0]["params"]) + list(decay_groups(model)[1]["params"])
    assert [group["params"] for group in state_dict["param_groups"]] == [[0, 1, 2], [3, 4, 5]]
    assert sorted(state_dict["state"]) == list(range(len(params)))
    for index, entry in state_dict["state"].items():
        assert entry["step"].shape == () and entry["step"].item() == 3
        for value in entry.values():
            assert value.device.type == "cpu"
        names = OPTIMIZERS[optimizer_name].state_names
        for name in names:
            if name in entry:
                assert entry[name].shape == params[index].shape and entry[name].dtype == torch.float32
            elif optimizer_name.endswith("4bit") and index != 0:
                assert params[index].numel() >= 256
                assert entry[f"{name}_packed_codes"].shape == (-(-params[index].numel() // 64) * 32,)
                assert entry[f"{name}_packed_codes"].dtype == torch.uint8
                assert entry[f"{name}_scales"].numel() == -(-params[index].numel() // 64)
            else:  # 8-bit codes: an 8-bit optimizer's, or a 4-bit one's for the first layer, whose rows of 20 are
                # shorter than a block
                assert optimizer_name.endswith("8bit") or index == 0
                assert params[index].numel() >= 256 and f"{name}_packed_codes" not in entry
                assert entry[f"{name}_codes"].shape == params[index].shape
                assert entry[f"{name}_codes"].dtype in (torch.int8, torch.uint8)
                assert entry[f"{name}_scales"].numel() == -(-params[index].numel() // 64)


def test_state_dict_is_a_copy(optimizer_name):
    model = make_mlp()
    optimizer = OPTIMIZERS[optimizer_name](decay_groups(model), **optimizer_kwargs(optimizer_name))
    batches = regression_batches(3)
    train(model, optimizer, batches[:1])
    saved = optimizer.state_dict()
    frozen = {index: {key: value.clone() for key, value in entry.items()} for index, entry in saved["state"].items()}
    train(model, optimizer, batches[1:])
    for index, entry in saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, frozen[index][key])


@pytest.mark.parametrize("cls", [hf_paged.PagedAdamW, hf_paged.PagedAdamW8bit, hf_paged.PagedAdamW4bit])
def test_torch_adamw_state_dict_loads(cls):
    batches = regression_batches(12)
    reference = make_mlp()
    torch_optimizer = torch.optim.AdamW(decay_groups(reference), lr=1e-2, foreach=False)
    train(reference, torch_optimizer, batches[:6])
    saved_model, saved_optimizer = roundtrip(reference.state_dict()), roundtrip(torch_optimizer.state_dict())
    train(reference, torch_optimizer, batches[6:])

    model = make_mlp(seed=5)
    model.load_state_dict(saved_model)
    kwargs = {
        hf_paged.PagedAdamW: {},
        hf_paged.PagedAdamW8bit: {"block_size": 64, "min_8bit_size": 256},
        hf_paged.PagedAdamW4bit: {"block_size": 64, "min_4bit_size": 256},
    }[cls]
    optimizer = cls(decay_groups(model), lr=1e-2, page_size=4096, device_budget=8192, **kwargs)
    optimizer.load_state_dict(saved_optimizer)
    loaded = optimizer.state_dict()["state"]
    for index, entry in saved_optimizer["state"].items():
        assert loaded[index]["step"].item() == 6
        if cls is hf_paged.PagedAdamW:
            assert torch.equal(loaded[index]["exp_avg"], entry["exp_avg"])
            assert torch.equal(loaded[index]["exp_avg_sq"], entry["exp_avg_sq"])
    if cls is hf_paged.PagedAdamW4bit:
        decoded = hf_paged.PagedAdamW(decay_groups(model), lr=1e-2)
        decoded.load_state_dict(optimizer.state_dict())
        for index, entry in decoded.state_dict()["state"].items():
            for name in ("exp_avg", "exp_avg_sq"):
                expected = saved_optimizer["state"][index][name]
                assert ((entry[name] - expected).norm() / expected.norm()).item() < 0.2, (index, name)
    train(model, optimizer, batches[6:])
    tolerance = {hf_paged.PagedAdamW: 1e-6, hf_paged.PagedAdamW8bit: 2e-2, hf_paged.PagedAdamW4bit: 0.1}[cls]
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert ((param - expected).norm() / expected.norm()).item() < tolerance


def test_8bit_state_loads_into_another_block_size_and_into_32bit():
    batches = regression_batches(8)
    model = make_mlp()
    optimizer = hf_paged.PagedAdamW8bit(decay_groups(model), lr=1e-2, page_size=4096, block_size=64, min_8bit_size=256)
    train(model, optimizer, batches)
    saved = optimizer.state_dict()
    other = hf_paged.PagedAdamW8bit(decay_groups(model), lr=1e-2, page_size=4096, block_size=128, min_8bit_size=256)
    other.load_state_dict(saved)
    fp32 = hf_paged.PagedAdamW(decay_groups(model), lr=1e-2, page_size=4096)
    fp32.load_state_dict(saved)
    exact = fp32.state_dict()["state"]
    requantized = other.state_dict()["state"]
    assert requantized[0]["exp_avg_scales"].numel() == -(-model[0].weight.numel() // 128)
    for index, entry in exact.items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert entry[name].dtype == torch.float32
            if f"{name}_codes" in requantized[index]:
                codec = hf_paged.codecs.Blockwise8bitCodec(128, name == "exp_avg")
                numel = entry[name].numel()
                codes = to_blocks(requantized[index][f"{name}_codes"].reshape(-1), 128)
                values = codec.decode((codes, requantized[index][f"{name}_scales"])).reshape(-1)[:numel]
                scale = entry[name].abs().max()
                assert ((values - entry[name].reshape(-1)).abs().max() / scale).item() < 0.05


def test_load_state_dict_under_another_map_location_and_group_hyperparameters(optimizer_name):
    model = make_mlp()
    optimizer = OPTIMIZERS[optimizer_name](decay_groups(model), **optimizer_kwargs(optimizer_name))
    train(model, optimizer, regression_batches(2))
    saved = optimizer.state_dict()
    saved["param_groups"][0]["lr"] = 0.5
    saved["param_groups"][0]["initial_lr"] = 0.5
    fresh = OPTIMIZERS[optimizer_name](decay_groups(model), **optimizer_kwargs(optimizer_name, device_budget=4096))
    fresh.load_state_dict(roundtrip(saved, map_location=lambda storage, location: storage))
    assert fresh.param_groups[0]["lr"] == 0.5 and fresh.param_groups[0]["initial_lr"] == 0.5
    assert fresh.param_groups[1]["lr"] == optimizer.param_groups[1]["lr"]
    assert fresh.param_groups[0]["params"] == decay_groups(model)[0]["params"]


TORCH_RULES_NOT_SUPPORTED = [
    (lambda groups: torch.optim.AdamW(groups, lr=1e-2, maximize=True), r"maximize=True is not supported"),
    (lambda groups: torch.optim.AdamW(groups, lr=1e-2, amsgrad=True), r"amsgrad=True is not supported"),
    (
        lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.1),
        r"decoupled_weight_decay=False with weight_decay=0.1 is not supported",
    ),
]


@pytest.mark.parametrize("make_torch, message", TORCH_RULES_NOT_SUPPORTED)
@pytest.mark.parametrize("name", ["PagedAdamW", "PagedAdamW8bit", "PagedLion"])
def test_torch_state_dicts_of_another_update_rule_are_refused_and_change_nothing(name, make_torch, message):
    """A torch group that changes the rule (maximize, AMSGrad, Adam's coupled weight decay) is refused on load as in
    the constructor, with the same error, before anything changes."""
    torch_model = make_mlp()
    torch_optimizer = make_torch(decay_groups(torch_model))
    train(torch_model, torch_optimizer, regression_batches(2))
    saved = roundtrip(torch_optimizer.state_dict())
    model = make_mlp()
    optimizer = OPTIMIZERS[name](decay_groups(model), **optimizer_kwargs(name, device_budget=4096))
    train(model, optimizer, regression_batches(2))
    before, groups_before = optimizer.state_dict(), [dict(group) for group in optimizer.param_groups]
    with pytest.raises(ValueError, match=r"param group 0 of state_dict: " + message):
        optimizer.load_state_dict(saved)
    after = optimizer.state_dict()
    assert [dict(group) for group in optimizer.param_groups] == groups_before
    assert after["param_groups"] == before["param_groups"] and after["state"].keys() == before["state"].keys()
    for index, entry in before["state"].items():
        assert entry.keys() == after["state"][index].keys()
        assert all(torch.equal(value, after["state"][index][key]) for key, value in entry.items()), index
    torch_group = {key: value for key, value in saved["param_groups"][0].items() if key != "params"}
    with pytest.raises(ValueError, match=r"param group 0: " + message):
        OPTIMIZERS[name]([{**torch_group, "params": list(make_mlp().parameters())}])


def test_torch_adam_state_dict_without_weight_decay_loads():
    """torch.optim.Adam without weight decay is AdamW's rule: its state dict loads and trains on alike."""
    batches = regression_batches(6)
    reference = make_mlp()
    torch_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2, foreach=False)
    train(reference, torch_optimizer, batches[:3])
    saved_model, saved_optimizer = roundtrip(reference.state_dict()), roundtrip(torch_optimizer.state_dict())
    train(reference, torch_optimizer, batches[3:])
    model = make_mlp(seed=5)
    model.load_state_dict(saved_model)
    optimizer = hf_paged.PagedAdamW(model.parameters(), lr=1e-2, page_size=4096)
    optimizer.load_state_dict(saved_optimizer)
    train(model, optimizer, batches[3:])
    for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, expected)
