"""Paged optimizers: ``torch.optim.Optimizer`` subclasses with state in pages under a device budget."""

from .adamw import PagedAdamW, PagedAdamW4bit, PagedAdamW8bit
from .ademamix import PagedAdEMAMix, PagedAdEMAMix4bit, PagedAdEMAMix8bit
from .base import PagedOptimizer
from .lion import PagedLion, PagedLion8bit
from .state_format import keep_fp32_state

__all__ = [
    "PagedAdEMAMix",
    "PagedAdEMAMix4bit",
    "PagedAdEMAMix8bit",
    "PagedAdamW",
    "PagedAdamW4bit",
    "PagedAdamW8bit",
    "PagedLion",
    "PagedLion8bit",
    "PagedOptimizer",
    "keep_fp32_state",
]
