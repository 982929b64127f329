"""The figures of ``hf-paged plan``'s report: the same optimizer state has the same figure everywhere, and each
figure counts what its line says."""

from __future__ import annotations

import torch

from hf_paged.cli.config import load_config
from hf_paged.cli.plan import (
    COMPARED_OPTIMIZERS,
    _comparison_optim_args,
    build_model,
    build_optimizer,
    format_report,
    make_batch,
    plan_setup,
    report,
    setup_from_config,
)
from hf_paged.planner import OPTIMIZER_STEP
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
