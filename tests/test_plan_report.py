"""The figures of ``hf-paged plan``'s report: the same optimizer state has the same figure everywhere, and each
figure counts what its line says."""

from __future__ import annotations

import pytest
import torch

from hf_paged.cli.config import load_config
from hf_paged.cli.plan import (
    COMPARED_OPTIMIZERS,
    _comparison_optim_args,
    _state_bytes,
    build_model,
    build_optimizer,
    format_report,
    make_batch,
    plan_setup,
    report,
    setup_from_config,
)
from hf_paged.planner import CUDA_ALLOCATION_ROUNDING, OPTIMIZER_STEP, plan
from hf_paged.sizes import format_size

from plan_utils import held_state_bytes

GIB = 2**30


def test_the_default_plan_gives_one_figure_for_all_the_optimizer_state() -> None:
    """The default config (QLoRA, hf_paged_adamw_8bit with device_budget=32KiB) planned for a 24 GiB GPU: the chosen
    optimizer's row of the comparison, the note under the table and a plan without the budget agree; the budget
    line counts pages, as device_budget does."""
    setup = setup_from_config(load_config(None, []))
    outcome = report(setup, "cuda", 24 * GIB)
    text = format_report(outcome)
    everything = outcome.plan.optimizer_state_bytes
    assert outcome.optimizer_states[setup.optimizer_name] == everything
    without_budget = _comparison_optim_args(setup, setup.optimizer_name)
    assert "device_budget" in setup.config.training["optim_args"] and "device_budget" not in without_budget
    unbudgeted = setup.with_changes(training={"optim_args": without_budget})
    assert plan_setup(unbudgeted, "cuda").peak(OPTIMIZER_STEP).by_kind["optimizer_state"] == everything
    on_device = outcome.plan.peak(OPTIMIZER_STEP).by_kind["optimizer_state"]
    assert on_device < everything
    chosen_row = next(line for line in text.splitlines() if line.endswith("<- chosen"))
    assert format_size(everything) in chosen_row
    assert f"all of it: {format_size(everything)})" in text
    assert f"all pages fit: {format_size(outcome.plan.paged_state_bytes)}" in text
    assert outcome.plan.paged_state_bytes == sum(page.nbytes for page in _real_pages(setup))


def test_on_the_cpu_the_pages_kept_on_the_device_are_copies_beside_all_the_state() -> None:
    """Planned for the CPU, host memory is the device: it holds all the state and the copies of the pages that
    device_budget keeps resident, which the note says, and the step plan's segment tables (one row of six int64 per
    segment, kept while the plan holds)."""
    setup = setup_from_config(load_config(None, []))
    outcome = report(setup, "cpu")
    everything = outcome.plan.optimizer_state_bytes
    assert outcome.optimizer_states[setup.optimizer_name] == everything
    on_device = outcome.plan.peak(OPTIMIZER_STEP).by_kind["optimizer_state"]
    tables = 6 * 8 * sum(len(page.segments) for page in _real_pages(setup))
    assert everything < on_device <= everything + 32 * 2**10 + tables  # the default config's device_budget=32KiB
    assert f"the host here: all of it, {format_size(everything)}, and copies" in format_report(outcome)


def _real_pages(setup):
    model = build_model(setup)
    optimizer = build_optimizer(setup, model)
    _train_one_step(setup, model, optimizer)
    return optimizer._store.pages


