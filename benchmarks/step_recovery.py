"""What an atomic optimizer step costs, and what recovering from an out-of-memory error inside it costs.

    python benchmarks/step_recovery.py [--params 4M] [--steps 7] [--page-size 1MiB]
        [--budget-fraction 0.25]

For each hf-paged optimizer (fp32 parameters, 1024x1024 matrices and their biases, default settings, a budget of a
fraction of the state so that pages stream), the table gives the median step time:

* as shipped: each chunk's update runs after a copy of what it writes (undone if the update fails);
* without those copies (``executor.update_whole`` replaced by a plain kernel call: what a step cost before issue 19);
* with one out-of-memory error injected at the middle page allocation of the step, recovered (state to the host,
  cached memory freed after a garbage collection, the pages left under a smaller budget).

Steps are timed in this process's CPU time (``time.process_time``), which other processes' load does not inflate.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import torch
from optimizer_step import parse_count

import hf_paged
from hf_paged.optim import executor

OPTIMIZERS = {
    "PagedAdamW": hf_paged.PagedAdamW,
    "PagedAdamW8bit": hf_paged.PagedAdamW8bit,
    "PagedAdamW4bit": hf_paged.PagedAdamW4bit,
    "PagedLion": hf_paged.PagedLion,
    "PagedLion8bit": hf_paged.PagedLion8bit,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=parse_count, default="4M", help="parameter elements, e.g. 4M or 16M")
    parser.add_argument("--steps", type=int, default=7, help="measured steps of each variant (after 2 warm-up)")
    parser.add_argument("--page-size", default="1MiB", help="page size of every optimizer")
    parser.add_argument("--budget-fraction", type=float, default=0.25, help="device budget as a fraction of the state")
    return parser.parse_args()


def make_params(elements: int) -> list[torch.nn.Parameter]:
    """Square matrices and their bias vectors, about ``elements`` elements in all."""
    width = 1024
    layers = max(1, elements // (width * width))
    torch.manual_seed(0)
    params = []
    for _ in range(layers):
        params += [torch.nn.Parameter(torch.randn(width, width) * 0.02), torch.nn.Parameter(torch.zeros(width))]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    return params


def timed(step: Callable[[], None], steps: int) -> float:
    """Median CPU seconds of ``step`` over ``steps`` calls, after two warm-up calls."""
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return statistics.median(times)


def fail_middle_page_allocation(optimizer) -> Callable[[], None]:
    """A step whose middle device allocation of a page raises ``torch.OutOfMemoryError`` once (the step recovers); a
    streamed step allocates a few page blocks and reuses them for the pages after. A first step counts them."""
    (store,) = optimizer._store.stores.values()
    allocate = store.backend.empty_device
    calls, failing_call = [0], [0]

    def counted(specs):
        calls[0] += 1
        if calls[0] == failing_call[0]:
            raise torch.OutOfMemoryError("injected by benchmarks/step_recovery.py")
        return allocate(specs)

    def step() -> None:
        calls[0] = 0
        store.backend.empty_device = counted
        try:
            optimizer.step()
        finally:
            store.backend.empty_device = allocate

    step()
    failing_call[0] = max(1, (calls[0] + 1) // 2)
    return step


def plain_update(kernel, param, grad, encoded, scalars, rounding=None) -> None:
    kernel(param, grad, encoded, scalars, *(() if rounding is None else (rounding,)))


def main() -> None:
    args = parse_args()
    logging.getLogger("hf_paged").setLevel(logging.ERROR)  # one warning per recovered step
    params = make_params(args.params)
    numel = sum(param.numel() for param in params)
    print(
        f"{numel / 1e6:.2f}M fp32 parameters, {args.steps} measured steps, budget {args.budget_fraction:.0%} of the state"
    )
    print()
    print(
        "| optimizer | compiled | step (ms) | without the undo copies (ms) | copies cost "
        "| step with one OOM recovered (ms) | recoveries |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    atomic_update = executor.update_whole
    for name, cls in OPTIMIZERS.items():
        optimizer = cls(params, lr=1e-4, page_size=args.page_size)
        optimizer.step()
        state_bytes = optimizer.paging_stats()["device_bytes"]
        budget = max(optimizer.page_size, int(state_bytes * args.budget_fraction))
        optimizer.set_device_budget(budget)
        with_copies = timed(optimizer.step, args.steps)
        executor.update_whole = plain_update
        try:
            without = timed(optimizer.step, args.steps)
        finally:
            executor.update_whole = atomic_update
        recoveries = []
        optimizer.on_oom_recovery = recoveries.append
        recovered = timed(fail_middle_page_allocation(optimizer), args.steps)
        print(
            f"| {name} | {optimizer.compiled} | {with_copies * 1e3:.1f} | {without * 1e3:.1f} "
            f"| {with_copies / without - 1:+.0%} | {recovered * 1e3:.1f} | {len(recoveries)} of {args.steps + 2} |"
        )
    print()
    print(f"(state under a budget of {args.budget_fraction:.0%}; pages of {args.page_size})")


if __name__ == "__main__":
    main()
