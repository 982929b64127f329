"""The memory timeline on disk: one JSON row per optimizer step, and its plot."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

GIB = 2**30
MIB = 2**20

PLOT_SIZE_INCHES = (10.0, 6.0)
PLOT_DPI = 100
"""The plot is ``PLOT_SIZE_INCHES × PLOT_DPI`` pixels: 1000 × 600."""


def write_rows(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Write ``rows`` to ``path`` as JSON lines, replacing the file atomically."""
    partial = f"{path}.partial"
    with open(partial, "w") as file:
        file.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(partial, path)


def read_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a timeline written by :func:`write_rows` (none if the file is missing)."""
    if not os.path.exists(path):
        return []
    with open(path) as file:
        return [json.loads(line) for line in file if line.strip()]


def plot_rows(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Draw per-phase peaks with spikes marked, and the optimizer's budget and device bytes, to a PNG.

    Raises:
        ImportError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("drawing memory_timeline.png needs matplotlib: pip install 'hf-paged[plot]'") from error
    steps = [row["step"] for row in rows]
    figure = Figure(figsize=PLOT_SIZE_INCHES, dpi=PLOT_DPI)
    peaks, state = figure.subplots(2, 1, sharex=True)
    peaks.plot(steps, [row["forward_backward_peak"] / GIB for row in rows], label="forward + backward peak")
    peaks.plot(steps, [row["optimizer_step_peak"] / GIB for row in rows], label="optimizer step peak")
    spikes = [row for row in rows if row["spike"]]
    if spikes:
        peaks.scatter(
            [row["step"] for row in spikes],
            [row["forward_backward_peak"] / GIB for row in spikes],
            color="red",
            zorder=3,
            label="spike",
        )
    capacity = rows[-1]["capacity"] if rows else 0
    highest = max((max(row["forward_backward_peak"], row["optimizer_step_peak"]) for row in rows), default=0)
    if capacity <= 1.5 * highest:
        peaks.axhline(capacity / GIB, color="gray", linestyle="--", label="capacity")
    peaks.set_ylabel("GiB")
    peaks.set_title(f"Memory per phase of each optimizer step (capacity {capacity / GIB:.1f} GiB)")
    peaks.legend(loc="upper left", fontsize="small")
    for key, label in (
        ("device_budget", "device budget"),
        ("state_bytes_forward", "optimizer state on device, forward"),
        ("state_bytes_after_step", "optimizer state on device, after step"),
    ):
        known = [row for row in rows if row.get(key) is not None]
        if known:
            state.step([row["step"] for row in known], [row[key] / MIB for row in known], where="post", label=label)
    state.set_yscale("symlog", linthresh=0.01)  # the budget may exceed the state by orders of magnitude
    state.set_xlabel("optimizer step")
    state.set_ylabel("MiB (log scale)")
    state.legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
