"""Out-of-memory recovery in the Trainer's training step (``Trainer`` and its subclasses, e.g. TRL's ``SFTTrainer``).

:func:`enable_oom_recovery` wraps the trainer's ``training_step`` (the forward and backward of one
micro-batch, the documented place to customise a step) in an :class:`~hf_paged.recovery.OOMRecovery`. A new
window of micro-batches starts whenever the trainer's ``global_step`` has moved on, which happens after every
optimizer step, skipped ones included. Metrics that a trainer accumulates per micro-batch during its loss
(TRL's token counts, entropy and accuracy) are rewound before a replay, so logs match a run without the error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..recovery import OOMRecovery, Recovery, paged_optimizer_of
from . import _transformers_internals as internals

logger = logging.getLogger(__name__)

_ATTRIBUTE = "_hf_paged_oom_recovery"


def enable_oom_recovery(
    trainer: Any,
    retries: int = 2,
    on_recovery: Callable[[Recovery], None] | None = None,
) -> OOMRecovery | None:
    """Make ``trainer``'s training steps survive out-of-memory errors in forward and backward, and in the
    optimizer's step.

    Call it once the trainer's optimizer exists (in ``on_train_begin``, as ``MemorySpikeCallback`` does).

    Args:
        trainer: a ``transformers.Trainer`` (or subclass) whose optimizer is, or wraps, an hf-paged one.
        retries: recoveries allowed per optimizer step, in forward/backward and in the optimizer's step (its
            ``oom_retries``); 0 leaves the training step as it is and the optimizer's step unprotected.
        on_recovery: called with each :class:`~hf_paged.recovery.Recovery`, before the replay or the rest of the
            optimizer's step.

    Returns:
        The recovery (its ``recoveries`` counts them), or ``None`` where none was installed: ``retries`` is
        0, the optimizer is not an hf-paged one, or training runs in several processes.
    """
    disable_oom_recovery(trainer)
    try:
        optimizer = paged_optimizer_of(trainer.optimizer)
    except TypeError:
        return None
    optimizer.oom_retries = retries  # the optimizer's own step recovers in any number of processes
    optimizer.on_oom_recovery = on_recovery
    if retries == 0:
        return None
    if trainer.args.world_size > 1:
        if trainer.is_world_process_zero():  # once for the launch, not once per process
            logger.warning(
                "hf-paged: out-of-memory recovery in forward and backward is off: it replays micro-batches in one "
                "process, and with %d processes their gradient collectives would diverge (the optimizer step still "
                "recovers)",
                trainer.args.world_size,
            )
        return None
    internals.trainer_metric_marks(trainer)  # fails now, not at a recovery, if a trainer's metrics moved
    marks: dict[str, Any] = {}

    def rewind_and_report(recovery: Recovery) -> None:
        if recovery.phase == "forward/backward":  # a replay runs the micro-batches' metrics again
            internals.rewind_trainer_metrics(trainer, marks)
        if on_recovery is not None:
            on_recovery(recovery)

    recovery = OOMRecovery(optimizer, retries=retries, on_recovery=rewind_and_report, model=trainer.model)
    original = trainer.training_step
    window_step: list[int | None] = [None]

    def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        step = trainer.state.global_step
        if step != window_step[0]:
            window_step[0] = step
            recovery.start_window(step + 1)
            marks.clear()
            marks.update(internals.trainer_metric_marks(trainer))
        return recovery.run(original, model, inputs, *args, **kwargs)

    trainer.training_step = training_step
    setattr(trainer, _ATTRIBUTE, recovery)
    return recovery


def disable_oom_recovery(trainer: Any) -> None:
    """Give ``trainer`` back its own ``training_step`` (nothing happens if recovery is not enabled)."""
    if getattr(trainer, _ATTRIBUTE, None) is None:
        return
    del trainer.training_step
    delattr(trainer, _ATTRIBUTE)


def oom_recovery_of(trainer: Any) -> OOMRecovery | None:
    """The recovery :func:`enable_oom_recovery` installed in ``trainer``, if any."""
    return getattr(trainer, _ATTRIBUTE, None)
