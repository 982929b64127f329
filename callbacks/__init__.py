"""Trainer callbacks of hf-paged, installed as ``hf_paged.callbacks``."""

from .memory_spike import MemorySpikeCallback
from .simulated_spike import SimulatedSpikeCallback

__all__ = ["MemorySpikeCallback", "SimulatedSpikeCallback"]
