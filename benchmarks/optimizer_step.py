"""Benchmark one optimizer step: hf_paged's optimizers against torch, bitsandbytes and torchao.

For each parameter dtype, every optimizer is warmed up (which also runs ``torch.compile``; the compiler's
caches are reset between optimizers, so each compiles as in a process of its own), then timed over a number
of steps on a fixed set of parameters and gradients. The script prints a markdown table per dtype (median
step time, ratio to ``torch.optim.AdamW(fused=True)``, state bytes per parameter, extra peak memory of one
step, paging throughput under a budget) and whether hf_paged's performance targets hold.

    PYTHONPATH=. python benchmarks/optimizer_step.py [--params 16M] [--dtype fp32|bf16|both] [--steps 10]
        [--warmup 3] [--page-size 1MiB 4MiB 16MiB] [--device cpu|cuda] [--quick]

Set ``HF_PAGED_COMPILE=0`` to run hf_paged's kernels eagerly.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

import hf_paged
from hf_paged.kernels import COMPILE_MIN_ELEMENTS, resolve_compiled
from hf_paged.optim.base import DEFAULT_PAGE_SIZE
from hf_paged.sizes import format_size, parse_size

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
REFERENCE = "torch AdamW fused"
BUDGET_FRACTION = 0.25
HYPERPARAMETERS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
"""AdamW hyperparameters shared by every AdamW variant."""

Builder = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


@dataclass
class Result:
    """One optimizer's measurements."""

    name: str
    budget: str
    page_size: int | None
    budgeted: bool
    numel: int
    median_ms: float
    state_bytes: int
    device_bytes: int
    extra_peak_mib: float | None
    streamed_mb_s: float | None


# Parameters -------------------------------------------------------------------------------------------


def parse_count(text: str) -> int:
    """An element count such as ``16M`` (binary multiples: K = 2**10, M = 2**20, G = 2**30)."""
    factors = {"K": 2**10, "M": 2**20, "G": 2**30}
    suffix = text[-1:].upper()
    number = float(text[:-1]) if suffix in factors else float(text)
    count = int(number * factors.get(suffix, 1))
    if count <= 0:
        raise argparse.ArgumentTypeError(f"--params must be a positive count such as 16M, got {text!r}")
    return count


def layer_shapes(numel: int) -> list[tuple[int, ...]]:
    """Shapes of a transformer-like stack totalling about ``numel`` elements.

    Each layer has four ``d x d`` attention matrices, a ``2d x d`` and a ``d x 2d`` MLP matrix, two norms and
    two MLP biases (all vectors have fewer than 4096 elements); a final norm closes the stack.
    """
    hidden = min(1024, max(64, round(math.sqrt(numel / 8) / 64) * 64))
    layers = max(1, round(numel / (8 * hidden * hidden)))
    layer = [(hidden, hidden)] * 4 + [(2 * hidden, hidden), (hidden, 2 * hidden)]
    layer += [(hidden,), (hidden,), (2 * hidden,), (hidden,)]
    return layer * layers + [(hidden,)]


