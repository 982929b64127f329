"""Stochastic rounding of updated parameters to bf16, with bits that depend only on (seed, step, element).

An fp32 value ``x`` between two neighbouring bf16 values rounds up with probability equal to its distance from the
lower one over their spacing, so the rounded value equals ``x`` in expectation and updates smaller than half a bf16
spacing are not lost on average. It adds a 16-bit random integer ``r`` to the low 16 bits of ``x``'s fp32 bit
pattern and truncates them: ``bits = (fp32_bits + r) & 0xFFFF0000``. NaN and infinities are kept as they are.

``r`` is a hash of the parameter's seed, the step and the element's row-major index ``i`` in its parameter,
``mix32(low(i) ^ key_a ^ mix32(high(i) ^ key_b)) >> 16`` with the two keys of (seed, step) and the 32-bit words of
``i``: the same in every kernel family (eager and compiled PyTorch, the C++ host kernels of
``hf_paged/native/host_kernels.cpp``), for any page size, budget, chunking or thread count. The hash works on unsigned 32-bit integers; the PyTorch version
holds them in int64 tensors and splits each product so that no intermediate exceeds 2**49 (no overflow).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MASK32 = 0xFFFFFFFF
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
"""The multipliers of the 32-bit finalizer (``mix32``): xor-shift, multiply, xor-shift, multiply, xor-shift."""
_KEY_B_SALT = 0x9E3779B9


class ElementRounding(NamedTuple):
    """Stochastic rounding of a chunk: the two 32-bit keys of (parameter seed, step), and the index in its parameter
    of the chunk's first element. Eager kernels take ints; compiled ones 0-d int64 CPU tensors."""

    key_a: int | torch.Tensor
    key_b: int | torch.Tensor
    start: int | torch.Tensor


def mix32_int(value: int) -> int:
    """The 32-bit finalizer on a Python int in [0, 2**32)."""
    value ^= value >> 16
    value = (value * _MULTIPLIERS[0]) & MASK32
    value ^= value >> 15
    value = (value * _MULTIPLIERS[1]) & MASK32
    return value ^ (value >> 16)


def _times(values: torch.Tensor, multiplier: int) -> torch.Tensor:
    """``values * multiplier mod 2**32`` for int64 tensors of values in [0, 2**32), without overflow."""
    low, high = multiplier & 0xFFFF, multiplier >> 16
    return (values * low + (((values * high) & 0xFFFF) << 16)) & MASK32


def mix32(values: torch.Tensor) -> torch.Tensor:
    """:func:`mix32_int` on an int64 tensor of values in [0, 2**32)."""
    values = values ^ (values >> 16)
    values = _times(values, _MULTIPLIERS[0])
    values = values ^ (values >> 15)
    values = _times(values, _MULTIPLIERS[1])
    return values ^ (values >> 16)


def parameter_seed(group_seed: int, position: int) -> int:
    """The seed of the parameter at ``position`` of a param group whose ``stochastic_round_seed`` is ``group_seed``."""
    return mix32_int(group_seed & MASK32 ^ mix32_int((position + 1) & MASK32)) | (group_seed >> 32) << 32


def step_keys(seed: int, step: int) -> tuple[int, int]:
    """The two 32-bit keys of a parameter's ``seed`` at ``step`` (1 for the first update)."""
    key_a = mix32_int(seed & MASK32 ^ mix32_int(step & MASK32))
    key_b = mix32_int(key_a ^ (seed >> 32) & MASK32 ^ (step >> 32) & MASK32 ^ _KEY_B_SALT)
    return key_a, key_b


def random_bits(shape: torch.Size, device: torch.device, rounding: ElementRounding) -> torch.Tensor:
    """The 16-bit random integers (int64) of the elements of a chunk of ``shape`` (row-major, from ``start``)."""
    index = torch.arange(shape.numel(), dtype=torch.int64, device=device).view(shape) + rounding.start
    if isinstance(rounding.start, int) and rounding.start + shape.numel() <= 2**32:
        # Every index below 2**32 (an eager chunk of a parameter of fewer elements): the high word's key is one int.
        return mix32(index ^ (rounding.key_a ^ mix32_int(rounding.key_b))) >> 16
    return mix32((index & MASK32) ^ rounding.key_a ^ mix32((index >> 32) ^ rounding.key_b)) >> 16


def stochastic_round_bf16(values: torch.Tensor, rounding: ElementRounding) -> torch.Tensor:
    """fp32 ``values`` rounded stochastically to bf16 values (still fp32, so that converting them is exact)."""
    bits = values.view(torch.int32).to(torch.int64) & MASK32
    rounded = (bits + random_bits(values.shape, values.device, rounding)) & 0xFFFF0000
    rounded = (rounded - ((rounded >> 31) << 32)).to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(values), rounded, values)


ROUNDING_SLICE_ELEMENTS = 2**14
"""Elements an eager kernel rounds at a time, bounding the integer temporaries of the hash."""

ROUNDING_BYTES_PER_ELEMENT = 40
"""Bytes of temporaries per element of a slice that eager stochastic rounding adds to a step's peak (int64 indices
and hashes, the fp32 result, the finiteness mask): 32 measured (tests/test_stochastic_rounding.py), rounded up."""


def round_into_bf16_(param: torch.Tensor, values: torch.Tensor, rounding: ElementRounding) -> None:
    """Write fp32 ``values`` rounded stochastically into the bf16 ``param`` of the same shape (both contiguous):
    eagerly :data:`ROUNDING_SLICE_ELEMENTS` at a time, in one expression where ``torch.compile`` fuses it."""
    if torch.compiler.is_compiling():
        param.copy_(stochastic_round_bf16(values, rounding))
        return
    flat_param, flat_values = param.view(-1), values.view(-1)
    for begin in range(0, flat_values.numel(), ROUNDING_SLICE_ELEMENTS):
        end = begin + ROUNDING_SLICE_ELEMENTS
        sliced = rounding._replace(start=rounding.start + begin)
        flat_param[begin:end].copy_(stochastic_round_bf16(flat_values[begin:end], sliced))


def check_stochastic_rounding(group: dict) -> None:
    """Raise ValueError for a bad ``bf16_stochastic_round`` or ``stochastic_round_seed`` of a param group."""
    enabled = group.get("bf16_stochastic_round", False)
    if enabled is not True and enabled is not False:
        raise ValueError(f"bf16_stochastic_round must be True or False, got {enabled!r}")
    seed = group.get("stochastic_round_seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
        raise ValueError(f"stochastic_round_seed must be an integer in [0, 2**64), got {seed!r}")


def rounding_defaults(bf16_stochastic_round: bool, stochastic_round_seed: int) -> dict[str, bool | int]:
    """The defaults an optimizer adds for stochastic rounding: none when it is off with the default seed, so that
    param groups and state dicts stay as they were without it."""
    if not bf16_stochastic_round and stochastic_round_seed == 0:
        return {}
    return {"bf16_stochastic_round": bf16_stochastic_round, "stochastic_round_seed": stochastic_round_seed}
