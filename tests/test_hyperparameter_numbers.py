"""Hyperparameters given as NumPy numbers or one-element tensors, as ``torch.optim.AdamW`` takes them: a learning-rate
scheduler computed in NumPy writes an ``np.float32`` lr into the param groups, and the run must go on through its
checkpoints (``load_state_dict``), ``copy.deepcopy`` and ``pickle``, which check every group again."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

import hf_paged

SHAPES = [(64, 64), (300,)]
OPTIMIZERS = {
    "PagedAdamW": {"lr": np.float32(1e-3), "betas": (np.float32(0.9), torch.tensor(0.999)), "eps": np.float64(1e-8)},
    "PagedAdamW8bit": {
        "lr": np.float32(1e-3),
        "betas": (torch.tensor(0.9), np.float32(0.999)),
        "weight_decay": np.float32(0.1),
    },
    "PagedAdamW4bit": {"lr": torch.tensor(1e-3), "betas": (np.float32(0.9), 0.999), "eps": np.float32(1e-8)},
    "PagedLion8bit": {
        "lr": np.float32(1e-4),
        "betas": (np.float32(0.9), np.float32(0.99)),
        "weight_decay": np.float16(0.01),
    },
    "PagedAdEMAMix8bit": {
        "lr": np.float32(1e-3),
        "betas": (np.float32(0.9), 0.999, torch.tensor(0.9999)),
        "alpha": np.float32(5.0),
        "t_alpha": 3,
    },
}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _train(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


def _as_floats(options: dict) -> dict:
    return {
        key: tuple(float(beta) for beta in value) if key == "betas" else value if key == "t_alpha" else float(value)
        for key, value in options.items()
    }


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_numpy_and_tensor_numbers_step_as_their_floats(name: str) -> None:
    build = getattr(hf_paged, name)
    numbers, floats = _params(), _params()
    given = (
        build(numbers, min_8bit_size=0, **OPTIMIZERS[name]) if "8bit" in name else build(numbers, **OPTIMIZERS[name])
    )
    as_floats = _as_floats(OPTIMIZERS[name])
    reference = build(floats, min_8bit_size=0, **as_floats) if "8bit" in name else build(floats, **as_floats)
    _train(given, numbers, 3)
    _train(reference, floats, 3)
    for param, expected in zip(numbers, floats):
        assert torch.equal(param, expected)


@pytest.mark.parametrize("name", ["PagedAdamW", "PagedAdamW8bit", "PagedAdamW4bit", "PagedAdEMAMix8bit"])
def test_a_numpy_schedule_leaves_checkpoints_copies_and_pickles_that_resume_bitwise(name: str) -> None:
    build = getattr(hf_paged, name)
    params = _params()
    optimizer = build(params, lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: np.float32(0.5) ** step)
    for _ in range(3):
        _train(optimizer, params, 1)
        schedule.step()
    assert isinstance(optimizer.param_groups[0]["lr"], np.floating)
    saved = copy.deepcopy(optimizer.state_dict())
    loaded_params = [torch.nn.Parameter(param.detach().clone()) for param in params]
    loaded = build(loaded_params, lr=1e-3)
    loaded.load_state_dict(saved)
    copied = copy.deepcopy(optimizer)
    pickled = pickle.loads(pickle.dumps(optimizer))
    _train(optimizer, params, 2, seed=5)
    _train(loaded, loaded_params, 2, seed=5)
    for param, expected in zip(loaded_params, params):
        assert torch.equal(param, expected)
    for other in (copied, pickled):
        assert other.param_groups[0]["lr"] == saved["param_groups"][0]["lr"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr": np.float32(-1e-3)}, "lr must be a finite number >= 0"),
        ({"lr": torch.tensor([1e-3, 1e-3])}, "Tensor lr must be 1-element"),
        ({"lr": torch.tensor(1e-3, dtype=torch.complex64)}, "lr must be a finite number >= 0"),
        ({"betas": (torch.tensor([0.9, 0.9]), 0.999)}, r"betas\[0\] must be in \[0, 1\)"),
        ({"betas": (0.9, np.float32(1.0))}, r"betas\[1\] must be in \[0, 1\)"),
        ({"betas": (True, 0.999)}, r"betas\[0\] must be in \[0, 1\)"),
        ({"eps": np.float32(-1.0)}, "eps must be a number >= 0"),
        ({"weight_decay": np.float64("nan")}, "weight_decay must be a finite number >= 0"),
        ({"weight_decay": "0.01"}, "weight_decay must be a finite number >= 0"),
    ],
)
def test_bad_numbers_are_still_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hf_paged.PagedAdamW8bit(_params(), **options)
