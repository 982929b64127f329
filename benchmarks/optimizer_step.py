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

    PYTHONPATH=. python benchmarks/optimizer_step.py [--params 16M | --layout llama] [--dtype fp32|bf16|both]
        [--steps 10] [--warmup 3] [--page-size 1MiB 4MiB 16MiB] [--device cpu|cuda] [--interleaved] [--quick]
        [--accelerator-layouts 1B/16 8B/16] [--accelerator-optimizers PagedAdamW8bit ...] [--accelerator-steps 3]
        [--accelerator-kernels triton torch] [--accelerator-page-size 16KiB] [--accelerator-prefetch 2]

``--layout llama`` takes the parameters of a Llama of 291 tensors (hidden 512, 32 layers, vocabulary 32000, 133.5M
parameters) instead of a stack of ``--params`` elements. Beside each optimizer's ratios the table gives the operators
one step dispatches (ATen calls counted by a ``TorchDispatchMode``) and its kernel calls (calls of hf_paged's
kernel objects, per segment or per batch, and of torch's fused AdamW).

The accelerator table times the host's work of a step as pages on an accelerator take it, on real tensors on the CPU:
with the Triton kernels (what CUDA takes where Triton runs: the whole launch path, its tables written into host
memory and copied to the "device", each launch of a compiled kernel a no-op; on the CPU Triton's interpreter runs the
kernels' first-use self-check, so the script sets ``TRITON_INTERPRET=1`` where no GPU is present) and with the PyTorch
kernels (compiled, in chunks of ``page_size / 8`` elements, the fallback; each call a no-op). The layouts are Llama
3.2 1B's and Llama 3 8B's with every dimension divided by 16 (``1B/16``, ``8B/16``) in 16 KiB pages: the same number
of pages, tensors and segments as the models in 4 MiB pages, 256 times fewer elements. Each row gives the step with
every page resident and with half the state on the host (a budget of half the state's bytes: each step streams
about half the pages through the device), its kernel launches against issue 36's bound (streamed pages / prefetch + 1,
per state format) and the host's microseconds per streamed page, against a reference measured in the same run: one
copy of a page of the full-size model (4 MiB: pinned host to device on CUDA, within host memory by one thread on the
CPU), which the host's work per page has to stay under for a streamed step to run at the speed of its copies; beside
them the one kernel launch per tensor and step of bitsandbytes. Issue 36's targets follow for the Triton rows of
``8B/16``.

``--interleaved`` builds and warms up every optimizer first and then times rounds of one step of each, so that the
load of a shared machine falls on all of them alike (``--steps`` rounds); use it for ratios on a busy machine.

On the CPU the fp32 run also times each step with its update kernels skipped (torch's fused AdamW and hf_paged's
host and segment kernels replaced by no-ops): what a step costs besides its arithmetic, against fused AdamW's. The table's
offload column is what an offloaded step (FSDP2's ``CPUOffloadPolicy``, ZeRO-Offload) keeps in host memory per
parameter: the parameter, its gradient and the optimizer state. DeepSpeed's ``DeepSpeedCPUAdam`` (the
``deepspeed`` extra) is the ZeRO-Offload reference there; it is skipped where DeepSpeed is absent.

``--quick`` is a small, short run that checks everything works (``tests/test_benchmarks.py`` runs it): 64 KiB
pages, so that the 25% budget pages, the accelerator path on the tiny layout only, no torchao, whose compiled steps take tens of seconds to compile, and no
DeepSpeed, whose C++ op takes minutes to build the first time.

Set ``HF_PAGED_COMPILE=0`` to run hf_paged's kernels eagerly.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import importlib
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

if not torch.cuda.is_available():
    # The accelerator path runs the Triton kernels' first-use self-check on the CPU, in Triton's interpreter, which
    # Triton reads when it is first imported (below, by hf_paged's kernels or by torch.compile).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch.utils._python_dispatch import TorchDispatchMode

import hf_paged
from hf_paged.kernels import COMPILE_MIN_ELEMENTS, resolve_compiled, stubbed_triton_kernels
from hf_paged.native import build_failure, host_kernels_disabled, host_kernels_enabled, native_setting
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
RANK1 = "PagedAdamW4bit (rank-1)"
"""The row of ``PagedAdamW4bit(normalization="rank1")``: its pages and its rank-1 statistics."""
ACCELERATOR_OPTIMIZERS = ("PagedAdamW", "PagedAdamW8bit", "PagedAdamW4bit", "PagedLion", "PagedLion8bit")
"""hf_paged's optimizers, each of which the accelerator path can time."""

Builder = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


@dataclass
class Result:
    """One optimizer's measurements."""

    name: str
    budget: str
    page_size: int | None
    budgeted: bool
    numel: int
    param_bytes: int
    """Bytes of the parameters and their gradients."""
    median_ms: float
    fastest_ms: float
    """The fastest timed step: what the step costs with the least interference from the rest of the machine."""
    state_bytes: int
    device_bytes: int
    extra_peak_mib: float | None
    bytes_to_device: float | None
    """Bytes paged in per timed step (``None`` unless budgeted)."""
    bytes_to_host: float | None
    """Bytes paged out per timed step (``None`` unless budgeted)."""
    efficiency: float | None = None
    """Streaming efficiency of a budgeted run, where the copy bandwidth was measured."""
    operator_calls: int | None = None
    """Operators dispatched by one step (``None`` where counting failed)."""
    kernel_calls: int | None = None
    """Calls into update kernels in one step (see :func:`counted_kernel_calls`); ``None`` for optimizers other
    than hf_paged's and torch's fused AdamW."""


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


@dataclass(frozen=True)
class LlamaShape:
    """The shape of a Llama model: what its parameter tensors are made from."""

    hidden: int
    intermediate: int
    layers: int
    vocabulary: int
    key_value: int
    """Rows of the key and value projections (key-value heads x head dimension)."""
    tied: bool
    """Whether the output head is the embedding (no tensor of its own)."""


def scaled(shape: LlamaShape, divisor: int) -> LlamaShape:
    """``shape`` with every dimension divided by ``divisor``: its tensors hold ``divisor**2`` times fewer elements."""
    return LlamaShape(
        hidden=shape.hidden // divisor,
        intermediate=shape.intermediate // divisor,
        layers=shape.layers,
        vocabulary=shape.vocabulary // divisor,
        key_value=shape.key_value // divisor,
        tied=shape.tied,
    )


LLAMA_LAYOUTS = {
    "llama-133M": LlamaShape(hidden=512, intermediate=1536, layers=32, vocabulary=32000, key_value=256, tied=False),
    "tiny": LlamaShape(hidden=64, intermediate=192, layers=2, vocabulary=1000, key_value=32, tied=False),
    "1B": LlamaShape(hidden=2048, intermediate=8192, layers=16, vocabulary=128256, key_value=512, tied=True),
    "8B": LlamaShape(hidden=4096, intermediate=14336, layers=32, vocabulary=128256, key_value=1024, tied=False),
}
LLAMA_LAYOUTS["1B/16"] = scaled(LLAMA_LAYOUTS["1B"], 16)
LLAMA_LAYOUTS["8B/16"] = scaled(LLAMA_LAYOUTS["8B"], 16)
"""Llama layouts: ``llama-133M`` (291 tensors, 133,464,576 parameters; ``--layout llama``), Llama 3.2 1B and
Llama 3 8B shapes (8 key-value heads of 64 and 128), the same with every dimension divided by 16 for the accelerator
path (in 16 KiB pages, the models' page counts in 4 MiB pages), and a tiny one for tests."""

ACCELERATOR_LAYOUTS = ("tiny", "1B/16", "8B/16")
"""The layouts the accelerator path takes: real tensors on the CPU."""
LAYOUT_DIVISORS = {"1B/16": 16, "8B/16": 16}
"""By scaled layout: what its dimensions were divided by (its pages stand for pages this squared times larger)."""


def llama_shapes(shape: LlamaShape) -> list[tuple[int, ...]]:
    """The parameter shapes of a Llama in ``model.parameters()`` order: the embedding, per layer the attention's
    query, key, value and output projections, the MLP's gate, up and down projections and two norms, the final norm
    and, unless tied, the output head."""
    hidden, intermediate, key_value = shape.hidden, shape.intermediate, shape.key_value
    layer = [(hidden, hidden), (key_value, hidden), (key_value, hidden), (hidden, hidden)]
    layer += [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate), (hidden,), (hidden,)]
    head = [] if shape.tied else [(shape.vocabulary, hidden)]
    return [(shape.vocabulary, hidden), *layer * shape.layers, (hidden,), *head]


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


