"""hf-paged optimizers as ``TrainingArguments(optim=...)`` names, with their ``optim_args``."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..memory import probe_for
from ..optim import (
    PagedAdamW,
    PagedAdamW4bit,
    PagedAdamW8bit,
    PagedAdEMAMix,
    PagedAdEMAMix4bit,
    PagedAdEMAMix8bit,
    PagedLion,
    PagedLion8bit,
    PagedOptimizer,
)
from ..recovery import paged_optimizer_of
from ..sizes import parse_size
from . import _transformers_internals as internals

logger = logging.getLogger(__name__)

OPTIMIZER_NAMES: dict[str, type] = {
    "hf_paged_adamw_32bit": PagedAdamW,
    "hf_paged_adamw_8bit": PagedAdamW8bit,
    "hf_paged_adamw_4bit": PagedAdamW4bit,
    "hf_paged_lion_32bit": PagedLion,
    "hf_paged_lion_8bit": PagedLion8bit,
    "hf_paged_ademamix": PagedAdEMAMix,
    "hf_paged_ademamix_8bit": PagedAdEMAMix8bit,
    "hf_paged_ademamix_4bit": PagedAdEMAMix4bit,
}
"""Our names and the optimizer each selects."""

BITSANDBYTES_NAMES: dict[str, str] = {
    "paged_adamw_32bit": "hf_paged_adamw_32bit",
    "paged_adamw_8bit": "hf_paged_adamw_8bit",
    "paged_lion_32bit": "hf_paged_lion_32bit",
    "paged_lion_8bit": "hf_paged_lion_8bit",
    "paged_ademamix_32bit": "hf_paged_ademamix",
    "paged_ademamix_8bit": "hf_paged_ademamix_8bit",
}
"""bitsandbytes' paged names that ``replace_bitsandbytes`` routes to ours."""

REPLACE_BITSANDBYTES_ENV = "HF_PAGED_REPLACE_BITSANDBYTES"

_replace_choice: bool | None = None
"""``register``'s explicit ``replace_bitsandbytes`` in this process, which wins over the environment variable;
``None`` where none was given."""

_announced_replacing = False
"""Whether the warning that bitsandbytes' names select ours was given in this process."""


