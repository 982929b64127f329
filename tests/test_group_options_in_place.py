"""Param group options set in place between steps (``optimizer.param_groups[0]["lr"] = ...``), as torch.optim reads
them: each step checks those that changed as the constructor and ``add_param_group`` check them, with the same
errors, and a group's tensors take its new state format at the next step whether or not the step plan is rebuilt.
A review found them unchecked (``maximize=True`` ignored where torch.optim.AdamW maximizes, ``betas=(0.9, 1.5)`` a
``math domain error``) and a new ``state_format`` followed only when the plan happened to be rebuilt."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_paged


def _params(*shapes: tuple[int, ...]) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def _grads(params: list[torch.nn.Parameter], steps: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [[torch.randn(param.shape, generator=generator) for param in params] for _ in range(steps)]


@pytest.mark.parametrize(
    ("build", "key", "value"),
    [
        (hf_paged.PagedAdamW, "maximize", True),
        (hf_paged.PagedAdamW8bit, "maximize", True),
        (hf_paged.PagedLion8bit, "maximize", True),
        (hf_paged.PagedAdamW8bit, "amsgrad", True),
        (hf_paged.PagedAdamW8bit, "state_format", "16bit"),
        (hf_paged.PagedAdamW8bit, "block_size", 128),
        (hf_paged.PagedAdamW8bit, "min_8bit_size", -1),
        (hf_paged.PagedAdamW8bit, "betas", (0.9, 1.5)),
        (hf_paged.PagedAdamW8bit, "eps", -1.0),
        (hf_paged.PagedAdamW8bit, "lr", -1.0),
        (hf_paged.PagedLion8bit, "weight_decay", -1.0),
        (hf_paged.PagedAdamW, "capturable", True),
        (hf_paged.PagedAdamW8bit, "differentiable", True),
        (hf_paged.PagedLion8bit, "capturable", True),
    ],
)
def test_an_option_set_in_place_is_refused_at_the_step_as_at_construction(build, key, value) -> None:
    """The step raises the constructor's ValueError before it changes anything; set back, the option steps again."""
    (param,) = _params((600,))
    kwargs = {"min_8bit_size": 0, "block_size": 64} if build is not hf_paged.PagedAdamW else {}
    with pytest.raises(ValueError) as constructed:
        build([{"params": [param], key: value}], **kwargs)
    optimizer = build([param], **kwargs)
    grads = _grads([param], 2)
    param.grad = grads[0][0]
    optimizer.step()
    before, state = param.detach().clone(), copy.deepcopy(optimizer.state_dict())
    checked = optimizer.param_groups[0].get(key)
    optimizer.param_groups[0][key] = value
    param.grad = grads[1][0]
    with pytest.raises(ValueError) as stepped:
        optimizer.step()
    assert str(stepped.value) == str(constructed.value)
    assert str(stepped.value).startswith("param group 0: ")
    assert torch.equal(param, before)
    for name, saved in optimizer.state_dict()["state"][0].items():
        assert torch.equal(saved, state["state"][0][name]), name
    if checked is None:
        del optimizer.param_groups[0][key]
    else:
        optimizer.param_groups[0][key] = checked
    optimizer.step()
    assert not torch.equal(param, before)


@pytest.mark.parametrize("rebuilt", [False, True], ids=["plan kept", "plan rebuilt"])
def test_a_state_format_set_in_place_is_taken_at_the_next_step(rebuilt: bool) -> None:
    """``state_format="fp32"`` set in place after two 8-bit steps: the group's tensor has fp32 state from the third
    step on, whether the step plan is kept or rebuilt (another tensor without a gradient at the fourth step), with
    the same values."""

    def run(skip_at: int | None) -> tuple[list[str], torch.Tensor]:
        first, second = _params((64, 64), (40, 40))
        optimizer = hf_paged.PagedAdamW8bit([{"params": [first]}, {"params": [second]}], lr=1e-2, min_8bit_size=100)
        formats = []
        for step, (grad, other) in enumerate(_grads([first, second], 5)):
            if step == 2:
                optimizer.param_groups[0]["state_format"] = "fp32"
            first.grad, second.grad = grad, None if step == skip_at else other
            optimizer.step()
            formats.append(optimizer._layout[first].kind)
        return formats, first.detach()

    expected_formats, expected = run(None)
    assert expected_formats == ["8bit", "8bit", "32bit", "32bit", "32bit"]
    formats, actual = run(3 if rebuilt else None)
    assert formats == expected_formats
    assert torch.equal(actual, expected)


def test_a_step_checks_only_the_options_that_changed_and_keeps_its_plan(monkeypatch) -> None:
    """Steps where no option changed since the groups were added check none and keep the plan; a new learning rate
    (as a scheduler sets it) is checked once and keeps the plan; a new state format is checked and rebuilds it."""
    first, second = _params((64, 64), (40, 40))
    optimizer = hf_paged.PagedAdamW8bit([{"params": [first]}, {"params": [second]}], lr=1e-2, min_8bit_size=100)
    checked = []
    check_group = optimizer.check_group
    monkeypatch.setattr(optimizer, "check_group", lambda group: checked.append(group["lr"]) or check_group(group))
    grads = _grads([first, second], 5)

    def step(index: int) -> None:
        first.grad, second.grad = grads[index]
        optimizer.step()

    step(0)
    plan = optimizer._plan
    step(1)
    assert checked == [] and optimizer._plan is plan
    optimizer.param_groups[1]["lr"] = 5e-3
    step(2)
    assert checked == [5e-3] and optimizer._plan is plan
    optimizer.param_groups[1]["state_format"] = "fp32"
    step(3)
    assert checked == [5e-3, 5e-3] and optimizer._plan is not plan
    assert optimizer._layout[second].kind == "32bit"
