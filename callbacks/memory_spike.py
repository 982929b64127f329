"""``MemorySpikeCallback``: memory per phase of every optimizer step, spikes, steering and the timeline.

Each optimizer step is split into two phases by the Trainer's events:

* forward + backward of all micro-batches: from ``on_step_begin`` to ``on_pre_optimizer_step``;
* the optimizer step: from ``on_pre_optimizer_step`` to ``on_optimizer_step``.

For each step the callback keeps a row (bytes unless named otherwise): the peak of each phase, allocated,
reserved and capacity of the device, host resident memory, and, for hf-paged optimizers, the optimizer
state on the device during forward and after the step, the budget and what moved each way. The rows are
added under ``memory/`` to the Trainer's training logs (so they reach ``log_history`` and the ``report_to``
integrations, which may rename them: TensorBoard shows ``train/memory/...``) and written as
``memory_timeline.jsonl`` and ``memory_timeline.png`` in the output directory at each save and at the end of
training. A resume reads the rows back and rebuilds the spike detector from them.

In several processes (one node or several) every process measures its own device and host memory, and at each
training log the processes' ``memory/`` metrics are gathered once (one ``all_gather_object``); global rank 0 alone
adds them to the logs: each is the maximum over the job's processes (the device nearest its limit), except
``memory/capacity_gib``, the smallest device's, and ``memory/host_resident_gib``, the largest sum over the processes
of one node (they share its host memory). Across several nodes, ``memory/node_<n>/<name>`` gives the same for node
``n`` alone (nodes numbered by their lowest global rank, as torchrun's ``--node-rank``) for the peaks, allocated,
reserved and host resident memory. The timeline holds the measurements of the process that writes it: global rank 0,
and with ``save_on_each_node`` also each node's first process, in its node's output directory.

Given a plan (:func:`hf_paged.plan`, ``hf-paged train --plan``), the callback hands it to an automatic budget
(which then starts from the planned peak, see :meth:`hf_paged.budget.AutoBudget.expect`) and compares the measured
peaks of the first steps with it.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from hf_paged.device import HostMemory
from hf_paged.integrations._transformers_internals import calling_callback_handler, calling_trainer
from hf_paged.integrations.oom import disable_oom_recovery, enable_oom_recovery
from hf_paged.integrations.trainer import keep_trainer_memory_metrics
from hf_paged.memory import MemoryProbe, probe_for
from hf_paged.planner import FORWARD_BACKWARD, OPTIMIZER_STEP, PHASES, MemoryPlan
from hf_paged.recovery import Recovery
from hf_paged.sizes import format_size, parse_size
from hf_paged.stores import device_key

from .spikes import SpikeDetector
from .timeline import GIB, plot_rows, read_rows, write_rows

logger = logging.getLogger(__name__)

TIMELINE_NAME = "memory_timeline.jsonl"
PLOT_NAME = "memory_timeline.png"

_FORWARD_BACKWARD = "hf_paged.callback.forward_backward"
_OPTIMIZER_STEP = "hf_paged.callback.optimizer_step"

PLAN_TOLERANCE = 0.1
"""Relative difference between a measured and a planned peak above which the callback warns."""

PLANNED_STEPS = 2
"""Steps a plan given as bytes per phase covers (what :func:`hf_paged.plan` traces by default)."""

_PHASE_LABELS = {FORWARD_BACKWARD: "forward+backward", OPTIMIZER_STEP: "optimizer step"}

_MOVED = ("bytes_to_device", "bytes_to_host", "page_ins", "page_outs", "stall_seconds")

TRAINING_LOG_KEY = "loss"
"""The key that marks the Trainer's training logs, the only ones the ``memory/`` metrics join (its evaluation
entries carry ``eval_*`` keys, its end-of-training summary ``train_runtime`` and ``train_loss``)."""

NODE_METRICS = (
    "memory/forward_backward_peak_gib",
    "memory/optimizer_step_peak_gib",
    "memory/allocated_gib",
    "memory/reserved_gib",
    "memory/host_resident_gib",
)
"""The metrics also logged per node (``memory/node_<n>/...``) when the job spans several nodes."""

_PAGING_METRICS = (
    "memory/optimizer_device_bytes, memory/device_budget_bytes, memory/moved_to_device_gib, "
    "memory/moved_to_host_gib and memory/stall_seconds"
)


def paged_optimizer(optimizer: Any) -> Any | None:
    """The hf-paged optimizer inside ``optimizer`` (accelerate wraps it at ``.optimizer``), if there is one."""
    while optimizer is not None and not hasattr(optimizer, "paging_stats"):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


class MemorySpikeCallback(TrainerCallback, ExportableState):
    """Measure memory per phase of every optimizer step, detect spikes, steer the budget, draw the timeline.

    Args:
        window: steps of forward/backward peaks the spike baseline (rolling median and MAD) covers.
        warmup: steps measured before spikes are judged, at most ``window``.
        spike_margin: fraction above the baseline's median a forward/backward peak must exceed to be a spike
            (it must also exceed the median by 3 robust standard deviations).
        device_capacity: bytes (or a string such as ``"24GiB"``) the device offers (the Trainer's, ``args.device``,
            which the callback measures); ``None`` reads ``HF_PAGED_DEVICE_CAPACITY``, else the device's total
            memory. That device's automatic budget uses it too.
        safety_margin: fraction of the capacity an automatic budget keeps free, on every device; ``None`` leaves
            the optimizer's (0.1 by default).
        warn_fraction: warn, once, when the predicted peak reaches this fraction of the capacity.
        plot: draw ``memory_timeline.png`` (needs matplotlib) besides writing ``memory_timeline.jsonl``.
        oom_retries: times a training step may recover from an out-of-memory error in forward or backward
            (all optimizer state moves to the host and the step's micro-batches are replayed exactly, see
            :func:`hf_paged.integrations.oom.enable_oom_recovery`; in one process not under DeepSpeed, or under DDP
            on every rank), and, as many times, from one in the optimizer's step (the pages left are updated under a
            smaller budget, in any number of processes); 0 turns recovery off. Only with an hf-paged optimizer: with
            another, recovery, the budget and the paging metrics are off, which a warning says once.
        plan: the planned peaks of this training: a :class:`~hf_paged.planner.MemoryPlan` (for the device that
            trains), or bytes per phase (``{"forward_backward": ..., "optimizer_step": ...}``, the highest of the
            first :data:`PLANNED_STEPS` steps). A MemoryPlan is handed to an hf-paged optimizer's automatic budget
            (:meth:`~hf_paged.budget.AutoBudget.expect`). Each phase's highest measured peak over the planned steps
            is compared with the plan's, and a difference above :data:`PLAN_TOLERANCE` is warned of once, by how
            much per phase. An automatic budget is planned as no limit: when it moved optimizer state to the host
            in those steps, the run is not what was planned and the comparison is skipped (logged). On the CPU
            it is skipped too (logged once): the probe there reads the process's resident memory (allocator
            caches, libraries, the interpreter: 646 MiB of it against a 158 MiB tensor peak in issue 20), not the
            live tensor bytes the plan predicts, and measuring those would take the profiler's allocator events or
            a dispatch mode over every operator of the steps compared, slowing them; a CUDA or XPU probe reads
            the allocator's peaks, the plan's like.
    """

    def __init__(
        self,
        *,
        window: int = 20,
        warmup: int = 5,
        spike_margin: float = 0.1,
        device_capacity: int | str | None = None,
        safety_margin: float | None = None,
        warn_fraction: float = 0.9,
        plot: bool = True,
        oom_retries: int = 2,
        plan: MemoryPlan | Mapping[str, int | str] | None = None,
    ) -> None:
        if not isinstance(oom_retries, int) or isinstance(oom_retries, bool) or oom_retries < 0:
            raise ValueError(f"oom_retries must be an integer >= 0, got {oom_retries!r}")
        if not isinstance(warn_fraction, (int, float)) or isinstance(warn_fraction, bool) or not 0 < warn_fraction <= 1:
            raise ValueError(f"warn_fraction must be a fraction in (0, 1], got {warn_fraction!r}")
        if safety_margin is not None and (
            not isinstance(safety_margin, (int, float)) or isinstance(safety_margin, bool) or not 0 <= safety_margin < 1
        ):
            raise ValueError(f"safety_margin must be None or a fraction in [0, 1), got {safety_margin!r}")
        if (
            not isinstance(spike_margin, (int, float))
            or isinstance(spike_margin, bool)
            or not 0 <= spike_margin < math.inf
        ):
            raise ValueError(f"spike_margin must be a finite number >= 0, got {spike_margin!r}")
        self.detector = SpikeDetector(window=window, warmup=warmup, margin=spike_margin)
        self.device_capacity = None if device_capacity is None else parse_size(device_capacity, "device_capacity")
        if self.device_capacity == 0:
            raise ValueError("device_capacity must be at least 1 byte (None: the device's), got 0")
        self.safety_margin = safety_margin
        self.warn_fraction = warn_fraction
        self.plot = plot
        self.oom_retries = oom_retries
        self.oom_recoveries = 0
        self.plan = plan if isinstance(plan, MemoryPlan) else None
        self.planned_peaks, self.planned_steps = _planned_peaks(plan)
        self.plan_differences: dict[str, float] | None = None
        """Per phase, the measured peak over the planned one less 1 (``None`` until compared)."""
        self._compare_plan = False
        self._automatic_budget = False
        self._state_left_device = False
        self.rows: list[dict[str, Any]] = []
        self.warned = False
        self.timeline_path: str | None = None
        self.plot_path: str | None = None
        self._probe: MemoryProbe | None = None
        self._logged_rows = 0
        self._plot_unavailable = False
        self._handler_missing_warned = False
        self._not_paged_warned = False
        self._row: dict[str, Any] = {}
        self._stats_at_begin: dict[str, Any] | None = None
        self._stats_before_step: dict[str, Any] | None = None
        self._trainer: Any | None = None
        self._engine: Any | None = None
        """DeepSpeed's engine, whose ``step`` this callback measures as the optimizer step (see
        :meth:`_measure_engine_steps`)."""
        self._engine_own_step: Any | None = None
        self._job_peaks: dict[str, Any] | None = None

    # Resume -------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Constructor arguments and the measurements that must survive a resume (for ``ExportableState``)."""
        return {
            "args": {
                "window": self.detector.peaks.maxlen,
                "warmup": self.detector.warmup,
                "spike_margin": self.detector.margin,
                "device_capacity": self.device_capacity,
                "safety_margin": self.safety_margin,
                "warn_fraction": self.warn_fraction,
                "plot": self.plot,
                "oom_retries": self.oom_retries,
                "plan": self.planned_peaks,  # a MemoryPlan's peaks per phase (restored without the budget's hand-over)
            },
            "attributes": {
                "detector_state": self.detector.state(),
                "warned": self.warned,
                "oom_recoveries": self.oom_recoveries,
            },
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Take the measurements of a saved :meth:`state` (its ``attributes``), keeping this callback's arguments.

        With ``restore_callback_states_from_checkpoint=True`` the Trainer hands a checkpoint's state to the
        callback it was given (see :func:`hf_paged.integrations.trainer.register_resume`), so that the object the
        user holds goes on measuring, with the plan it was given.
        """
        for name, value in state["attributes"].items():
            setattr(self, name, value)

    @property
    def detector_state(self) -> dict[str, list]:
        return self.detector.state()

    @detector_state.setter
    def detector_state(self, state: dict[str, list]) -> None:
        self.detector.load_state(state)

    # Events ---------------------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self._run_before_integrations()
        self._job_peaks = None
        self._probe = probe_for(args.device)
        self._probe.reset_peaks = True
        keep_trainer_memory_metrics(args)
        auto_budgets = getattr(paged_optimizer(kwargs.get("optimizer")), "auto_budgets", {})
        for auto_budget in auto_budgets.values():
            if self.safety_margin is not None:
                auto_budget.safety_margin = self.safety_margin
        measured_budget = auto_budgets.get(device_key(self._probe.device))
        if measured_budget is not None:  # the capacity and the plan are those of the device the probe measures
            if self.device_capacity is not None:
                measured_budget.capacity = self.device_capacity
            if self.plan is not None:
                measured_budget.expect(self.plan)
        self._automatic_budget, self._state_left_device = bool(auto_budgets), False
        self._compare_plan = self.planned_peaks is not None and state.global_step < self.planned_steps
        if self._compare_plan and self._reads_resident_memory():
            self._compare_plan = False
            logger.info(
                "hf-paged: the plan is not compared with the measured peaks on %s: its probe reads the process's "
                "resident memory, not the live tensor bytes the plan predicts",
                self._probe.device,
            )
        if paged_optimizer(kwargs.get("optimizer")) is None:
            if state.is_world_process_zero:
                self._warn_not_paged(kwargs.get("optimizer"))
        else:
            self._enable_recovery()
        self._measure_engine_steps(kwargs.get("optimizer"))
        if state.global_step == 0:  # a run from the start measures afresh, in a callback used before too
            self.rows, self._logged_rows, self.warned, self.plan_differences = [], 0, False, None
            self._resume_from_rows()
        else:
            resumed = read_rows(os.path.join(args.output_dir, TIMELINE_NAME))
            self.rows = [row for row in resumed if row["step"] <= state.global_step]
            self._logged_rows = len(self.rows)
            if self.rows:
                self._resume_from_rows()

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._run_before_integrations()
        optimizer = paged_optimizer(kwargs.get("optimizer"))
        # the step's moves count from before the state its forward makes room for leaves the device
        self._stats_at_begin = optimizer.paging_stats() if optimizer is not None else None
        evicted = optimizer.prepare_forward() if optimizer is not None else 0
        self._row = {
            "step": state.global_step + 1,
            "micro_batches": 1,
            "evicted_at_step_begin": evicted,
            "state_bytes_forward": self._state_bytes_on_probed_device(optimizer),
            "device_budget": optimizer.device_budget if optimizer is not None else None,
            "oom_recoveries": 0,
        }
        self._probe.mark(_FORWARD_BACKWARD)

    def on_substep_end(self, args, state, control, **kwargs) -> None:
        self._probe.sample()
        self._row["micro_batches"] += 1

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        if self._engine is None:
            self._begin_optimizer_step(kwargs.get("optimizer"))

    def on_optimizer_step(self, args, state, control, **kwargs) -> None:
        if self._engine is None:
            self._end_optimizer_step(kwargs.get("optimizer"))

    def _begin_optimizer_step(self, optimizer: Any) -> None:
        self._row["forward_backward_peak"] = self._probe.peak(_FORWARD_BACKWARD)
        optimizer = paged_optimizer(optimizer)
        self._stats_before_step = optimizer.paging_stats() if optimizer is not None else None
        self._probe.mark(_OPTIMIZER_STEP)

    def _end_optimizer_step(self, optimizer: Any) -> None:
        self._row["optimizer_step_peak"] = self._probe.peak(_OPTIMIZER_STEP)
        optimizer = paged_optimizer(optimizer)
        after = optimizer.paging_stats() if optimizer is not None else None
        self._row["state_bytes_after_step"] = after["device_bytes"] if after is not None else None
        for key in _MOVED:
            self._row[key] = after[key] - self._stats_at_begin[key] if after is not None else None
        self._row["page_ins_during_step"] = (
            after["page_ins"] - self._stats_before_step["page_ins"] if after is not None else None
        )
        if after is not None and (after["host_bytes"] or self._row["bytes_to_host"]):
            self._state_left_device = True

    def on_step_end(self, args, state, control, **kwargs) -> None:
        row = self._row
        if "optimizer_step_peak" not in row:
            return
        probe = self._probe
        row.update(
            allocated=probe.allocated(),
            reserved=probe.reserved(),
            capacity=self.device_capacity if self.device_capacity is not None else probe.capacity,
            host_resident=probe.host_resident(),
        )
        state_bytes = self._state_in_peak(row)
        baseline = self.detector.baseline()
        row["baseline"] = baseline[0] + state_bytes if baseline is not None else None
        spike = self.detector.observe(row["step"], row["forward_backward_peak"] - state_bytes)
        row["spike"] = spike is not None
        if spike is not None:
            logger.info(
                "hf-paged: memory spike at step %d: forward/backward peak %.2f GiB, %.2f GiB above the baseline",
                spike.step,
                row["forward_backward_peak"] / GIB,
                spike.size / GIB,
            )
        self._warn_near_capacity(row)
        self.rows.append(row)
        self._row = {}
        if self._compare_plan and row["step"] >= self.planned_steps:
            self._check_plan()

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        new_rows = self.rows[self._logged_rows :]
        if logs is None or TRAINING_LOG_KEY not in logs or not new_rows:
            return
        self._logged_rows = len(self.rows)
        metrics = self._metrics(new_rows)
        if getattr(args, "world_size", 1) > 1:  # the Trainer's processes all log the same steps: all take part
            metrics = _across_processes(metrics)
        if not state.is_world_process_zero:
            return
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_save(self, args, state, control, **kwargs) -> None:
        self._write(args, state)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self._compare_plan:
            self._check_plan()
        if self._trainer is not None:
            disable_oom_recovery(self._trainer)
            self._trainer = None
        self._stop_measuring_engine()
        self._write(args, state)
        several = getattr(args, "world_size", 1) > 1  # the Trainer's processes all end training: all take part
        self._job_peaks = _peaks_across_processes(self._own_peaks(), gather=several)

    # Results --------------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Steps measured, the highest peak of each phase and the last optimizer device bytes (bytes),
        the spike and out-of-memory recovery counts, the steps recovered (``oom_recovery_steps``; on every rank for a
        step replayed on every rank) and, for those, the ranks that ran out of memory (``oom_ranks``, step to ranks),
        and the paths of the timeline and the plot (``None`` where not written).

        After training in several processes, the peaks are the highest of the job's processes, and ``node_peaks``
        gives each node's (one entry per node, in the order of their lowest global rank; one entry in one process);
        the other values are this process's.
        """
        last_state = self.rows[-1]["state_bytes_after_step"] if self.rows else None
        peaks = self._job_peaks
        if peaks is None:  # before the end of training: this process's
            peaks = _peaks_across_processes(self._own_peaks(), gather=False)
        return {
            "steps": len(self.rows),
            "forward_backward_peak_bytes": peaks["forward_backward_peak_bytes"],
            "optimizer_step_peak_bytes": peaks["optimizer_step_peak_bytes"],
            "node_peaks": peaks["node_peaks"],
            "optimizer_device_bytes": last_state,
            "spikes": len(self.detector.spikes),
            "oom_recoveries": self.oom_recoveries,
            "oom_recovery_steps": [row["step"] for row in self.rows if row.get("oom_recoveries")],
            "oom_ranks": {row["step"]: row["oom_ranks"] for row in self.rows if row.get("oom_ranks")},
            "timeline_path": self.timeline_path,
            "plot_path": self.plot_path,
        }

    # Internals ------------------------------------------------------------------------------------------

    def _own_peaks(self) -> dict[str, int | None]:
        """This process's highest peak of each phase (bytes; ``None`` before a step was measured)."""
        return {
            "forward_backward_peak_bytes": max((row["forward_backward_peak"] for row in self.rows), default=None),
            "optimizer_step_peak_bytes": max((row["optimizer_step_peak"] for row in self.rows), default=None),
        }

    def _enable_recovery(self) -> None:
        """Wrap the calling trainer's training step in out-of-memory recovery and set its optimizer's (called from
        ``on_train_begin``)."""
        trainer = calling_trainer()
        if trainer is None and not self.oom_retries:
            return
        if trainer is None:
            logger.warning(
                "hf-paged: MemorySpikeCallback could not find the Trainer running it; out-of-memory recovery is "
                "off (call hf_paged.integrations.enable_oom_recovery(trainer) to turn it on)"
            )
            return
        if enable_oom_recovery(trainer, self.oom_retries, on_recovery=self._record_recovery) is not None:
            self._trainer = trainer

    def _measure_engine_steps(self, optimizer: Any) -> None:
        """Under DeepSpeed, measure the engine's ``step`` as the optimizer step (called from ``on_train_begin``).

        accelerate runs DeepSpeed's optimizer step inside the backward of a step's last micro-batch
        (``engine.step()`` in its ``backward``), before the Trainer's ``on_pre_optimizer_step``; the Trainer's own
        ``optimizer.step()`` is then a no-op. The phases are taken around the engine's ``step`` instead.
        """
        self._stop_measuring_engine()
        trainer = calling_trainer()
        engine = getattr(trainer, "model_wrapped", None)
        if not getattr(trainer, "is_deepspeed_enabled", False) or not callable(getattr(engine, "step", None)):
            return
        step = engine.step

        def measured_step(*args: Any, **kwargs: Any) -> Any:
            if not engine.is_gradient_accumulation_boundary():  # a micro-step: no optimizer step
                return step(*args, **kwargs)
            self._begin_optimizer_step(optimizer)
            result = step(*args, **kwargs)
            self._end_optimizer_step(optimizer)
            return result

        self._engine, self._engine_own_step = engine, vars(engine).get("step")
        engine.step = measured_step

    def _stop_measuring_engine(self) -> None:
        """Give DeepSpeed's engine its own ``step`` back (nothing happens if it is not measured)."""
        if self._engine is None:
            return
        if self._engine_own_step is None:
            vars(self._engine).pop("step", None)
        else:
            self._engine.step = self._engine_own_step
        self._engine = self._engine_own_step = None

    def _warn_not_paged(self, optimizer: Any) -> None:
        """Say, once per callback, what an optimizer that is not an hf-paged one leaves out."""
        if self._not_paged_warned:
            return
        self._not_paged_warned = True
        inner = getattr(optimizer, "optimizer", optimizer)
        name = type(inner).__name__ if inner is not None else "none given"
        skipped = f"out-of-memory recovery (oom_retries={self.oom_retries}), " if self.oom_retries else ""
        logger.warning(
            "hf-paged: MemorySpikeCallback: the optimizer (%s) is not an hf-paged optimizer, so %sthe optimizer "
            "state's budget and the paging metrics (%s) are off: they need an optimizer that pages its state and "
            "can give it back to the host. Peaks, spikes and the timeline are measured as usual. Train with "
            "optim='hf_paged_adamw_8bit' (or another hf_paged_* name) to have them.",
            name,
            skipped,
            _PAGING_METRICS,
        )

    def _state_bytes_on_probed_device(self, optimizer: Any) -> int | None:
        """Bytes of ``optimizer``'s state resident on the device the probe measures (``None`` without a paged
        optimizer): other devices' pages are in other devices' peaks."""
        if optimizer is None:
            return None
        device = optimizer.paging_stats()["devices"].get(device_key(self._probe.device))
        return device["device_bytes"] if device is not None else 0

    def _state_in_peak(self, row: dict[str, Any]) -> int:
        """Bytes of optimizer state in ``row``'s forward/backward peak, which the spike detector leaves out: a peak
        that rises only by the state an automatic budget lets back onto the device is no spike. None where the probe
        reads the process's resident memory, which holds the state wherever its pages are."""
        return 0 if self._reads_resident_memory() else row.get("state_bytes_forward") or 0

    def _reads_resident_memory(self) -> bool:
        """Whether the probe reads the process's resident memory (the CPU), not an accelerator's allocated bytes."""
        return isinstance(getattr(self._probe, "_memory", None), HostMemory)

    def _resume_from_rows(self) -> None:
        """Rebuild the spike detector (its recent peaks and the spikes it flagged) and the recovery count from the
        rows read back at a resume, as they were when those steps were measured."""
        peaks = [row["forward_backward_peak"] - self._state_in_peak(row) for row in self.rows]
        spikes = [
            {"step": row["step"], "peak": peak, "size": row["forward_backward_peak"] - row["baseline"]}
            for row, peak in zip(self.rows, peaks)
            if row["spike"]
        ]
        self.detector.load_state({"peaks": peaks, "spikes": spikes})
        self.oom_recoveries = sum(row.get("oom_recoveries", 0) for row in self.rows)

    def _record_recovery(self, recovery: Recovery) -> None:
        """Count a recovery and mark the step's row, with the ranks that ran out of memory where the step was replayed
        on every rank (so the timeline of rank 0 shows another rank's)."""
        self.oom_recoveries += 1
        if self._row:
            self._row["oom_recoveries"] += 1
            if recovery.failed_ranks:
                ranks = set(self._row.get("oom_ranks", ())) | set(recovery.failed_ranks)
                self._row["oom_ranks"] = sorted(ranks)

    def _run_before_integrations(self) -> None:
        """Move this callback to the front of the Trainer's callbacks (in place, safe during ``call_event``).

        The Trainer copies ``logs`` into ``log_history`` and hands them to the ``report_to`` integrations,
        which come before user callbacks; metrics added in ``on_log`` reach them only from the front.
        """
        handler = calling_callback_handler()
        if handler is None:
            if self._handler_missing_warned:
                return
            self._handler_missing_warned = True
            logger.warning(
                "hf-paged: MemorySpikeCallback could not find the Trainer's callback handler; its metrics "
                "reach log_history but may miss report_to integrations"
            )
            return
        if handler.callbacks[0] is not self:
            handler.callbacks[:] = [self] + [callback for callback in handler.callbacks if callback is not self]

    def _metrics(self, rows: list[dict[str, Any]]) -> dict[str, float | int]:
        """The ``memory/`` metrics of the steps since the last log."""
        last = rows[-1]
        metrics: dict[str, float | int] = {
            "memory/forward_backward_peak_gib": max(row["forward_backward_peak"] for row in rows) / GIB,
            "memory/optimizer_step_peak_gib": max(row["optimizer_step_peak"] for row in rows) / GIB,
            "memory/allocated_gib": last["allocated"] / GIB,
            "memory/reserved_gib": last["reserved"] / GIB,
            "memory/capacity_gib": last["capacity"] / GIB,
            "memory/host_resident_gib": last["host_resident"] / GIB,
            "memory/spikes": len(self.detector.spikes),
            "memory/oom_recoveries": self.oom_recoveries,
            "memory/spike_gib": max(
                (row["forward_backward_peak"] - row["baseline"] for row in rows if row["spike"]), default=0
            )
            / GIB,
        }
        if last["state_bytes_after_step"] is not None:
            metrics.update(
                {
                    "memory/optimizer_device_bytes": last["state_bytes_after_step"],
                    "memory/moved_to_device_gib": sum(row["bytes_to_device"] for row in rows) / GIB,
                    "memory/moved_to_host_gib": sum(row["bytes_to_host"] for row in rows) / GIB,
                    "memory/stall_seconds": sum(row["stall_seconds"] for row in rows),
                }
            )
            if last["device_budget"] is not None:
                metrics["memory/device_budget_bytes"] = last["device_budget"]
        return metrics

    def _warn_near_capacity(self, row: dict[str, Any]) -> None:
        predicted = max(self.detector.peaks)
        if self.warned or predicted < self.warn_fraction * row["capacity"]:
            return
        self.warned = True
        logger.warning(
            "hf-paged: the forward/backward peak (%.2f GiB) is within %d%% of the device capacity (%.2f GiB) at "
            "step %d. To make room: lower the optimizer's device budget (optim_args device_budget=auto or a "
            "smaller size), use an 8-bit optimizer (optim=hf_paged_adamw_8bit), or train on shorter sequences "
            "or smaller batches (with more gradient accumulation).",
            predicted / GIB,
            round((1 - self.warn_fraction) * 100),
            row["capacity"] / GIB,
            row["step"],
        )

    def _check_plan(self) -> None:
        """Compare each phase's highest measured peak of the planned steps with the plan's; warn once above the
        tolerance (called once, after the last planned step or at the end of a shorter run)."""
        self._compare_plan = False
        rows = [row for row in self.rows if row["step"] <= self.planned_steps]
        if not rows:
            return
        if self._automatic_budget and self._state_left_device:
            logger.info(
                "hf-paged: the plan is not compared with the measured peaks: the automatic budget kept optimizer "
                "state on the host in the first %d steps, and the plan was made with all of it on the device",
                self.planned_steps,
            )
            return
        measured = {phase: max(row[f"{phase}_peak"] for row in rows) for phase in PHASES}
        self.plan_differences = {
            phase: measured[phase] / self.planned_peaks[phase] - 1 for phase in PHASES if self.planned_peaks[phase]
        }
        if all(abs(difference) <= PLAN_TOLERANCE for difference in self.plan_differences.values()):
            return
        details = "; ".join(
            f"{_PHASE_LABELS[phase]} {format_size(measured[phase])} measured, {format_size(self.planned_peaks[phase])} "
            f"planned ({100 * difference:+.1f}%)"
            for phase, difference in self.plan_differences.items()
        )
        logger.warning(
            "hf-paged: the measured peaks of the first %d steps differ from the plan by more than %d%%: %s. The plan "
            "may be of another configuration or device, or miss memory it does not model (see README, Planning "
            "memory).",
            len(rows),
            round(100 * PLAN_TOLERANCE),
            details,
        )

    def _write(self, args, state) -> None:
        """Write the timeline (and its plot) into the output directory, on the processes that save checkpoints:
        global rank 0, and with ``save_on_each_node`` each node's first process (a resume on that node reads it)."""
        on_each_node = getattr(args, "save_on_each_node", False)
        if not (state.is_world_process_zero or (on_each_node and state.is_local_process_zero)) or not self.rows:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        self.timeline_path = os.path.join(args.output_dir, TIMELINE_NAME)
        write_rows(self.rows, self.timeline_path)
        if not self.plot or self._plot_unavailable:
            return
        try:
            plot_rows(self.rows, os.path.join(args.output_dir, PLOT_NAME))
        except ImportError as error:
            self._plot_unavailable = True
            logger.warning("hf-paged: %s not written: %s", PLOT_NAME, error)
            return
        self.plot_path = os.path.join(args.output_dir, PLOT_NAME)


def _planned_peaks(plan: MemoryPlan | Mapping[str, int | str] | None) -> tuple[dict[str, int] | None, int]:
    """The planned peak of each phase (bytes) and the steps it covers, from the callback's ``plan`` argument."""
    if plan is None:
        return None, 0
    if isinstance(plan, MemoryPlan):
        return {phase: plan.peak(phase).peak_bytes for phase in PHASES}, max(item.step for item in plan.phases)
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a MemoryPlan or a mapping of phase to bytes, got {type(plan).__name__}")
    if set(plan) != set(PHASES):
        raise ValueError(f"plan must give bytes for exactly the phases {', '.join(map(repr, PHASES))}, got {plan!r}")
    return {phase: parse_size(plan[phase], f"plan[{phase!r}]") for phase in PHASES}, PLANNED_STEPS


def node_key() -> tuple[str, str]:
    """What tells this process's node from the others: the host name, and the launcher's node rank (torchrun's
    ``GROUP_RANK``, which ``accelerate launch`` sets too), which tells apart nodes started on one host."""
    return socket.gethostname(), os.environ.get("GROUP_RANK", "")


def combine_metrics(processes: Sequence[tuple[tuple[str, str], dict[str, float | int]]]) -> dict[str, float | int]:
    """The job's ``memory/`` metrics from every process's ``(node key, metrics)``, in global rank order: each the
    maximum over the processes, ``memory/capacity_gib`` the minimum, ``memory/host_resident_gib`` the largest sum
    over one node's processes; with several nodes also :data:`NODE_METRICS` per node, as
    ``memory/node_<n>/<name>`` (nodes numbered in the order of their lowest global rank)."""
    nodes: dict[tuple[str, str], list[dict[str, float | int]]] = {}
    for key, metrics in processes:
        nodes.setdefault(key, []).append(metrics)
    per_node = [_combine_node(members) for members in nodes.values()]
    combined = {
        name: (min if name == "memory/capacity_gib" else max)(node[name] for node in per_node) for name in per_node[0]
    }
    if len(per_node) > 1:
        for index, node in enumerate(per_node):
            combined.update({f"memory/node_{index}/{name[len('memory/') :]}": node[name] for name in NODE_METRICS})
    return combined


def _combine_node(members: list[dict[str, float | int]]) -> dict[str, float | int]:
    """One node's metrics from its processes': host resident memory summed, capacity the minimum, the rest the
    maximum."""
    reduce = {"memory/host_resident_gib": sum, "memory/capacity_gib": min}
    return {name: reduce.get(name, max)(metrics[name] for metrics in members) for name in members[0]}


def _gather(value: Any) -> list[Any] | None:
    """``(node key, value)`` of every process of the default group, in global rank order; ``None`` without one.
    A collective: every process of the group must call it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (node_key(), value))
    return gathered


def _across_processes(metrics: dict[str, float | int]) -> dict[str, float | int]:
    """``metrics`` combined over every process of the job (:func:`combine_metrics`); as they are in one process."""
    gathered = _gather(metrics)
    return metrics if gathered is None else combine_metrics(gathered)


def _peaks_across_processes(peaks: dict[str, int | None], gather: bool) -> dict[str, Any]:
    """The highest of each peak over the job's processes (``gather``, a collective) or this one's, and ``node_peaks``:
    the highest over each node's processes, one dictionary per node in the order of their lowest global rank."""
    gathered = (_gather(peaks) if gather else None) or [(node_key(), peaks)]
    nodes: dict[tuple[str, str], list[dict[str, int | None]]] = {}
    for key, process_peaks in gathered:
        nodes.setdefault(key, []).append(process_peaks)
    per_node = [{name: _highest(member[name] for member in members) for name in peaks} for members in nodes.values()]
    return {**{name: _highest(node[name] for node in per_node) for name in peaks}, "node_peaks": per_node}


def _highest(values: Iterable[int | None]) -> int | None:
    """The largest of the values that are not ``None``; ``None`` if none is."""
    return max((value for value in values if value is not None), default=None)
