"""``SimulatedSpikeCallback``: one out-of-memory error on purpose, to watch a recovery happen."""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback


class SimulatedSpikeCallback(TrainerCallback):
    """Raise one ``torch.OutOfMemoryError`` at the start of the forward of optimizer step ``step`` (from 1).

    It stands for a spike no prediction saw coming; with ``MemorySpikeCallback(oom_retries >= 1)`` and an
    hf-paged optimizer the step recovers and training goes on with the same results.
    """

    def __init__(self, step: int) -> None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(f"step must be an integer >= 1, got {step!r}")
        self.step = step
        self.fired = False
        self._hook: Any = None

    def on_step_begin(self, args, state, control, model=None, **kwargs) -> None:
        if not self.fired and self._hook is None and state.global_step + 1 == self.step:
            self._hook = model.register_forward_pre_hook(self._raise)

    def _raise(self, module: torch.nn.Module, inputs: Any) -> None:
        self._hook.remove()
        self._hook = None
        self.fired = True
        raise torch.OutOfMemoryError(
            f"simulated out-of-memory error in the forward of step {self.step} (memory.simulate_spike_at)"
        )
