"""Trainer callbacks of hf-paged, installed as ``hf_paged.callbacks``."""

from .memory_spike import MemorySpikeCallback

__all__ = ["MemorySpikeCallback"]
