"""Per-parameter state formats: a param group names its tensors' state format (``"state_format"``),
``keep_fp32_state`` and ``fp32_state_modules`` keep chosen modules' state in fp32, and through the Trainer the 8-bit
and 4-bit names keep ``nn.Embedding`` state in fp32 as transformers does for bitsandbytes' 8-bit optimizers."""

from __future__ import annotations

import copy
import pickle

import bitsandbytes
import pytest
import torch
from conftest import decay_groups, make_mlp, regression_batches, train
from test_paging import assert_same_result
from transformers import Trainer

import hf_paged
from hf_paged import keep_fp32_state
from hf_paged.optim.state_format import STATE_FORMAT

from trainer_utils import tiny_llama, token_dataset, training_args

QUANTIZED = {"PagedAdamW8bit": hf_paged.PagedAdamW8bit, "PagedAdamW4bit": hf_paged.PagedAdamW4bit}
SMALL_BLOCKS = {"block_size": 64, "page_size": 4096}


def small_blocks(name: str) -> dict:
    """Pages of 4 KiB and blocks of 64 elements, of 16 for 4-bit state: the MLP's first layer's rows (20 elements)
    then span whole blocks, so that the layer takes the optimizer's own quantized format."""
    return {**SMALL_BLOCKS, "block_size": 16 if name.endswith("4bit") else 64}


def kinds(optimizer: hf_paged.PagedOptimizer, params) -> list[str]:
    """The page format of each parameter's state."""
    return [optimizer._layout[param].kind for param in params]


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_a_group_names_the_format_of_its_state(name):
    """``"fp32"`` keeps a large matrix's state in fp32, the optimizer's own format quantizes a vector below the size
    threshold, and a group that names none takes the format its tensors' sizes choose."""
    model = make_mlp()
    bits = name[-4:]
    first, middle, last = model[0], model[2], model[4]
    groups = [
        {"params": [middle.weight], "state_format": "fp32"},
        {"params": [first.bias, last.bias], "state_format": bits},
        {"params": [first.weight, middle.bias, last.weight]},
    ]
    optimizer = QUANTIZED[name](groups, **small_blocks(name), **{f"min_{bits}_size": 256})
    train(model, optimizer, regression_batches(2))
    assert kinds(optimizer, [middle.weight, first.bias, last.bias]) == ["32bit", bits, bits]
    assert kinds(optimizer, [first.weight, middle.bias, last.weight]) == [bits, "32bit", "32bit"]
    saved = optimizer.state_dict()
    assert saved["param_groups"][0]["state_format"] == "fp32" and "state_format" not in saved["param_groups"][2]
    assert saved["state"][0]["exp_avg"].shape == middle.weight.shape


def test_fp32_state_trains_as_torch_adamw():
    """A matrix whose group keeps fp32 state in PagedAdamW8bit is updated as torch.optim.AdamW updates it (to fp32
    rounding: 1e-6 after 5 steps), where one of 8-bit state moves 1e-3 away."""
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 64, generator=generator) for _ in range(2)]
    grads = [[torch.randn(64, 64, generator=generator) for _ in range(2)] for _ in range(5)]
    kept, quantized = (torch.nn.Parameter(tensor.clone()) for tensor in start)
    reference = [torch.nn.Parameter(tensor.clone()) for tensor in start]
    optimizer = hf_paged.PagedAdamW8bit(
        [{"params": [kept], "state_format": "fp32"}, {"params": [quantized]}], lr=1e-2, **SMALL_BLOCKS
    )
    torch_adamw = torch.optim.AdamW(reference, lr=1e-2)
    for step_grads in grads:
        for params, step in (([kept, quantized], optimizer), (reference, torch_adamw)):
            for param, grad in zip(params, step_grads):
                param.grad = grad.clone()
            step.step()
    assert kinds(optimizer, [kept, quantized]) == ["32bit", "8bit"]
    assert (kept - reference[0]).abs().max() < 1e-6
    assert (quantized - reference[1]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "optimizer_class, state_format, allowed",
    [
        (hf_paged.PagedAdamW8bit, "4bit", "'fp32', '8bit'"),
        (hf_paged.PagedAdamW4bit, "fp16", "'fp32', '4bit'"),
        (hf_paged.PagedAdamW, "8bit", "'fp32'"),
        (hf_paged.PagedAdEMAMix8bit, 32, "'fp32', '8bit'"),
    ],
)
def test_a_format_the_optimizer_lacks_is_refused(optimizer_class, state_format, allowed):
    message = rf"state_format must be one of {allowed} for {optimizer_class.__name__}, got {state_format!r}"
    params = list(make_mlp().parameters())
    with pytest.raises(ValueError, match=rf"param group 0: {message}"):
        optimizer_class([{"params": params[:2], "state_format": state_format}])
    optimizer = optimizer_class([{"params": params[:2]}])
    with pytest.raises(ValueError, match=rf"param group 1: {message}"):
        optimizer.add_param_group({"params": params[2:], "state_format": state_format})
    assert len(optimizer.param_groups) == 1


