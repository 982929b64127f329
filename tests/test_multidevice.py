"""Parameters on several devices: one page store and one budget per device, results as on one device.

On the CPU, the last two layers of the model are given the pseudo device ``"cpu:1"`` (its own store, backend,
budget and probe), the way ``device_map="auto"`` puts the last layers of a model on a second GPU.
tests/test_gpu.py runs the same on two CUDA devices where they exist.
"""

from __future__ import annotations

import pytest
import torch
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, regression_batches, train
from test_memory_callback import run_step
from test_paging import assert_same_result
from torch.nn.functional import mse_loss
from transformers import TrainerControl, TrainerState

from hf_paged import PagedAdamW, PagedAdamW8bit
from hf_paged.budget import AutoBudget
from hf_paged.callbacks import MemorySpikeCallback
from hf_paged.optim.base import PagedOptimizer

PAGE_SIZE = 4096
SECOND = "cpu:1"


@pytest.fixture
def split_model(monkeypatch):
    """A model whose last two layers' state lives on the pseudo device ``"cpu:1"``, the first's on ``"cpu"``."""
    model = make_mlp()
    on_second = {id(param) for param in [*model[2].parameters(), *model[4].parameters()]}
    monkeypatch.setattr(
        PagedOptimizer, "_state_device", lambda self, param: SECOND if id(param) in on_second else "cpu"
    )
    return model


def check_budgets(optimizer, budgets: dict[str, int]) -> list[str]:
    """Check after every page operation that each device holds no more than its budget; return the devices seen."""
    seen = []

    def check(operation, page):
        device = optimizer._store.device_of(page)
        seen.append(device)
        assert optimizer._store.stores[device].device_bytes <= budgets[device], (operation, device)

    optimizer._store.add_observer(check)
    return seen


@pytest.mark.parametrize("prefetch", [0, 2])
def test_split_devices_match_one_unlimited_device_bitwise(optimizer_name, split_model, prefetch):
    batches = regression_batches(6)
    reference = make_mlp()
    reference_optimizer = OPTIMIZERS[optimizer_name](decay_groups(reference), **optimizer_kwargs(optimizer_name))
    train(reference, reference_optimizer, batches)

    budgets = {"cpu": PAGE_SIZE, SECOND: PAGE_SIZE}
    device_budget = {"cpu": PAGE_SIZE, torch.device(SECOND): "4KiB"}
    optimizer = OPTIMIZERS[optimizer_name](
        decay_groups(split_model), **optimizer_kwargs(optimizer_name, device_budget=device_budget, prefetch=prefetch)
    )
    seen = check_budgets(optimizer, budgets)
    train(split_model, optimizer, batches)
    assert_same_result(split_model, optimizer, reference, reference_optimizer)
    assert set(seen) == {"cpu", SECOND}

    second = {id(param) for param in [*split_model[2].parameters(), *split_model[4].parameters()]}
    for page in optimizer._store.pages:  # pages never mix devices
        devices = {SECOND if id(optimizer._layout.tensor_of(s)) in second else "cpu" for s in page.segments}
        assert devices == {optimizer._store.device_of(page)}

    stats = optimizer.paging_stats()
    assert set(stats["devices"]) == {"cpu", SECOND}
    for key, value in stats["devices"]["cpu"].items():
        assert stats[key] == value + stats["devices"][SECOND][key], key
    for device, store in optimizer._store.stores.items():  # a device whose state exceeds its budget paged
        if sum(page.nbytes for page in store.pages) > budgets[device]:
            assert stats["devices"][device]["page_outs"] > 0, device
    assert stats["page_outs"] > 0
    assert optimizer.device_budgets == budgets and optimizer.device_budget == 2 * PAGE_SIZE


def test_state_dict_moves_between_split_and_single_device(optimizer_name, split_model):
    batches = regression_batches(8)
    reference = make_mlp()
    reference_optimizer = OPTIMIZERS[optimizer_name](decay_groups(reference), **optimizer_kwargs(optimizer_name))
    train(reference, reference_optimizer, batches)

    optimizer = OPTIMIZERS[optimizer_name](
        decay_groups(split_model), **optimizer_kwargs(optimizer_name, device_budget=PAGE_SIZE)
    )
    train(split_model, optimizer, batches[:4])
    single = make_mlp()
    single.load_state_dict(split_model.state_dict())
    single_optimizer = OPTIMIZERS[optimizer_name](decay_groups(single), **optimizer_kwargs(optimizer_name))
    single_optimizer.load_state_dict(optimizer.state_dict())
    train(single, single_optimizer, batches[4:6])

    split_model.load_state_dict(single.state_dict())
    optimizer.load_state_dict(single_optimizer.state_dict())
    assert optimizer.paging_stats()["device_bytes"] == 0
    train(split_model, optimizer, batches[6:])
    assert_same_result(split_model, optimizer, reference, reference_optimizer)