def make_master(
    shapes: Iterable[tuple[int, ...]], dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random (parameter, gradient) pairs, copied for every run so that each starts from the same values."""
    generator = torch.Generator().manual_seed(0)
    return [
        (
            (0.02 * torch.randn(shape, generator=generator)).to(device, dtype),
            torch.randn(shape, generator=generator).to(device, dtype),
        )
        for shape in shapes
    ]


def fresh_params(master: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Parameters cloned from ``master`` with their gradients set (they stay fixed across steps)."""
    params = []
    for value, grad in master:
        param = torch.nn.Parameter(value.clone())
        param.grad = grad.clone()
        params.append(param)
    return params


# Measurements -----------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(optimizer: torch.optim.Optimizer, device: torch.device) -> float:
    """Seconds of one ``optimizer.step()``, device work included."""
    synchronize(device)
    start = time.perf_counter()
    optimizer.step()
    synchronize(device)
    return time.perf_counter() - start


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def extra_peak_mib(optimizer: torch.optim.Optimizer, device: torch.device) -> float | None:
    """MiB allocated at the peak of one step above what was allocated before it (``None`` if unmeasurable).

    On the CPU: the peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) minus the resident
    set before the step, after returning freed heap memory to the system so that the step's temporaries show.
    """
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        optimizer.step()
        synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    try:
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        before = _proc_status_kib("VmRSS")
    except (OSError, AttributeError, RuntimeError):
        return None
    optimizer.step()
    return (_proc_status_kib("VmHWM") - before) / 2**10


def tensor_bytes(value: Any, seen: set[tuple[int, int]]) -> int:
    """Bytes of the tensors in ``value`` (nested dicts, lists, tuples), each buffer counted once.

    Tensor subclasses (torchao's 8-bit state) count the inner tensors named by ``__tensor_flatten__``.
    """
    if isinstance(value, torch.Tensor):
        flatten = getattr(value, "__tensor_flatten__", None)
        if flatten is not None:
            names, _ = flatten()
            return sum(tensor_bytes(getattr(value, name), seen) for name in names)
        key = (value.data_ptr(), value.nbytes)
        if key in seen:
            return 0
        seen.add(key)
        return value.nbytes
    if isinstance(value, dict):
        return sum(tensor_bytes(item, seen) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item, seen) for item in value)
    return 0