def test_keep_fp32_state_splits_each_group_and_keeps_its_settings():
    """Tensors, named parameters and param groups: each group's parameters of the modules go to a group right after
    it, with its settings (names included) and ``"state_format": "fp32"``; a part left empty is dropped; a parameter
    tied to another module's counts as the modules'."""
    model = make_mlp()
    for params, expected_sizes in (
        (model.parameters(), [4, 2]),
        (model.named_parameters(), [4, 2]),
        (decay_groups(model), [2, 1, 2, 1]),
    ):
        groups = keep_fp32_state(params, [model[2]])
        assert [len(group["params"]) for group in groups] == expected_sizes
        kept = [group for group in groups if group.get("state_format") == "fp32"]
        assert {id(member[1] if isinstance(member, tuple) else member) for g in kept for member in g["params"]} == {
            id(model[2].weight),
            id(model[2].bias),
        }
    named = keep_fp32_state([{"params": list(model.named_parameters()), "lr": 0.5}], [model[2]])
    assert [group["lr"] for group in named] == [0.5, 0.5]
    assert [name for name, _ in named[1]["params"]] == ["2.weight", "2.bias"]
    assert keep_fp32_state(model.parameters(), [model]) == [
        {"params": list(model.parameters()), "state_format": "fp32"}
    ]
    embedding = torch.nn.Embedding(8, 4)
    head = torch.nn.Linear(4, 8, bias=False)
    head.weight = embedding.weight
    assert keep_fp32_state(head.parameters(), [embedding])[0]["state_format"] == "fp32"


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_fp32_state_modules_page_and_resume_bitwise(name):
    """``fp32_state_modules``: the modules' state is fp32, the rest as sizes choose; a budget of one page and a resume
    from a state dict after 3 of 6 steps give bitwise the unlimited, uninterrupted run."""
    batches = regression_batches(6)

    def build(budget=None):
        model = make_mlp()
        optimizer = QUANTIZED[name](
            decay_groups(model), fp32_state_modules=[model[2]], device_budget=budget, **small_blocks(name),
            **{f"min_{name[-4:]}_size": 256},
        )  # fmt: skip
        return model, optimizer

    model, optimizer = build()
    train(model, optimizer, batches)
    assert len(optimizer.param_groups) == 2  # the groups as given
    assert kinds(optimizer, [*model[2].parameters(), model[0].weight]) == ["32bit", "32bit", name[-4:]]
    paged_model, paged = build(budget=4096)
    train(paged_model, paged, batches)
    assert paged.paging_stats()["page_outs"] > 0
    assert_same_result(paged_model, paged, model, optimizer)
    interrupted_model, interrupted = build()
    train(interrupted_model, interrupted, batches[:3])
    resumed_model, resumed = build(budget=8192)
    resumed_model.load_state_dict(interrupted_model.state_dict())
    resumed.load_state_dict(interrupted.state_dict())
    train(resumed_model, resumed, batches[3:])
    assert_same_result(resumed_model, resumed, model, optimizer)


