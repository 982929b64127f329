"""hf-paged: paged optimizers for fine-tuning with the Hugging Face stack.

The optimizers keep their state in pages that live on the accelerator under an explicit device budget
or rest in host memory, and work the same on CUDA, other accelerators and the CPU.
"""

from . import _autoregister
from .optim import (
    PagedAdamW,
    PagedAdamW4bit,
    PagedAdamW8bit,
    PagedAdEMAMix,
    PagedAdEMAMix4bit,
    PagedAdEMAMix8bit,
    PagedLion,
    PagedLion8bit,
    PagedOptimizer,
    keep_fp32_state,
)
from .recovery import OOMRecovery, recover_oom
from .sizes import parse_size

__version__ = "0.1.0"

__all__ = [
    "MemoryPlan",
    "MemorySpikeCallback",
    "OOMRecovery",
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
    "parse_size",
    "plan",
    "recover_oom",
    "register",
]


def __getattr__(name: str):
    if name == "MemorySpikeCallback":
        from .callbacks import MemorySpikeCallback

        return MemorySpikeCallback
    if name in ("plan", "MemoryPlan"):
        from . import planner

        return getattr(planner, name)
    raise AttributeError(f"module 'hf_paged' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names with those loaded at first use (:func:`__getattr__`), as ``dir`` and completion list them."""
    return sorted(set(globals()) | set(__all__))


def register(replace_bitsandbytes: bool | None = None) -> None:
    """Register the ``hf_paged_*`` names with transformers now (see :func:`hf_paged.integrations.register`)."""
    from .integrations import register as register_with_transformers

    register_with_transformers(replace_bitsandbytes=replace_bitsandbytes)


_autoregister.install()
