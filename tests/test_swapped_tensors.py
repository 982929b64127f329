"""State follows the tensors in the param groups, as in ``torch.optim``, when an engine swaps them after construction.

Each engine's swap is reproduced here as the engine does it, without the engine (tests/test_fsdp2_trainer.py and
tests/test_deepspeed.py run the engines themselves):

* accelerate's FSDP2 switch (``fsdp2_switch_optimizer_parameters``): the Trainer builds the optimizer on the full
  parameters; before any step, each group's ``params`` is replaced by the sharded parameters, of other shapes.
* DeepSpeed ZeRO stages 1 and 2: each group's ``params`` becomes one flat fp32 partition at engine init, and
  around each step ``optimizer.param_groups`` is narrowed to one group at a time.
* DeepSpeed ZeRO stage 3: the groups' ``params`` are empty between steps; the flat fp32 partitions are put in
  only around ``step()``, ``state_dict()`` and ``load_state_dict()``.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import weakref

import pytest
import torch
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, regression_batches, train

import hf_paged

STEPS = 6


def make_optimizer(name: str, params, **paging) -> torch.optim.Optimizer:
    if name == "torch AdamW":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    return OPTIMIZERS[name](params, **optimizer_kwargs(name, **paging))


def switch_parameters(optimizer: torch.optim.Optimizer, mapping: dict[torch.Tensor, torch.Tensor]) -> None:
    """What accelerate's ``fsdp2_switch_optimizer_parameters`` does: each group's tensors replaced in place."""
    for group in optimizer.param_groups:
        group["params"] = [mapping[param] for param in group["params"]]


def replace_groups(optimizer: torch.optim.Optimizer, mapping: dict[torch.Tensor, torch.Tensor]) -> list[dict]:
    """Assign ``param_groups`` new group dicts, each a copy of one listing the tensors ``mapping`` gives; return the
    groups it held."""
    groups = optimizer.param_groups
    optimizer.param_groups = [{**group, "params": [mapping[param] for param in group["params"]]} for group in groups]
    return groups


def sharded_and_full(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A "sharded" MLP (hidden 32: each weight a slice of the full one's shape) and the full MLP (hidden 64)."""
    return make_mlp(seed, hidden=32), make_mlp(seed, hidden=64)


@pytest.mark.parametrize("name", ["torch AdamW", *sorted(OPTIMIZERS)])
def test_tensors_switched_before_the_first_step_are_trained_with_pages_of_their_size(name):
    batches = regression_batches(STEPS)
    sharded, full = sharded_and_full()
    optimizer = make_optimizer(name, decay_groups(full))
    switch_parameters(optimizer, dict(zip(full.parameters(), sharded.parameters(), strict=True)))
    full_before = [param.detach().clone() for param in full.parameters()]
    train(sharded, optimizer, batches)

    direct_model = make_mlp(0, hidden=32)
    direct = make_optimizer(name, decay_groups(direct_model))
    train(direct_model, direct, batches)
    for param, expected in zip(sharded.parameters(), direct_model.parameters(), strict=True):
        assert torch.equal(param, expected)
    for param, before in zip(full.parameters(), full_before, strict=True):
        assert torch.equal(param, before)  # the tensors that left the groups are not touched
    saved, expected_saved = optimizer.state_dict(), direct.state_dict()  # no KeyError for the tensors that left
    assert saved["state"].keys() == expected_saved["state"].keys()
    for index, entry in expected_saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(saved["state"][index][key], value), (index, key)
    if name != "torch AdamW":
        assert optimizer.paging_stats()["pages_total"] == direct.paging_stats()["pages_total"]
        assert optimizer.paging_stats()["host_bytes"] + optimizer.paging_stats()["device_bytes"] == (
            direct.paging_stats()["host_bytes"] + direct.paging_stats()["device_bytes"]
        )