def test_the_trainer_keeps_embedding_state_in_fp32_as_for_bitsandbytes(tmp_path):
    """hf_paged_adamw_8bit (and the other 8-bit and 4-bit names) keep the state of the model's nn.Embedding modules in
    fp32, the parameters transformers' Trainer registers with bitsandbytes for 32-bit state when it builds
    adamw_bnb_8bit; ``optim_args="fp32_embeddings=false"`` quantizes them."""
    model = tiny_llama(vocab_size=4096)
    bnb = Trainer(model=model, args=training_args(tmp_path / "bnb", optim="adamw_bnb_8bit"))
    manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
    manager.module_weight_config_triple.clear()
    bnb.create_optimizer()
    expected = {id(getattr(module, name)) for module, name, config in manager.module_weight_config_triple}
    manager.module_weight_config_triple.clear()
    assert expected == {id(model.model.embed_tokens.weight)}
    for optim, optim_args, fp32 in (
        ("hf_paged_adamw_8bit", None, expected),
        ("hf_paged_ademamix_4bit", "min_4bit_size=1024", expected),
        ("hf_paged_adamw_8bit", "fp32_embeddings=false", set()),
    ):
        trainer = Trainer(
            model=model,
            args=training_args(tmp_path / optim, optim=optim, optim_args=optim_args, max_steps=1),
            train_dataset=token_dataset(),
        )
        trainer.train()
        optimizer = trainer.optimizer.optimizer
        groups = optimizer.param_groups
        kept = {id(param) for group in groups for param in group["params"] if optimizer._keeps_fp32(param)}
        assert kept == fp32, optim_args
        assert (optimizer._layout[model.model.embed_tokens.weight].kind == "32bit") == bool(fp32)
        # the Trainer's decay and no-decay groups as it gave them
        assert [group["weight_decay"] for group in groups] == [0.1, 0.0]
        assert all(STATE_FORMAT not in group for group in groups)


def test_state_saved_in_one_format_loads_into_another():
    """8-bit state loads into a group that keeps fp32 state as its decoded values, and back, and the loading
    optimizer's format stays."""
    param = torch.nn.Parameter(torch.randn(64, 64))
    quantized = hf_paged.PagedAdamW8bit([param], **SMALL_BLOCKS)
    param.grad = torch.randn_like(param)
    quantized.step()
    kept = hf_paged.PagedAdamW8bit([{"params": [param], "state_format": "fp32"}], **SMALL_BLOCKS)
    kept.load_state_dict(quantized.state_dict())
    assert kept.param_groups[0]["state_format"] == "fp32" and kinds(kept, [param]) == ["32bit"]
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(kept.get_state_tensor(param, name), quantized.get_state_tensor(param, name))
    back = hf_paged.PagedAdamW8bit([param], **SMALL_BLOCKS)
    back.load_state_dict(kept.state_dict())
    assert "state_format" not in back.param_groups[0] and kinds(back, [param]) == ["8bit"]
    assert all(
        torch.equal(a, b)
        for a, b in zip(back.state_dict()["state"][0].values(), quantized.state_dict()["state"][0].values())
    )


@pytest.mark.parametrize(
    ("params", "modules", "error", "message"),
    [
        ("set", "embedding", TypeError, "a set has no fixed order"),
        ("group of a set", "embedding", TypeError, r"param group 0: params must be an ordered collection"),
        ("tensor", "embedding", TypeError, "params must be an ordered iterable"),
        (
            "group and tensor",
            "embedding",
            TypeError,
            r"params mixes param groups \(entry 0\) and parameters \(entry 1\)",
        ),
        ("group without params", "embedding", ValueError, "param group 0 has no 'params'"),
        ("list", None, TypeError, "fp32_state_modules must be an iterable of torch.nn.Module .*, got NoneType"),
        ("list", "parameter", TypeError, "fp32_state_modules must be an iterable of torch.nn.Module .*, got Parameter"),
    ],
)
def test_keep_fp32_state_refuses_what_an_optimizer_refuses(params, modules, error, message):
    """Sets of parameters have no fixed order (torch.optim refuses them: a resumed state could follow another
    tensor of the same shape); the splitting refused them too late, after making lists of them."""
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8))
    weights = list(model.parameters())
    given = {
        "set": set(weights),
        "group of a set": [{"params": set(weights)}],
        "tensor": weights[0],
        "group and tensor": [{"params": weights[:1]}, weights[1]],
        "group without params": [{"lr": 1e-3}],
        "list": weights,
    }[params]
    chosen = {"embedding": [model[0]], "parameter": [weights[0]], None: None}[modules]
    with pytest.raises(error, match=message):
        hf_paged.PagedAdamW8bit(given, fp32_state_modules=chosen)
    if modules is not None:
        with pytest.raises(error, match=message.replace("fp32_state_modules", "modules")):
            keep_fp32_state(given, chosen)


