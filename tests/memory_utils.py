"""A scripted memory source for probe, budget and callback tests: levels are set by the test, not measured."""

from __future__ import annotations

GIB = 2**30


class ScriptedMemory:
    """Memory figures with the shape of :class:`hf_paged.device.AcceleratorMemory`, driven by :meth:`set_level`.

    The peak follows the levels set since the last reset, like PyTorch's ``max_memory_allocated``.
    """

    can_reset_peak = True

    def __init__(self, total: int = 16 * GIB, level: int = 0) -> None:
        self._total = total
        self.level = level
        self._peak = level
        self.resets = 0

    def set_level(self, level: int) -> None:
        self.level = level
        self._peak = max(self._peak, level)

    def spike(self, level: int, after: int) -> None:
        """Rise to ``level`` and fall back to ``after`` (a phase's transient peak)."""
        self.set_level(level)
        self.set_level(after)

    def allocated(self) -> int:
        return self.level

    reserved = allocated
    resident = allocated

    def peak(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self.level
        self.resets += 1

    def total(self) -> int:
        return self._total

    def free(self) -> int:
        return self._total - self.level
