"""Per-parameter state formats: a param group may name the format of its parameters' state (``"state_format"``), and
:func:`keep_fp32_state` moves chosen modules' parameters into groups that keep fp32 state (an optimizer's
``fp32_state_modules`` keeps it for them within the groups as given).

A quantized optimizer picks a tensor's format by its size (``min_8bit_size``, ``min_4bit_size``), and a 4-bit one by
its shape as well: a tensor whose rows are shorter than a block (:func:`rows_shorter_than_block`, LoRA's ``B``
matrices) keeps 8-bit state, as 4-bit state for them made LoRA train measurably faster than fp32 AdamW (README.md,
Fidelity). A group with ``"state_format": "fp32"`` keeps fp32 state for every tensor it lists, as bitsandbytes'
``GlobalOptimManager.register_module_override(module, name, {"optim_bits": 32})`` does for a module's parameter
(transformers' Trainer does it for every ``nn.Embedding`` of a model it trains with a bitsandbytes 8-bit optimizer);
one naming the optimizer's own quantized format (``"8bit"``, ``"4bit"``) keeps tensors of any size and shape in that
format.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

STATE_FORMAT = "state_format"
"""The param group key that names the format of its tensors' state."""

FP32 = "fp32"


def state_formats(state_bits: int) -> tuple[str, ...]:
    """The formats a param group of an optimizer with ``state_bits``-bit state may name: ``"fp32"``, and for a
    quantized optimizer its own (``"8bit"`` or ``"4bit"``)."""
    return (FP32,) if state_bits == 32 else (FP32, f"{state_bits}bit")


def rows_shorter_than_block(shape: torch.Size | tuple[int, ...], block_size: int) -> bool:
    """Whether a tensor of ``shape`` has two or more dimensions and rows (its elements per index of the first
    dimension: a linear layer's weights of one output) shorter than ``block_size`` elements, so that each block of its
    flat state spans several rows."""
    return len(shape) >= 2 and shape[0] > 0 and math.prod(shape) < block_size * shape[0]


def check_state_format(group: dict[str, Any], state_bits: int, optimizer_name: str) -> None:
    """Raise ValueError where ``group`` names a state format (``"state_format"``) that an optimizer with
    ``state_bits``-bit state does not have."""
    if STATE_FORMAT not in group:
        return
    allowed = state_formats(state_bits)
    if group[STATE_FORMAT] not in allowed:
        raise ValueError(
            f"{STATE_FORMAT} must be one of {', '.join(map(repr, allowed))} for {optimizer_name}, got "
            f"{group[STATE_FORMAT]!r}"
        )


def check_modules(modules: Any, name: str) -> list[torch.nn.Module]:
    """``modules`` as a list, or TypeError naming ``name`` where it is not an iterable of ``torch.nn.Module``."""
    if not isinstance(modules, Iterable) or isinstance(modules, torch.Tensor):
        found = type(modules).__name__
    else:
        modules = list(modules)
        found = next((type(module).__name__ for module in modules if not isinstance(module, torch.nn.Module)), None)
    if found is not None:
        raise TypeError(
            f"{name} must be an iterable of torch.nn.Module (whose parameters keep fp32 state), got {found}"
        )
    return modules


def ordered_param_groups(
    params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]],
) -> list[dict[str, Any]]:
    """``params`` (tensors, ``(name, tensor)`` pairs, or param groups) as param groups, or TypeError where they have no
    fixed order (a set) or mix groups and parameters, ValueError for a group without ``params``."""
    if isinstance(params, (torch.Tensor, set)):
        raise TypeError(
            "params must be an ordered iterable of tensors, (name, tensor) pairs or param groups (a set has no fixed "
            f"order), got {type(params).__name__}"
        )
    entries = list(params)
    dicts = [isinstance(entry, dict) for entry in entries]
    if any(dicts) and not all(dicts):
        raise TypeError(
            f"params mixes param groups (entry {dicts.index(True)}) and parameters (entry {dicts.index(False)}); give "
            "all as param groups (dicts) or none"
        )
    groups = entries if any(dicts) else [{"params": entries}]
    for index, group in enumerate(groups):
        if "params" not in group:
            raise ValueError(f"param group {index} has no 'params'")
        if isinstance(group["params"], set):
            raise TypeError(f"param group {index}: params must be an ordered collection (a set has no fixed order)")
    return groups


def keep_fp32_state(
    params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]],
    modules: Iterable[torch.nn.Module],
) -> list[dict[str, Any]]:
    """``params`` as param groups in which the parameters of ``modules`` keep fp32 state.

    ``params`` is what an optimizer takes: tensors, ``(name, tensor)`` pairs, or param groups. Each group is split in
    two: its other parameters, as they were, and the parameters of ``modules`` (a submodule's included) in a group of
    their own right after it, with the same settings and ``"state_format": "fp32"``; a part left empty is dropped.
    A parameter shared with another module (tied embeddings) is one of the modules' if any of them holds it.

    >>> groups = keep_fp32_state(model.named_parameters(), [model.embed_tokens])
    >>> optimizer = PagedAdamW8bit(groups, lr=2e-4)
    """
    chosen = {id(param) for module in check_modules(modules, "modules") for param in module.parameters()}
    split = []
    for group in ordered_param_groups(params):
        members = group["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        names = group.get("param_names")
        moved = [id(member[1] if isinstance(member, tuple) else member) in chosen for member in members]
        for keeps_fp32 in (False, True):
            positions = [position for position, fp32 in enumerate(moved) if fp32 == keeps_fp32]
            if not positions and (keeps_fp32 or any(moved)):
                continue
            part = {**group, "params": [members[position] for position in positions]}
            if names is not None:
                part["param_names"] = [names[position] for position in positions]
            if keeps_fp32:
                part[STATE_FORMAT] = FP32
            split.append(part)
    return split