@pytest.mark.parametrize("how", ["appended", "added"])
def test_a_tensor_moved_into_an_fp32_group_takes_its_format(how):
    """A tensor moved with its 8-bit state into a group that keeps fp32 state gets fp32 state at its next step, its
    values decoded as a state dict loaded into the new grouping decodes them; it kept its 8-bit pages before, so that a
    resumed run (laid out by its groups) stepped otherwise than the uninterrupted one."""
    generator = torch.Generator().manual_seed(0)
    moving, staying = (torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((64, 64), (40, 40)))
    gradients = [[torch.randn(p.shape, generator=generator) for p in (moving, staying)] for _ in range(6)]

    def run(optimizer, params, steps):
        for step_gradients in steps:
            for param, gradient in zip(params, step_gradients):
                param.grad = gradient.clone()
            optimizer.step()

    optimizer = hf_paged.PagedAdamW8bit(
        [{"params": [moving]}, {"params": [staying], "state_format": "fp32"}], lr=1e-2, min_8bit_size=100
    )
    run(optimizer, (moving, staying), gradients[:2])
    before = {name: optimizer.get_state_tensor(moving, name) for name in optimizer.state_names}
    saved_before = optimizer.state_dict()
    if how == "appended":
        optimizer.param_groups[1]["params"].append(optimizer.param_groups[0]["params"].pop(0))
    else:
        optimizer.param_groups[0]["params"].clear()
        optimizer.add_param_group({"params": [moving], "state_format": "fp32"})
    copies = [torch.nn.Parameter(param.detach().clone()) for param in (moving, staying)]
    regrouped = hf_paged.PagedAdamW8bit(
        [{"params": []}, {"params": [copies[0], copies[1]], "state_format": "fp32"}], lr=1e-2, min_8bit_size=100
    )
    regrouped.load_state_dict({**saved_before, "param_groups": regrouped.state_dict()["param_groups"]})
    run(optimizer, (moving, staying), gradients[2:4])
    run(regrouped, copies, gradients[2:4])
    assert optimizer._layout[moving].kind == "32bit"
    saved = optimizer.state_dict()
    assert "exp_avg" in saved["state"][1] and not any(
        "codes" in key for entry in saved["state"].values() for key in entry
    )
    assert all(torch.equal(mine, theirs) for mine, theirs in zip((moving, staying), copies))
    resumed_params = [torch.nn.Parameter(param.detach().clone()) for param in (moving, staying)]
    groups = [{"params": []}, {"params": [resumed_params[1], resumed_params[0]], "state_format": "fp32"}]
    if how == "added":
        groups = [{"params": []}, {"params": [resumed_params[1]], "state_format": "fp32"}]
        groups.append({"params": [resumed_params[0]], "state_format": "fp32"})
    resumed = hf_paged.PagedAdamW8bit(groups, lr=1e-2, min_8bit_size=100)
    resumed.load_state_dict(saved)
    run(optimizer, (moving, staying), gradients[4:])
    run(resumed, resumed_params, gradients[4:])
    assert all(torch.equal(mine, theirs) for mine, theirs in zip((moving, staying), resumed_params))
    assert before["exp_avg"].abs().sum() > 0


