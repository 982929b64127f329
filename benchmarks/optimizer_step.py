"""Benchmark one optimizer step: hf_paged's optimizers against torch, bitsandbytes and torchao.

For each parameter dtype, every optimizer is warmed up (which also runs ``torch.compile``; the compiler's
caches are reset between optimizers, so each compiles as in a process of its own), then timed over a number
of steps on a fixed set of parameters and gradients. The script prints a markdown table per dtype (median
step time, ratio to ``torch.optim.AdamW(fused=True)``, state bytes per parameter, extra peak memory of one
step, bytes paged each way per step under a budget) and whether hf_paged's performance targets hold.

On CUDA the run also measures the copy bandwidth between pinned host memory and the device, gives each
budgeted run its streaming efficiency (``_streaming.streaming_efficiency``: step time over
max(unlimited step time, max(bytes to device / host-to-device bandwidth, bytes to host / device-to-host
bandwidth)); 1.0 is perfect overlap of copies and updates) and times bitsandbytes' ``PagedAdamW8bit`` under
a device memory limit matching hf_paged's 25% budget. On the CPU, where pages move between two pools in
host memory, the bytes moved are counted but the efficiency column stays empty, and the bitsandbytes paged
row is listed as skipped.

    PYTHONPATH=. python benchmarks/optimizer_step.py [--params 16M] [--dtype fp32|bf16|both] [--steps 10]
        [--warmup 3] [--page-size 1MiB 4MiB 16MiB] [--device cpu|cuda] [--quick]

``--quick`` is a small, short run that checks everything works (``tests/test_benchmarks.py`` runs it): 64 KiB
pages, so that the 25% budget pages, and no torchao, whose compiled steps take tens of seconds to compile.

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
from hf_paged.native import build_failure, native_setting
from hf_paged.optim.base import DEFAULT_PAGE_SIZE
from hf_paged.sizes import format_size, parse_size

from _streaming import COPY_BYTES, COPY_REPEATS, Bandwidth, copy_bandwidth, memory_limit, streaming_efficiency

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
REFERENCE = "torch AdamW fused"
BUDGET_FRACTION = 0.25
PAGED_BASELINE = "bitsandbytes PagedAdamW8bit"
ALLOCATOR_SLACK = 64 * 2**20
"""Bytes the memory limit of bitsandbytes' paged run allows beyond parameters, gradients and state."""
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
    bytes_to_device: float | None
    """Bytes paged in per timed step (``None`` unless budgeted)."""
    bytes_to_host: float | None
    """Bytes paged out per timed step (``None`` unless budgeted)."""
    efficiency: float | None = None
    """Streaming efficiency of a budgeted run, where the copy bandwidth was measured."""


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
        moved_before = moved_bytes(optimizer) if paged else (0, 0)
        seconds = [timed_step(optimizer, args.device) for _ in range(args.steps)]
        moved_after = moved_bytes(optimizer) if paged else (0, 0)
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
        bytes_to_device=(moved_after[0] - moved_before[0]) / args.steps if budgeted else None,
        bytes_to_host=(moved_after[1] - moved_before[1]) / args.steps if budgeted else None,
    )


