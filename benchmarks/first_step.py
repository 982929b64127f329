"""Benchmark the first optimizer step against later ones: the stall a user sees when training starts.

Each optimizer runs in a fresh process with an empty ``torch.compile`` cache (a cold start, as on a new
machine), on a small transformer-like stack of parameters, with default settings. The table gives the
first step, the median of the later steps, the difference (the first-step overhead) and whether the
optimizer compiled its kernels. ``torch.optim.AdamW(fused=True)`` is the reference.

    PYTHONPATH=. python benchmarks/first_step.py [--params 300K] [--steps 6] [--compile default|0|1]

``--compile 1`` sets ``HF_PAGED_COMPILE=1`` (compile whatever the size), as the default was before it
compiled only states of ``hf_paged.kernels.COMPILE_MIN_ELEMENTS`` elements or more.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

OPTIMIZERS = ("torch AdamW fused", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW4bit", "PagedLion", "PagedLion8bit")


def parse_count(text: str) -> int:
    """An element count such as ``300K`` or ``4M`` (K = 2**10, M = 2**20)."""
    factors = {"K": 2**10, "M": 2**20}
    suffix = text[-1:].upper()
    count = int(float(text[:-1]) * factors[suffix]) if suffix in factors else int(text)
    if count <= 0:
        raise argparse.ArgumentTypeError(f"--params must be a positive count such as 300K, got {text!r}")
    return count


def step_times(name: str, numel: int, steps: int) -> dict:
    """Run in the child process: ``steps`` steps of optimizer ``name`` on about ``numel`` parameters."""
    import torch

    import hf_paged

    torch.manual_seed(0)
    width = max(8, int((numel / 12) ** 0.5))
    shapes = [(width, width)] * 12 + [(width,)] * 12
    params = [torch.nn.Parameter(torch.randn(shape) * 0.02) for shape in shapes]
    if name == "torch AdamW fused":
        optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    else:
        optimizer = getattr(hf_paged, name)(params, lr=1e-3)
    times = []
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn_like(param)
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    compiled = getattr(optimizer, "compiled", False)
    return {"numel": sum(param.numel() for param in params), "times": times, "compiled": compiled}


def run_fresh(name: str, numel: int, steps: int, compile_setting: str) -> dict:
    """``step_times`` in a new process with an empty Inductor cache and ``HF_PAGED_COMPILE`` as set."""
    with tempfile.TemporaryDirectory() as cache:
        environment = {key: value for key, value in os.environ.items() if key != "HF_PAGED_COMPILE"}
        environment["TORCHINDUCTOR_CACHE_DIR"] = cache
        if compile_setting != "default":
            environment["HF_PAGED_COMPILE"] = compile_setting
        command = [sys.executable, __file__, "--child", name, "--params", str(numel), "--steps", str(steps)]
        result = subprocess.run(command, capture_output=True, text=True, env=environment, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{name}: the child process failed:\n{result.stderr[-2000:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=parse_count, default=parse_count("300K"), help="parameter elements")
    parser.add_argument("--steps", type=int, default=6, help="steps per optimizer, the first included (>= 2)")
    parser.add_argument("--compile", choices=("default", "0", "1"), default="default", help="HF_PAGED_COMPILE")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    if args.child:
        print(json.dumps(step_times(args.child, args.params, args.steps)))
        return
    setting = "unset" if args.compile == "default" else args.compile
    print(f"First step against later ones: {args.params} parameters requested, cold torch.compile cache, ", end="")
    print(f"HF_PAGED_COMPILE {setting}\n")
    print("| optimizer | params | first step ms | later steps ms (median) | first-step overhead s | compiled |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in OPTIMIZERS:
        measured = run_fresh(name, args.params, args.steps, args.compile)
        first, later = measured["times"][0], statistics.median(measured["times"][1:])
        print(
            f"| {name} | {measured['numel']} | {first * 1e3:.1f} | {later * 1e3:.1f} | {first - later:.3f} "
            f"| {'yes' if measured['compiled'] else 'no'} |"
        )


if __name__ == "__main__":
    main()