class OperatorCounter(TorchDispatchMode):
    """Counts the operators dispatched while it is active (each ATen call, views included)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def kernel_methods() -> list[tuple[Any, str]]:
    """What a kernel call is: torch's fused AdamW (``torch._fused_adamw_``, which PagedAdamW's fp32 pages also
    call), and the per-segment calls (``__call__``) and batch calls (``update_batch``, and the rank-1 statistics pass's
    ``gather_batch``) of the kernel classes of the modules of ``hf_paged.kernels`` imported so far."""
    methods: list[tuple[Any, str]] = [(torch, "_fused_adamw_")]
    for module_name, module in sorted(sys.modules.items()):
        if module is None or not module_name.startswith("hf_paged.kernels"):
            continue
        for value in vars(module).values():
            if not isinstance(value, type) or value.__module__ != module_name:
                continue
            if "allocates_nothing" in vars(value) or "update_batch" in vars(value):
                names = ("__call__", "update_batch", "gather_batch")
                methods += [(value, name) for name in names if name in vars(value)]
    return methods


@contextlib.contextmanager
def counted_kernel_calls(replacement: Callable[..., None] | None = None) -> Iterator[list[int]]:
    """Count the kernel calls (:func:`kernel_methods`) made inside; a kernel that hands its call to another (a host
    kernel's fallback) counts once. With ``replacement``, kernels call it instead of updating (stubs). Yields a
    one-element list holding the count."""
    count = [0]
    depth = [0]

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return original(*args, **kwargs)
            count[0] += 1
            depth[0] += 1
            try:
                return (replacement or original)(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    methods = kernel_methods()
    originals = [getattr(owner, name) for owner, name in methods]
    for (owner, name), original in zip(methods, originals):
        setattr(owner, name, counting(original))
    try:
        yield count
    finally:
        for (owner, name), original in zip(methods, originals):
            setattr(owner, name, original)


def count_calls(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """The operators dispatched and the kernel calls made by one more step of ``optimizer``. Compiled kernels run
    eagerly under the counting mode (Dynamo does not trace under a dispatch mode), so their operators count."""
    with counted_kernel_calls() as kernels, OperatorCounter() as operators:
        optimizer.step()
    return operators.calls, kernels[0]


def counts_kernels(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s kernel calls are counted: hf_paged's and torch's fused AdamW."""
    return isinstance(optimizer, hf_paged.PagedOptimizer) or bool(optimizer.defaults.get("fused"))


@dataclass
class Run:
    """An optimizer built and warmed up, whose steps are being timed."""

    name: str
    budget: str
    page_size: int | None
    budgeted: bool
    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]
    moved_before: tuple[int, int]
    seconds: list[float]