def moved_bytes(optimizer: hf_paged.PagedOptimizer) -> tuple[int, int]:
    """Bytes paged to the device and to the host since the optimizer was built."""
    stats = optimizer.paging_stats()
    return stats["bytes_to_device"], stats["bytes_to_host"]


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
        if args.quick and name.startswith("torchao"):
            skipped.append((name, "not in --quick: its step is compiled, which takes tens of seconds"))
            continue
        record(measure(name, "-", build, master, args), name)
    budgets: dict[tuple[str, int], int] = {}
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
            budgets[name, page_size] = budget
            budgeted = record(
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
            if budgeted is not None and args.bandwidth is not None:
                budgeted.efficiency = streaming_efficiency(
                    budgeted.median_ms / 1e3,
                    unlimited.median_ms / 1e3,
                    budgeted.bytes_to_device,
                    budgeted.bytes_to_host,
                    args.bandwidth,
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
    matching_budget = budgets.get(("PagedAdamW8bit", args.page_size[0]))
    if args.device.type != "cuda":
        skipped.append((PAGED_BASELINE, "needs CUDA (its paged state is CUDA managed memory)"))
    elif matching_budget is None:
        skipped.append((PAGED_BASELINE, "PagedAdamW8bit's unlimited run, which sets the matching limit, failed"))
    else:
        record(bitsandbytes_paged(master, args, matching_budget), PAGED_BASELINE)
    return results, skipped


def bitsandbytes_paged(
    master: list[tuple[torch.Tensor, torch.Tensor]], args: argparse.Namespace, budget: int
) -> Result | str:
    """bitsandbytes' ``PagedAdamW8bit`` on CUDA with the memory PyTorch may allocate limited as for hf_paged's
    ``PagedAdamW8bit`` under ``budget`` bytes (its 25% budget at the first page size).

    The limit (``_streaming.memory_limit``) is what the process reserves before the run (the master copy of
    the parameters and gradients), plus the run's own parameters and gradients (as many bytes again), plus
    ``budget`` for the optimizer state, plus ``ALLOCATOR_SLACK`` for the caching allocator's rounding and the
    step's temporaries: what hf_paged's budgeted run may hold on the device. The limit caps PyTorch's caching
    allocator only: bitsandbytes keeps its paged state (tensors of 100K elements or more) in CUDA managed
    memory, outside it, which the driver moves to the host only when the device's physical memory runs out.
    """

    def build(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        import bitsandbytes

        return bitsandbytes.optim.PagedAdamW8bit(params, **HYPERPARAMETERS)

    master_bytes = sum(value.nbytes + grad.nbytes for value, grad in master)
    headroom = master_bytes + budget + ALLOCATOR_SLACK
    with memory_limit(args.device, headroom) as fraction:
        label = f"{format_size(budget)} + params, grads (memory fraction {fraction:.4f})"
        return measure(PAGED_BASELINE, label, build, master, args)


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
        "MB to device/step",
        "MB to host/step",
        "streaming efficiency",
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
            "" if result.bytes_to_device is None else f"{result.bytes_to_device / 1e6:.2f}",
            "" if result.bytes_to_host is None else f"{result.bytes_to_host / 1e6:.2f}",
            "" if result.efficiency is None else f"{result.efficiency:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check(label: str, value: float | None, limit: float, unit: str) -> str:
    """One target: ``label: value unit (target <= limit) PASS|MISS``, or ``n/a`` without a measurement."""
    if value is None:
        return f"{label}: n/a"
    verdict = "PASS" if value <= limit else "MISS"
    return f"{label} {value:.3f}{unit} (<= {limit:g}{unit}) {verdict}"


TARGETS = {"fp32": (1.1, 1.5), "bf16": (1.2, 1.6)}
"""Most PagedAdamW and PagedAdamW8bit step times (no budget) per fused torch AdamW's on the same parameters."""
HOST_TARGETS = {"PagedAdamW8bit": 1.3, "PagedAdamW4bit": 1.5, "PagedLion8bit": 1.1}
"""Most step times (no budget) per fused torch AdamW's of the quantized optimizers on the CPU, where their pages take
the C++ host kernels (issue 21), for fp32 and bf16 parameters alike."""
BUDGET_TARGET = 2.1
"""Most PagedAdamW step time at the 25% budget per its unlimited step time."""


def targets(results: list[Result], page_size: int, dtype_name: str, device: torch.device) -> str:
    """The targets of hf_paged at one page size and parameter dtype, each with its measured figure and verdict;
    ``results`` are those of that dtype, whose fused torch AdamW is the reference (on the CPU with the host kernels,
    also :data:`HOST_TARGETS`)."""

    def find(name: str, budgeted: bool) -> Result | None:
        matches = (r for r in results if r.name == name and r.page_size == page_size and r.budgeted == budgeted)
        return next(matches, None)

    def ratio(numerator: Result | None, denominator: Result | None) -> float | None:
        return numerator.median_ms / denominator.median_ms if numerator and denominator else None

    reference = next((result for result in results if result.name == REFERENCE), None)
    adamw, adamw_budget = find("PagedAdamW", False), find("PagedAdamW", True)
    adamw8, adamw4 = find("PagedAdamW8bit", False), find("PagedAdamW4bit", False)
    adamw_limit, adamw8_limit = TARGETS[dtype_name]
    host_kernels = device.type == "cpu" and native_setting() is not False and build_failure() is None
    host = HOST_TARGETS if host_kernels else {}
    return "; ".join(
        [
            check("PagedAdamW unlimited", ratio(adamw, reference), adamw_limit, "x fused"),
            check("PagedAdamW8bit unlimited", ratio(adamw8, reference), adamw8_limit, "x fused"),
            *(
                check(f"{name} host kernel", ratio(find(name, False), reference), host[name], "x fused")
                for name in host
            ),
            check("PagedAdamW 25% budget", ratio(adamw_budget, adamw), BUDGET_TARGET, "x unlimited"),
            check("PagedAdamW8bit state", adamw8.state_bytes / adamw8.numel if adamw8 else None, 2.04, " B/param"),
            check("PagedAdamW4bit state", adamw4.state_bytes / adamw4.numel if adamw4 else None, 1.07, " B/param"),
        ]
    )


def streaming_note(bandwidth: Bandwidth | None) -> str:
    """The measured copy bandwidth and the definition of the streaming efficiency; on the CPU, why neither."""
    if bandwidth is None:
        return (
            "On the CPU pages move between two pools in host memory: their bytes are counted, but there is no "
            "host-device bandwidth to measure, so no streaming efficiency."
        )
    return (
        f"Pinned copy bandwidth: host to device {bandwidth.to_device / 1e9:.1f} GB/s, device to host "
        f"{bandwidth.to_host / 1e9:.1f} GB/s ({format_size(COPY_BYTES)} copies, median of {COPY_REPEATS}). "
        "Streaming efficiency = step time / max(unlimited step time, max(bytes to device / host-to-device "
        "bandwidth, bytes to host / device-to-host bandwidth)): the two directions overlap on their own copy "
        "streams; 1.0 is perfect overlap."
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
    if device.type == "cpu":
        reason = None if native_setting() is False else build_failure()
        host = "off (HF_PAGED_NATIVE=0)" if native_setting() is False else reason or "C++ (hf_paged/native)"
        compiled += f", 8-bit and 4-bit pages: {host}"
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
        help="hf_paged page sizes to compare, e.g. 1MiB 4MiB 16MiB (default: the library's; 64KiB with --quick)",
    )
    parser.add_argument(
        "--device", type=torch.device, default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda"
    )
    parser.add_argument("--quick", action="store_true", help="a small, short run to check that everything works")
    args = parser.parse_args(argv)
    if args.page_size is None:
        args.page_size = [parse_size("64KiB" if args.quick else DEFAULT_PAGE_SIZE, "--page-size")]
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
        f"{numel / 1e6:.2f}M parameter elements ({numel} exactly; {matrices} matrices, "
        f"{len(shapes) - matrices} vectors), "
        f"{args.warmup} warmup + {args.steps} timed steps, median reported\n"
    )
    args.bandwidth = copy_bandwidth(args.device) if args.device.type == "cuda" else None
    print(f"{streaming_note(args.bandwidth)}\n")
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
            verdicts.append(
                f"- {dtype_name}, {format_size(page_size)} pages: {targets(results, page_size, dtype_name, args.device)}"
            )
    print("Targets:\n" + "\n".join(verdicts))
    print(f"\nAt the end: {load_average()}")


if __name__ == "__main__":
    main()