def _replace_requested_by_environment() -> bool:
    return os.environ.get(REPLACE_BITSANDBYTES_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _replaces_bitsandbytes() -> bool:
    """Whether bitsandbytes' paged names select ours now: ``register``'s explicit choice, else the variable."""
    return _replace_requested_by_environment() if _replace_choice is None else _replace_choice


def optimizer_class_for(name: str) -> type | None:
    """The hf-paged optimizer the Trainer builds for ``optim=name``, ``None`` for any other optimizer."""
    if name in OPTIMIZER_NAMES:
        return OPTIMIZER_NAMES[name]
    if name in BITSANDBYTES_NAMES and _replaces_bitsandbytes():
        return OPTIMIZER_NAMES[BITSANDBYTES_NAMES[name]]
    return None


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
_FOUR_BIT_ARGS = {"block_size": int, "min_4bit_size": int, "short_rows": str}
_NORMALIZATION_ARGS = {"normalization": str}
_ADEMAMIX_ARGS = {
    "beta1": float,
    "beta2": float,
    "beta3": float,
    "alpha": float,
    "t_alpha": int,
    "t_beta3": int,
    "eps": float,
}
"""AdEMAMix's ``optim_args``, those transformers' Trainer reads for bitsandbytes' AdEMAMix."""
_EIGHT_BIT = (PagedAdamW8bit, PagedLion8bit, PagedAdEMAMix8bit)
_FOUR_BIT = (PagedAdamW4bit, PagedAdEMAMix4bit)
_QUANTIZED_ARGS = {"fp32_embeddings": _boolean}
"""Whether the model's ``nn.Embedding`` modules keep fp32 state (default ``true``, as transformers keeps them for
bitsandbytes' 8-bit optimizers)."""
_ADEMAMIX = (PagedAdEMAMix, PagedAdEMAMix8bit, PagedAdEMAMix4bit)


def split_optim_args(optim_args: str | None) -> dict[str, str]:
    """Split ``TrainingArguments.optim_args`` (``"key=value,key=value"``, spaces ignored) as the Trainer does."""
    if not optim_args:
        return {}
    split = {}
    for entry in optim_args.replace(" ", "").split(","):
        if entry.count("=") != 1:
            raise ValueError(f"optim_args entry {entry!r} is not of the form key=value (in {optim_args!r})")
        key, value = entry.split("=")
        split[key] = value
    return split


def parse_optim_args(optim_args: dict[str, str], optimizer_cls: type) -> dict[str, Any]:
    """Convert the Trainer's ``optim_args`` strings to typed keyword arguments of ``optimizer_cls``."""
    allowed = {
        **_COMMON_ARGS,
        **(_EIGHT_BIT_ARGS if optimizer_cls in _EIGHT_BIT else {}),
        **(_FOUR_BIT_ARGS if optimizer_cls in _FOUR_BIT else {}),
        **(_QUANTIZED_ARGS if optimizer_cls in (*_EIGHT_BIT, *_FOUR_BIT) else {}),
        **(_NORMALIZATION_ARGS if optimizer_cls is PagedAdamW4bit else {}),
        **(_ADEMAMIX_ARGS if optimizer_cls in _ADEMAMIX else {}),
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


def _optimizer_kwargs(
    optimizer_cls: type,
    optimizer_kwargs: dict[str, Any],
    adam_kwargs: dict[str, Any],
    optim_args: dict[str, str],
    model: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """The keyword arguments the Trainer's optimizer settings and ``optim_args`` give ``optimizer_cls`` for ``model``.
    AdEMAMix takes them as transformers gives them to bitsandbytes' AdEMAMix: ``beta1``, ``beta2`` and ``eps`` from
    ``optim_args`` or the Trainer's ``adam_*`` settings, ``beta3`` (default 0.9999), ``alpha`` (5.0), ``t_alpha`` and
    ``t_beta3`` (no scheduler) from ``optim_args``. An 8-bit or 4-bit optimizer keeps the state of ``model``'s
    ``nn.Embedding`` modules in fp32 unless ``fp32_embeddings=false``, as transformers' Trainer keeps them for
    bitsandbytes' 8-bit optimizers (``register_module_override(module, "weight", {"optim_bits": 32})``)."""
    kwargs = dict(optimizer_kwargs)
    kwargs["betas"] = adam_kwargs["betas"]
    if optimizer_cls in (PagedAdamW, PagedAdamW8bit, PagedAdamW4bit, *_ADEMAMIX):
        kwargs["eps"] = adam_kwargs["eps"]
    parsed = parse_optim_args(optim_args, optimizer_cls)
    if optimizer_cls in _ADEMAMIX:
        beta1, beta2 = adam_kwargs["betas"]
        kwargs["betas"] = (parsed.pop("beta1", beta1), parsed.pop("beta2", beta2), parsed.pop("beta3", 0.9999))
    if parsed.pop("fp32_embeddings", True) and optimizer_cls in (*_EIGHT_BIT, *_FOUR_BIT) and model is not None:
        kwargs["fp32_state_modules"] = [module for module in model.modules() if isinstance(module, torch.nn.Embedding)]
    kwargs.update(parsed)
    return kwargs


def check_training_arguments(args) -> None:
    """Raise ValueError now for what the optimizer ``args.optim`` selects would reject when the Trainer builds it.

    Runs when the ``TrainingArguments`` are built (before a model or data is loaded, before the output
    folder exists): ``optim_args`` are parsed, and the optimizer is built once on a one-element CPU tensor
    with them and the Trainer's learning rate, betas and epsilon, so that its own checks apply.
    """
    name = getattr(args.optim, "value", args.optim)
    optimizer_cls = optimizer_class_for(name)
    if optimizer_cls is None:
        return
    try:
        kwargs = _optimizer_kwargs(
            optimizer_cls,
            {"lr": args.learning_rate},
            {"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon},
            split_optim_args(args.optim_args),
        )
        if kwargs.get("device_budget") == "auto":
            kwargs["device_budget"] = None
        optimizer_cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"optim={name!r} with optim_args={args.optim_args!r}: {error}") from None


def _handler(optimizer_cls: type):
    def build(context) -> tuple[type, dict[str, Any]]:
        kwargs = _optimizer_kwargs(
            optimizer_cls, context.optimizer_kwargs, context.adam_kwargs, context.optim_args, context.model
        )
        if kwargs.get("device_budget") == "auto":
            keep_trainer_memory_metrics(context.args)
        return optimizer_cls, kwargs

    return build


def register_names() -> None:
    """Add the ``hf_paged_*`` names to ``TrainingArguments``' choices and check their ``optim_args`` (idempotent)."""
    for name in OPTIMIZER_NAMES:
        internals.add_optimizer_name(name)
    internals.check_training_arguments_with(check_training_arguments)


def register_handlers(replace_bitsandbytes: bool | None = None) -> None:
    """Make the Trainer build our optimizers for our names (and, if asked, for bitsandbytes' paged names)."""
    global _replace_choice
    if replace_bitsandbytes is not None:
        _replace_choice = replace_bitsandbytes
    register_names()
    for name, optimizer_cls in OPTIMIZER_NAMES.items():
        internals.set_optimizer_handler(name, _handler(optimizer_cls))
    for bitsandbytes_name in BITSANDBYTES_NAMES:
        theirs = internals.optimizer_handler(bitsandbytes_name)
        if not getattr(theirs, "_hf_paged_routes", False):
            internals.set_optimizer_handler(bitsandbytes_name, _routed(bitsandbytes_name, theirs))
    if _replaces_bitsandbytes():
        _announce_replacing()


def _announce_replacing() -> None:
    """Say once per process that bitsandbytes' paged names select ours."""
    global _announced_replacing
    if not _announced_replacing:
        logger.warning(
            "hf-paged: bitsandbytes' paged optimizer names (%s) now select hf-paged optimizers",
            ", ".join(BITSANDBYTES_NAMES),
        )
    _announced_replacing = True


def _routed(name: str, theirs: Any):
    """The handler of bitsandbytes' ``name``: ours where :func:`optimizer_class_for` selects ours when the Trainer
    builds it (as the arguments were checked, also when ``HF_PAGED_REPLACE_BITSANDBYTES`` was set after the imports),
    else transformers' own, ``theirs``."""

    def build(context) -> tuple[type, dict[str, Any]]:
        optimizer_cls = optimizer_class_for(name)
        if optimizer_cls is None:
            return theirs(context)
        _announce_replacing()
        return _handler(optimizer_cls)(context)

    build._hf_paged_routes = True
    return build


def is_paged(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the optimizer that accelerate's ``AcceleratedOptimizer`` wraps) is ours."""
    return isinstance(getattr(optimizer, "optimizer", optimizer), PagedOptimizer)


def _trains_with_paged(trainer: Any) -> bool:
    """Whether ``trainer``'s optimizer is, or wraps at any depth (DeepSpeed's engine), an hf-paged optimizer."""
    try:
        paged_optimizer_of(trainer.optimizer)
    except TypeError:
        return False
    return True


def _keeps_its_instance(callback: Any) -> bool:
    """Whether ``callback`` loads its saved state itself at a resume (``MemorySpikeCallback``)."""
    from ..callbacks import MemorySpikeCallback  # hf_paged.callbacks imports this module

    return isinstance(callback, MemorySpikeCallback)


def register_resume() -> None:
    """Make the Trainer load our optimizers' state from a checkpoint to the CPU, under any world size, and hand
    ``MemorySpikeCallback``'s saved state to the callback it was given (``restore_callback_states_from_checkpoint``)
    instead of replacing it with a new one; with ``save_on_each_node``, write the model's weights on every node; with
    our optimizers, name a checkpoint ``checkpoint-N`` only once every process has written it whole."""
    internals.load_optimizer_state_on_cpu(is_paged)
    internals.restore_callback_states_in_place(_keeps_its_instance)
    internals.save_weights_on_each_node()
    internals.write_checkpoints_whole(_trains_with_paged)


def register(replace_bitsandbytes: bool | None = None) -> None:
    """Register the ``hf_paged_*`` optimizer names with transformers (idempotent).

    Args:
        replace_bitsandbytes: also route bitsandbytes' ``paged_adamw_8bit``, ``paged_adamw_32bit``,
            ``paged_lion_8bit``, ``paged_lion_32bit``, ``paged_ademamix_8bit`` and ``paged_ademamix_32bit`` to the
            hf-paged optimizers. ``True`` or ``False`` decides for the rest of the process, whatever the
            environment says; ``None`` leaves it to the ``HF_PAGED_REPLACE_BITSANDBYTES`` environment variable
            (``1`` turns it on; off by default), which the Trainer reads when it checks and builds the optimizer, so
            that it takes effect when set after the imports too.
    """
    register_names()
    register_handlers(replace_bitsandbytes)
    register_resume()
