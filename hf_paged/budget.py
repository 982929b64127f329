"""The automatic device budget: optimizer state gets what the measured memory of training leaves free.

With usable memory ``U = capacity × (1 − safety_margin)``:

* between steps (the forward/backward to come): ``budget = U − P``, where ``P`` is the predicted peak of
  forward and backward without optimizer state: the highest of the exact peaks measured in the last
  ``window`` steps, each the peak since the end of the previous step minus the optimizer state the device
  held then, or the last exact peak when none of those steps had one. A peak the probe only sampled (a
  device whose high-water mark is not reset, in a phase below an earlier high) misses the phase's
  activations and never enters the prediction; until a step has an exact peak, ``budget = 0``;
* during a step: ``budget = U − (A − S) − W``, where ``A`` is allocated now, ``S`` the optimizer state on the
  device and ``W`` the step's workspace (the temporaries of one chunk of a page, see
  ``PagedOptimizer.step_workspace``); at least the largest page, so a step always runs.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from .memory import MemoryProbe, probe_for
from .sizes import parse_size


class AutoBudget:
    """Device budget that follows measurements (``device_budget="auto"`` of the paged optimizers).

    Args:
        safety_margin: fraction of the capacity kept free, in [0, 1).
        window: optimizer steps whose forward/backward peaks predict the next one.
        capacity: bytes (or a string such as ``"24GiB"``) the device offers; ``None`` takes the probe's
            (``HF_PAGED_DEVICE_CAPACITY``, else the device's total memory).
        probe: the probe to measure with; ``None`` uses the shared probe of the parameters' device.
    """

    def __init__(
        self,
        safety_margin: float = 0.1,
        window: int = 20,
        capacity: int | str | None = None,
        probe: MemoryProbe | None = None,
    ) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self.safety_margin = safety_margin
        self.capacity = capacity
        self._peaks: deque[int | None] = deque(maxlen=window)
        self._last_exact: int | None = None
        self.probe = probe

    def __getstate__(self) -> dict:
        """Copies and pickles keep the settings and measured peaks, not the probe: binding measures again."""
        return {**self.__dict__, "probe": None}

    def bind(self, device: torch.device) -> None:
        """Measure ``device`` with its shared probe unless a probe was given."""
        if self.probe is None:
            self.probe = probe_for(device)

    @property
    def safety_margin(self) -> float:
        """Fraction of the capacity kept free."""
        return self._safety_margin

    @safety_margin.setter
    def safety_margin(self, safety_margin: float) -> None:
        if (
            not isinstance(safety_margin, (int, float))
            or isinstance(safety_margin, bool)
            or not math.isfinite(safety_margin)
            or not 0 <= safety_margin < 1
        ):
            raise ValueError(f"safety_margin must be a fraction in [0, 1), got {safety_margin!r}")
        self._safety_margin = float(safety_margin)

    @property
    def capacity(self) -> int:
        """Bytes the device offers: the one given, else the probe's."""
        return self._capacity if self._capacity is not None else self.probe.capacity

    @capacity.setter
    def capacity(self, capacity: int | str | None) -> None:
        self._capacity = None if capacity is None else parse_size(capacity, "capacity")

    @property
    def usable(self) -> int:
        """Bytes that training may use: the capacity less the safety margin."""
        return int(self.capacity * (1 - self.safety_margin))

    def observe(self, peak_without_state: int | None) -> None:
        """Record one step's forward/backward peak without optimizer state, in bytes.

        ``None`` for a step whose exact peak is unknown: it counts as a step of the window and nothing else.
        """
        peak = None if peak_without_state is None else max(0, int(peak_without_state))
        self._peaks.append(peak)
        if peak is not None:
            self._last_exact = peak

    @property
    def predicted_peak(self) -> int | None:
        """The forward/backward peak without optimizer state expected next, ``None`` before any exact measurement.

        The highest exact peak of the last ``window`` steps, else the last exact peak, which never expires.
        """
        return max((peak for peak in self._peaks if peak is not None), default=self._last_exact)

    def resting_budget(self) -> int | None:
        """The budget for the coming forward/backward, ``None`` (leave it) before any step was observed.

        0 while the observed steps had no exact peak: nothing is known to fit beside the activations.
        """
        predicted = self.predicted_peak
        if predicted is None:
            return 0 if self._peaks else None
        return max(0, self.usable - predicted)

    def step_budget(self, state_bytes: int, workspace: int, minimum: int) -> int:
        """The budget while the optimizer steps: what the step leaves free, at least ``minimum`` bytes."""
        others = self.probe.allocated() - state_bytes
        return max(minimum, self.usable - others - workspace)
