"""The paged optimizers keep ``torch.optim.Optimizer``'s whole contract, with ``torch.optim.AdamW`` as the reference:
each test makes the same calls on both and compares what they do.
"""

from __future__ import annotations

import collections
import copy
import io
import itertools
import pickle

import pytest
import torch
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, regression_batches, train
from torch.optim.optimizer import register_optimizer_step_pre_hook

import hf_paged
from hf_paged.optim._params import StridedRange

TWO_KINDS = ["PagedAdamW", "PagedLion8bit"]
"""A 32-bit and an 8-bit optimizer of the other rule: enough where the behaviour is the base class's alone."""

STATE_KEYS = {"exp_avg", "exp_avg_sq", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales"}


def paged(name: str, params, **overrides):
    return OPTIMIZERS[name](params, **{**optimizer_kwargs(name), **overrides})


def reference(params, **overrides):
    return torch.optim.AdamW(params, **{"lr": 1e-2, **overrides})


def trained(name: str | None, model=None, steps: int = 2, **overrides):
    """A model and its optimizer (``None``: ``torch.optim.AdamW``) after ``steps`` steps, with paging in play."""
    model = model or make_mlp()
    groups = decay_groups(model)
    optimizer = reference(groups, **overrides) if name is None else paged(name, groups, device_budget=8192, **overrides)
    train(model, optimizer, regression_batches(steps))
    return model, optimizer


def assert_same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        assert entry.keys() == b["state"][index].keys()
        for key, value in entry.items():
            assert torch.equal(value, b["state"][index][key]), (index, key)


def flat(model) -> torch.Tensor:
    return torch.cat([param.detach().reshape(-1) for param in model.parameters()])


# 1. deepcopy and pickle -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [None, *sorted(OPTIMIZERS)], ids=lambda name: name or "torch.AdamW")
def test_deepcopy_is_an_independent_optimizer_with_the_same_state(name):
    model, optimizer = trained(name)
    duplicate = copy.deepcopy(optimizer)
    assert type(duplicate) is type(optimizer)
    assert_same_state(optimizer.state_dict(), duplicate.state_dict())
    # as torch does, a copy of the optimizer alone holds copies of the parameters
    assert all(
        a is not b and torch.equal(a, b)
        for a, b in zip(duplicate.param_groups[0]["params"], decay_groups(model)[0]["params"])
    )
    if name is not None:
        for setting in ("page_size", "prefetch", "device_budget", "compiled"):
            assert getattr(duplicate, setting) == getattr(optimizer, setting), setting
        assert duplicate.paging_stats()["pages_total"] == optimizer.paging_stats()["pages_total"]
    before = optimizer.state_dict()
    for param in itertools.chain.from_iterable(group["params"] for group in duplicate.param_groups):
        param.grad = torch.ones_like(param)
    duplicate.step()
    assert_same_state(before, optimizer.state_dict())
    assert not torch.equal(duplicate.state_dict()["state"][0]["step"], before["state"][0]["step"])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_deepcopy_with_the_model_binds_to_the_copied_parameters_and_trains_alike(name):
    model, optimizer = trained(name)
    model_copy, optimizer_copy = copy.deepcopy((model, optimizer))
    assert [p for group in optimizer_copy.param_groups for p in group["params"]] == [
        p for group in decay_groups(model_copy) for p in group["params"]
    ]
    batches = regression_batches(3, seed=7)
    train(model, optimizer, batches)
    train(model_copy, optimizer_copy, batches)
    assert torch.equal(flat(model), flat(model_copy))
    assert_same_state(optimizer.state_dict(), optimizer_copy.state_dict())


def test_deepcopy_of_paged_adamw_trains_like_a_deepcopy_of_torch_adamw():
    ours, theirs = trained("PagedAdamW"), trained(None)
    (ours_model, ours_opt), (their_model, their_opt) = copy.deepcopy(ours), copy.deepcopy(theirs)
    batches = regression_batches(3, seed=7)
    train(ours_model, ours_opt, batches)
    train(their_model, their_opt, batches)
    torch.testing.assert_close(flat(ours_model), flat(their_model))


@pytest.mark.parametrize("name", [None, *sorted(OPTIMIZERS)], ids=lambda name: name or "torch.AdamW")
def test_pickle_round_trip_steps_and_saves(name):
    model, optimizer = trained(name)
    model_copy, optimizer_copy = pickle.loads(pickle.dumps((model, optimizer)))
    assert_same_state(optimizer.state_dict(), optimizer_copy.state_dict())
    buffer = io.BytesIO()
    torch.save(optimizer, buffer)
    buffer.seek(0)
    assert_same_state(optimizer.state_dict(), torch.load(buffer, weights_only=False).state_dict())
    batches = regression_batches(2, seed=7)
    train(model, optimizer, batches)
    train(model_copy, optimizer_copy, batches)
    assert torch.equal(flat(model), flat(model_copy))
    assert_same_state(optimizer.state_dict(), optimizer_copy.state_dict())


@pytest.mark.parametrize("name", [None, "PagedAdamW"], ids=lambda name: name or "torch.AdamW")
def test_copies_of_an_optimizer_with_a_scheduler_step_themselves(name):
    _, optimizer = trained(name)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)  # wraps optimizer.step on the instance
    for duplicate in (copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer))):
        before = optimizer.state_dict()
        for param in itertools.chain.from_iterable(group["params"] for group in duplicate.param_groups):
            param.grad = torch.ones_like(param)
        duplicate.step()
        assert_same_state(before, optimizer.state_dict())
        assert duplicate.state_dict()["state"][0]["step"] == before["state"][0]["step"] + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_deepcopy_and_pickle_on_cuda(name):
    def train_on_cuda(model, optimizer, batches):
        for inputs, targets in batches:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs.cuda()), targets.cuda()).backward()
            optimizer.step()

    model = make_mlp().cuda()
    optimizer = paged(name, decay_groups(model), device_budget=8192)
    train_on_cuda(model, optimizer, regression_batches(2))
    copies = [copy.deepcopy((model, optimizer)), pickle.loads(pickle.dumps((model, optimizer)))]
    batches = regression_batches(2, seed=7)
    train_on_cuda(model, optimizer, batches)
    for model_copy, optimizer_copy in copies:
        train_on_cuda(model_copy, optimizer_copy, batches)
        assert torch.equal(flat(model), flat(model_copy))
        assert_same_state(optimizer.state_dict(), optimizer_copy.state_dict())
        assert optimizer_copy.paging_stats()["device_bytes"] <= 8192