def measure(
    name: str,
    budget: str,
    build: Builder,
    master: list[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
    page_size: int | None = None,
    budgeted: bool = False,
) -> Result | str:
    """Warm up, time and measure one optimizer; the error text instead if it fails."""
    label = f"{name} [{budget}]"
    print(f"{time.strftime('%H:%M:%S')} running {label} ...", file=sys.stderr, flush=True)
    params = fresh_params(master)
    numel = sum(param.numel() for param in params)
    try:
        optimizer = build(params)
        for _ in range(args.warmup):
            optimizer.step()
        paged = isinstance(optimizer, hf_paged.PagedOptimizer)
        moved_before = streamed_bytes(optimizer) if paged else 0
        seconds = [timed_step(optimizer, args.device) for _ in range(args.steps)]
        moved = streamed_bytes(optimizer) - moved_before if paged else 0
        peak = extra_peak_mib(optimizer, args.device)
    except Exception as error:  # a benchmark reports failures and goes on
        traceback.print_exc(file=sys.stderr)
        first_paragraph = str(error).strip().split("\n\n")[0]
        return f"{type(error).__name__}: {' '.join(first_paragraph.split())}"
    if paged:
        stats = optimizer.paging_stats()
        state_bytes, device_bytes = stats["device_bytes"] + stats["host_bytes"], stats["device_bytes"]
    else:
        state_bytes = device_bytes = tensor_bytes(dict(optimizer.state), set())
    median = statistics.median(seconds)
    print(f"  {label}: {1e3 * median:.2f} ms", file=sys.stderr, flush=True)
    return Result(
        name=name,
        budget=budget,
        page_size=page_size,
        budgeted=budgeted,
        median_ms=1e3 * median,
        numel=numel,
        state_bytes=state_bytes,
        device_bytes=device_bytes,
        extra_peak_mib=peak,
        streamed_mb_s=moved / sum(seconds) / 1e6 if budgeted else None,
    )


def streamed_bytes(optimizer: hf_paged.PagedOptimizer) -> int:
    stats = optimizer.paging_stats()
    return stats["bytes_to_device"] + stats["bytes_to_host"]


# Optimizers -------------------------------------------------------------------------------------------


def baseline_builders() -> dict[str, Builder]:
    """The optimizers hf_paged is compared with; imports happen at construction, so failures are skips."""

    def bitsandbytes_adamw8bit(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, **HYPERPARAMETERS)

    def torchao_adamw8bit(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, **HYPERPARAMETERS)

    def torchao_adamw4bit(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        from torchao.optim import AdamW4bit

        return AdamW4bit(params, **HYPERPARAMETERS)

    return {
        REFERENCE: lambda params: torch.optim.AdamW(params, fused=True, **HYPERPARAMETERS),
        "torch AdamW foreach": lambda params: torch.optim.AdamW(params, foreach=True, **HYPERPARAMETERS),
        "bitsandbytes AdamW8bit": bitsandbytes_adamw8bit,
        "torchao AdamW8bit": torchao_adamw8bit,
        "torchao AdamW4bit": torchao_adamw4bit,
    }


def run_dtype(
    master: list[tuple[torch.Tensor, torch.Tensor]], args: argparse.Namespace
) -> tuple[list[Result], list[tuple[str, str]]]:
    """All optimizers on one set of parameters: the results and the (optimizer, reason) skips."""
    results: list[Result] = []
    skipped: list[tuple[str, str]] = []

    def record(outcome: Result | str, name: str) -> Result | None:
        gc.collect()
        torch._dynamo.reset()  # each optimizer compiles from scratch, as in a process of its own
        if isinstance(outcome, str):
            print(f"  skipped {name}: {outcome}", file=sys.stderr, flush=True)
            skipped.append((name, outcome))
            return None
        results.append(outcome)
        return outcome

    for name, build in baseline_builders().items():
        record(measure(name, "-", build, master, args), name)
    for page_size in args.page_size:
        pages = f"{format_size(page_size)} pages"
        for cls in (hf_paged.PagedAdamW, hf_paged.PagedAdamW8bit, hf_paged.PagedAdamW4bit):
            name = cls.__name__
            unlimited = record(
                measure(
                    name,
                    f"unlimited, {pages}",
                    functools.partial(cls, **HYPERPARAMETERS, page_size=page_size),
                    master,
                    args,
                    page_size,
                ),
                name,
            )
            if unlimited is None:
                skipped.append((f"{name} (budget)", "its unlimited run failed"))
                continue
            state_bytes = unlimited.device_bytes
            budget = max(page_size, int(BUDGET_FRACTION * state_bytes) // page_size * page_size)
            record(
                measure(
                    name,
                    f"{format_size(budget)} ({budget / state_bytes:.0%}), {pages}",
                    functools.partial(cls, **HYPERPARAMETERS, page_size=page_size, device_budget=budget),
                    master,
                    args,
                    page_size,
                    budgeted=True,
                ),
                name,
            )
        record(
            measure(
                "PagedLion8bit",
                f"unlimited, {pages}",
                functools.partial(hf_paged.PagedLion8bit, page_size=page_size),
                master,
                args,
                page_size,
            ),
            "PagedLion8bit",
        )
    return results, skipped


# Report -----------------------------------------------------------------------------------------------


def format_table(results: list[Result]) -> str:
    """The results as a markdown table, times relative to the reference optimizer."""
    reference = next((result.median_ms for result in results if result.name == REFERENCE), None)
    header = [
        "optimizer",
        "budget",
        "median step ms",
        "ratio to torch fused",
        "state bytes/param",
        "device bytes/param",
        "extra peak MiB",
        "MB/s streamed",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in results:
        cells = [
            result.name,
            result.budget,
            f"{result.median_ms:.2f}",
            f"{result.median_ms / reference:.2f}x" if reference else "",
            f"{result.state_bytes / result.numel:.3f}",
            f"{result.device_bytes / result.numel:.3f}",
            "" if result.extra_peak_mib is None else f"{result.extra_peak_mib:.1f}",
            "" if result.streamed_mb_s is None else f"{result.streamed_mb_s:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check(label: str, value: float | None, limit: float, unit: str) -> str:
    """One target: ``label: value unit (target <= limit) PASS|MISS``, or ``n/a`` without a measurement."""
    if value is None:
        return f"{label}: n/a"
    verdict = "PASS" if value <= limit else "MISS"
    return f"{label} {value:.3f}{unit} (<= {limit:g}{unit}) {verdict}"


def targets(results: list[Result], page_size: int) -> str:
    """The targets of hf_paged at one page size, each with its measured figure and verdict."""

    def find(name: str, budgeted: bool) -> Result | None:
        matches = (r for r in results if r.name == name and r.page_size == page_size and r.budgeted == budgeted)
        return next(matches, None)

    def ratio(numerator: Result | None, denominator: Result | None) -> float | None:
        return numerator.median_ms / denominator.median_ms if numerator and denominator else None

    reference = next((result for result in results if result.name == REFERENCE), None)
    adamw, adamw_budget = find("PagedAdamW", False), find("PagedAdamW", True)
    adamw8, adamw8_budget = find("PagedAdamW8bit", False), find("PagedAdamW8bit", True)
    adamw4 = find("PagedAdamW4bit", False)
    return "; ".join(
        [
            check("PagedAdamW8bit unlimited", ratio(adamw8, reference), 1.0, "x fused"),
            check("PagedAdamW unlimited", ratio(adamw, reference), 1.1, "x fused"),
            check("PagedAdamW 25% budget", ratio(adamw_budget, adamw), 1.3, "x unlimited"),
            check("PagedAdamW8bit 25% budget", ratio(adamw8_budget, adamw8), 1.3, "x unlimited"),
            check("PagedAdamW8bit state", adamw8.state_bytes / adamw8.numel if adamw8 else None, 2.04, " B/param"),
            check("PagedAdamW4bit state", adamw4.state_bytes / adamw4.numel if adamw4 else None, 1.07, " B/param"),
        ]
    )


def machine(device: torch.device) -> str:
    """A line describing the machine and the settings that shape the timings."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as cpuinfo:
                name = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
    compiled = (
        f"torch.compile from {COMPILE_MIN_ELEMENTS} state elements"
        if resolve_compiled(None, device, COMPILE_MIN_ELEMENTS)
        else "eager"
    )
    return (
        f"torch {torch.__version__}, device {device} ({name}), {torch.get_num_threads()} threads, "
        f"hf_paged {hf_paged.__version__} kernels: {compiled}, {load_average()}"
    )


def load_average() -> str:
    """The system's load averages, to tell whether other processes competed for the CPUs."""
    return "load average " + " ".join(f"{load:.2f}" for load in os.getloadavg())


# Command line -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=parse_count, help="parameter elements, e.g. 16M (default; 1M with --quick)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both", help="parameter dtype")
    parser.add_argument("--steps", type=int, help="timed steps (default 10; 3 with --quick)")
    parser.add_argument("--warmup", type=int, help="steps before timing, which compile (default 3; 2 with --quick)")
    parser.add_argument(
        "--page-size",
        nargs="+",
        type=lambda text: parse_size(text, "--page-size"),
        default=[DEFAULT_PAGE_SIZE],
        help="hf_paged page sizes to compare, e.g. 1MiB 4MiB 16MiB (default: the library's default)",
    )
    parser.add_argument(
        "--device", type=torch.device, default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda"
    )
    parser.add_argument("--quick", action="store_true", help="a small, short run to check that everything works")
    args = parser.parse_args(argv)
    args.params = args.params or parse_count("1M" if args.quick else "16M")
    args.steps = args.steps or (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shapes = layer_shapes(args.params)
    numel = sum(math.prod(shape) for shape in shapes)
    matrices = sum(len(shape) == 2 for shape in shapes)
    print(f"# Optimizer step benchmark\n\n{machine(args.device)}\n")
    print(
        f"{numel / 1e6:.2f}M parameter elements ({matrices} matrices, {len(shapes) - matrices} vectors), "
        f"{args.warmup} warmup + {args.steps} timed steps, median reported\n"
    )
    verdicts = []
    for dtype_name in ("fp32", "bf16") if args.dtype == "both" else (args.dtype,):
        master = make_master(shapes, DTYPES[dtype_name], args.device)
        results, skipped = run_dtype(master, args)
        del master
        gc.collect()
        print(f"## {dtype_name} parameters\n\n{format_table(results)}\n")
        for name, reason in skipped:
            print(f"- skipped {name}: {reason}")
        if skipped:
            print()
        for page_size in args.page_size:
            verdicts.append(f"- {dtype_name}, {format_size(page_size)} pages: {targets(results, page_size)}")
    print("Targets:\n" + "\n".join(verdicts))
    print(f"\nAt the end: {load_average()}")


if __name__ == "__main__":
    main()