def prepare(
    name: str,
    budget: str,
    build: Builder,
    master: list[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
    page_size: int | None = None,
    budgeted: bool = False,
) -> Run | str:
    """Build and warm up one optimizer on fresh parameters; the error text instead if it fails."""
    label = f"{name} [{budget}]"
    print(f"{time.strftime('%H:%M:%S')} running {label} ...", file=sys.stderr, flush=True)
    params = fresh_params(master)
    try:
        optimizer = build(params)
        for _ in range(args.warmup):
            optimizer.step()
    except Exception as error:  # noqa: BLE001 (a benchmark reports failures and goes on)
        return failure(error)
    return Run(name, budget, page_size, budgeted, optimizer, params, moved_bytes(optimizer), [])


def failure(error: Exception) -> str:
    """The traceback on standard error; the error's first paragraph on one line."""
    traceback.print_exc(file=sys.stderr)
    first_paragraph = str(error).strip().split("\n\n")[0]
    return f"{type(error).__name__}: {' '.join(first_paragraph.split())}"


def finish(run: Run, args: argparse.Namespace) -> Result | str:
    """The measurements of a run whose steps are timed: bytes moved, state, the extra peak of one more step."""
    try:
        moved_after = moved_bytes(run.optimizer)
        peak = extra_peak_mib(run.optimizer, args.device)
    except Exception as error:  # noqa: BLE001 (reported as the run's skip)
        return failure(error)
    if isinstance(run.optimizer, hf_paged.PagedOptimizer):
        stats = run.optimizer.paging_stats()
        state_bytes, device_bytes = stats["device_bytes"] + stats["host_bytes"], stats["device_bytes"]
    else:
        state_bytes = device_bytes = tensor_bytes(dict(run.optimizer.state), set())
    try:  # one more step, after the figures above
        operator_calls, kernel_calls = count_calls(run.optimizer)
    except Exception as error:  # noqa: BLE001 (the counts stay empty, the timings stand)
        print(f"  {run.name}: counting calls failed: {failure(error)}", file=sys.stderr, flush=True)
        operator_calls = kernel_calls = None
    median = statistics.median(run.seconds)
    print(f"  {run.name} [{run.budget}]: {1e3 * median:.2f} ms", file=sys.stderr, flush=True)
    steps = len(run.seconds)
    return Result(
        name=run.name,
        budget=run.budget,
        page_size=run.page_size,
        budgeted=run.budgeted,
        median_ms=1e3 * median,
        fastest_ms=1e3 * min(run.seconds),
        numel=sum(param.numel() for param in run.params),
        param_bytes=sum(param.nbytes + param.grad.nbytes for param in run.params),
        state_bytes=state_bytes,
        device_bytes=device_bytes,
        extra_peak_mib=peak,
        bytes_to_device=(moved_after[0] - run.moved_before[0]) / steps if run.budgeted else None,
        bytes_to_host=(moved_after[1] - run.moved_before[1]) / steps if run.budgeted else None,
        operator_calls=operator_calls,
        kernel_calls=kernel_calls if counts_kernels(run.optimizer) else None,
    )


def time_steps(run: Run, steps: int, device: torch.device) -> str | None:
    """Time ``steps`` more steps of ``run``; the error text if one fails."""
    try:
        run.seconds.extend(timed_step(run.optimizer, device) for _ in range(steps))
    except Exception as error:  # noqa: BLE001 (reported as the run's skip)
        return failure(error)
    return None


def measure(
    name: str,
    budget: str,
    build: Builder,
    master: list[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
) -> Result | str:
    """Build, warm up, time and measure one optimizer on its own; the error text instead if it fails."""
    run = prepare(name, budget, build, master, args)
    if isinstance(run, str):
        return run
    return time_steps(run, args.steps, args.device) or finish(run, args)


def moved_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes paged to the device and to the host since the optimizer was built (none for other optimizers)."""
    if not isinstance(optimizer, hf_paged.PagedOptimizer):
        return 0, 0
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

    def deepspeed_cpu_adam(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger writes to the stream it finds at import
            from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **HYPERPARAMETERS)

    return {
        REFERENCE: lambda params: torch.optim.AdamW(params, fused=True, **HYPERPARAMETERS),
        "torch AdamW foreach": lambda params: torch.optim.AdamW(params, foreach=True, **HYPERPARAMETERS),
        "bitsandbytes AdamW8bit": bitsandbytes_adamw8bit,
        "torchao AdamW8bit": torchao_adamw8bit,
        "torchao AdamW4bit": torchao_adamw4bit,
        DEEPSPEED: deepspeed_cpu_adam,
    }


DEEPSPEED = "DeepSpeed CPUAdam"
"""ZeRO-Offload's host step (the ``deepspeed`` extra; built by DeepSpeed at its first use)."""
HOST_ONLY = "runs on the host only (ZeRO-Offload's step)"
QUICK_SKIPS = {
    "torchao AdamW8bit": "not in --quick: its step is compiled, which takes tens of seconds",
    "torchao AdamW4bit": "not in --quick: its step is compiled, which takes tens of seconds",
    DEEPSPEED: "not in --quick: DeepSpeed builds its C++ op at first use, which takes minutes",
}
"""Baselines ``--quick`` leaves out, and why."""


def run_dtype(
    master: list[tuple[torch.Tensor, torch.Tensor]], args: argparse.Namespace
) -> tuple[list[Result], list[tuple[str, str]]]:
    """All optimizers on one set of parameters: the results and the (optimizer, reason) skips.

    One after another, each optimizer is built, warmed up and timed (``torch.compile``'s caches reset between
    them); with ``--interleaved``, all are built and warmed up first, then each round times one step of every
    optimizer, so that the load of a shared machine falls on all of them alike.
    """
    results: list[Result] = []
    skipped: list[tuple[str, str]] = []
    runs: list[Run] = []

    def skip(name: str, reason: str) -> None:
        print(f"  skipped {name}: {reason}", file=sys.stderr, flush=True)
        skipped.append((name, reason))

    def complete(run: Run) -> None:
        outcome = time_steps(run, args.steps, args.device) if not args.interleaved else None
        outcome = outcome or finish(run, args)
        if isinstance(outcome, str):
            skip(run.name, outcome)
        else:
            results.append(outcome)

    def start(name: str, budget: str, build: Builder, page_size: int | None = None, budgeted: bool = False) -> int:
        """Prepare one optimizer (and time it unless interleaved); its state bytes, 0 if it failed."""
        run = prepare(name, budget, build, master, args, page_size, budgeted)
        if isinstance(run, str):
            skip(name, run)
            return 0
        state_bytes = paged_state_bytes(run.optimizer)
        if args.interleaved:
            runs.append(run)
        else:
            complete(run)
            del run
            gc.collect()
            torch._dynamo.reset()  # each optimizer compiles from scratch, as in a process of its own
        return state_bytes

    for name, build in baseline_builders().items():
        reason = QUICK_SKIPS.get(name) if args.quick else None
        if reason is None and name == DEEPSPEED and args.device.type != "cpu":
            reason = HOST_ONLY
        if reason is not None:
            skipped.append((name, reason))
            continue
        start(name, "-", build)
    budgets: dict[tuple[str, int], int] = {}
    for page_size in args.page_size:
        pages = f"{format_size(page_size)} pages"
        for cls in (hf_paged.PagedAdamW, hf_paged.PagedAdamW8bit, hf_paged.PagedAdamW4bit):
            name = cls.__name__
            state_bytes = start(
                name, f"unlimited, {pages}", functools.partial(cls, **HYPERPARAMETERS, page_size=page_size), page_size
            )
            if not state_bytes:
                skipped.append((f"{name} (budget)", "its unlimited run failed"))
                continue
            budget = max(page_size, int(BUDGET_FRACTION * state_bytes) // page_size * page_size)
            budgets[name, page_size] = budget
            start(
                name,
                f"{format_size(budget)} ({budget / state_bytes:.0%}), {pages}",
                functools.partial(cls, **HYPERPARAMETERS, page_size=page_size, device_budget=budget),
                page_size,
                budgeted=True,
            )
        start(
            "PagedLion8bit",
            f"unlimited, {pages}",
            functools.partial(hf_paged.PagedLion8bit, page_size=page_size),
            page_size,
        )
        start(
            RANK1,
            f"unlimited, {pages}",
            functools.partial(hf_paged.PagedAdamW4bit, **HYPERPARAMETERS, page_size=page_size, normalization="rank1"),
            page_size,
        )
    if runs:
        for name, error in interleave(runs, args):
            skip(name, error)
        for run in runs:
            complete(run)
        runs.clear()
    matching_budget = budgets.get(("PagedAdamW8bit", args.page_size[0]))
    if args.device.type != "cuda":
        skipped.append((PAGED_BASELINE, "needs CUDA (its paged state is CUDA managed memory)"))
    elif matching_budget is None:
        skipped.append((PAGED_BASELINE, "PagedAdamW8bit's unlimited run, which sets the matching limit, failed"))
    else:
        outcome = bitsandbytes_paged(master, args, matching_budget)
        if isinstance(outcome, str):
            skip(PAGED_BASELINE, outcome)
        else:
            results.append(outcome)
    if args.bandwidth is not None:
        add_streaming_efficiency(results, args.bandwidth)
    return results, skipped


def interleave(runs: list[Run], args: argparse.Namespace, rounds: int | None = None) -> list[tuple[str, str]]:
    """Time ``rounds`` (default ``args.steps``) rounds of one step of every run; a run that fails drops out of
    ``runs``. Returns the (optimizer, error) of each that failed."""
    print(f"{time.strftime('%H:%M:%S')} timing {len(runs)} optimizers interleaved ...", file=sys.stderr, flush=True)
    failed = []
    for _ in range(rounds or args.steps):
        for run in list(runs):
            error = time_steps(run, 1, args.device)
            if error is not None:
                failed.append((run.name, error))
                runs.remove(run)
    return failed


def paged_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a paged optimizer's state, on the device and on the host (0 for other optimizers)."""
    if not isinstance(optimizer, hf_paged.PagedOptimizer):
        return 0
    stats = optimizer.paging_stats()
    return stats["device_bytes"] + stats["host_bytes"] + stats["statistics_bytes"]


def add_streaming_efficiency(results: list[Result], bandwidth: Bandwidth) -> None:
    """Give each budgeted result its streaming efficiency against the unlimited run of its optimizer."""
    unlimited = {(r.name, r.page_size): r for r in results if r.page_size is not None and not r.budgeted}
    for result in results:
        reference = unlimited.get((result.name, result.page_size))
        if result.budgeted and reference is not None:
            result.efficiency = streaming_efficiency(
                result.median_ms / 1e3,
                reference.median_ms / 1e3,
                result.bytes_to_device,
                result.bytes_to_host,
                bandwidth,
            )


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
    reference = next((result for result in results if result.name == REFERENCE), None)
    header = [
        "optimizer",
        "budget",
        "median step ms",
        "ratio to torch fused",
        "fastest steps' ratio",
        "operator calls/step",
        "kernel calls/step",
        "state bytes/param",
        "device bytes/param",
        "offload host bytes/param",
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
            f"{result.median_ms / reference.median_ms:.2f}x" if reference else "",
            f"{result.fastest_ms / reference.fastest_ms:.2f}x" if reference else "",
            "" if result.operator_calls is None else f"{result.operator_calls:,}",
            "" if result.kernel_calls is None else f"{result.kernel_calls:,}",
            f"{result.state_bytes / result.numel:.3f}",
            f"{result.device_bytes / result.numel:.3f}",
            f"{(result.param_bytes + result.state_bytes) / result.numel:.3f}",
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

    def host_check(name: str) -> str:
        """A host kernel's target on the median steps, with the ratio of the fastest steps beside it."""
        result = find(name, False)
        fastest = f" (fastest steps {result.fastest_ms / reference.fastest_ms:.3f}x)" if result and reference else ""
        return check(f"{name} host kernel{fastest}", ratio(result, reference), host[name], "x fused")

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
            *(host_check(name) for name in host),
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
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="build and warm up every optimizer first, then time rounds of one step of each (for shared machines)",
    )
    parser.add_argument(
        "--layout",
        choices=("stack", "llama"),
        default="stack",
        help="parameter shapes: a transformer-like stack of --params elements, or llama: the Llama of 291 tensors "
        "(hidden 512, 32 layers, vocabulary 32000; 133.5M parameters; --params is then ignored)",
    )
    parser.add_argument(
        "--accelerator-layouts",
        nargs="*",
        choices=ACCELERATOR_LAYOUTS,
        help="Llama layouts whose accelerator path is timed with its kernels stubbed (default 1B/16 8B/16; tiny with "
        "--quick; none for no such table)",
    )
    parser.add_argument(
        "--accelerator-optimizers",
        nargs="*",
        choices=ACCELERATOR_OPTIMIZERS,
        default=["PagedAdamW8bit"],
        help="hf_paged optimizers timed on the accelerator path (default PagedAdamW8bit)",
    )
    parser.add_argument(
        "--accelerator-page-size",
        type=lambda text: parse_size(text, "--accelerator-page-size"),
        default=16 * 2**10,
        help="page size of the accelerator path (default 16KiB: the /16 layouts' pages are the models' at 4MiB)",
    )
    parser.add_argument(
        "--accelerator-kernels",
        nargs="+",
        choices=("triton", "torch"),
        default=["triton", "torch"],
        help="kernel families of the accelerator path (default both: triton where it imports, and torch)",
    )
    parser.add_argument(
        "--accelerator-steps", type=int, default=3, help="timed steps of the accelerator path, each way (default 3)"
    )
    parser.add_argument(
        "--accelerator-prefetch", type=int, default=2, help="prefetch of the accelerator path's optimizers (default 2)"
    )
    parser.add_argument("--quick", action="store_true", help="a small, short run to check that everything works")
    args = parser.parse_args(argv)
    if args.accelerator_layouts is None:
        args.accelerator_layouts = ["tiny"] if args.quick else ["1B/16", "8B/16"]
    if args.accelerator_steps < 1:
        parser.error(f"--accelerator-steps must be at least 1, got {args.accelerator_steps}")
    if args.page_size is None:
        args.page_size = [parse_size("64KiB" if args.quick else DEFAULT_PAGE_SIZE, "--page-size")]
    args.params = args.params or parse_count("1M" if args.quick else "16M")
    args.steps = args.steps or (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    return args


OVERHEAD_TARGET = 2.0
"""Most time a hf_paged step spends besides its kernels per fused torch AdamW's, on the host (issue 21)."""
OVERHEAD_ROUNDS = 5
"""Rounds of the step overhead per timed step of the benchmark (``--steps``)."""
OVERHEAD_OPTIMIZERS = ("PagedAdamW", "PagedAdamW8bit", "PagedAdamW4bit", "PagedLion8bit")


@contextlib.contextmanager
def kernels_skipped() -> Iterator[None]:
    """The host's update kernels replaced by no-ops: torch's fused AdamW (which PagedAdamW's resident fp32 pages
    also call), hf_paged's C++ kernels, per segment and per page batch, and its PyTorch segment kernels, so that a
    step costs only what it does around them."""

    def skip(*args: Any, **kwargs: Any) -> None:
        return None

    replaced = [
        (torch, "_fused_adamw_"),
        (torch.ops.hf_paged, "adamw_segment_"),
        (torch.ops.hf_paged, "lion_segment_"),
        (torch.ops.hf_paged, "ademamix_segment_"),
        (torch.ops.hf_paged, "adamw_batch_"),
        (torch.ops.hf_paged, "lion_batch_"),
        (torch.ops.hf_paged, "ademamix_batch_"),
        (hf_paged.kernels.SegmentKernel, "__call__"),
    ]
    importlib.import_module("torch._inductor.compile_fx")  # its first import reads the operators: not while replaced
    originals = [getattr(owner, name) for owner, name in replaced]
    for owner, name in replaced:
        setattr(owner, name, skip)
    hf_paged.kernels._segment_kernel.cache_clear()  # host kernels bind their operator when made, once per process
    try:
        yield
    finally:
        for (owner, name), original in zip(replaced, originals):
            setattr(owner, name, original)
        hf_paged.kernels._segment_kernel.cache_clear()


def step_overheads(master: list[tuple[torch.Tensor, torch.Tensor]], args: argparse.Namespace) -> str:
    """The time of a step besides its kernels, fused torch AdamW's against each hf_paged optimizer's without a
    budget: the fastest of :data:`OVERHEAD_ROUNDS` interleaved rounds (Python work, which interference from the
    rest of the machine only lengthens); the target line, ``n/a`` where the kernels are not the host's."""
    rounds = OVERHEAD_ROUNDS * args.steps
    label = f"step overhead (kernels skipped, {format_size(args.page_size[0])} pages, fastest of {rounds} steps)"
    if args.device.type != "cpu" or not host_kernels_enabled():
        return f"{label}: n/a (measured on the CPU with the host kernels)"
    builders = {REFERENCE: baseline_builders()[REFERENCE]}
    for name in OVERHEAD_OPTIMIZERS:
        builders[name] = functools.partial(getattr(hf_paged, name), page_size=args.page_size[0])
    with kernels_skipped():
        runs = [prepare(name, "kernels skipped", build, master, args) for name, build in builders.items()]
        failed = [run for run in runs if isinstance(run, str)]
        failed = failed or [error for _, error in interleave(runs, args, rounds)]
        if failed:
            return f"{label}: n/a ({failed[0]})"
    microseconds = {run.name: 1e6 * min(run.seconds) for run in runs}
    reference = microseconds[REFERENCE]
    checks = [
        check(f"{name} {microseconds[name]:.0f} us", microseconds[name] / reference, OVERHEAD_TARGET, "x fused")
        for name in OVERHEAD_OPTIMIZERS
    ]
    return f"{label}: fused torch AdamW {reference:.0f} us; " + "; ".join(checks)


@dataclass
class AcceleratorPath:
    """One optimizer's steps on the accelerator path over a Llama layout, its kernels stubbed: with every page
    resident, and with half the state on the host."""

    layout: str
    optimizer: str
    kernels: str
    """The kernel family: ``triton`` or ``torch``."""
    params: int
    tensors: int
    pages: int
    kernel_calls: int
    """Kernel calls per resident step: launches of the Triton kernels, calls of the PyTorch kernels."""
    operator_calls: int
    host_ms: float
    """The fastest resident step, CPU time, its kernels stubbed."""
    streamed_pages: float
    """Pages copied to the device per step with half the state on the host."""
    streamed_kernel_calls: int
    streamed_host_ms: float
    """The fastest such step."""
    formats: int
    """State formats of the layout's pages (a launch takes pages of one)."""
    prefetch: int
    page_copy_us: float
    """The reference measured in the same run: microseconds to copy one page of the full-size model (see
    :func:`page_copy_microseconds`)."""

    @property
    def microseconds_per_streamed_page(self) -> float:
        """Host microseconds of the streamed step per page it streams."""
        return 1e3 * self.streamed_host_ms / self.streamed_pages if self.streamed_pages else float("nan")

    @property
    def launch_bound(self) -> float:
        """Issue 36's most launches of a streamed step: streamed pages / prefetch + 1, per state format."""
        return self.formats * (math.ceil(self.streamed_pages / max(1, self.prefetch)) + 1)


def page_copy_microseconds(nbytes: int, device: torch.device, repeats: int = 20) -> float:
    """The fastest of ``repeats`` copies of ``nbytes`` bytes to ``device``, in microseconds: from pinned memory
    (timed with events) on CUDA, a copy within host memory by one thread on the CPU (the stand-in for a page's
    copy there)."""
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        target.copy_(host, non_blocking=True)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return min(times)
    source, target = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread's copy: on a loaded machine a parallel copy waits for busy threads
    try:
        target.copy_(source)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            target.copy_(source)
            times.append((time.perf_counter() - start) * 1e6)
    finally:
        torch.set_num_threads(threads)
    return min(times)


@contextlib.contextmanager
def counted_triton_launches() -> Iterator[list[int]]:
    """Inside :func:`~hf_paged.kernels.stubbed_triton_kernels`: count the launches of its no-op compiled kernels.
    Yields a one-element list holding the count."""
    module = importlib.import_module("hf_paged.kernels.triton_kernels")
    count = [0]
    names = ("_update_batch_kernel", "_gather_batch_kernel")
    idle = {name: getattr(module, name) for name in names}

    class Counted:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: Any) -> Callable[..., None]:
            count[0] += 1
            return self.kernel[grid]

    for name in names:
        setattr(module, name, Counted(idle[name]))
    try:
        yield count
    finally:
        for name in names:
            setattr(module, name, idle[name])


def fastest_steps(optimizer: torch.optim.Optimizer, steps: int) -> float:
    """CPU seconds of this process in the fastest of ``steps`` steps of ``optimizer``: the host's work, which a shared
    machine's other processes slow down but do not add to."""
    seconds = []
    for _ in range(steps):
        start = time.process_time()
        optimizer.step()
        seconds.append(time.process_time() - start)
    return min(seconds)


def accelerator_path(layout: str, name: str, family: str, args: argparse.Namespace) -> AcceleratorPath:
    """Step ``name`` (bf16 parameters, ``--accelerator-page-size`` pages, ``--accelerator-prefetch``, ``compiled=True``)
    on the Llama layout ``layout`` as the pages of an accelerator take it with the kernel ``family``: ``triton``, the
    launch path of the Triton kernels on real tensors, each compiled kernel's launch a no-op
    (:func:`~hf_paged.kernels.stubbed_triton_kernels`), or ``torch``, the PyTorch kernels (host kernels off) in
    chunks of ``page_size / 8`` elements, each call a no-op. The first step lays the pages out and is not timed;
    then the fastest of ``--accelerator-steps`` steps with every page resident, and after a budget of half the
    state's bytes, one step to settle and the fastest of as many more, each streaming half the pages."""
    shapes = llama_shapes(LLAMA_LAYOUTS[layout])

    def skip(*args: Any, **kwargs: Any) -> None:
        return None

    print(f"{time.strftime('%H:%M:%S')} accelerator path {layout} {name} {family} ...", file=sys.stderr, flush=True)
    steps = args.accelerator_steps
    model_page = args.accelerator_page_size * LAYOUT_DIVISORS.get(layout, 1) ** 2
    with contextlib.ExitStack() as stack:
        stack.enter_context(host_kernels_disabled())
        if family == "triton":
            if not stack.enter_context(stubbed_triton_kernels()):
                raise RuntimeError("Triton does not import here (or HF_PAGED_KERNELS=torch)")
            kernel_calls = stack.enter_context(counted_triton_launches())
        else:
            kernel_calls = stack.enter_context(counted_kernel_calls(skip))
        params = []
        for shape in shapes:
            param = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
            param.grad = torch.zeros_like(param)
            params.append(param)
        optimizer = getattr(hf_paged, name)(
            params, page_size=args.accelerator_page_size, prefetch=args.accelerator_prefetch, compiled=True
        )
        optimizer.step()
        kernel_calls[0] = 0
        with OperatorCounter() as operators:
            optimizer.step()
        resident_calls = kernel_calls[0]
        host_seconds = fastest_steps(optimizer, steps)
        state = optimizer.paging_stats()
        optimizer.set_device_budget(state["device_bytes"] // 2)
        optimizer.step()
        page_ins, kernel_calls[0] = optimizer.paging_stats()["page_ins"], 0
        streamed_seconds = fastest_steps(optimizer, steps)
        streamed_pages = (optimizer.paging_stats()["page_ins"] - page_ins) / steps
        streamed_calls = kernel_calls[0] // steps
        formats = len({id(page.format) for page in optimizer._store.pages})
    return AcceleratorPath(
        layout=layout,
        optimizer=name,
        kernels=family,
        params=sum(math.prod(shape) for shape in shapes),
        tensors=len(shapes),
        pages=state["pages_total"],
        kernel_calls=resident_calls,
        operator_calls=operators.calls,
        host_ms=1e3 * host_seconds,
        streamed_pages=streamed_pages,
        streamed_kernel_calls=streamed_calls,
        streamed_host_ms=1e3 * streamed_seconds,
        formats=formats,
        prefetch=args.accelerator_prefetch,
        page_copy_us=page_copy_microseconds(model_page, args.device),
    )


ACCELERATOR_HEADER = [
    "layout",
    "parameters",
    "tensors",
    "optimizer",
    "kernels",
    "pages",
    "kernel calls/step",
    "operator calls/step",
    "host ms/step (kernels stubbed)",
    "half on host: pages streamed/step",
    "kernel calls/step (streamed)",
    "host ms/step (streamed)",
    "host us/streamed page",
    "launches/bound (streamed)",
    "page copy us (reference)",
    "host per page / page copy",
    "bitsandbytes launches/step",
]
ACCELERATOR_TARGETS = {"PagedAdamW": 20.0}
"""Issue 36's most host milliseconds of a resident step at 8B page counts, by optimizer (10 for the others)."""
MICROSECONDS_PER_PAGE_TARGET = 25.0
"""Issue 36's most host microseconds per streamed page."""


def accelerator_table(args: argparse.Namespace) -> tuple[str, list[AcceleratorPath]]:
    """The accelerator path of each ``--accelerator-layouts`` layout and ``--accelerator-optimizers`` optimizer as a
    markdown table, beside bitsandbytes' one kernel launch per tensor and step (a failed row says why), and the rows
    measured."""
    lines = ["| " + " | ".join(ACCELERATOR_HEADER) + " |", "|" + "---|" * len(ACCELERATOR_HEADER)]
    rows = []
    for layout in args.accelerator_layouts:
        for name in args.accelerator_optimizers:
            for family in args.accelerator_kernels:
                try:
                    row = accelerator_path(layout, name, family, args)
                except Exception as error:  # noqa: BLE001 (a benchmark reports failures and goes on)
                    tensors = len(llama_shapes(LLAMA_LAYOUTS[layout]))
                    cells = [layout, "", str(tensors), name, family] + [""] * (len(ACCELERATOR_HEADER) - 7)
                    cells += [f"failed: {failure(error)}", str(tensors)]
                    lines.append("| " + " | ".join(cells) + " |")
                    continue
                rows.append(row)
                lines.append("| " + " | ".join(accelerator_cells(row)) + " |")
    return "\n".join(lines), rows


def accelerator_cells(row: AcceleratorPath) -> list[str]:
    """The table cells of one accelerator path."""
    return [
        row.layout,
        f"{row.params:,}",
        str(row.tensors),
        row.optimizer,
        row.kernels,
        f"{row.pages:,}",
        f"{row.kernel_calls:,}",
        f"{row.operator_calls:,}",
        f"{row.host_ms:.1f}",
        f"{row.streamed_pages:,.0f}",
        f"{row.streamed_kernel_calls:,}",
        f"{row.streamed_host_ms:.1f}",
        f"{row.microseconds_per_streamed_page:.1f}",
        f"{row.streamed_kernel_calls:,} / {row.launch_bound:,.0f}",
        f"{row.page_copy_us:.1f}",
        f"{row.microseconds_per_streamed_page / row.page_copy_us:.2f}x",
        str(row.tensors),
    ]


def accelerator_targets(rows: list[AcceleratorPath]) -> list[str]:
    """Issue 36's targets for each Triton row of an 8B-sized layout: resident host ms, host us per streamed page,
    launches of a streamed step against their bound."""
    verdicts = []
    for row in rows:
        if row.kernels != "triton" or not row.layout.startswith("8B"):
            continue
        where = f"{row.layout} {row.optimizer}"
        resident = ACCELERATOR_TARGETS.get(row.optimizer, 10.0)
        verdicts += [
            check(f"{where} resident host", row.host_ms, resident, " ms"),
            check(
                f"{where} streamed host", row.microseconds_per_streamed_page, MICROSECONDS_PER_PAGE_TARGET, " us/page"
            ),
            check(f"{where} streamed launches", row.streamed_kernel_calls, row.launch_bound, ""),
        ]
    return verdicts


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shapes = layer_shapes(args.params) if args.layout == "stack" else llama_shapes(LLAMA_LAYOUTS["llama-133M"])
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
        if dtype_name == "fp32":
            overhead = f"- fp32, {step_overheads(master, args)}"
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
        if dtype_name == "fp32":
            verdicts.append(overhead)
    print("Targets:\n" + "\n".join(verdicts))
    if args.accelerator_layouts and args.accelerator_optimizers:
        print(
            f"\n## Accelerator path: host time per step, kernels stubbed\n\n"
            f"bf16 parameters, {format_size(args.accelerator_page_size)} pages, prefetch {args.accelerator_prefetch}, "
            "real tensors on the CPU; the Triton kernels' launch path (tables in host memory, copied to the device; "
            "one launch per page batch and state format) or the PyTorch kernels in chunks of page_size / 8 "
            f"(compiled); the host's CPU time of the fastest of {args.accelerator_steps} steps, every page resident and "
            "then half the state's bytes as the budget. Launches of a streamed step against issue 36's bound (streamed "
            "pages / prefetch + 1, per state format); the reference, measured in this run: one copy of a page of the "
            "full-size model (the layout's page size times 256 for the /16 layouts), "
            + ("pinned host to device" if args.device.type == "cuda" else "within host memory")
            + ", fastest of 20. bitsandbytes launches one kernel per tensor and step.\n"
        )
        table, rows = accelerator_table(args)
        print(table)
        verdicts = accelerator_targets(rows)
        if verdicts:
            print("\nAccelerator targets:\n" + "\n".join(f"- {verdict}" for verdict in verdicts))
    print(f"\nAt the end: {load_average()}")


if __name__ == "__main__":
    main()