@pytest.mark.parametrize("name", [None, "PagedAdamW8bit"], ids=lambda name: name or "torch.AdamW")
def test_copies_keep_no_hooks_and_get_step_hooks_anew(name):
    _, optimizer = trained(name)
    calls = []
    optimizer.register_step_pre_hook(lambda *args: calls.append("original"))
    optimizer.register_load_state_dict_post_hook(lambda *args: calls.append("original"))
    duplicate = copy.deepcopy(optimizer)
    duplicate.register_step_post_hook(lambda *args: calls.append("copy"))
    duplicate.load_state_dict(duplicate.state_dict())
    duplicate.step()
    assert calls == ["copy"]


def test_deepcopy_keeps_an_automatic_budget_of_its_own():
    model = make_mlp()
    optimizer = hf_paged.PagedAdamW(
        model.parameters(), page_size=4096, device_budget=hf_paged.budget.AutoBudget(0.25, window=3)
    )
    train(model, optimizer, regression_batches(2))
    duplicate = copy.deepcopy(optimizer)
    assert duplicate.auto_budget is not optimizer.auto_budget
    assert (
        duplicate.auto_budget.safety_margin == 0.25
        and duplicate.auto_budget.predicted_peak == optimizer.auto_budget.predicted_peak
    )
    assert duplicate.auto_budget.probe is optimizer.auto_budget.probe  # the shared probe of the CPU, bound anew
    for param in itertools.chain.from_iterable(group["params"] for group in duplicate.param_groups):
        param.grad = torch.ones_like(param)
    duplicate.step()


# 2. hooks ---------------------------------------------------------------------------------------------


def record_load_hooks(optimizer, calls: list) -> None:
    def replace(opt, state_dict):
        calls.append(("replace", "marker" in state_dict))
        replaced = copy.deepcopy(state_dict)
        replaced["param_groups"][0]["lr"] = 0.125
        return replaced

    optimizer.register_load_state_dict_pre_hook(
        lambda opt, sd: calls.append(("pre", "in place")) or sd.update(marker=1)
    )
    optimizer.register_load_state_dict_pre_hook(replace)
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: calls.append(("first", "marker" in sd)), prepend=True)
    optimizer.register_load_state_dict_post_hook(lambda opt: calls.append(("post", opt.param_groups[0]["lr"])))
    optimizer.register_load_state_dict_post_hook(
        lambda opt: calls.append(("post first", opt.param_groups[0]["lr"])), prepend=True
    )


