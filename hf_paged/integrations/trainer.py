"""hf-paged optimizers as ``TrainingArguments(optim=...)`` names, with their ``optim_args``."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..memory import probe_for
from ..optim import PagedAdamW, PagedAdamW4bit, PagedAdamW8bit, PagedLion, PagedLion8bit, PagedOptimizer
from ..sizes import parse_size
from . import _transformers_internals as internals

logger = logging.getLogger(__name__)

OPTIMIZER_NAMES: dict[str, type] = {
    "hf_paged_adamw_32bit": PagedAdamW,
    "hf_paged_adamw_8bit": PagedAdamW8bit,
    "hf_paged_adamw_4bit": PagedAdamW4bit,
    "hf_paged_lion_32bit": PagedLion,
    "hf_paged_lion_8bit": PagedLion8bit,
}
"""Our names and the optimizer each selects."""

BITSANDBYTES_NAMES: dict[str, str] = {
    "paged_adamw_32bit": "hf_paged_adamw_32bit",
    "paged_adamw_8bit": "hf_paged_adamw_8bit",
    "paged_lion_32bit": "hf_paged_lion_32bit",
    "paged_lion_8bit": "hf_paged_lion_8bit",
}
"""bitsandbytes' paged names that ``replace_bitsandbytes`` routes to ours."""

REPLACE_BITSANDBYTES_ENV = "HF_PAGED_REPLACE_BITSANDBYTES"


def _budget(value: str) -> int | str | None:
    lowered = value.strip().lower()
    if lowered in ("none", "auto"):
        return None if lowered == "none" else "auto"
    return parse_size(value, "device_budget")


def _boolean(value: str) -> bool:
    lowered = value.lower()
    if lowered not in ("true", "false", "1", "0"):
        raise ValueError(f"expected true or false, got {value!r}")
    return lowered in ("true", "1")


_COMMON_ARGS = {
    "device_budget": _budget,
    "page_size": lambda value: parse_size(value, "page_size"),
    "prefetch": int,
    "compiled": _boolean,
}
_EIGHT_BIT_ARGS = {"block_size": int, "min_8bit_size": int}
_FOUR_BIT_ARGS = {"block_size": int, "min_4bit_size": int}


def parse_optim_args(optim_args: dict[str, str], optimizer_cls: type) -> dict[str, Any]:
    """Convert the Trainer's ``optim_args`` strings to typed keyword arguments of ``optimizer_cls``."""
    allowed = {
        **_COMMON_ARGS,
        **(_EIGHT_BIT_ARGS if optimizer_cls in (PagedAdamW8bit, PagedLion8bit) else {}),
        **(_FOUR_BIT_ARGS if optimizer_cls is PagedAdamW4bit else {}),
    }
    parsed = {}
    for key, value in optim_args.items():
        if key not in allowed:
            raise ValueError(
                f"optim_args key {key!r} is not accepted by {optimizer_cls.__name__}; allowed keys: {', '.join(sorted(allowed))}"
            )
        try:
            parsed[key] = allowed[key](value)
        except (TypeError, ValueError) as error:
            raise ValueError(f"optim_args {key}={value!r} is not valid: {error}") from None
    return parsed


def keep_trainer_memory_metrics(args) -> None:
    """Leave the device's global peak alone when the Trainer reports it (``skip_memory_metrics=False``).

    The Trainer's memory metrics read the accelerator's global peak at the end of training; on the CPU it
    samples the resident set itself, so resetting ``VmHWM`` there does not disturb it.
    """
    if not args.skip_memory_metrics and args.device.type != "cpu":
        probe_for(args.device).reset_peaks = False


def _handler(optimizer_cls: type):
    def build(context) -> tuple[type, dict[str, Any]]:
        kwargs = dict(context.optimizer_kwargs)
        kwargs["betas"] = context.adam_kwargs["betas"]
        if optimizer_cls in (PagedAdamW, PagedAdamW8bit, PagedAdamW4bit):
            kwargs["eps"] = context.adam_kwargs["eps"]
        kwargs.update(parse_optim_args(context.optim_args, optimizer_cls))
        if kwargs.get("device_budget") == "auto":
            keep_trainer_memory_metrics(context.args)
        return optimizer_cls, kwargs

    return build


def register_names() -> None:
    """Add the ``hf_paged_*`` names to ``TrainingArguments``' choices (idempotent)."""
    for name in OPTIMIZER_NAMES:
        internals.add_optimizer_name(name)


def register_handlers(replace_bitsandbytes: bool | None = None) -> None:
    """Make the Trainer build our optimizers for our names (and, if asked, for bitsandbytes' paged names)."""
    if replace_bitsandbytes is None:
        replace_bitsandbytes = os.environ.get(REPLACE_BITSANDBYTES_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    register_names()
    for name, optimizer_cls in OPTIMIZER_NAMES.items():
        internals.set_optimizer_handler(name, _handler(optimizer_cls))
    if replace_bitsandbytes:
        for bitsandbytes_name, ours in BITSANDBYTES_NAMES.items():
            internals.set_optimizer_handler(bitsandbytes_name, _handler(OPTIMIZER_NAMES[ours]))
        logger.warning(
            "hf-paged: bitsandbytes' paged optimizer names (%s) now select hf-paged optimizers",
            ", ".join(BITSANDBYTES_NAMES),
        )


def is_paged(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the optimizer that accelerate's ``AcceleratedOptimizer`` wraps) is ours."""
    return isinstance(getattr(optimizer, "optimizer", optimizer), PagedOptimizer)


def register_resume() -> None:
    """Make the Trainer load our optimizers' state from a checkpoint to the CPU, under any world size."""
    internals.load_optimizer_state_on_cpu(is_paged)


def register(replace_bitsandbytes: bool | None = None) -> None:
    """Register the ``hf_paged_*`` optimizer names with transformers (idempotent).

    Args:
        replace_bitsandbytes: also route bitsandbytes' ``paged_adamw_8bit``, ``paged_adamw_32bit``,
            ``paged_lion_8bit`` and ``paged_lion_32bit`` to the hf-paged optimizers. ``None`` reads the
            ``HF_PAGED_REPLACE_BITSANDBYTES`` environment variable (``1`` turns it on); off by default.
    """
    register_names()
    register_handlers(replace_bitsandbytes)
    register_resume()
