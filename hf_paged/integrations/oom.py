"""Out-of-memory recovery in the Trainer's training step (``Trainer`` and its subclasses, e.g. TRL's ``SFTTrainer``).

:func:`enable_oom_recovery` wraps the trainer's ``training_step`` (the forward and backward of one
micro-batch, the documented place to customise a step) in an :class:`~hf_paged.recovery.OOMRecovery`. A new
window of micro-batches starts whenever the trainer's ``global_step`` has moved on, which happens after every
optimizer step, skipped ones included. Metrics that a trainer accumulates per micro-batch during its loss
(TRL's token counts, entropy and accuracy) are rewound before a replay, so logs match a run without the error.

Under several processes with DDP, a micro-batch inside ``no_sync`` is replayed on its rank alone, and an error in the
micro-batch whose gradients the ranks all-reduce makes every rank replay the step (see :mod:`hf_paged.ddp_replay`).
FSDP and DeepSpeed run collectives in every micro-batch that a rank cannot complete after an error. An error that is not
recovered, in forward, backward or the optimizer's step, and one in an evaluation or a checkpoint's save, is published
to every rank of the job (:mod:`hf_paged.rank_failure`), whose watchers end their processes within seconds with a note
on which rank failed, at which step, why it was not recovered, what to change and the last checkpoint written whole (a
checkpoint gets its name only then: see :func:`~hf_paged.integrations._transformers_internals.write_checkpoints_whole`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from ..rank_failure import RankFailure, RankFailureWatcher
from ..recovery import OOMRecovery, Recovery, check_callable, check_retries, paged_optimizer_of
from . import _transformers_internals as internals

logger = logging.getLogger(__name__)

_ATTRIBUTE = "_hf_paged_oom_recovery"
_FAILURES_ATTRIBUTE = "_hf_paged_rank_failures"
_OWN_STEP_ATTRIBUTE = "_hf_paged_own_training_step"
"""The ``training_step`` set on the trainer instance before recovery wrapped it (``None``: the class's)."""


def enable_oom_recovery(
    trainer: Any,
    retries: int = 2,
    on_recovery: Callable[[Recovery], None] | None = None,
) -> OOMRecovery | None:
    """Make ``trainer``'s training steps survive out-of-memory errors in forward and backward, and in the
    optimizer's step; under several processes, make a failure on one rank end every rank within seconds.

    Call it once the trainer's optimizer exists (in ``on_train_begin``, as ``MemorySpikeCallback`` does).

    Args:
        trainer: a ``transformers.Trainer`` (or subclass) whose optimizer is, or wraps, an hf-paged one.
        retries: recoveries allowed per optimizer step, in forward/backward and in the optimizer's step (its
            ``oom_retries``); 0 leaves the training step without recovery and the optimizer's step unprotected.
        on_recovery: called with each :class:`~hf_paged.recovery.Recovery`, before the replay or the rest of the
            optimizer's step.

    Under several processes with DDP, every rank replays a step that one rank's out-of-memory error interrupted;
    under FSDP none does, and under DeepSpeed none does in any number of processes. An error that is not recovered in
    forward, backward or the optimizer's step is published to every rank, and a
    :class:`~hf_paged.rank_failure.RankFailureWatcher` on each rank ends the job (see :mod:`hf_paged.rank_failure`)
    until training ends.

    Returns:
        The recovery (its ``recoveries`` counts them), or ``None`` where none was installed: ``retries`` is 0 or
        the optimizer is not an hf-paged one.

    Raises:
        ValueError: ``retries`` is not an integer >= 0.
        TypeError: ``on_recovery`` is neither callable nor ``None``.

    Bad arguments are refused before anything changes: a recovery enabled before stays as it was.
    """
    check_retries(retries)
    check_callable("on_recovery", on_recovery)
    internals.trainer_metric_marks(trainer)  # fails now, not at a recovery, if a trainer's metrics moved
    disable_oom_recovery(trainer)
    try:
        optimizer = paged_optimizer_of(trainer.optimizer)
    except TypeError:
        return None
    optimizer.oom_retries = retries  # the optimizer's own step recovers in any number of processes
    optimizer.on_oom_recovery = on_recovery
    failures = _RankFailures(trainer, optimizer) if trainer.args.world_size > 1 else None
    model = trainer.model_wrapped
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    obstacle = None if ddp else _engine_obstacle(trainer, several=failures is not None)
    if failures is not None:
        setattr(trainer, _FAILURES_ATTRIBUTE, failures)
        if trainer.is_world_process_zero() and obstacle is not None:  # once for the launch, not once per process
            logger.warning(
                "hf-paged: with %d processes, an out-of-memory error in forward or backward is not replayed (%s) and "
                "ends every rank with a note; the optimizer step still recovers",
                trainer.args.world_size,
                obstacle,
            )
    elif obstacle is not None and retries:
        logger.warning(
            "hf-paged: an out-of-memory error in forward or backward is not replayed (%s); the optimizer step still "
            "recovers",
            obstacle,
        )
    marks: dict[str, Any] = {}

    def rewind_and_report(recovery: Recovery) -> None:
        if recovery.phase == "forward/backward":  # a replay runs the micro-batches' metrics again
            internals.rewind_trainer_metrics(trainer, marks)
        if on_recovery is not None:
            on_recovery(recovery)

    recovery = OOMRecovery(
        optimizer,
        retries=retries,
        on_recovery=rewind_and_report,
        model=model if ddp else trainer.model,
        replay_obstacle=None if obstacle is None else lambda: obstacle,
    )
    if retries == 0 and failures is None:
        return None
    own_step = vars(trainer).get("training_step")
    original = trainer.training_step
    window_step: list[int | None] = [None]

    def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        step = trainer.state.global_step
        if step != window_step[0]:
            window_step[0] = step
            recovery.start_window(step + 1)
            marks.clear()
            marks.update(internals.trainer_metric_marks(trainer))
        if failures is None:
            return recovery.run(original, model, inputs, *args, **kwargs)
        with failures.publishing("forward/backward"):
            return recovery.run(original, model, inputs, *args, **kwargs)

    trainer.training_step = training_step
    setattr(trainer, _OWN_STEP_ATTRIBUTE, own_step)
    setattr(trainer, _ATTRIBUTE, recovery)
    return recovery if retries else None


def disable_oom_recovery(trainer: Any) -> None:
    """Give ``trainer`` back its own ``training_step`` (the one set on the instance before recovery was enabled, if
    any, else its class's) and stop watching for failures on other ranks (nothing happens if recovery is not
    enabled)."""
    failures = getattr(trainer, _FAILURES_ATTRIBUTE, None)
    if failures is not None:
        failures.close()
        delattr(trainer, _FAILURES_ATTRIBUTE)
    recovery = getattr(trainer, _ATTRIBUTE, None)
    if recovery is None:
        return
    recovery.close()
    own_step = vars(trainer).pop(_OWN_STEP_ATTRIBUTE, None)
    if own_step is None:
        del trainer.training_step
    else:
        trainer.training_step = own_step
    delattr(trainer, _ATTRIBUTE)


def _engine_obstacle(trainer: Any, several: bool) -> str | None:
    """Why the engine that runs ``trainer``'s model, not DDP, keeps a step from being replayed (``None`` where nothing
    does). DeepSpeed and FSDP do in one process too: a replay would add the micro-batches it repeats to DeepSpeed's
    gradients again, and FSDP2 leaves its parameters gathered at an error part way."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        return (
            "DeepSpeed's engine gathers parameters (ZeRO-3) and reduces gradients into its partitions in hooks of its "
            "own, counting micro-steps, and a rank that failed part way can neither complete those collectives nor "
            "rewind that state (a replay would count the micro-batches it repeats twice); on gloo and NCCL a "
            "collective a rank never joins cannot be left either, so only DDP replays such a step."
        )
    if getattr(trainer, "is_fsdp_enabled", False):
        return (
            "FSDP gathers each module's parameters in forward and backward and reduce-scatters its gradients: an error "
            "part way leaves its parameters gathered and its state mid-step (a replay in one process trained copies the "
            "optimizer no longer updates) and, across processes, collectives the other ranks wait in; only DDP replays "
            "such a step."
        )
    if not several:
        return None
    return (
        "the model runs across processes without DDP, so hf-paged cannot tell which collectives a rank that failed "
        "owes; only DDP replays such a step."
    )


class _RankFailures(TrainerCallback):
    """Under several processes: publishes an error of this rank's forward, backward, optimizer step, evaluation or
    checkpoint save in the job's store and watches for the other ranks' (a
    :class:`~hf_paged.rank_failure.RankFailureWatcher`). Added to the trainer's callbacks; stops at the end of training
    (and is left in the callbacks, inert: removing it while the trainer calls them would skip another)."""

    def __init__(self, trainer: Any, optimizer: Any) -> None:
        self.trainer = trainer
        self.optimizer = optimizer
        self.rank = trainer.args.process_index
        self.watcher = RankFailureWatcher(rank=self.rank).start() if dist.is_initialized() else None
        if self.watcher is None:
            logger.warning(
                "hf-paged: %d processes without a torch.distributed process group: a failure on one rank is not "
                "published to the others",
                trainer.args.world_size,
            )
        self._closed = False
        self._own_step = optimizer.__dict__.get("step")
        self._own_evaluate = vars(trainer).get("evaluate")
        optimizer.step = self._published(optimizer.step, "optimizer step")
        trainer.evaluate = self._published(trainer.evaluate, "evaluation", after_step=True)
        self._unwrap_saves = internals.around_checkpoint_saves(
            trainer, lambda save: self._published(save, "checkpoint save", after_step=True)
        )
        trainer.add_callback(self)

    def _published(self, call: Callable[..., Any], phase: str, after_step: bool = False) -> Callable[..., Any]:
        """``call`` that publishes an error it raises as one in ``phase``."""

        def published(*args: Any, **kwargs: Any) -> Any:
            with self.publishing(phase, after_step):
                return call(*args, **kwargs)

        return published

    @contextlib.contextmanager
    def publishing(self, phase: str, after_step: bool = False):
        """Publish an error raised inside (once), and note it on the error: one in ``phase`` of the step under way, or
        of the step just ended where ``after_step``."""
        try:
            yield
        except Exception as error:
            if not getattr(error, "_hf_paged_rank_failure", False):
                error._hf_paged_rank_failure = True
                self._publish(error, phase, self.trainer.state.global_step + (0 if after_step else 1))
            raise

    def _publish(self, error: Exception, phase: str, step: int) -> None:
        output_dir = self.trainer.args.output_dir
        checkpoint = get_last_checkpoint(output_dir) if output_dir and os.path.isdir(output_dir) else None
        failure = RankFailure.of(error, self.rank, step, phase, checkpoint)
        if self.watcher is None:
            error.add_note(f"hf-paged: {failure.describe()}")
            return
        first = self.watcher.publish(failure)
        if first.rank == self.rank:
            error.add_note(f"hf-paged: {failure.describe()} Every other rank of the job ends within seconds.")
        else:
            error.add_note(f"hf-paged: this error on rank {self.rank} follows another: {first.describe()}")

    def close(self) -> None:
        """Stop watching and give the optimizer its own step, the trainer its own evaluation and saves back
        (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.watcher is not None:
            self.watcher.stop()
        for owner, name, own in (
            (self.optimizer, "step", self._own_step),
            (self.trainer, "evaluate", self._own_evaluate),
        ):
            if own is None:
                vars(owner).pop(name, None)
            else:
                setattr(owner, name, own)
        self._unwrap_saves()

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self.close()  # a watcher left running would end this process once the job's store goes away


def oom_recovery_of(trainer: Any) -> OOMRecovery | None:
    """The recovery :func:`enable_oom_recovery` installed in ``trainer``, if any."""
    return getattr(trainer, _ATTRIBUTE, None)