@pytest.mark.parametrize("name", TWO_KINDS)
def test_load_state_dict_hooks_run_as_in_torch(name):
    runs = {}
    for key in (None, name):
        _, optimizer = trained(key)
        calls = []
        record_load_hooks(optimizer, calls)
        state_dict = optimizer.state_dict()
        optimizer.load_state_dict(state_dict)
        assert "marker" not in state_dict  # the hooks got a shallow copy
        assert optimizer.param_groups[0]["lr"] == 0.125 and optimizer.param_groups[1]["lr"] != 0.125
        runs[key] = calls
    assert runs[name] == runs[None]
    assert runs[name][-2:] == [("post first", 0.125), ("post", 0.125)]


def state_dict_hook_calls(optimizer) -> list:
    calls = []
    optimizer.register_state_dict_pre_hook(lambda opt: calls.append("pre"))
    optimizer.register_state_dict_pre_hook(lambda opt: calls.append("pre first"), prepend=True)

    def post(opt, state_dict):
        calls.append(("post", bool(set(state_dict["state"][0]) & STATE_KEYS), "step" in state_dict["state"][0]))
        return {**state_dict, "extra": "from a hook"}

    optimizer.register_state_dict_post_hook(post)
    assert optimizer.state_dict()["extra"] == "from a hook"
    return calls


@pytest.mark.parametrize("name", TWO_KINDS)
def test_state_dict_hooks_run_as_in_torch_and_see_the_whole_state(name):
    ours, theirs = state_dict_hook_calls(trained(name)[1]), state_dict_hook_calls(trained(None)[1])
    assert ours == theirs == ["pre first", "pre", ("post", True, True)]


def step_hook_calls(model, optimizer) -> tuple[list, bool]:
    calls = []
    inputs, targets = regression_batches(1, seed=3)[0]

    def closure():
        calls.append("closure")
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        return loss

    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre") or (args, {"closure": closure}))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", "closure" in kwargs)))
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: calls.append("global"))
    try:
        loss = optimizer.step()
    finally:
        handle.remove()
    return calls, loss is not None


@pytest.mark.parametrize("name", TWO_KINDS)
def test_step_hooks_run_as_in_torch(name):
    ours, theirs = step_hook_calls(*trained(name)), step_hook_calls(*trained(None))
    assert ours == theirs == (["global", "pre", "closure", ("post", True)], True)


# 3. named parameters ----------------------------------------------------------------------------------