@pytest.mark.parametrize(
    ("saved_with", "resumed_with"),
    [
        (("adamw_torch", None), ("hf_paged_adamw_8bit", None)),
        (("adamw_torch", None), ("hf_paged_adamw_4bit", "min_4bit_size=1024")),
        (("hf_paged_adamw_8bit", "fp32_embeddings=false"), ("hf_paged_adamw_8bit", None)),
        (("hf_paged_adamw_8bit", None), ("hf_paged_adamw_8bit", "fp32_embeddings=false")),
    ],
    ids=["adamw_torch to 8bit", "adamw_torch to 4bit", "quantized embedding to fp32", "fp32 embedding to quantized"],
)
def test_trainer_checkpoints_resume_across_the_embeddings_fp32_state(tmp_path, saved_with, resumed_with):
    """A Trainer checkpoint resumes under another optimizer name whether or not either keeps the embeddings' state in
    fp32: the param groups are the Trainer's two (decay, no-decay) whatever the state format, so that the state dict,
    and the LR scheduler's state, fit. The embedding split off into a third group refused it: "state_dict has 2 param
    groups, this optimizer has 3". The embedding's state is converted as a state dict loaded into another format is:
    fp32 values kept bitwise, 8-bit codes decoded."""
    optim, optim_args = saved_with
    saving = Trainer(
        model=tiny_llama(vocab_size=4096),
        args=training_args(
            tmp_path / "saved", optim=optim, optim_args=optim_args, max_steps=2, save_strategy="steps", save_steps=2
        ),
        train_dataset=token_dataset(8),
    )
    saving.train()
    checkpoint = tmp_path / "saved" / "checkpoint-2"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert len(saved["param_groups"]) == 2
    optim, optim_args = resumed_with
    resuming = Trainer(
        model=tiny_llama(vocab_size=4096),
        args=training_args(tmp_path / "resumed", optim=optim, optim_args=optim_args, max_steps=4),
        train_dataset=token_dataset(8),
    )
    resuming.create_optimizer_and_scheduler(num_training_steps=4)
    resuming._load_optimizer_and_scheduler(str(checkpoint))
    optimizer = resuming.optimizer.optimizer if hasattr(resuming.optimizer, "optimizer") else resuming.optimizer
    embedding = resuming.model.model.embed_tokens.weight
    position = [id(param) for param in optimizer.param_groups[0]["params"]].index(id(embedding))
    kept = optim_args != "fp32_embeddings=false"
    assert optimizer._layout[embedding].kind == ("32bit" if kept else optim[-4:])
    decoded = hf_paged.PagedAdamW8bit([torch.nn.Parameter(torch.zeros(embedding.shape))])
    decoded.load_state_dict(
        {"state": {0: saved["state"][position]}, "param_groups": [{**saved["param_groups"][0], "params": [0]}]}
    )
    for name in ("exp_avg", "exp_avg_sq"):
        values = optimizer.get_state_tensor(embedding, name)
        expected = saved["state"][position].get(name)
        if expected is None:  # 8-bit codes: their decoded values
            expected = decoded.get_state_tensor(decoded.param_groups[0]["params"][0], name)
        if kept:
            assert torch.equal(values, expected), name
        else:
            torch.testing.assert_close(values, expected, rtol=0, atol=0.02 * expected.abs().max().item())
    resuming.train(resume_from_checkpoint=str(checkpoint))
    assert resuming.state.global_step == 4
    last_lr = resuming.lr_scheduler.get_last_lr()
    assert [group["lr"] for group in optimizer.param_groups] == last_lr and len(last_lr) == 2


def test_fp32_state_modules_survive_copies_and_follow_a_tensor_swapped_in():
    """The fp32 choice of ``fp32_state_modules`` is held per tensor: a deepcopy and a pickled copy keep it for their
    own tensors, and a tensor swapped in at such a parameter's position before the first step (accelerate's FSDP2
    shards) takes it; the param groups stay as given."""
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    optimizer = hf_paged.PagedAdamW8bit(
        decay_groups(model), fp32_state_modules=[model[0]], min_8bit_size=0, **SMALL_BLOCKS
    )
    assert [len(group["params"]) for group in optimizer.param_groups] == [2, 1]
    swapped = [torch.nn.Parameter(param.detach().clone()) for param in optimizer.param_groups[0]["params"]]
    optimizer.param_groups[0]["params"] = list(swapped)
    for copied in (copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer)), optimizer):
        params = [param for group in copied.param_groups for param in group["params"]]
        for param in params:
            param.grad = torch.ones_like(param)
        copied.step()
        assert kinds(copied, params) == ["32bit", "8bit", "8bit"]
        assert all(STATE_FORMAT not in group for group in copied.state_dict()["param_groups"])


def test_tensors_listed_in_another_order_keep_their_formats_and_a_copy_changes_nothing():
    """Tensors of a group put in another order after a step were not swapped: each keeps its own format, in the
    optimizer and in a copy taken then, and taking the copy changes nothing in the optimizer copied."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    optimizer = hf_paged.PagedAdamW8bit(model.parameters(), fp32_state_modules=[model[0]], min_8bit_size=0)
    params = list(model.parameters())
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert kinds(optimizer, params) == ["32bit", "32bit", "8bit", "8bit"]
    listed = optimizer.param_groups[0]["params"]
    listed[0], listed[2] = listed[2], listed[0]
    for copied in (copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer)), optimizer):
        copied_params = [param for group in copied.param_groups for param in group["params"]]
        copied.step()
        assert kinds(copied, copied_params) == ["8bit", "32bit", "32bit", "8bit"]