def test_one_number_applies_to_each_device_and_evict_empties_all(split_model):
    optimizer = PagedAdamW(decay_groups(split_model), **optimizer_kwargs("PagedAdamW"))
    train(split_model, optimizer, regression_batches(1))
    assert all(stats["device_bytes"] > PAGE_SIZE for stats in optimizer.paging_stats()["devices"].values())
    optimizer.set_device_budget(PAGE_SIZE)
    assert optimizer.device_budgets == {"cpu": PAGE_SIZE, SECOND: PAGE_SIZE}
    assert all(stats["device_bytes"] <= PAGE_SIZE for stats in optimizer.paging_stats()["devices"].values())
    optimizer.set_device_budget({torch.device("cpu"): "8KiB"})
    assert optimizer.device_budgets == {"cpu": 8192, SECOND: None}
    train(split_model, optimizer, regression_batches(1))
    freed = optimizer.evict()
    stats = optimizer.paging_stats()
    assert freed > 0 and stats["device_bytes"] == 0
    assert all(device["device_bytes"] == 0 and device["host_bytes"] > 0 for device in stats["devices"].values())


def test_auto_gives_each_device_its_own_automatic_budget(split_model):
    optimizer = PagedAdamW8bit(decay_groups(split_model), **optimizer_kwargs("PagedAdamW8bit", device_budget="auto"))
    autos = optimizer.auto_budgets
    assert set(autos) == {"cpu", SECOND} and autos["cpu"] is not autos[SECOND]
    assert autos[SECOND].probe.device == torch.device(SECOND) and autos["cpu"].probe.device == torch.device("cpu")
    mixed = PagedAdamW8bit(
        decay_groups(split_model),
        **optimizer_kwargs("PagedAdamW8bit", device_budget={"cpu": "auto", SECOND: 3 * PAGE_SIZE}),
    )
    assert set(mixed.auto_budgets) == {"cpu"} and mixed.device_budgets[SECOND] == 3 * PAGE_SIZE


def test_bad_device_budgets_name_the_key_and_change_nothing(split_model):
    with pytest.raises(ValueError, match=r"device_budget\['cpu:1'\]='lots' is not a size"):
        PagedAdamW8bit(decay_groups(split_model), device_budget={"cpu:1": "lots"})
    with pytest.raises(ValueError, match=r"device_budget\['cpu'\]=1 is smaller than one page"):
        PagedAdamW8bit(decay_groups(split_model), device_budget={"cpu": 1})
    with pytest.raises(ValueError, match="device_budget key 'gpu:0' is not a device"):
        PagedAdamW8bit(decay_groups(split_model), device_budget={"gpu:0": "8MiB"})
    with pytest.raises(TypeError, match="device_budget keys must be devices"):
        PagedAdamW8bit(decay_groups(split_model), device_budget={0: "8MiB"})
    with pytest.raises(ValueError, match="gives device cpu two budgets"):
        PagedAdamW8bit(decay_groups(split_model), device_budget={"cpu": "8MiB", torch.device("cpu"): "9MiB"})
    with pytest.raises(ValueError, match="one AutoBudget cannot measure both cpu and cpu:1"):
        PagedAdamW8bit(decay_groups(split_model), device_budget=AutoBudget())

    optimizer = PagedAdamW8bit(decay_groups(split_model), device_budget="auto", page_size=PAGE_SIZE)
    autos = optimizer.auto_budgets
    for bad in (AutoBudget(), {"cpu": "auto", "cpu:1": "nope"}):
        with pytest.raises(ValueError):
            optimizer.set_device_budget(bad)
        assert optimizer.auto_budgets == autos


class _Args:
    device = torch.device("cpu")
    skip_memory_metrics = True

    def __init__(self, output_dir):
        self.output_dir = str(output_dir)


def test_the_memory_callback_sets_each_automatic_budget_s_margin_and_its_own_device_s_capacity(split_model, tmp_path):
    optimizer = PagedAdamW8bit(decay_groups(split_model), **optimizer_kwargs("PagedAdamW8bit", device_budget="auto"))
    second_capacity = optimizer.auto_budgets[SECOND].capacity
    callback = MemorySpikeCallback(safety_margin=0.5, device_capacity="8GiB", plot=False, oom_retries=0)
    args, state, control = _Args(tmp_path), TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control, optimizer=optimizer)
    autos = optimizer.auto_budgets
    assert autos["cpu"].safety_margin == autos[SECOND].safety_margin == 0.5
    assert autos["cpu"].capacity == 8 * 2**30 and autos[SECOND].capacity == second_capacity
    inputs, targets = regression_batches(1)[0]
    run_step(callback, args, state, optimizer, lambda: mse_loss(split_model(inputs), targets).backward())
    callback.on_step_begin(args, state, control, optimizer=optimizer)
    devices = optimizer.paging_stats()["devices"]
    assert devices[SECOND]["device_bytes"] > 0  # the second device's pages are in its own peaks, not the probe's
    assert callback._row["state_bytes_forward"] == devices["cpu"]["device_bytes"] > 0