def named_groups(model):
    named = list(model.named_parameters())
    return [
        {"params": [(n, p) for n, p in named if p.ndim > 1], "weight_decay": 0.1},
        {"params": [(n, p) for n, p in named if p.ndim <= 1], "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("name", TWO_KINDS)
def test_named_parameters_as_in_torch(name):
    model = make_mlp()
    ours, theirs = paged(name, model.named_parameters()), reference(model.named_parameters())
    assert (
        ours.param_groups[0]["param_names"]
        == theirs.param_groups[0]["param_names"]
        == [n for n, _ in model.named_parameters()]
    )
    assert ours.param_groups[0]["params"] == theirs.param_groups[0]["params"]
    ours, theirs = paged(name, named_groups(model)), reference(named_groups(model))
    train(model, ours, regression_batches(1))
    for optimizer in (ours, theirs):
        with pytest.raises(ValueError, match="with/without names|all param groups with names or all without"):
            optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert [g["param_names"] for g in ours.state_dict()["param_groups"]] == [
        g["param_names"] for g in theirs.state_dict()["param_groups"]
    ]


@pytest.mark.parametrize("name", ["PagedAdamW", "PagedAdamW8bit"])
@pytest.mark.parametrize("direction", ["named into unnamed", "unnamed into named"])
def test_named_and_unnamed_state_dicts_load_both_ways_as_in_torch(name, direction):
    source_named = direction == "named into unnamed"
    results = {}
    for key in (None, name):
        model = make_mlp()
        source_groups = named_groups(model) if source_named else decay_groups(model)
        target_groups = decay_groups(model) if source_named else named_groups(model)
        make = reference if key is None else (lambda groups: paged(name, groups, device_budget=8192))
        source, target = make(source_groups), make(target_groups)
        train(model, source, regression_batches(2))
        target.load_state_dict(source.state_dict())
        results[key] = [group.get("param_names") for group in target.param_groups]
        if key is not None:
            assert_same_state({**source.state_dict(), "param_groups": []}, {**target.state_dict(), "param_groups": []})
    assert results[name] == results[None]
    assert all(names is not None for names in results[name])


# 4. keys of optimizer.state that are not parameters ---------------------------------------------------


@pytest.mark.parametrize("name", TWO_KINDS)
def test_state_keys_that_are_not_parameters_pass_through_as_in_torch(name):
    results = {}
    for key in (None, name):
        _, optimizer = trained(key)
        optimizer.register_state_dict_pre_hook(lambda opt: opt.state.__setitem__("something", {"count": 3}))
        state_dict = optimizer.state_dict()
        fresh = reference(decay_groups(make_mlp())) if key is None else paged(name, decay_groups(make_mlp()))
        fresh.load_state_dict(state_dict)
        results[key] = (
            state_dict["state"]["something"],
            fresh.state["something"],
            "something" in fresh.state_dict()["state"],
        )
    assert results[name] == results[None] == ({"count": 3}, {"count": 3}, True)


def with_state_no_step_wrote(name: str | None):
    """A model and its trained optimizer (``None``: ``torch.optim.AdamW``) whose ``state`` of parameter 1 was only
    read before it ever stepped (``state`` is a defaultdict: an empty entry), and whose state of parameters 0 and 2
    has keys that a user or a library added after a step."""
    model = make_mlp()
    groups = decay_groups(model)
    optimizer = reference(groups) if name is None else paged(name, groups, device_budget=8192)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    params[1].requires_grad_(False)
    assert optimizer.state[params[1]] == {}
    train(model, optimizer, regression_batches(2))
    params[1].requires_grad_(True)
    optimizer.state[params[0]]["scale"] = 0.5
    optimizer.state[params[2]]["count"] = torch.tensor([3, 4])
    return model, optimizer


def round_trip(how: str, name: str | None, model, optimizer):
    """The model and optimizer that ``how`` gives back: a new optimizer that loads the state dict (through
    ``torch.save``), a deepcopy, or a pickle round trip."""
    if how == "load_state_dict":
        fresh = reference(decay_groups(model)) if name is None else paged(name, decay_groups(model), device_budget=8192)
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        buffer.seek(0)
        fresh.load_state_dict(torch.load(buffer, weights_only=True))
        return model, fresh
    if how == "deepcopy":
        return copy.deepcopy((model, optimizer))
    return pickle.loads(pickle.dumps((model, optimizer)))


def other_keys(optimizer) -> dict:
    """Each parameter's saved keys besides the step and the optimizer's states, tensors as (dtype, values)."""

    def comparable(value):
        return (value.dtype, value.tolist()) if isinstance(value, torch.Tensor) else value

    state = optimizer.state_dict()["state"]
    return {
        index: {key: comparable(value) for key, value in entry.items() if key != "step" and "exp_avg" not in key}
        for index, entry in state.items()
    }


@pytest.mark.parametrize("how", ["load_state_dict", "deepcopy", "pickle"])
@pytest.mark.parametrize("name", [*TWO_KINDS, "PagedAdamW4bit"])
def test_state_entries_that_no_step_wrote_and_keys_users_add_round_trip_as_in_torch(name, how):
    results = {}
    for key in (None, name):
        model, optimizer = with_state_no_step_wrote(key)
        saved = other_keys(optimizer)
        model, copied = round_trip(how, key, model, optimizer)
        loaded = other_keys(copied)
        params = [param for group in copied.param_groups for param in group["params"]]
        entry = dict(copied.state[params[1]])
        train(model, copied, regression_batches(1, seed=5))
        steps = [copied.state_dict()["state"][index]["step"].item() for index in range(len(params))]
        results[key] = (saved, loaded, entry, steps, other_keys(copied))
    assert results[name] == results[None]
    saved, loaded, empty, steps, _after = results[name]
    assert saved[1] == {} and saved[0] == {"scale": 0.5} and saved[2]["count"][1] == [3, 4]
    assert empty == {} and steps == [3, 1, 3, 3, 3, 3]


STATE_RESETS = {
    "del state[p]": lambda optimizer, param: optimizer.state.__delitem__(param),
    "state[p] = {}": lambda optimizer, param: optimizer.state.__setitem__(param, {}),
    "state[p].clear()": lambda optimizer, param: optimizer.state[param].clear(),
    "state.clear()": lambda optimizer, param: optimizer.state.clear(),
    "state = defaultdict(dict)": lambda optimizer, param: setattr(optimizer, "state", collections.defaultdict(dict)),
}
"""Ways users and libraries reset a tensor's state (the last two: every tensor's) in ``torch.optim``."""


@pytest.mark.parametrize(
    ("name", "reset"),
    [(name, "del state[p]") for name in sorted(OPTIMIZERS) if name not in TWO_KINDS]
    + [(name, reset) for name in (None, *TWO_KINDS) for reset in STATE_RESETS],
    ids=lambda value: value or "torch.AdamW",
)
def test_a_tensor_whose_state_entry_was_reset_starts_afresh_as_in_torch(name, reset):
    """A tensor whose entry of ``optimizer.state`` is gone or empty takes its next step as a first step, from zero
    moments, as ``torch.optim`` gives it: not from the moments its pages held. The other tensors go on as they were."""
    model, optimizer = trained(name, steps=3)
    kept_model, kept = copy.deepcopy((model, optimizer))
    fresh_model = copy.deepcopy(model)
    fresh = reference(decay_groups(fresh_model)) if name is None else paged(name, decay_groups(fresh_model))
    reset_param = model[0].weight
    STATE_RESETS[reset](optimizer, reset_param)
    if name is not None:
        with pytest.raises(KeyError, match="no 'exp_avg' state"):
            optimizer.get_state_tensor(reset_param, "exp_avg")
    saved = optimizer.state_dict()["state"]
    assert 0 not in saved or saved[0] == {}
    batch = regression_batches(1, seed=7)
    for each_model, each in ((model, optimizer), (kept_model, kept), (fresh_model, fresh)):
        train(each_model, each, batch)
    resets_all = reset.startswith(("state ", "state."))
    for param, kept_param, fresh_param in zip(model.parameters(), kept_model.parameters(), fresh_model.parameters()):
        started_afresh = resets_all or param is reset_param
        assert torch.equal(param, fresh_param if started_afresh else kept_param)
        assert optimizer.state[param]["step"].item() == (1 if started_afresh else 4)


# 5. tensor lr -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TWO_KINDS)
def test_tensor_lr_must_have_one_element_as_in_torch(name):
    params = list(make_mlp().parameters())
    with pytest.raises(ValueError, match="^Tensor lr must be 1-element$"):
        reference(params, lr=torch.tensor([1e-3, 1e-3]))
    with pytest.raises(ValueError, match="^Tensor lr must be 1-element$"):
        paged(name, params, lr=torch.tensor([1e-3, 1e-3]))
    optimizer = paged(name, params[:2])
    with pytest.raises(ValueError, match=r"param group 1: Tensor lr must be 1-element"):
        optimizer.add_param_group({"params": params[2:], "lr": torch.tensor([1e-3, 1e-3])})
    assert len(optimizer.param_groups) == 1


def test_one_element_tensor_lr_follows_schedulers_as_in_torch():
    runs = {}
    for key in (None, "PagedAdamW"):
        model = make_mlp()
        groups = decay_groups(model)
        lr = torch.tensor(1e-2)
        optimizer = reference(groups, lr=lr) if key is None else paged(key, groups, lr=lr, device_budget=8192)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=2)
        decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=3)
        scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, decay], milestones=[2])
        lrs = []
        for batch in regression_batches(5):
            train(model, optimizer, [batch])
            scheduler.step()
            lrs.append([float(group["lr"]) for group in optimizer.param_groups])
        assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)
        runs[key] = (lrs, flat(model))
    assert runs["PagedAdamW"][0] == runs[None][0]
    torch.testing.assert_close(runs["PagedAdamW"][1], runs[None][1])


