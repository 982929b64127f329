"""The memory timeline on disk: one JSON row per optimizer step, and its plot."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

GIB = 2**30
MIB = 2**20
KIB = 2**10

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


def _unit(nbytes: float) -> tuple[int, str]:
    """The binary unit (bytes per unit, name) that shows ``nbytes`` as a number from 1 upwards."""
    for scale, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if nbytes >= scale:
            return scale, name
    return 1, "bytes"


def plot_rows(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Draw a PNG of the timeline: per-phase peaks with spikes and out-of-memory recoveries marked; and the
    optimizer's budget, its state on the device at forward/backward and after the step, and the bytes moved
    each way per step (linear when these are of one order of magnitude, else on a log scale).

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
    recoveries = [row["step"] for row in rows if row.get("oom_recoveries")]
    for axes in (peaks, state):
        for index, step in enumerate(recoveries):
            label = "out-of-memory recovery" if index == 0 and axes is peaks else None
            axes.axvline(step, color="red", linestyle=":", linewidth=1.5, label=label)
    capacity = rows[-1]["capacity"] if rows else 0
    highest = max((max(row["forward_backward_peak"], row["optimizer_step_peak"]) for row in rows), default=0)
    if capacity <= 1.5 * highest:
        peaks.axhline(capacity / GIB, color="gray", linestyle="--", label="capacity")
    peaks.set_ylabel("GiB")
    title = f"Memory per phase of each optimizer step (capacity {capacity / GIB:.1f} GiB"
    figure.suptitle(title + (f"; out-of-memory recoveries: {len(recoveries)})" if recoveries else ")"))
    peaks.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    series = [
        (key, label, style)
        for key, label, style in (
            ("device_budget", "device budget", {"color": "black", "linestyle": "--", "zorder": 3}),
            ("state_bytes_forward", "optimizer state on device, forward + backward", {}),
            ("state_bytes_after_step", "optimizer state on device, after step", {}),
            ("bytes_to_device", "moved to device in the step", {"marker": ".", "markersize": 4, "linestyle": "none"}),
            ("bytes_to_host", "moved to host in the step", {"marker": "x", "markersize": 3, "linestyle": "none"}),
        )
        if any(row.get(key) is not None for row in rows)
    ]
    values = [row[key] for key, _, _ in series for row in rows if row.get(key)]
    moved = [
        row[key]
        for key in ("state_bytes_forward", "state_bytes_after_step", "bytes_to_device", "bytes_to_host")
        for row in rows
        if row.get(key)
    ]
    scale, unit = _unit(max(moved, default=max(values, default=0)))
    logarithmic = bool(values) and max(values) > 10 * max(moved, default=1)
    for key, label, style in series:
        known = [row for row in rows if row.get(key) is not None]
        xs, ys = [row["step"] for row in known], [row[key] / scale for row in known]
        if style.get("linestyle") == "none":
            state.plot(xs, ys, label=label, **style)
        else:
            state.step(xs, ys, where="post", label=label, **style)
    if logarithmic:  # an automatic budget may exceed the state by orders of magnitude
        state.set_yscale("symlog", linthresh=1)
    state.set_xlabel("optimizer step")
    state.set_ylabel(unit + (" (log scale)" if logarithmic else ""))
    state.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    figure.tight_layout()
    partial = f"{path}.partial.png"  # replaced atomically, as the rows are
    figure.savefig(partial)
    os.replace(partial, path)
