"""Spike detection on a series of memory peaks: a rolling median baseline with a robust spread."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass

MAD_TO_SIGMA = 1.4826
"""Median absolute deviation to standard deviation, for normally distributed values."""


@dataclass
class Spike:
    """One step whose peak rose above the baseline: the step, its peak and its excess over the baseline (bytes)."""

    step: int
    peak: int
    size: int


class SpikeDetector:
    """Flags peaks above ``median × (1 + margin)`` and ``median + sigmas × 1.4826 × MAD`` of the last ``window``.

    Args:
        window: recent peaks the baseline is taken over.
        warmup: peaks observed before any is judged, at most ``window``.
        margin: fraction above the median a peak must exceed.
        sigmas: robust standard deviations above the median a peak must exceed.
    """

    def __init__(self, window: int = 20, warmup: int = 5, margin: float = 0.1, sigmas: float = 3.0) -> None:
        for name, value, low in (("window", window, 1), ("warmup", warmup, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if warmup > window:
            raise ValueError(
                f"warmup must be at most window ({window}): peaks are judged once warmup of them are in the window, "
                f"got {warmup}"
            )
        for name, value in (("margin", margin), ("sigmas", sigmas)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        self.warmup = warmup
        self.margin = float(margin)
        self.sigmas = float(sigmas)
        self.peaks: deque[int] = deque(maxlen=window)
        self.spikes: list[Spike] = []

    def baseline(self) -> tuple[int, int] | None:
        """The median of the recent peaks and the threshold above it, ``None`` during warm-up (bytes)."""
        if len(self.peaks) < self.warmup:
            return None
        median = statistics.median(self.peaks)
        spread = statistics.median(abs(peak - median) for peak in self.peaks) * MAD_TO_SIGMA
        return int(median), int(max(median * (1 + self.margin), median + self.sigmas * spread))

    def observe(self, step: int, peak: int) -> Spike | None:
        """Judge ``peak`` of ``step`` against the baseline before it, then add it; return the spike, if one."""
        baseline = self.baseline()
        self.peaks.append(int(peak))
        if baseline is None or peak <= baseline[1]:
            return None
        spike = Spike(step=step, peak=int(peak), size=int(peak) - baseline[0])
        self.spikes.append(spike)
        return spike

    def state(self) -> dict[str, list]:
        """The recent peaks and the spikes so far, as JSON-serialisable lists."""
        return {"peaks": list(self.peaks), "spikes": [asdict(spike) for spike in self.spikes]}

    def load_state(self, state: dict[str, Iterable]) -> None:
        """Restore what :meth:`state` returned."""
        self.peaks.clear()
        self.peaks.extend(int(peak) for peak in state["peaks"])
        self.spikes = [Spike(**spike) for spike in state["spikes"]]