# 6. non-contiguous parameters -------------------------------------------------------------------------


def strided_params(seed: int = 0, device: str = "cpu") -> list[torch.nn.Parameter]:
    """A transposed matrix, a strided vector and a permuted 3-d tensor, none contiguous, as leaf parameters."""
    generator = torch.Generator().manual_seed(seed)
    bases = [torch.randn(shape, generator=generator).to(device) for shape in ((12, 100), (600,), (5, 6, 20))]
    params = [
        torch.nn.Parameter(bases[0].t()),
        torch.nn.Parameter(bases[1][::2]),
        torch.nn.Parameter(bases[2].permute(2, 0, 1)),
    ]
    assert not any(param.is_contiguous() for param in params)
    return params


def step_with(params, optimizer, steps: int = 3) -> None:
    generator = torch.Generator().manual_seed(5)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(param.device)
        optimizer.step()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
        ),
    ],
)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_non_contiguous_parameters_update_exactly_like_contiguous_ones(name, device):
    strided = strided_params(device=device)
    contiguous = [torch.nn.Parameter(param.detach().contiguous()) for param in strided]
    layouts = [(param.data_ptr(), param.stride()) for param in strided]
    runs = []
    for params in (strided, contiguous):
        optimizer = paged(name, params, page_size=1024, device_budget=2048)
        step_with(params, optimizer)
        runs.append(optimizer)
    for a, b in zip(strided, contiguous):
        assert torch.equal(a, b)
    assert_same_state(runs[0].state_dict(), runs[1].state_dict())
    assert [(param.data_ptr(), param.stride()) for param in strided] == layouts  # updated in place, no new storage
    stats = [optimizer.paging_stats() for optimizer in runs]
    assert stats[0]["host_bytes"] + stats[0]["device_bytes"] == stats[1]["host_bytes"] + stats[1]["device_bytes"]
    strided_copy, optimizer_copy = copy.deepcopy((strided, runs[0]))
    for params, optimizer in ((strided, runs[0]), (strided_copy, optimizer_copy)):
        step_with(params, optimizer, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(strided, strided_copy))
    assert_same_state(runs[0].state_dict(), optimizer_copy.state_dict())


