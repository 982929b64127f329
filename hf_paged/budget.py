"""The automatic device budget: optimizer state gets what the measured memory of training leaves free.

With usable memory ``U = min(capacity, free + reserved) × (1 − safety_margin)`` (``free`` as the driver reports it,
so other processes on the device and the context count; ``reserved`` what this process holds):

* between steps (the forward/backward to come): ``budget = s × (U − P)``, where ``P`` is the predicted peak of
  forward and backward without optimizer state: the highest of the exact peaks measured in the last
  ``window`` steps of any optimizer measuring the device, each the peak since the end of the step before
  (of any of them) minus the optimizer state (of all of them) the device held then, or the last exact peak
  when none of those steps had one; ``s`` is the optimizer's share of the state of all optimizers with
  automatic budgets on the device (1 for one optimizer), so their budgets together leave room for the peak.
  A peak the probe only sampled (a device whose high-water mark is not reset, in a phase below an earlier
  high) misses the phase's activations and never enters the prediction; until a step has an exact peak,
  ``budget = 0``. A planned peak (:meth:`AutoBudget.expect`, e.g. from :func:`hf_paged.plan`) counts as one
  exact peak observed before the first step: from step 1 the budget leaves room for it; a higher measured peak
  takes over at once, a lower one once the plan has left the window (``window`` steps later); it stays the last
  exact peak until a step has one;
* during a step: ``budget = U − (A − S) − W``, where ``A`` is allocated now, ``S`` the optimizer state on the
  device and ``W`` the step's workspace (the temporaries of one chunk of a page, see
  ``PagedOptimizer.step_workspace``); at least the largest page, so a step always runs.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .memory import MemoryProbe, probe_for
from .sizes import parse_size

if TYPE_CHECKING:
    from .planner import MemoryPlan

StateBytes = Callable[[], tuple[int, int]]
"""An optimizer's state on one device: ``(bytes on the device now, bytes of all its pages)``."""

_PEERS: weakref.WeakKeyDictionary[MemoryProbe, weakref.WeakSet[AutoBudget]] = weakref.WeakKeyDictionary()
"""The automatic budgets that measure each probe: the optimizers sharing a device."""