def _train_one_step(setup, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    from hf_paged.cli.plan import architecture

    torch.manual_seed(0)
    model(**make_batch(setup, architecture(setup.config).vocab_size)).loss.backward()
    optimizer.step()


def test_the_comparison_counts_the_state_real_optimizers_keep() -> None:
    """Each row of the comparison (on the CPU: no allocator rounding) is the state the real optimizer keeps after a
    step of the same model, built with the chosen optim_args it takes and no budget."""
    optim_args = "training.optim_args=page_size=16KiB,min_8bit_size=1024,device_budget=32KiB"
    setup = setup_from_config(load_config(None, [optim_args]))
    outcome = report(setup, "cpu")
    model = build_model(setup)
    for name in COMPARED_OPTIMIZERS:
        if name == "adamw_bnb_8bit":
            continue  # its 8-bit kernels need CUDA
        other = setup.with_changes(training={"optim": name, "optim_args": _comparison_optim_args(setup, name)})
        optimizer = build_optimizer(other, model)
        _train_one_step(other, model, optimizer)
        assert outcome.optimizer_states[name] == held_state_bytes(optimizer), name
        model.zero_grad(set_to_none=True)


class _Summed(torch.nn.Module):
    """Parameters of given shapes whose output, their sum, gives each a gradient (what the comparison once traced)."""

    def __init__(self, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter(torch.empty(shape, dtype=dtype)) for shape, dtype in shapes
        )

    def forward(self) -> torch.Tensor:
        return torch.stack([param.sum() for param in self.params]).sum()


ADAPTERS = [((8, 128), torch.float32), ((344, 8), torch.float32), ((64, 96), torch.float32), ((50,), torch.float32)]
"""LoRA-like fp32 adapters, one 2-D tensor that takes rank-1 state at 16-element blocks and one below every minimum."""

FULL = [((260, 128), torch.bfloat16), ((128,), torch.bfloat16), ((344, 128), torch.bfloat16), ((5000,), torch.float32)]
"""A full fine-tune's bf16 weights (an embedding-sized matrix, a norm, a projection) and an fp32 tensor."""


@pytest.mark.parametrize(
    ("shapes", "optim", "optim_args", "device"),
    [
        (ADAPTERS, "hf_paged_adamw_8bit", "page_size=16KiB,min_8bit_size=1024,block_size=64", "cuda"),
        (ADAPTERS, "hf_paged_adamw_4bit", "page_size=4KiB,block_size=16,min_4bit_size=100,normalization=rank1", "cpu"),
        (FULL, "adamw_torch", None, "cuda"),
        (FULL, "hf_paged_lion_8bit", "page_size=8KiB,min_8bit_size=4096,fp32_embeddings=false", "cpu"),
    ],
)
def test_the_comparison_gives_the_state_a_traced_step_leaves(shapes, optim, optim_args, device) -> None:
    """Each row of the comparison, computed without a step, is the optimizer state bytes of a plan of one step of
    the same parameters (what the comparison traced before), for any page size, block size, size minimum, rank-1
    state and allocator rounding."""
    overrides = [f"training.optim={optim}", f"training.optim_args={'null' if optim_args is None else optim_args}"]
    setup = setup_from_config(load_config(None, overrides))
    rounding = CUDA_ALLOCATION_ROUNDING if device == "cuda" else 1
    for name in COMPARED_OPTIMIZERS:
        if name == "adamw_bnb_8bit":
            continue  # its state is computed from bitsandbytes' layout: its optimizer cannot be traced
        other = setup.with_changes(training={"optim": name, "optim_args": _comparison_optim_args(setup, name)})
        traced = plan(
            lambda: _Summed(shapes),
            lambda: None,
            lambda model, other=other: build_optimizer(other, model, device),
            loss=lambda model, _: model(),
            steps=1,
            device=device,
            step_temporaries=False,
        )
        assert _state_bytes(other, shapes, device, rounding) == traced.optimizer_state_bytes, name


@pytest.mark.parametrize("optim", ["adamw_torch", "hf_paged_adamw_8bit"])
def test_the_planned_optimizer_has_the_trainers_param_groups(optim: str, tmp_path) -> None:
    """The plan's optimizer holds the trainable parameters in the param groups ``Trainer.create_optimizer`` makes
    (weight decay, then biases and norms without it): DeepSpeed's ZeRO-2 partitions each group on its own and frees
    its 16-bit gradients after the last group's, so a plan of one group misplaces the step's peak."""
    from transformers import Trainer

    from hf_paged.cli.train import training_arguments

    setup = setup_from_config(load_config(None, ["training.weight_decay=0.1", f"training.optim={optim}"]), "full")
    model = build_model(setup)
    names = {id(param): name for name, param in model.named_parameters()}
    args = training_arguments(setup.with_changes(training={"output_dir": str(tmp_path)}).config)
    expected = Trainer(model=model, args=args).create_optimizer().param_groups
    planned = build_optimizer(setup, model, training_args=args).param_groups
    assert [(g["weight_decay"], [names[id(p)] for p in g["params"]]) for g in planned] == [
        (g["weight_decay"], [names[id(p)] for p in g["params"]]) for g in expected
    ]


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "fsdp2"])
def test_under_sharding_every_row_of_the_comparison_is_one_rank_s_state(strategy: str) -> None:
    """A full fine-tune with fp32 AdamW on 2 GPUs: hf-paged's 32-bit AdamW keeps the state torch's does (the chosen
    row, the plan's own), one rank's half of it. Under ZeRO the other rows counted the whole model's (2x)."""
    overrides = ["model.tiny.num_hidden_layers=1", "training.optim=adamw_torch", "training.optim_args=null"]
    setup = setup_from_config(load_config(None, overrides), "full").with_changes(world_size=2, strategy=strategy)
    outcome = report(setup, "cpu")
    states = outcome.optimizer_states
    assert states["adamw_torch"] == outcome.plan.optimizer_state_bytes
    assert states["hf_paged_adamw_32bit"] == pytest.approx(states["adamw_torch"], rel=1e-3)
    assert states["adamw_torch"] < 0.6 * 8 * outcome.plan.trainable_params