def test_non_contiguous_parameters_match_torch_adamw():
    ours, theirs = strided_params(), strided_params()
    step_with(ours, paged("PagedAdamW", ours, page_size=2048, device_budget=4096))
    step_with(theirs, reference(theirs))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


def test_strided_ranges_read_and_write_row_major_elements():
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(5, 6, 7, generator=generator)
    for tensor in (base.permute(2, 0, 1), base.transpose(0, 1), base[:, ::2], base[1:, :, 3]):
        expected = tensor.reshape(-1).clone()
        for start, end in itertools.combinations(range(0, tensor.numel() + 1, 5), 2):
            selection = StridedRange(tensor, start, end)
            assert torch.equal(selection.gather(), expected[start:end])
            selection.scatter(-selection.gather())
            changed = expected.clone()
            changed[start:end] *= -1
            assert torch.equal(tensor.reshape(-1), changed)
            tensor.copy_(expected.view(tensor.shape))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_complex_parameters_get_a_clear_error(name):
    with pytest.raises(TypeError, match=r"parameter 1 \('w'\) of param group 0 is complex.*does not support complex"):
        paged(
            name,
            [
                ("v", torch.nn.Parameter(torch.zeros(3))),
                ("w", torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))),
            ],
        )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_float64_parameters_get_a_clear_error(name):
    """The kernels compute in fp32: an fp64 parameter was taken and rounded to fp32 at every step, even with lr=0."""
    double = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    allowed = r"allowed: torch.float32, torch.bfloat16, torch.float16"
    with pytest.raises(TypeError, match=rf"parameter 1 \('w'\) of param group 0 has dtype torch.float64; .*{allowed}"):
        paged(name, [("v", torch.nn.Parameter(torch.zeros(3))), ("w", double)])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_a_parameter_whose_data_changed_dtype_is_refused_at_the_step(name, dtype):
    """A parameter whose ``.data`` was replaced by an fp64 or complex tensor after the optimizer took it was stepped
    in fp32, its imaginary part dropped; the step refuses it, as the constructor does, before any update."""
    kept, changed = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.zeros(3))
    optimizer = paged(name, [("v", kept), ("w", changed)])
    changed.data = torch.arange(3).to(dtype)
    kept.grad, changed.grad = torch.ones(3), torch.ones(3, dtype=dtype)
    with pytest.raises(TypeError, match=r"parameter 1 \('w'\) of param group 0 (has dtype|is complex)"):
        optimizer.step()
    assert torch.equal(kept, torch.ones(3)) and torch.equal(changed, torch.arange(3).to(dtype))
    assert not optimizer.state


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_parameters_that_share_memory_get_a_clear_error(name):
    """Views of one tensor as two parameters were updated each from its own state: the C++ host kernels refused the
    step naming no parameter, the PyTorch and Triton kernels wrote the shared elements twice. Disjoint views are
    taken, whether their element ranges interleave (columns of a matrix) or not."""
    base = torch.zeros(40, 30)
    shared = r"parameter 1 \('b'\) of param group 0 shares memory with parameter 0 \('a'\) of param group 0"
    for a, b in [(base, base[:10]), (base[:, ::2], base[5, 4:6]), (base[1:3], base[2:4].t())]:
        with pytest.raises(ValueError, match=shared):
            paged(name, [("a", torch.nn.Parameter(a)), ("b", torch.nn.Parameter(b))])
    for a, b in [(base[:20], base[20:]), (base[:, :10], base[:, 10:]), (base[:, ::2], base[:, 1::2])]:
        paged(name, [("a", torch.nn.Parameter(a)), ("b", torch.nn.Parameter(b))])