class ZeroLike:
    """What DeepSpeed ZeRO does to its client optimizer, on one rank holding every partition.

    Each param group's tensors are flattened into one fp32 partition (kept by the engine); the model's
    gradients are copied into the partitions' gradients before a step and the partitions back into the model
    after it. Stages 1 and 2 list the partitions in the groups and step one group at a time; stage 3 lists them
    only around ``step()``, ``state_dict()`` and ``load_state_dict()``. Stage 0 is the reference: an optimizer
    built on the partitions, with nothing swapped.
    """

    def __init__(self, model: torch.nn.Module, name: str, stage: int, **paging) -> None:
        self.stage = stage
        groups = decay_groups(model)
        self.model_params = [group["params"] for group in groups]
        self.partitions = [
            torch.cat([param.detach().reshape(-1) for param in params]).requires_grad_() for params in self.model_params
        ]
        if stage == 0:
            partition_groups = [{**group, "params": [part]} for group, part in zip(groups, self.partitions)]
            self.optimizer = make_optimizer(name, partition_groups, **paging)
            return
        self.optimizer = make_optimizer(name, groups, **paging)
        for group, partition in zip(self.optimizer.param_groups, self.partitions):
            group["params"] = [partition] if stage < 3 else []

    @contextlib.contextmanager
    def listed(self):
        """Stage 3 lists the partitions in the groups only around the optimizer's calls."""
        if self.stage == 3:
            for group, partition in zip(self.optimizer.param_groups, self.partitions):
                group["params"] = [partition]
        try:
            yield
        finally:
            if self.stage == 3:
                for group in self.optimizer.param_groups:
                    group["params"] = []

    def step(self) -> None:
        for partition, params in zip(self.partitions, self.model_params):
            partition.grad = torch.cat([param.grad.reshape(-1) for param in params])
        if self.stage in (1, 2):
            groups = self.optimizer.param_groups
            for group in groups:
                self.optimizer.param_groups = [group]
                self.optimizer.step()
            self.optimizer.param_groups = groups
        else:
            with self.listed():
                self.optimizer.step()
        with torch.no_grad():
            for partition, params in zip(self.partitions, self.model_params):
                partition.grad = None
                for piece, param in zip(partition.split([param.numel() for param in params]), params):
                    param.copy_(piece.view_as(param))

    def zero_grad(self) -> None:
        for params in self.model_params:
            for param in params:
                param.grad = None

    def state_dict(self) -> dict:
        with self.listed():
            return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        with self.listed():
            self.optimizer.load_state_dict(state_dict)


def assert_same_training(model, engine, reference_model, reference_engine) -> None:
    for param, expected in zip(model.parameters(), reference_model.parameters(), strict=True):
        assert torch.equal(param, expected)
    for partition, expected in zip(engine.partitions, reference_engine.partitions, strict=True):
        assert torch.equal(partition, expected)
    saved, expected_saved = engine.state_dict()["state"], reference_engine.state_dict()["state"]
    assert saved.keys() == expected_saved.keys() == {0, 1}
    for index, entry in expected_saved.items():
        for key, value in entry.items():
            assert torch.equal(saved[index][key], value), (index, key)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", ["torch AdamW", *sorted(OPTIMIZERS)])