class AutoBudget:
    """Device budget that follows measurements (``device_budget="auto"`` of the paged optimizers).

    Args:
        safety_margin: fraction of the capacity kept free, in [0, 1).
        window: optimizer steps whose forward/backward peaks predict the next one.
        capacity: bytes (or a string such as ``"24GiB"``) the device offers; ``None`` takes the probe's
            (``HF_PAGED_DEVICE_CAPACITY``, else the device's total memory).
        probe: the probe to measure with; ``None`` uses the shared probe of the parameters' device.
        planned_peak: the forward/backward peak to expect before any is measured, see :meth:`expect`.
    """

    _planned: int | None = None
    _planned_for: str | None = None
    _planned_steps: int = 0
    _owner: weakref.ref | None = None

    def __init__(
        self,
        safety_margin: float = 0.1,
        window: int = 20,
        capacity: int | str | None = None,
        probe: MemoryProbe | None = None,
        planned_peak: int | str | MemoryPlan | None = None,
    ) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self.safety_margin = safety_margin
        self.capacity = capacity
        self._peaks: deque[int | None] = deque(maxlen=window)
        self._last_exact: int | None = None
        self._state: StateBytes | None = None
        self.probe = probe
        if planned_peak is not None:
            self.expect(planned_peak)

    def __getstate__(self) -> dict:
        """Copies and pickles keep the settings and measured peaks, not the probe nor the optimizer's state:
        binding measures again."""
        return {**self.__dict__, "probe": None, "_state": None, "_owner": None}

    def bind(self, device: torch.device, state: StateBytes | None = None, owner: object | None = None) -> None:
        """Measure ``device`` with its shared probe unless a probe was given, for the optimizer ``owner`` whose state
        there ``state`` reports; the automatic budgets of all optimizers on one probe share its memory.

        Raises ValueError where this budget measures another optimizer still (each needs its own, or their budgets
        together would take the room twice), or a plan given for another kind of device."""
        bound = self._owner() if self._owner is not None else None
        if owner is not None and bound is not None and bound is not owner:
            raise ValueError(
                "device_budget: this AutoBudget already sets another optimizer's budget; give each optimizer its own "
                "('auto', or an AutoBudget each): optimizers on one device share its room through their own budgets"
            )
        probe = self.probe if self.probe is not None else probe_for(device)
        _check_plan_device(self._planned_for, probe)
        self.probe, self._state = probe, state
        self._owner = None if owner is None else weakref.ref(owner)
        _PEERS.setdefault(self.probe, weakref.WeakSet()).add(self)

    def unbind(self) -> None:
        """Stop measuring for the optimizer this budget was bound to (which no longer uses it): it is no longer one
        of the device's peers, whose shares of the room it would lower."""
        peers = _PEERS.get(self.probe) if self.probe is not None else None
        if peers is not None:
            peers.discard(self)
        self._state, self._owner = None, None

    def alone(self) -> bool:
        """Whether no other bound automatic budget measures this budget's probe."""
        return not [peer for peer in self._peers() if peer is not self]

    def _peers(self) -> list[AutoBudget]:
        """The bound automatic budgets on this budget's probe that know their optimizer's state, this one included."""
        if self.probe is None:
            return [self]
        peers = [peer for peer in _PEERS.get(self.probe, ()) if peer._state is not None]
        return peers if self in peers else [*peers, self]

    def state_bytes(self) -> int:
        """Bytes of optimizer state on the device now: of every optimizer whose automatic budget measures it."""
        return sum(peer._state()[0] for peer in self._peers() if peer._state is not None)

    def share(self) -> float:
        """This optimizer's share of the room left for optimizer state: its pages' bytes over those of all the
        optimizers measuring the device (equal shares while one of them has no pages yet)."""
        totals = [(peer is self, peer._state()[1]) for peer in self._peers() if peer._state is not None]
        if len(totals) <= 1:
            return 1.0
        if not all(total for _, total in totals):
            return 1 / len(totals)
        own = next(total for mine, total in totals if mine)
        return own / sum(total for _, total in totals)

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
        if self._capacity is not None:
            return self._capacity
        if self.probe is None:
            raise ValueError(
                "capacity: this AutoBudget measures no device yet; give it capacity=, or an optimizer's device_budget"
            )
        return self.probe.capacity

    @capacity.setter
    def capacity(self, capacity: int | str | None) -> None:
        parsed = None if capacity is None else parse_size(capacity, "capacity")
        if parsed == 0:
            raise ValueError("capacity must be at least 1 byte (None: the device's), got 0")
        self._capacity = parsed

    @property
    def usable(self) -> int:
        """Bytes that training may use: the capacity, or what other processes leave of it (free memory as the
        driver reports it, plus what this process holds), less the safety margin."""
        available = self.capacity
        if self.probe is not None:
            available = min(available, self.probe.free() + self.probe.reserved())
        return int(available * (1 - self.safety_margin))

    def expect(self, planned_peak: int | str | MemoryPlan) -> None:
        """Start from a planned forward/backward peak without optimizer state instead of learning it.

        Args:
            planned_peak: bytes (or a string such as ``"12GiB"``), or a :class:`~hf_paged.planner.MemoryPlan`
                of this training, whose highest forward/backward peak less the optimizer state it held is taken
                (the plan of the device this budget measures: a CUDA plan's peaks are allocated bytes).

        The planned peak counts as one exact peak observed now: in :attr:`predicted_peak` for the next ``window``
        observed steps (a higher measured peak takes over at once, a lower one when the plan leaves the window),
        and as the last exact peak until a step has one. A later call replaces it.
        """
        if isinstance(planned_peak, (int, str)) and not isinstance(planned_peak, bool):
            peak = parse_size(planned_peak, "planned_peak")
            self._planned_for = None
        elif hasattr(planned_peak, "forward_backward_peak_without_state"):
            # a MemoryPlan, known by what is read of it: hf_paged.planner sits above the optimizers, which use this
            planned_for = torch.device(planned_peak.device).type
            if self.probe is not None:
                _check_plan_device(planned_for, self.probe)
            self._planned_for = planned_for
            peak = planned_peak.forward_backward_peak_without_state
        else:
            raise TypeError(
                f"planned_peak must be bytes, a size string such as '12GiB' or a MemoryPlan, got "
                f"{type(planned_peak).__name__}"
            )
        self._planned = peak
        self._planned_steps = self._peaks.maxlen

    @property
    def planned_peak(self) -> int | None:
        """The planned forward/backward peak without optimizer state (bytes) given to :meth:`expect`, ``None``
        without a plan."""
        return self._planned

    def observe(self, peak_without_state: int | None) -> None:
        """Record one step's forward/backward peak without optimizer state, in bytes.

        ``None`` for a step whose exact peak is unknown: it counts as a step of the window and nothing else.
        """
        peak = None if peak_without_state is None else max(0, int(peak_without_state))
        self._peaks.append(peak)
        self._planned_steps = max(0, self._planned_steps - 1)
        if peak is not None:
            self._last_exact = peak

    @property
    def predicted_peak(self) -> int | None:
        """The forward/backward peak without optimizer state expected next, ``None`` before any exact measurement
        or plan.

        Of each optimizer measuring the device, the highest exact peak of its last ``window`` steps, else its
        last exact peak, which never expires; the highest of these. (Several optimizers share one phase mark:
        the first to step after a forward/backward measures it, the next ones only the steps between.)
        """
        predictions = [peer._own_prediction() for peer in self._peers()]
        return max((peak for peak in predictions if peak is not None), default=None)

    def _own_prediction(self) -> int | None:
        peaks = [peak for peak in self._peaks if peak is not None]
        if self._planned_steps:
            peaks.append(self._planned)
        last = self._last_exact if self._last_exact is not None else self._planned
        return max(peaks, default=last)

    def resting_budget(self) -> int | None:
        """The budget for the coming forward/backward, ``None`` (leave it) before any step was observed or planned:
        this optimizer's :meth:`share` of what the predicted peak leaves of the usable memory.

        0 while the observed steps had no exact peak: nothing is known to fit beside the activations.
        """
        predicted = self.predicted_peak
        if predicted is None:
            return 0 if self._peaks else None
        return int(max(0, self.usable - predicted) * self.share())

    def step_budget(self, state_bytes: int, workspace: int, minimum: int) -> int:
        """The budget while the optimizer steps: what the step leaves free, at least ``minimum`` bytes."""
        others = self.probe.allocated() - state_bytes
        return max(minimum, self.usable - others - workspace)


def _check_plan_device(planned_for: str | None, probe: MemoryProbe) -> None:
    """A plan for the device type ``planned_for`` (``None``: no plan's) may budget the device ``probe`` measures."""
    if planned_for is not None and planned_for != probe.device.type:
        raise ValueError(
            f"planned_peak: the plan is for {planned_for}, this budget measures {probe.device}: plan for the device "
            "that trains"
        )