def test_a_new_group_is_checked_against_the_earlier_parameters_that_meet_it_at_either_end():
    """An earlier contiguous parameter is compared with a new group's only where their bytes meet: one element of
    overlap at either end, or inside, is found, and ranges that only touch are taken; so is an earlier strided
    parameter that crosses a new one."""
    base, matrix = torch.zeros(100), torch.zeros(8, 8)
    optimizer = hf_paged.PagedAdamW(
        [torch.nn.Parameter(base[10:20]), torch.nn.Parameter(base[40:50]), torch.nn.Parameter(matrix[:, 0])], lr=1e-3
    )
    optimizer.add_param_group({"params": [torch.nn.Parameter(base[20:40])]})
    for overlapping, earlier in [
        (base[19:21], r"parameter [03] of param group [01]"),
        (base[0:11], "parameter 0 of param group 0"),
        (base[49:60], "parameter 1 of param group 0"),
        (base[45:46], "parameter 1 of param group 0"),
        (matrix[3], "parameter 2 of param group 0"),
    ]:
        with pytest.raises(ValueError, match=rf"parameter 0 of param group 2 shares memory with {earlier} "):
            optimizer.add_param_group({"params": [torch.nn.Parameter(overlapping)]})
    optimizer.add_param_group({"params": [torch.nn.Parameter(base[50:60]), torch.nn.Parameter(matrix[3, 1:])]})
    assert len(optimizer.param_groups) == 3