def test_zero_partitions_train_as_with_an_optimizer_built_on_them(name, stage):
    batches = regression_batches(STEPS)
    model, reference_model = make_mlp(), make_mlp()
    engine, reference = ZeroLike(model, name, stage), ZeroLike(reference_model, name, 0)
    train(model, engine, batches)
    train(reference_model, reference, batches)
    assert_same_training(model, engine, reference_model, reference)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_paged_adamw_matches_torch_fused_adamw_bitwise(stage):
    batches = regression_batches(STEPS)
    model, reference_model = make_mlp(), make_mlp()
    engine = ZeroLike(model, "PagedAdamW", stage, device_budget=4096)
    train(model, engine, batches)
    train(reference_model, ZeroLike(reference_model, "torch AdamW", stage), batches)
    for param, expected in zip(model.parameters(), reference_model.parameters(), strict=True):
        assert torch.equal(param, expected)
    assert engine.optimizer.paging_stats()["page_outs"] > 0


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_zero_state_dict_resumes_bitwise_under_another_budget(name, stage):
    batches = regression_batches(STEPS)
    reference_model = make_mlp()
    reference = ZeroLike(reference_model, name, stage)
    train(reference_model, reference, batches)

    model = make_mlp()
    engine = ZeroLike(model, name, stage)
    train(model, engine, batches[: STEPS // 2])
    saved_model, saved_optimizer = model.state_dict(), engine.state_dict()
    resumed_model = make_mlp(seed=1)
    resumed_model.load_state_dict(saved_model)
    resumed = ZeroLike(resumed_model, name, stage, device_budget=4096)
    resumed.load_state_dict(saved_optimizer)
    train(resumed_model, resumed, batches[STEPS // 2 :])
    assert_same_training(resumed_model, resumed, reference_model, reference)
    assert resumed.optimizer.paging_stats()["page_outs"] > 0


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_zero3_state_stays_paged_while_its_tensors_are_away(name):
    model = make_mlp()
    engine = ZeroLike(model, name, 3)
    train(model, engine, regression_batches(2))
    optimizer = engine.optimizer
    assert all(group["params"] == [] for group in optimizer.param_groups)
    stats = optimizer.paging_stats()
    assert stats["pages_total"] > 0 and stats["device_bytes"] > 0
    assert optimizer.evict() == stats["device_bytes"]
    assert optimizer.paging_stats()["device_bytes"] == 0
    assert optimizer.state_dict()["state"] == {}  # nothing listed, nothing to number
    saved = engine.state_dict()
    assert saved["state"].keys() == {0, 1} and saved["state"][0]["step"] == 2


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_tensor_with_state_that_changes_shape_is_a_clear_error_before_any_update(name):
    model = make_mlp()
    optimizer = make_optimizer(name, model.parameters())
    train(model, optimizer, regression_batches(1))
    before = [param.detach().clone() for param in model.parameters()]
    saved = optimizer.state_dict()
    weight = model[-1].weight
    weight.data = torch.zeros(6, 64)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    message = r"parameter 4 of param group 0 has shape \(6, 64\).*laid out for shape \(3, 64\)"
    with pytest.raises(RuntimeError, match=message):
        optimizer.step()
    for param, expected in zip(list(model.parameters())[:-2], before[:-2]):
        assert torch.equal(param, expected)
    state = optimizer.state_dict()["state"]
    assert all(torch.equal(state[0][key], saved["state"][0][key]) for key in saved["state"][0])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_gradient_of_another_size_than_its_tensor_is_a_clear_error(name):
    """The fused CPU AdamW kernel does not check sizes: a longer gradient would be read out of bounds."""
    partition = torch.zeros(100, requires_grad=True)
    optimizer = make_optimizer(name, [partition])
    partition.grad = torch.ones(100)
    partition.data = torch.zeros(50)
    with pytest.raises(RuntimeError, match=r"gradient of shape \(100,\).*expected shape \(50,\)"):
        optimizer.step()
    assert torch.equal(partition, torch.zeros(50))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_tensors_get_pages_lazily_at_their_first_step(name):
    model = make_mlp()
    optimizer = make_optimizer(name, model.parameters())
    assert optimizer.paging_stats()["pages_total"] == 0 and optimizer.state_dict()["state"] == {}
    last = list(model.parameters())[-2:]
    for param in last:
        param.requires_grad_(False)
    train(model, optimizer, regression_batches(1))
    first_pages = optimizer.paging_stats()["pages_total"]
    assert first_pages > 0 and all(param not in optimizer.state for param in last)
    for param in last:
        param.requires_grad_(True)
    train(model, optimizer, regression_batches(1))
    assert optimizer.paging_stats()["pages_total"] > first_pages
    assert sorted(optimizer.state_dict()["state"]) == list(range(6))


def test_oom_recovery_follows_switched_tensors():
    """A recovery built before the switch resets the gradients of the tensors the groups hold at the error."""

    def run(fail: bool) -> torch.nn.Module:
        sharded, full = sharded_and_full()
        optimizer = hf_paged.PagedAdamW(full.parameters(), lr=1e-2, page_size=4096)
        recovery = hf_paged.OOMRecovery(optimizer)
        switch_parameters(optimizer, dict(zip(full.parameters(), sharded.parameters(), strict=True)))
        failures = [fail]

        def forward_backward(inputs, targets):
            torch.nn.functional.mse_loss(sharded(inputs), targets).backward()
            if failures.pop() if failures else False:
                raise torch.OutOfMemoryError("injected after backward")

        for inputs, targets in regression_batches(2):
            with recovery.window():
                recovery.run(forward_backward, inputs, targets)
            optimizer.step()
            optimizer.zero_grad()
        return sharded

    for param, expected in zip(run(fail=True).parameters(), run(fail=False).parameters(), strict=True):
        assert torch.equal(param, expected)


@pytest.mark.parametrize("swap", [switch_parameters, replace_groups], ids=["group params", "group dicts"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_tensors_with_state_swapped_for_tensors_of_another_shape_is_a_clear_error(name, swap):
    """Whether the groups' ``params`` or whole group dicts are replaced; swapped back, the tensors keep their state
    and train on."""
    sharded, full = sharded_and_full()
    optimizer = make_optimizer(name, decay_groups(full))
    train(full, optimizer, regression_batches(1))
    saved = optimizer.state_dict()
    swap(optimizer, dict(zip(full.parameters(), sharded.parameters(), strict=True)))
    before = [param.detach().clone() for param in sharded.parameters()]
    message = r"parameter 0 of param group 0 is a new tensor of shape \(32, 20\) in place of one whose state has shape"
    with pytest.raises(RuntimeError, match=message):
        train(sharded, optimizer, regression_batches(1))
    for param, expected in zip(sharded.parameters(), before, strict=True):
        assert torch.equal(param, expected)
    swap(optimizer, dict(zip(sharded.parameters(), full.parameters(), strict=True)))
    state = optimizer.state_dict()["state"]
    for index, entry in saved["state"].items():
        assert all(torch.equal(state[index][key], value) for key, value in entry.items())
    train(full, optimizer, regression_batches(1))


@pytest.mark.parametrize("swap", [switch_parameters, replace_groups], ids=["group params", "group dicts"])
@pytest.mark.parametrize("name", ["torch AdamW", "PagedAdamW"])
def test_tensors_with_state_swapped_for_tensors_of_the_same_shape_start_afresh_as_in_torch(name, swap):
    """State is keyed by tensor: a new tensor gets new state, as ``torch.optim.AdamW`` gives it, whether the groups'
    ``params`` or whole group dicts are replaced."""
    first, second = make_mlp(seed=0), make_mlp(seed=1)
    optimizer = make_optimizer(name, decay_groups(first))
    train(first, optimizer, regression_batches(2))
    swap(optimizer, dict(zip(first.parameters(), second.parameters(), strict=True)))
    train(second, optimizer, regression_batches(2, seed=3))
    fresh_model = make_mlp(seed=1)
    train(fresh_model, make_optimizer(name, decay_groups(fresh_model)), regression_batches(2, seed=3))
    for param, expected in zip(second.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(param, expected)


@pytest.mark.parametrize("name", ["torch AdamW", *sorted(OPTIMIZERS)])
def test_a_tensor_added_ahead_of_tensors_with_state_gets_state_of_its_own_as_in_torch(name):
    """A tensor put into a group ahead of tensors with state is a new tensor with state of its own, as in
    ``torch.optim``: the tensors it moves along keep theirs, as where it is put at the end."""
    results = []
    for position in ("ahead", "at the end"):
        model = make_mlp()
        first, *weights = [param for key, param in model.named_parameters() if key.endswith("weight")]
        biases = [param for key, param in model.named_parameters() if key.endswith("bias")]
        optimizer = make_optimizer(name, [{"params": weights}, {"params": biases, "weight_decay": 0.0}])
        train(model, optimizer, regression_batches(2))
        listed = optimizer.param_groups[0]["params"]
        listed.insert(0 if position == "ahead" else len(listed), first)
        train(model, optimizer, regression_batches(2, seed=3))
        results.append([param.detach().clone() for param in model.parameters()])
    for param, expected in zip(*results, strict=True):
        assert torch.equal(param, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_partitions_on_cuda_page_under_a_budget_bitwise(stage):
    """The ZeRO swaps on CUDA: partitions on the device, pages streamed under a one-page budget through the copy
    streams, bitwise the result of an optimizer built on the partitions with no budget."""

    def run(engine_stage: int, **paging) -> list[torch.Tensor]:
        model = make_mlp().cuda()
        engine = ZeroLike(model, "PagedAdamW8bit", engine_stage, **paging)
        for inputs, targets in regression_batches(STEPS):
            engine.zero_grad()
            torch.nn.functional.mse_loss(model(inputs.cuda()), targets.cuda()).backward()
            engine.step()
        return [partition.detach().cpu() for partition in engine.partitions]

    reference = run(0)
    for partition, expected in zip(run(stage, device_budget=4096), reference, strict=True):
        assert torch.equal(partition, expected)


def swap_middle_weight(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Parameter:
    """What an engine or a user swapping tensors at every step does: the middle weight becomes a new tensor of the
    same values, in the model and in the param group; return the old one."""
    old = model[2].weight
    model[2].weight = torch.nn.Parameter(old.detach().clone())
    optimizer.param_groups[0]["params"][1] = model[2].weight
    return old


def train_with_swaps(model, optimizer, batches, keep: list | None = None) -> list[tuple[int, int]]:
    """Swap the middle weight before each step (the old one dropped, or kept in ``keep``); return the pages and
    bytes of paged state after each step."""
    held = []
    for batch in batches:
        old = swap_middle_weight(model, optimizer)
        if keep is not None:
            keep.append(old)
        del old
        train(model, optimizer, [batch])
        if hasattr(optimizer, "paging_stats"):
            stats = optimizer.paging_stats()
            held.append((stats["pages_total"], stats["host_bytes"] + stats["device_bytes"]))
    return held


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_pages_of_tensors_swapped_out_and_dropped_are_freed(name):
    """Seven swaps hold the state of one: the pages of the tensors nothing holds any more are freed (a page shared
    with a tensor kept stays). Training, state_dict() and a resume from it are bitwise those of a run that holds
    every swapped-out tensor, whose pages are kept."""
    batches = regression_batches(8)
    half = len(batches) // 2
    model = make_mlp()
    optimizer = make_optimizer(name, decay_groups(model), device_budget=4 * 4096)
    train(model, optimizer, batches[:1])
    first = optimizer.paging_stats()["pages_total"]
    held = train_with_swaps(model, optimizer, batches[1:half])
    resumed_model = make_mlp(seed=1)
    resumed_model.load_state_dict(model.state_dict())
    resumed = make_optimizer(name, decay_groups(resumed_model))
    resumed.load_state_dict(optimizer.state_dict())
    held += train_with_swaps(model, optimizer, batches[half:])
    train_with_swaps(resumed_model, resumed, batches[half:])
    weight_pages = -(-64 * 64 * 8 // 4096)  # its fp32 moments, or fewer pages of 8-bit or 4-bit codes
    assert held[0][0] <= first + weight_pages
    assert held == held[:1] * len(held), held

    keep = []
    reference_model = make_mlp()
    reference = make_optimizer(name, decay_groups(reference_model))
    train(reference_model, reference, batches[:1])
    kept = train_with_swaps(reference_model, reference, batches[1:], keep)
    assert kept[-1][0] > held[-1][0]  # the state of tensors still held is kept, as in torch.optim
    for trained in (model, resumed_model):
        for param, expected in zip(trained.parameters(), reference_model.parameters(), strict=True):
            assert torch.equal(param, expected)
    expected_saved = reference.state_dict()["state"]
    for saved in (optimizer.state_dict()["state"], resumed.state_dict()["state"]):
        assert saved.keys() == expected_saved.keys() == set(range(6))
        for index, entry in expected_saved.items():
            for key, value in entry.items():
                assert torch.equal(saved[index][key], value), (index, key)


def test_paged_adamw_with_swaps_matches_torch_adamw_bitwise():
    """``torch.optim.AdamW`` keeps the state of every swapped-out tensor (its state_dict() then fails on them);
    PagedAdamW frees it and trains bitwise as torch does."""
    batches = regression_batches(6)
    models, optimizers = [], []
    for name, paging in (("torch AdamW", {}), ("PagedAdamW", {"device_budget": 4096})):
        model = make_mlp()
        optimizer = make_optimizer(name, decay_groups(model), **paging)
        train(model, optimizer, batches[:1])
        train_with_swaps(model, optimizer, batches[1:])
        models.append(model)
        optimizers.append(optimizer)
    for param, expected in zip(models[1].parameters(), models[0].parameters(), strict=True):
        assert torch.equal(param, expected)
    saved = optimizers[1].state_dict()["state"]
    listed = [param for group in optimizers[0].param_groups for param in group["params"]]
    for index, param in enumerate(listed):
        for key, value in optimizers[0].state[param].items():
            assert torch.equal(saved[index][key], value), (index, key)
    assert len(optimizers[1].state) == 6 < len(optimizers[0].state)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_tensor_swapped_out_and_held_keeps_its_state_until_it_comes_back(name):
    """Only tensors nothing holds are forgotten: the middle weight, swapped out for a step in which a stand-in
    steps and back, trains on from its state as in ``torch.optim``; the stand-in, dropped, leaves no pages."""

    def run(swap_out: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, weakref.ref | None]:
        model = make_mlp()
        optimizer = make_optimizer(name, decay_groups(model))
        batches = regression_batches(4)
        train(model, optimizer, batches[:2])
        stand_in_ref = None
        if swap_out:
            optimizer.zero_grad()
            stand_in = torch.nn.Parameter(torch.ones_like(model[2].weight))
            stand_in.grad = torch.ones_like(stand_in)
            optimizer.param_groups[0]["params"][1] = stand_in
            optimizer.step()
            optimizer.param_groups[0]["params"][1] = model[2].weight
            stand_in_ref = weakref.ref(stand_in)
            del stand_in
        train(model, optimizer, batches[2:])
        return model, optimizer, stand_in_ref

    model, optimizer, stand_in = run(swap_out=True)
    reference_model, reference, _ = run(swap_out=False)
    for param, expected in zip(model.parameters(), reference_model.parameters(), strict=True):
        assert torch.equal(param, expected)
    saved, expected_saved = optimizer.state_dict()["state"], reference.state_dict()["state"]
    assert saved.keys() == expected_saved.keys() == set(range(6))
    for index, entry in expected_saved.items():
        for key, value in entry.items():
            assert torch.equal(saved[index][key], value), (index, key)
    assert stand_in() is None and len(optimizer.state) == 6
    assert optimizer.paging_stats()["pages_total"] == reference.paging_stats()["pages_total"]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("name", ["torch AdamW", *sorted(OPTIMIZERS)])
def test_a_copy_keeps_the_state_of_a_tensor_away_from_the_groups(name, how):
    """A copy taken while a tensor with state is away from the param groups (a layer taken out of its group, ZeRO-3's
    partitions between steps) has its state, as a copy of a ``torch.optim`` optimizer does: back in the copy's group,
    the tensor trains on as it does in the optimizer copied."""
    model = make_mlp()
    optimizer = make_optimizer(name, decay_groups(model))
    batches = regression_batches(4)
    train(model, optimizer, batches[:2])
    listed = optimizer.param_groups[0]["params"]
    position = next(index for index, param in enumerate(listed) if param is model[2].weight)
    del listed[position]
    copied_model, copied = copy.deepcopy((model, optimizer)) if how == "deepcopy" else pickle.loads(
        pickle.dumps((model, optimizer))
    )
    for each_model, each in ((model, optimizer), (copied_model, copied)):
        each.param_groups[0]["params"].insert(position, each_model[2].weight)
        train(each_model, each, batches[2:])
        assert each.state[each_model[2].weight]["step"].item() == 4
    for param, expected in zip(copied_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(param, expected)


def test_tensors_in_turn_each_train_with_their_own_state_bitwise_as_torch():
    """DeepSpeed ZeRO-3's sub-groups: tensors of different sizes listed one at a time in one group, each stepped with
    its own state, bitwise as ``torch.optim.AdamW`` steps them; outside ``tensors_in_turn`` the second is refused as a
    replacement of the first."""

    def run(name: str) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        tensors = [torch.nn.Parameter(torch.randn(size, generator=generator)) for size in (3000, 2000)]
        optimizer = make_optimizer(name, [tensors[0]], **({} if name == "torch AdamW" else {"device_budget": 4096}))
        for step in range(3):
            for tensor in tensors:
                tensor.grad = torch.sin(tensor.detach() * (step + 1))
                optimizer.param_groups[0]["params"] = [tensor]
                with contextlib.nullcontext() if name == "torch AdamW" else optimizer.tensors_in_turn():
                    optimizer.step()
                optimizer.param_groups[0]["params"] = []
        optimizer.param_groups[0]["params"] = [tensors[0]]
        optimizer.step()  # outside the block, a tensor with state of its own comes back: no replacement
        if name != "torch AdamW":
            optimizer.param_groups[0]["params"] = [torch.nn.Parameter(torch.zeros(100))]
            optimizer.param_groups[0]["params"][0].grad = torch.ones(100)
            with pytest.raises(RuntimeError, match="is a new tensor of shape"):
                optimizer.step()
        return tensors

    for tensor, expected in zip(run("PagedAdamW"), run("torch AdamW"), strict=True):
        assert torch.equal(tensor, expected)
