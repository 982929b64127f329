"""``hf-paged env``: versions of the stack, the devices with their memory, and the optimizer names."""

from __future__ import annotations

import importlib.metadata
import os
import platform

import torch

from ..device import memory_for
from ..sizes import format_size

PACKAGES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "datasets", "hf-paged")
"""Distributions whose versions are reported."""


def versions() -> dict[str, str | None]:
    """Installed version of each of :data:`PACKAGES`, ``None`` where it is not installed."""
    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _cpu_name() -> str:
    """The processor's model name (from ``/proc/cpuinfo`` where there is one) and its logical cores."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} logical cores"


def devices() -> list[dict[str, object]]:
    """The CPU (physical and available RAM) and each CUDA device (name, total and free memory), in bytes."""
    host = memory_for(torch.device("cpu"))
    found: list[dict[str, object]] = [
        {
            "device": "cpu",
            "name": _cpu_name(),
            "total_bytes": host.total(),
            "free_bytes": host.free(),
        }
    ]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            device = torch.device("cuda", index)
            memory = memory_for(device)
            found.append(
                {
                    "device": str(device),
                    "name": torch.cuda.get_device_name(index),
                    "total_bytes": memory.total(),
                    "free_bytes": memory.free(),
                }
            )
    return found


def report() -> str:
    """What ``hf-paged env`` prints."""
    from ..integrations.trainer import OPTIMIZER_NAMES

    lines = [f"python        {platform.python_version()} ({platform.system()} {platform.machine()})"]
    lines += [f"{name:<13} {version or 'not installed'}" for name, version in versions().items()]
    lines.append("devices:")
    for entry in devices():
        lines.append(
            f"  {entry['device']:<7} {entry['name']}: {format_size(entry['total_bytes'])} total, "
            f"{format_size(entry['free_bytes'])} free"
        )
    if not torch.cuda.is_available():
        lines.append("  (no CUDA device)")
    lines.append("optimizers (TrainingArguments optim=): " + ", ".join(OPTIMIZER_NAMES))
    return "\n".join(lines)