def test_many_views_of_one_buffer_are_checked_by_neighbours_in_bounded_memory(monkeypatch):
    """The shared-memory check compared every pair of parameters on one storage (2000 views of one flat buffer, as
    FSDP with use_orig_params gives, took 4.6 s) and listed the elements of two strided views that met with an
    int64 arange as long as their span (about 4 GB for a 525M-element embedding). Now only tensors whose byte
    ranges meet are compared, and their elements a few MiB at a time."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_paged.optim import _params

    flat = torch.zeros(2000 * 16)
    views = [torch.nn.Parameter(flat[i * 16 : (i + 1) * 16]) for i in range(2000)]
    compared = []
    share_elements = _params._share_elements
    monkeypatch.setattr(_params, "_share_elements", lambda *pair: compared.append(pair) or share_elements(*pair))
    hf_paged.PagedAdamW([{"params": views[:1000]}] + [{"params": [view]} for view in views[1000:]], lr=1e-3)
    assert len(compared) <= 2000  # neighbours only, not 2000 * 1999 / 2 pairs
    monkeypatch.undo()

    class LargestAllocation(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.largest = max(self.largest, tensor.numel() * tensor.element_size())
            return out

    base = torch.zeros(4000, 1000)  # 4M elements: an int64 index of the span would take 32 MiB
    for a, b, shared in [
        (base[:, ::2], base[:, 1::2], False),
        (base[:, :500], base[:, 500:], False),
        (base[:, 1:999], base.t()[998], True),
        (base[:, 3::7], base[:, 5::3], True),
    ]:
        with LargestAllocation() as mode:
            assert _params._share_elements(a, b) is shared
        assert mode.largest <= 4 << 20


# 7. errors name what is at fault and change nothing ---------------------------------------------------


def snapshot(model, optimizer):
    return flat(model).clone(), optimizer.state_dict(), optimizer.paging_stats()["pages_total"], len(optimizer.state)


def assert_unchanged(before, after):
    assert torch.equal(before[0], after[0])
    assert_same_state(before[1], after[1])
    assert before[2:] == after[2:]


def bad_groups(model):
    first = next(model.parameters())
    fresh = torch.nn.Parameter(torch.zeros(3))
    return [
        ({"params": [fresh, "weight"]}, TypeError, r"parameter 1 of param group 2 must be a tensor, got str"),
        (
            {"params": [fresh, torch.zeros(2, dtype=torch.int64)]},
            TypeError,
            r"parameter 1 of param group 2 has dtype torch.int64",
        ),
        (
            {"params": [fresh, torch.zeros(2, dtype=torch.float64, requires_grad=True)]},
            TypeError,
            r"parameter 1 of param group 2 has dtype torch.float64; .*allowed: torch.float32, torch.bfloat16, torch.float16",
        ),
        ({"params": [fresh, first]}, ValueError, r"parameter 1 of param group 2 is already in param group 0"),
        (
            {"params": [fresh, torch.nn.Parameter(first.data[:1])]},
            ValueError,
            r"parameter 1 of param group 2 shares memory with parameter 0 of param group 0",
        ),
        ({"params": [fresh, fresh]}, ValueError, r"parameter 1 of param group 2 is the same tensor as parameter 0"),
        ({"params": [fresh, fresh * 2]}, ValueError, r"parameter 1 of param group 2 is not a leaf"),
        ({"params": [fresh], "lr": -1.0}, ValueError, r"param group 2: lr must be"),
        ({"params": [fresh], "betas": (0.9, 1.5)}, ValueError, r"param group 2: betas\[1\]"),
        ({"params": [("a", fresh)]}, ValueError, r"param group 2 is with parameter names but param group 0 is not"),
        ({"params": [("a", fresh), first]}, ValueError, r"param group 2 mixes \(name, tensor\) pairs \(parameter 0\)"),
        ({"params": {fresh}}, TypeError, r"param group 2: params must be an ordered collection"),
        ({"lr": 1.0}, ValueError, r"param group 2 has no 'params'"),
        (
            {"params": [fresh, torch.zeros(3, device="meta", requires_grad=True)]},
            ValueError,
            r"parameter 1 of param group 2 is on the meta device",
        ),
    ]


def test_rejected_param_groups_name_the_parameter_and_change_nothing(optimizer_name):
    model, optimizer = trained(optimizer_name)
    before = snapshot(model, optimizer)
    for group, error, message in bad_groups(model):
        with pytest.raises(error, match=message):
            optimizer.add_param_group(group)
        assert_unchanged(before, snapshot(model, optimizer))
    train(model, optimizer, regression_batches(1))


def test_rejected_steps_name_the_parameter_and_change_nothing(optimizer_name):
    model = make_mlp()
    optimizer = paged(optimizer_name, named_groups(model), device_budget=8192)
    train(model, optimizer, regression_batches(2))
    before = snapshot(model, optimizer)
    torch.nn.functional.mse_loss(model(torch.randn(4, 20)), torch.randn(4, 3)).backward()
    bias = model[4].bias
    bias.grad = bias.grad.to_sparse()
    with pytest.raises(RuntimeError, match=r"parameter 2 \('4.bias'\) of param group 1 has a sparse gradient"):
        optimizer.step()
    assert_unchanged(before, snapshot(model, optimizer))
    bias.grad = torch.zeros(3)
    bias.grad.data = torch.zeros(5)
    with pytest.raises(RuntimeError, match=r"parameter 2 \('4.bias'\) of param group 1 has a gradient of shape \(5,\)"):
        optimizer.step()
    assert_unchanged(before, snapshot(model, optimizer))


BAD_STATE_DICTS = [
    (lambda sd: sd["param_groups"][1].update(lr=float("nan")), r"param group 1 of state_dict: lr must be"),
    (lambda sd: sd["param_groups"][1].update(lr=torch.tensor([1.0, 2.0])), r"param group 1 of state_dict: Tensor lr"),
    (lambda sd: sd["param_groups"][0].pop("params"), r"param group 0 of state_dict is not a dict with 'params'"),
    (lambda sd: sd["state"][2].pop("step"), r"state of parameter 2 has no 'step'"),
    (lambda sd: sd["state"].update({42: sd["state"][0]}), r"state for parameter 42, which no param group lists"),
]


def test_rejected_state_dicts_name_the_key_and_change_nothing(optimizer_name):
    model, optimizer = trained(optimizer_name)
    before = snapshot(model, optimizer)
    for corrupt, message in BAD_STATE_DICTS:
        state_dict = optimizer.state_dict()
        corrupt(state_dict)
        with pytest.raises(ValueError, match=message):
            optimizer.load_state_dict(state_dict)
        assert_unchanged(before, snapshot(model, optimizer))


def test_a_failing_load_pre_hook_changes_nothing(optimizer_name):
    model, optimizer = trained(optimizer_name)
    state_dict = optimizer.state_dict()
    train(model, optimizer, regression_batches(1))
    before = snapshot(model, optimizer)

    def refuse(opt, sd):
        raise RuntimeError("refused by a hook")

    optimizer.register_load_state_dict_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="refused by a hook"):
        optimizer.load_state_dict(state_dict)
    assert_unchanged(before, snapshot(model, optimizer))


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, *OPTIMIZERS.values()], ids=lambda cls: cls.__name__)
def test_the_param_group_dicts_given_are_the_optimizer_s_as_in_torch(optimizer_class) -> None:
    """torch.optim keeps the dicts it is given (with its defaults filled in), so an edit to one, later, takes effect;
    the paged optimizers kept copies, and ignored such edits."""
    first, second = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64))
    given, added = {"params": [first], "lr": 1e-2}, {"params": (second,), "lr": 1e-2}
    optimizer = optimizer_class([given])
    optimizer.add_param_group(added)
    assert optimizer.param_groups[0] is given and optimizer.param_groups[1] is added
    assert added["params"] == [second] and added["weight_decay"] == optimizer.defaults["weight_decay"]
    for param in (first, second):
        param.grad = torch.ones_like(param)
    optimizer.step()
    given["lr"] = 0.0
    before = first.detach().clone()
    optimizer.step()
    assert torch.equal(first, before)  # a learning rate of 0 moves nothing
