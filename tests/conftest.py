"""Shared fixtures: tiny models and training loops that every optimizer test runs on."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from unittest import mock

os.environ.setdefault("HF_PAGED_COMPILE", "0")
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # Workers share the cores: PyTorch's threads in each worker, and in the processes it launches, would otherwise
    # outnumber them and spin while they wait (the suite took 900 s on two cores with two threads per worker, 508 s
    # with one). Set before PyTorch is first imported, which reads it then.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    # Triton runs kernels in its interpreter only where TRITON_INTERPRET=1 was set at its first import, which comes
    # here, before any test module's: tests/test_triton_kernels.py sets it again while its tests run, and other tests
    # see the environment as it was.
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        import triton.language  # noqa: F401

import hf_paged
from hf_paged import native

OPTIMIZERS = {
    "PagedAdamW": hf_paged.PagedAdamW,
    "PagedAdamW4bit": hf_paged.PagedAdamW4bit,
    "PagedAdamW8bit": hf_paged.PagedAdamW8bit,
    "PagedLion": hf_paged.PagedLion,
    "PagedLion8bit": hf_paged.PagedLion8bit,
    "PagedAdEMAMix": hf_paged.PagedAdEMAMix,
    "PagedAdEMAMix8bit": hf_paged.PagedAdEMAMix8bit,
    "PagedAdEMAMix4bit": hf_paged.PagedAdEMAMix4bit,
}


CAPABILITY_LADDER = ("default", "avx2", "avx512")
"""The CPU capabilities the host kernels are built for, lowest first (tests/test_native_variants.py runs each one
this machine can)."""

_background_builds: list[subprocess.Popen] = []

MOST_WORKERS = 8
"""The most workers ``-n auto`` starts: each holds PyTorch and transformers (about 1 GB) and launches runs of two
processes."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core this process may run on, at most :data:`MOST_WORKERS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, MOST_WORKERS)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start building the host kernels of this process's capability and of every one below it that is not built yet,
    each in its own process, before the tests are collected: this process's build (about 20 s of one core the first
    time) then runs on the core collection leaves idle, so the first test that steps with the host kernels finds them
    built or nearly, and the builds of the lower capabilities, at the lowest nice level, use a core the tests leave
    idle instead of running when tests/test_native_variants.py first needs them. Nothing starts where the host kernels
    are off (``HF_PAGED_NATIVE=0``), where ``ATEN_CPU_CAPABILITY`` is set (test_native_variants.py's own runs) or where
    PyTorch's capability is not one the host kernels are built for. Under ``-n``, the controlling process starts
    them for its workers."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    current = torch.backends.cpu.get_cpu_capability().lower()
    if "ATEN_CPU_CAPABILITY" in os.environ or native.native_setting() is False or current not in CAPABILITY_LADDER:
        return
    for capability in CAPABILITY_LADDER[: CAPABILITY_LADDER.index(current) + 1]:
        name = native.build_name(capability)
        if (native.extension_directory(name) / f"{name}.so").exists():
            continue
        niceness = 0 if capability == current else 19
        code = f"import os; os.nice({niceness}); from hf_paged import native; native.build_failure()"
        environment = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1"}
        _background_builds.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=environment,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the background builds and their compilers where the run was interrupted (the next builder removes the
    lock a stopped build leaves: hf_paged/native/__init__.py); otherwise those still going finish on their own, and a
    short run does not wait for them."""
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        for build in _background_builds:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(build.pid, signal.SIGKILL)
            build.wait()


def runs_slow_tests(config: pytest.Config) -> bool:
    """Whether this run takes the tests marked ``slow``: ``HF_PAGED_SLOW=1`` or a ``-m`` expression asks for them."""
    markexpr = config.getoption("markexpr") or ""
    return os.environ.get("HF_PAGED_SLOW") == "1" or ("slow" in markexpr and "not slow" not in markexpr)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``slow`` unless :func:`runs_slow_tests`."""
    if runs_slow_tests(config):
        return
    skip = pytest.mark.skip(reason="slow: run with HF_PAGED_SLOW=1 or -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def make_mlp(seed: int = 0, hidden: int = 64, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A small MLP (20 -> hidden -> hidden -> 3) with deterministic weights."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, 3),
    )
    return model.to(dtype)


def decay_groups(model: torch.nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Two param groups as the Trainer builds them: matrices with weight decay, vectors without."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]


def regression_batches(steps: int, seed: int = 1, dtype: torch.dtype = torch.float32):
    """``steps`` fixed (input, target) batches of a smooth regression task."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(20, 3, generator=generator)
    batches = []
    for _ in range(steps):
        inputs = torch.randn(64, 20, generator=generator)
        targets = torch.tanh(inputs @ weight) + 0.05 * torch.randn(64, 3, generator=generator)
        batches.append((inputs.to(dtype), targets.to(dtype)))
    return batches


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches) -> list[float]:
    """Run one optimizer step per batch; return the losses."""
    losses = []
    for inputs, targets in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs).float(), targets.float())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def deviation(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Relative distance of ``model``'s parameters from ``reference``'s, all flattened into one vector."""
    flat = torch.cat([param.detach().reshape(-1) for param in model.parameters()])
    expected = torch.cat([param.detach().reshape(-1) for param in reference.parameters()])
    return ((flat - expected).norm() / expected.norm()).item()


def second_moment_midpoints(block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients whose squares, AdamW's second moment with beta2 = 0, lie on the midpoints between adjacent 4-bit
    levels in the square-root domain, one fp32 step below and above each, and between each and the midpoint of the
    fourth-root domain (a quarter of 1 / 512 below), in two blocks of ``block_size`` whose second moments' scales are
    1 and 2**-20 (the roots of the squares are exact), and the lowest and highest code each may take: a midpoint
    takes the upper level, a value between the two domains' midpoints the lower one, and one step below a midpoint
    the lower one, or the upper where ``sqrt(1024 sqrt(x) - 1)`` rounds up to the odd integer (codecs.encode_4bit)."""
    k = torch.arange(1, 16)
    midpoints = ((2 * k * k + 2 * k + 1) / 512).float()
    below, above = torch.nextafter(midpoints, torch.zeros(1)), torch.nextafter(midpoints, torch.ones(1))
    between = midpoints - 0.25 / 512
    roots = torch.cat([torch.ones(1), midpoints, below, between, above])
    lowest = torch.cat([torch.tensor([15]), k, k - 1, k - 1, k])
    highest = torch.cat([torch.tensor([15]), k, k, k - 1, k])
    padding = block_size - roots.numel()
    block, lowest, highest = (torch.nn.functional.pad(values, (0, padding)) for values in (roots, lowest, highest))
    return torch.stack([block, block * 2.0**-10]), lowest.expand(2, -1), highest.expand(2, -1)


def optimizer_kwargs(name: str, **paging) -> dict:
    """Keyword arguments that give every optimizer several pages of state on the tiny MLP."""
    kwargs = {"lr": 1e-3 if "Lion" in name else 1e-2, "page_size": 4096, **paging}
    if name.endswith("8bit"):
        kwargs.update(block_size=64, min_8bit_size=256)
    if name.endswith("4bit"):
        kwargs.update(block_size=64, min_4bit_size=256)
    return kwargs


@pytest.fixture(scope="module")
def built():
    """The host kernels, built (or loaded from the cache) once for the process; skips where they cannot be."""
    reason = native.build_failure()
    if reason is not None:
        pytest.skip(f"host kernels unavailable: {reason}")


@pytest.fixture(params=sorted(OPTIMIZERS))
def optimizer_name(request) -> str:
    return request.param
