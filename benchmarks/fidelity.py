"""How close 4-bit AdamW trains to fp32 AdamW: hf-paged's PagedAdamW4bit against torchao's AdamW4bit.

The task of ``tests/test_4bit.py``: an MLP 128-512-512-16 fitted to a fixed random linear teacher, ``--steps``
steps of 256 samples at lr 1e-3, one thread. Prints a markdown table: per optimizer the final loss (mean of the
last 20 steps), its gap to fp32 AdamW's in percent, and the relative distance of the weights from fp32 AdamW's
(``|w - w_fp32| / |w_fp32|`` over all parameters flattened). torchao's optimizer runs its update eagerly (its
``torch.compile`` would only change the speed).

    PYTHONPATH=. python benchmarks/fidelity.py [--steps 200]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable
from unittest import mock

import torch

import hf_paged

Optimizer = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def student() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 16)
    )


def teacher_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A regression task: targets from a fixed random linear teacher."""
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(128, 16, generator=generator) / math.sqrt(128)
    return [(inputs, inputs @ teacher) for inputs in (torch.randn(256, 128, generator=generator) for _ in range(steps))]


def fit(make_optimizer: Optimizer, steps: int) -> tuple[torch.nn.Module, float, float]:
    """Train the student; return it with its first and final (mean of the last 20 steps) loss."""
    model = student()
    optimizer = make_optimizer(model.parameters())
    losses = []
    for inputs, targets in teacher_batches(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    last = losses[-20:]
    return model, losses[0], sum(last) / len(last)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([param.detach().reshape(-1) for param in model.parameters()])


def optimizers() -> dict[str, Optimizer]:
    """The 4-bit optimizers compared, by the name the table gives them."""
    found: dict[str, Optimizer] = {
        "hf-paged PagedAdamW4bit": lambda params: hf_paged.PagedAdamW4bit(
            params, lr=1e-3, device_budget="256KiB", page_size="64KiB"
        ),
    }
    try:
        from torchao.optim import AdamW4bit
    except ImportError:
        return found
    found["torchao AdamW4bit"] = lambda params: AdamW4bit(params, lr=1e-3)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (at least 20)")
    args = parser.parse_args()
    if args.steps < 20:
        parser.error(f"--steps must be at least 20, got {args.steps}")
    torch.set_num_threads(1)
    reference, first, reference_loss = fit(lambda params: torch.optim.AdamW(params, lr=1e-3), args.steps)
    print(f"fp32 AdamW: loss {first:.4g} -> {reference_loss:.4g} over {args.steps} steps\n")
    print("| optimizer | final loss | loss gap to fp32 AdamW | weight distance from fp32 AdamW |")
    print("| --- | --- | --- | --- |")
    with mock.patch.object(torch, "compile", lambda function, **options: function):
        for name, make_optimizer in optimizers().items():
            model, _, loss = fit(make_optimizer, args.steps)
            gap = 100 * abs(loss - reference_loss) / reference_loss
            distance = ((flat(model) - flat(reference)).norm() / flat(reference).norm()).item()
            print(f"| {name} | {loss:.4g} | {gap:.1f}% | {distance:.3f} |")


if __name__ == "__main__":
    main()
