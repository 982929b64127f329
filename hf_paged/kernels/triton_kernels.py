"""The Triton kernels: AdamW, Lion and AdEMAMix on 8-bit, 4-bit and fp32 state, and AdamW on rank-1 normalized 4-bit
state, one launch per page batch.

Each program updates tiles of whole blocks of a segment (``block_size`` elements of blockwise state, or
:data:`FP32_BLOCK` elements of fp32 state) in registers: it reads the parameter, gradient and state codes, decodes the
state, runs the rule in fp32, writes the parameter once and encodes the state with each block's new largest magnitude
as its scale. Nothing is allocated on the device besides the batch's small table of addresses, made before the first
write, so a call needs no undo copy.

Rank-1 normalized 4-bit state (:class:`~hf_paged.codecs.Rank1Normalized4bitCodec`): the codes are those of 4-bit
blockwise state, each element's normalizer ``min(rows[i], cols[j])`` (fp32, read from its tensor's statistics) taking
the place of its block's scale: decoded with the current statistics, encoded with the next ones. ``gather_batch``
decodes the state and advances the moments as the update will, and raises the next row and column maxima to their
magnitudes by atomic maxima of their bits (non-negative fp32 values order as their int32 patterns); it writes nothing
else. See :mod:`hf_paged.kernels.batch`.

The arithmetic is that of the host kernels (``hf_paged/native/host_kernels.cpp``) operation by operation: products
and sums rounded one by one (launched with ``enable_fp_fusion=False``, so that no multiply and add are contracted),
lerp, ``add(alpha=)`` and ``addcmul`` as ATen's (one fused multiply-add each), square roots and quotients IEEE-rounded
(``sqrt_rn``, ``div_rn``), codes rounded to nearest, ties to even. Conversions to bf16 round to nearest even in
integer arithmetic (a NaN becomes ``0x7FC0``, as ``c10::BFloat16`` on the CPU), so results are bitwise the host's and
the eager PyTorch kernels' on finite values. Stochastic rounding of bf16 parameters takes the hash of
:mod:`hf_paged.stochastic_rounding` in 32-bit integer arithmetic. Where the host and eager kernels differ among
themselves (Lion's sign of a NaN momentum: 0 in the host kernels), these follow the host kernels. The one difference:
those three operations are always one fused multiply-add here, as ATen's CPU kernels compute them where the CPU has
one (AVX2, AVX-512, ARM); on a CPU without (PyTorch's ``default`` capability) they round the product and sum apart,
and a moment can differ by an ulp, its code by one.

On the CPU they run only under Triton's interpreter (``TRITON_INTERPRET=1`` when Triton and this module are first
imported, and while they run), which the tests use to run them without an accelerator.

First-use self-check: the first time a process asks a kernel to update segments of a (rule, state format, parameter
dtype, gradient dtype, device) combination, it updates a small synthetic batch on that device (a few blocks, a partial
last block, two segments on one page; for bf16 parameters with and without stochastic rounding) and compares the
parameter, codes, scales and fp32 state (and, for rank-1 state, the gathered statistics) with the eager PyTorch
kernel's on the CPU (:func:`self_check`): bitwise
where the CPU's lerp is one fused multiply-add, else within the bound above. Where the launch raises (a compilation
error, ``OutOfResources``, any other error but running out of memory) or a result differs, the combination takes the
PyTorch kernels (the fallback) from then on, which is logged once with the reason.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensor
from triton.backends import backends

from ..codecs import (
    Blockwise4bitCodec,
    Blockwise8bitCodec,
    Codec,
    EncodedSegment,
    Float32Codec,
    PageFormat,
    Rank1Normalized4bitCodec,
    Rank1Statistics,
    random_page_buffers,
)
from ..device import values_to_device
from ..stochastic_rounding import ElementRounding, step_keys
from .batch import (
    LENGTH,
    NO_ROUNDING,
    OFFSET,
    PAGE,
    ROW,
    START,
    TABLE_COLUMNS,
    TENSOR,
    HostToDevice,
    PageBatch,
)
from .pytorch import gather_in_buffers, update_in_buffers, update_or_undo
from .rules import (
    ADEMAMIX_SCALAR_NAMES,
    UpdateRule,
    adamw_moments_,
    adamw_scalars,
    adamw_update_,
    ademamix_scalars,
    ademamix_update_,
    lion_update_,
)

if TYPE_CHECKING:
    from ..store import Page, Segment

logger = logging.getLogger(__name__)

FP32_BLOCK = 256
"""Elements of fp32 state the kernels take as one block (fp32 state has no scales: only the tiling)."""

TILE_ELEMENTS = 8192 if triton.knobs.runtime.interpret else 1024
"""Elements a program updates at a time (whole blocks, at least one): the interpreter runs programs one after
another, each at a cost of its own, so it takes larger tiles."""

MAX_PROGRAMS_PER_SEGMENT = 4096
"""Programs a launch gives each segment at most; each loops over its tiles of the segment."""

INTERPRETED = bool(triton.knobs.runtime.interpret)
"""Whether this process runs Triton kernels in the interpreter (``TRITON_INTERPRET=1`` at import)."""

_RULES: dict[UpdateRule, tuple[str, tuple[bool, ...], tuple[str, ...]]] = {
    adamw_update_: (
        "adamw",
        (True, False),
        ("decay", "avg_weight", "beta2", "sq_weight", "eps", "step_size", "inv_bias_correction2_sqrt"),
    ),
    lion_update_: ("lion", (True,), ("lr", "decay", "direction_weight", "avg_weight")),
    ademamix_update_: ("ademamix", (True, True, False), ADEMAMIX_SCALAR_NAMES),
}
"""The rules with Triton kernels: their name, the signedness of their states, and their scalars in kernel order."""

_RULE_CODES = {"adamw": 0, "lion": 1, "ademamix": 2}
"""The code of each rule that the update kernel is specialized on (``RULE``)."""

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Parameter and gradient dtypes the kernels take, by the code the kernels are specialized on."""


def _pair_code(param: torch.Tensor, grad: torch.Tensor) -> int:
    """The code of a parameter's and gradient's dtypes that the kernel compares with its specialization."""
    return _DTYPES[param.dtype] * 3 + _DTYPES[grad.dtype]


def _padded(addresses: list[int]) -> list[int]:
    """``addresses`` with a 0 appended where their number is odd: the int64 entries that follow start at a 16-byte
    boundary, as every pointer the kernels take does (Triton specializes a kernel on whether a pointer is 16-byte
    aligned)."""
    return addresses + [0] if len(addresses) % 2 else addresses


def triton_rule(rule: UpdateRule, codecs: tuple[Codec, ...]) -> tuple[str, int, int] | None:
    """The Triton kernel's rule name, state bits (8, 4, or 32 for fp32 state) and block size for ``rule`` on
    ``codecs``, or ``None`` where it has none: a rule other than AdamW's, Lion's and AdEMAMix's, or states that are
    not all 8-bit, all 4-bit (of one block size), all fp32, or (AdamW only) all rank-1 normalized 4-bit."""
    entry = _RULES.get(rule)
    if entry is None or not codecs:
        return None
    name, signedness, _ = entry
    if len(codecs) != len(signedness):
        return None
    kind = type(codecs[0])
    if any(type(codec) is not kind for codec in codecs):
        return None
    if kind is Float32Codec:
        return name, 32, FP32_BLOCK
    if kind is Rank1Normalized4bitCodec and name != "adamw":
        return None
    if kind not in (Blockwise8bitCodec, Blockwise4bitCodec, Rank1Normalized4bitCodec):
        return None
    if any(codec.block_size != codecs[0].block_size for codec in codecs):
        return None
    if tuple(codec.signed for codec in codecs) != signedness:
        return None
    block_size = codecs[0].block_size
    if block_size < 16 or block_size & (block_size - 1):
        return None
    return name, 8 if kind is Blockwise8bitCodec else 4, block_size


STATISTICS_COLUMNS = 9
"""Entries per tensor of a rank-1 launch's table of statistics: the addresses of its eight maxima in
:attr:`PageBatch.statistics` order (current rows and columns of state 0 and 1, then the next ones), then its number of
columns."""


def runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels run on pages of ``device``: NVIDIA GPUs of compute capability 8.0 or more, AMD GPUs
    (ROCm) and XPU devices where the installed Triton has a backend for them, and the CPU under the interpreter."""
    if INTERPRETED:
        return device.type == "cpu"
    if device.type == "cuda" and torch.cuda.is_available():
        if torch.version.hip is not None:
            return "amd" in backends
        return "nvidia" in backends and torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "xpu":
        return "intel" in backends and hasattr(torch, "xpu") and torch.xpu.is_available()
    return False


# The arithmetic of one block, in registers ---------------------------------------------------------------------


@triton.jit
def _lerp(start, end, weight):
    """ATen's lerp: start + w (end - start) for |w| < 0.5, else end + (w - 1) (end - start), one fused multiply-add."""
    small = tl.abs(weight) < 0.5
    coefficient = tl.where(small, weight, weight - 1.0)
    return tl.fma(coefficient, end - start, tl.where(small, start, end))


@triton.jit
def _sign(x):
    """torch.sign of finite values: 1, -1 or 0 (0 for NaN, as the host kernels)."""
    return tl.where(x > 0.0, 1.0, 0.0) - tl.where(x < 0.0, 1.0, 0.0)


@triton.jit
def _round_even(x):
    """x rounded to the nearest integer, ties to even, for 0 <= x < 2**22."""
    return (x + 8388608.0) - 8388608.0


@triton.jit
def _is_nan(x):
    """Where ``x`` is NaN, the one value unequal to itself."""
    return x != x  # noqa: PLR0124


@triton.jit
def _saturate(x):
    """NaN to 0, the rest clamped to [-1, 1] (codecs.saturate_)."""
    return tl.minimum(tl.maximum(tl.where(_is_nan(x), 0.0, x), -1.0), 1.0)


@triton.jit
def _largest(values):
    """Each block's (row's) largest finite magnitude: NaN counts as 0, an infinity as the largest fp32 value."""
    magnitude = tl.abs(values)
    magnitude = tl.minimum(tl.where(_is_nan(magnitude), 0.0, magnitude), 3.4028234663852886e38)
    return tl.max(magnitude, axis=1)


@triton.jit
def _reciprocal(scale):
    """1 / scale where scale >= the smallest normal fp32, else 0."""
    safe = tl.maximum(scale, 1.1754943508222875e-38)
    return tl.where(scale >= 1.1754943508222875e-38, tl.div_rn(tl.full([], 1.0, tl.float32), safe), 0.0)


@triton.jit
def _inverse_root(scale):
    """1 / sqrt(scale) for a positive scale, subnormal ones included, else 0 (codecs.square_roots)."""
    safe = tl.where(scale > 0.0, scale, 1.0)
    return tl.where(scale > 0.0, tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(safe)), 0.0)


@triton.jit
def _infinity_at_max(values):
    """+infinity where ``values`` are the largest fp32 value: how a non-negative state stores one (codecs.scaled)."""
    return tl.where(values == 3.4028234663852886e38, float("inf"), values)


@triton.jit
def _decode(codes, scale, BITS: tl.constexpr, SIGNED: tl.constexpr):
    """fp32 values of integer ``codes`` (one per element, as fp32) of a block whose scale is ``scale``."""
    if BITS == 8:
        if SIGNED:
            normalized = codes * 0.007874015748031496  # 1 / 127
            return normalized * tl.abs(normalized) * scale
        else:
            normalized = codes * 0.00392156862745098  # 1 / 255
            squared = normalized * normalized
            return _infinity_at_max(squared * squared * scale)
    else:
        if SIGNED:
            level = codes - 7.0
            return level * tl.abs(level) * 0.02040816326530612 * scale  # 1 / 49
        else:
            root = (codes + 1.0) * 0.0625
            squared = root * root
            return _infinity_at_max(squared * squared * scale)


@triton.jit
def _signed_code(values, inverse, BITS: tl.constexpr):
    """Codes of a signed state: int8 for 8 bits, 0..14 (the level plus 7) for 4 bits, as int32."""
    normalized = _saturate(values * inverse)
    if BITS == 8:
        magnitude = _round_even(tl.sqrt_rn(tl.abs(normalized)) * 127.0)
        return magnitude.to(tl.int32) * _sign(normalized).to(tl.int32)
    else:
        excess = tl.abs(normalized) * 196.0 - 1.0
        level = tl.minimum(tl.floor((tl.sqrt_rn(tl.maximum(excess, 0.0)) + 1.0) * 0.5), 7.0)
        return level.to(tl.int32) * _sign(normalized).to(tl.int32) + 7


@triton.jit
def _unsigned_code(roots, inverse_root, BITS: tl.constexpr):
    """Codes of a non-negative state from the square roots of its values, as int32 (4 bits: the nearest level in the
    square roots' domain, codecs.encode_4bit)."""
    normalized = _saturate(roots * inverse_root)
    if BITS == 8:
        code = _round_even(tl.sqrt_rn(normalized) * 255.0)
        return tl.maximum(code, tl.where(normalized > 0.0, 1.0, 0.0)).to(tl.int32)
    else:
        excess = normalized * 1024.0 - 1.0
        level = tl.floor((tl.sqrt_rn(tl.maximum(excess, 0.0)) + 1.0) * 0.5)
        return tl.maximum(level - 1.0, 0.0).to(tl.int32)


@triton.jit
def _mix32(x):
    """The 32-bit finalizer of hf_paged.stochastic_rounding on uint32 values."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _to_bf16_bits(values):
    """The bf16 bit patterns (int32) of fp32 values rounded to nearest even; NaN gives 0x7FC0."""
    bits = values.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(_is_nan(values), 0x7FC0, rounded.to(tl.int32))


@triton.jit
def _load_float(pointer, index, mask, DTYPE: tl.constexpr):
    """fp32 values of elements ``index`` of a tensor of ``DTYPE`` (0 fp32, 1 bf16, 2 fp16); 0 where masked."""
    if DTYPE == 1:
        bits = tl.load(pointer.to(tl.pointer_type(tl.uint16)) + index, mask=mask, other=0)
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    elif DTYPE == 2:
        return tl.load(pointer.to(tl.pointer_type(tl.float16)) + index, mask=mask, other=0.0).to(tl.float32)
    else:
        return tl.load(pointer.to(tl.pointer_type(tl.float32)) + index, mask=mask, other=0.0)


@triton.jit
def _store_param(
    pointer, index, mask, values, rounds, key_a, key_b, round_index, DTYPE: tl.constexpr, ROUND: tl.constexpr
):
    """Write fp32 ``values`` to elements ``index`` of a parameter of ``DTYPE``: rounded to nearest even, or for bf16
    with ``ROUND`` where ``rounds`` stochastically by the hash of ``key_a``, ``key_b`` and ``round_index`` (the
    elements' indices in the parameter)."""
    if DTYPE == 1:
        bits = _to_bf16_bits(values)
        if ROUND:
            low = (round_index & 0xFFFFFFFF).to(tl.uint32)
            high = (round_index >> 32).to(tl.uint32)
            hashed = _mix32(low ^ key_a ^ _mix32(high ^ key_b)) >> 16
            random = ((values.to(tl.uint32, bitcast=True) + hashed) >> 16).to(tl.int32)
            bits = tl.where(rounds & (tl.abs(values) <= 3.4028234663852886e38), random, bits)
        tl.store(pointer.to(tl.pointer_type(tl.uint16)) + index, bits.to(tl.uint16), mask=mask)
    elif DTYPE == 2:
        tl.store(pointer.to(tl.pointer_type(tl.float16)) + index, values.to(tl.float16), mask=mask)
    else:
        tl.store(pointer.to(tl.pointer_type(tl.float32)) + index, values, mask=mask)


@triton.jit
def _adamw_moments(grad, moment, second, s):
    """adamw_moments_ on fp32 values: the new first and second moments."""
    moment = _lerp(moment, grad, tl.load(s + 1))
    second = second * tl.load(s + 2) + grad * tl.load(s + 3) * grad
    return moment, second


@triton.jit
def _adamw_values(param, grad, moment, second, s):
    """adamw_update_ on fp32 values: the new parameter, first moment, second moment and its square root."""
    moment, second = _adamw_moments(grad, moment, second, s)
    root = tl.sqrt_rn(second)
    denominator = root * tl.load(s + 6) + tl.load(s + 4)
    param = param * tl.load(s + 0) - tl.div_rn(moment, denominator) * tl.load(s + 5)
    return param, moment, second, root


@triton.jit
def _lion_values(param, grad, moment, s):
    """lion_update_ on fp32 values: the new parameter and momentum (NaN and infinities stored as 0)."""
    direction = _sign(_lerp(moment, grad, tl.load(s + 2)))
    param = param * tl.load(s + 1) - direction * tl.load(s + 0)
    moment = _lerp(moment, grad, tl.load(s + 3))
    return param, tl.where(tl.abs(moment) <= 3.4028234663852886e38, moment, 0.0)


@triton.jit
def _normalizers(statistics, which, row, col, valid):
    """Rank-1 normalizers ``min(rows[row], cols[col])`` (fp32) of a tensor whose row of the statistics table is at
    ``statistics``, from its maxima ``which`` (0, 1: the current ones of state 0, 1; 2, 3: the next ones); 0 where not
    ``valid``."""
    rows = tl.load(statistics + 2 * which).to(tl.pointer_type(tl.float32))
    cols = tl.load(statistics + 2 * which + 1).to(tl.pointer_type(tl.float32))
    return tl.minimum(
        tl.load(rows + row, mask=valid, other=0.0),
        tl.load(cols + col, mask=valid, other=0.0),
        propagate_nan=tl.PropagateNan.ALL,
    )


@triton.jit
def _raise_maxima(statistics, which, row, col, values, valid):
    """Raise the maxima ``which`` (2, 3: the next ones of state 0, 1) of rows ``row`` and columns ``col`` to the
    magnitudes of ``values`` where ``valid`` (NaN counts as 0, an infinity as the largest fp32 value), by atomic
    maxima of their int32 bit patterns."""
    magnitude = tl.abs(values)
    magnitude = tl.minimum(tl.where(_is_nan(magnitude), 0.0, magnitude), 3.4028234663852886e38)
    bits = magnitude.to(tl.int32, bitcast=True)
    rows = tl.load(statistics + 2 * which).to(tl.pointer_type(tl.int32))
    cols = tl.load(statistics + 2 * which + 1).to(tl.pointer_type(tl.int32))
    tl.atomic_max(rows + row, bits, mask=valid, sem="relaxed")
    tl.atomic_max(cols + col, bits, mask=valid, sem="relaxed")


@triton.jit
def _segment_entry(table, scalars, segment, SCALARS: tl.constexpr):
    """Row ``segment`` of a batch's table: its tensor, first element, length (elements), page and page offset
    (elements), and the address of its row of ``scalars``."""
    row = table + segment * 6
    s = scalars + tl.load(row + 5) * SCALARS
    return tl.load(row + 0), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4), s


@triton.jit
def _ademamix_values(param, grad, fast, slow, second, s):
    """ademamix_update_ on fp32 values: the new parameter, fast and slow averages, second moment and its square root.
    Each average is one fused multiply-add (ATen's add with alpha), the second moment one (ATen's addcmul), and so is
    the weight decay's share of the update."""
    fast = tl.fma(grad, tl.load(s + 1), fast * tl.load(s + 0))
    slow = tl.fma(grad, tl.load(s + 3), slow * tl.load(s + 2))
    second = tl.fma(grad * tl.load(s + 5), grad, second * tl.load(s + 4))
    root = tl.sqrt_rn(second)
    denominator = tl.div_rn(root, tl.load(s + 8)) + tl.load(s + 6)
    update = tl.div_rn(tl.div_rn(fast, tl.load(s + 7)) + slow * tl.load(s + 9), denominator)
    param = param + tl.fma(param, tl.load(s + 10), update) * tl.load(s + 11)
    return param, fast, slow, second, root


@triton.jit
def _update_elements(
    param, grad, index, mask, old0, old1, old2, s, rounds, key_a, key_b, round_index,
    RULE: tl.constexpr, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    """Update elements ``index`` of a parameter (masked elements read as zeros and are not written) from their
    decoded states ``old0``, ``old1``, ``old2`` (a rule with fewer states ignores the others; see :data:`_RULES`);
    return the new states (fp32; a rule's missing ones repeat its first) and the square roots of the second moment
    (AdamW, AdEMAMix), which the encoding of that non-negative state takes."""
    p = _load_float(param, index, mask, P_DTYPE)
    g = _load_float(grad, index, mask, G_DTYPE)
    if RULE == 0:
        p, new0, new1, root = _adamw_values(p, g, old0, old1, s)
        new2 = new0
    elif RULE == 1:
        p, new0 = _lion_values(p, g, old0, s)
        new1 = new0
        new2 = new0
        root = new0
    else:
        p, new0, new1, new2, root = _ademamix_values(p, g, old0, old1, old2, s)
    _store_param(param, index, mask, p, rounds, key_a, key_b, round_index, P_DTYPE, ROUND)
    return new0, new1, new2, root


@triton.jit
def _fp32_values(buffers, k, offset):
    """Where the values of state ``k`` of a segment of fp32 state start (buffer ``k`` of its page, ``offset`` on)."""
    return tl.load(buffers + k).to(tl.pointer_type(tl.float32)) + offset


@triton.jit
def _decode_8bit(buffers, k, offset, index, whole, scale_index, blocks, SIGNED: tl.constexpr):
    """The values of state ``k`` at elements ``index`` of a segment of 8-bit state starting at element ``offset`` of its
    page (its codes and scales: the page's buffers ``2 k`` and ``2 k + 1``), ``whole`` the rows of its blocks
    ``scale_index`` of which ``blocks`` are valid."""
    scales = tl.load(buffers + 2 * k + 1).to(tl.pointer_type(tl.float32))
    scale = tl.load(scales + scale_index, mask=blocks, other=0.0)[:, None]
    if SIGNED:
        codes = tl.load(buffers + 2 * k).to(tl.pointer_type(tl.int8)) + offset
    else:
        codes = tl.load(buffers + 2 * k).to(tl.pointer_type(tl.uint8)) + offset
    return _decode(tl.load(codes + index, mask=whole, other=0).to(tl.float32), scale, 8, SIGNED)


@triton.jit
def _encode_8bit(buffers, k, offset, index, whole, scale_index, blocks, values, roots, SIGNED: tl.constexpr):
    """Store the new ``values`` of state ``k`` (a non-negative state's from their square roots ``roots``) at elements
    ``index`` of a segment of 8-bit state (see :func:`_decode_8bit`), each block scaled by its largest magnitude."""
    scale = _largest(values)
    if SIGNED:
        codes = tl.load(buffers + 2 * k).to(tl.pointer_type(tl.int8)) + offset
        tl.store(codes + index, _signed_code(values, _reciprocal(scale)[:, None], 8).to(tl.int8), mask=whole)
    else:
        codes = tl.load(buffers + 2 * k).to(tl.pointer_type(tl.uint8)) + offset
        tl.store(codes + index, _unsigned_code(roots, _inverse_root(scale)[:, None], 8).to(tl.uint8), mask=whole)
    tl.store(tl.load(buffers + 2 * k + 1).to(tl.pointer_type(tl.float32)) + scale_index, scale, mask=blocks)


@triton.jit
def _decode_4bit(packed, byte, whole, low_scale, high_scale, SIGNED: tl.constexpr):
    """The values of a state's elements whose 4-bit codes are the low and high nibbles of bytes ``byte`` from
    ``packed``, scaled by ``low_scale`` and ``high_scale`` (a block's scale or each element's normalizer)."""
    codes = tl.load(packed + byte, mask=whole, other=0).to(tl.int32)
    low = _decode((codes & 15).to(tl.float32), low_scale, 4, SIGNED)
    return low, _decode((codes >> 4).to(tl.float32), high_scale, 4, SIGNED)


@triton.jit
def _encode_4bit(packed, byte, whole, low, high, low_inverse, high_inverse, SIGNED: tl.constexpr):
    """Store 4-bit codes into the low and high nibbles of bytes ``byte`` from ``packed``: of the values ``low`` and
    ``high`` times ``low_inverse`` and ``high_inverse`` (a non-negative state: of the square roots ``low`` and ``high``
    times the inverse square roots of their scales)."""
    if SIGNED:
        codes = _signed_code(low, low_inverse, 4) | (_signed_code(high, high_inverse, 4) << 4)
    else:
        codes = _unsigned_code(low, low_inverse, 4) | (_unsigned_code(high, high_inverse, 4) << 4)
    tl.store(packed + byte, codes.to(tl.uint8), mask=whole)


@triton.jit
def _encode_4bit_blocks(
    buffers, k, offset, byte, whole, scale_index, blocks, low, high, low_roots, high_roots, SIGNED: tl.constexpr
):
    """Store the new values ``low`` and ``high`` of state ``k`` of a segment of blockwise 4-bit state (its packed codes
    and scales: the page's buffers ``2 k`` and ``2 k + 1``; a non-negative state's codes from the square roots), each
    block scaled by its largest magnitude."""
    scale = tl.maximum(_largest(low), _largest(high))
    packed = tl.load(buffers + 2 * k).to(tl.pointer_type(tl.uint8)) + offset // 2
    if SIGNED:
        inverse = _reciprocal(scale)[:, None]
        _encode_4bit(packed, byte, whole, low, high, inverse, inverse, True)
    else:
        inverse_root = _inverse_root(scale)[:, None]
        _encode_4bit(packed, byte, whole, low_roots, high_roots, inverse_root, inverse_root, False)
    tl.store(tl.load(buffers + 2 * k + 1).to(tl.pointer_type(tl.float32)) + scale_index, scale, mask=blocks)


@triton.jit(do_not_specialize=["round_shift", "programs"])
def _update_batch_kernel(
    table, scalars, rounding, param_addresses, grad_addresses, buffer_addresses, statistic_addresses, round_shift,
    programs, RULE: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, BUFFERS: tl.constexpr,
    SCALARS: tl.constexpr, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, ROUND: tl.constexpr, RANK1: tl.constexpr,
):  # fmt: skip
    """Update segment ``program_id(0)`` of a batch whose parameters and gradients have dtypes ``P_DTYPE`` and
    ``G_DTYPE`` (segments of other dtypes are left to other launches), ``ROWS`` blocks at a time: blocks
    ``program_id(1) * ROWS`` on, then every ``programs * ROWS`` blocks further. A block is ``BLOCK`` elements of
    blockwise state with its scale, or of fp32 state; with ``RANK1``, of 4-bit state whose elements take their
    normalizers from the tensors' rows of ``statistic_addresses`` (:data:`STATISTICS_COLUMNS` entries each).

    The rule ``RULE`` (see :data:`_RULES`) has state 0 (signed), state 1 unless it is Lion (signed for AdEMAMix, the
    non-negative second moment for AdamW) and state 2 for AdEMAMix (its non-negative second moment)."""
    SLOW: tl.constexpr = RULE == 2  # state 1 is signed and state 2 the second moment
    segment = tl.program_id(0)
    tensor, start, length, page, offset, s = _segment_entry(table, scalars, segment, SCALARS)
    matches = tl.load(param_addresses + tensor * 2 + 1) == P_DTYPE * 3 + G_DTYPE
    if ROUND:
        key_a = tl.load(rounding + segment * 2)
        key_b = tl.load(rounding + segment * 2 + 1)
        rounds = key_a >= 0
        key_a = tl.where(rounds, key_a, 0).to(tl.uint32)
        key_b = tl.where(rounds, key_b, 0).to(tl.uint32)
    else:
        rounds = tl.full([], 0, tl.int1)
        key_a = tl.full([], 0, tl.uint32)
        key_b = tl.full([], 0, tl.uint32)
    param = tl.load(param_addresses + tensor * 2).to(tl.pointer_type(tl.int8)) + start * (4 if P_DTYPE == 0 else 2)
    grad = tl.load(grad_addresses + tensor).to(tl.pointer_type(tl.int8)) + start * (4 if G_DTYPE == 0 else 2)
    buffers = buffer_addresses + page * BUFFERS
    blocks = tl.where(matches, (length + BLOCK - 1) // BLOCK, 0)
    for base in range(tl.program_id(1) * ROWS, blocks, programs * ROWS):
        block = base + tl.arange(0, ROWS)
        valid = block < blocks
        whole = valid[:, None]  # the rows of blocks of the segment
        if BITS == 32:
            index = block[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
            mask = whole & (index < length)
            old0 = tl.load(_fp32_values(buffers, 0, offset) + index, mask=mask, other=0.0)
            old1 = old0
            old2 = old0
            if RULE != 1:
                old1 = tl.load(_fp32_values(buffers, 1, offset) + index, mask=mask, other=0.0)
            if SLOW:
                old2 = tl.load(_fp32_values(buffers, 2, offset) + index, mask=mask, other=0.0)
            new0, new1, new2, root = _update_elements(
                param, grad, index, mask, old0, old1, old2, s, rounds, key_a, key_b, start + round_shift + index,
                RULE, P_DTYPE, G_DTYPE, ROUND,
            )  # fmt: skip
            tl.store(_fp32_values(buffers, 0, offset) + index, new0, mask=mask)
            if RULE != 1:
                tl.store(_fp32_values(buffers, 1, offset) + index, new1, mask=mask)
            if SLOW:
                tl.store(_fp32_values(buffers, 2, offset) + index, new2, mask=mask)
        elif BITS == 8:
            scale_index = offset // BLOCK + block
            index = block[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
            mask = whole & (index < length)
            old0 = _decode_8bit(buffers, 0, offset, index, whole, scale_index, valid, True)
            old1 = old0
            old2 = old0
            if RULE != 1:
                old1 = _decode_8bit(buffers, 1, offset, index, whole, scale_index, valid, SLOW)
            if SLOW:
                old2 = _decode_8bit(buffers, 2, offset, index, whole, scale_index, valid, False)
            new0, new1, new2, root = _update_elements(
                param, grad, index, mask, old0, old1, old2, s, rounds, key_a, key_b, start + round_shift + index,
                RULE, P_DTYPE, G_DTYPE, ROUND,
            )  # fmt: skip
            _encode_8bit(buffers, 0, offset, index, whole, scale_index, valid, new0, root, True)
            if RULE != 1:
                _encode_8bit(buffers, 1, offset, index, whole, scale_index, valid, new1, root, SLOW)
            if SLOW:
                _encode_8bit(buffers, 2, offset, index, whole, scale_index, valid, new2, root, False)
        else:
            # byte i of a block holds element i (low nibble) and element i + BLOCK // 2 (high nibble)
            scale_index = offset // BLOCK + block
            byte = block[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
            low_index = byte + block[:, None] * (BLOCK // 2)
            high_index = low_index + BLOCK // 2
            low_valid = whole & (low_index < length)
            high_valid = whole & (high_index < length)
            if RANK1:
                # AdamW only: element (row, col) of its tensor, normalized by min(rows[row], cols[col]); padding by 0;
                # each state's packed codes are the page's buffer k
                row_statistics = statistic_addresses + tensor * 9  # STATISTICS_COLUMNS
                columns = tl.load(row_statistics + 8)
                low_row = (start + low_index) // columns
                low_col = start + low_index - low_row * columns
                high_row = (start + high_index) // columns
                high_col = start + high_index - high_row * columns
                moments = tl.load(buffers).to(tl.pointer_type(tl.uint8)) + offset // 2
                seconds = tl.load(buffers + 1).to(tl.pointer_type(tl.uint8)) + offset // 2
                old0_low, old0_high = _decode_4bit(
                    moments, byte, whole, _normalizers(row_statistics, 0, low_row, low_col, low_valid),
                    _normalizers(row_statistics, 0, high_row, high_col, high_valid), True,
                )  # fmt: skip
                old1_low, old1_high = _decode_4bit(
                    seconds, byte, whole, _normalizers(row_statistics, 1, low_row, low_col, low_valid),
                    _normalizers(row_statistics, 1, high_row, high_col, high_valid), False,
                )  # fmt: skip
                old2_low = old0_low
                old2_high = old0_high
            else:
                # each state's packed codes and scales are the page's buffers 2 k and 2 k + 1
                scales = tl.load(buffers + 1).to(tl.pointer_type(tl.float32))
                scale = tl.load(scales + scale_index, mask=valid, other=0.0)[:, None]
                packed = tl.load(buffers).to(tl.pointer_type(tl.uint8)) + offset // 2
                old0_low, old0_high = _decode_4bit(packed, byte, whole, scale, scale, True)
                old1_low = old0_low
                old1_high = old0_high
                old2_low = old0_low
                old2_high = old0_high
                if RULE != 1:
                    scales = tl.load(buffers + 3).to(tl.pointer_type(tl.float32))
                    scale = tl.load(scales + scale_index, mask=valid, other=0.0)[:, None]
                    packed = tl.load(buffers + 2).to(tl.pointer_type(tl.uint8)) + offset // 2
                    old1_low, old1_high = _decode_4bit(packed, byte, whole, scale, scale, SLOW)
                if SLOW:
                    scales = tl.load(buffers + 5).to(tl.pointer_type(tl.float32))
                    scale = tl.load(scales + scale_index, mask=valid, other=0.0)[:, None]
                    packed = tl.load(buffers + 4).to(tl.pointer_type(tl.uint8)) + offset // 2
                    old2_low, old2_high = _decode_4bit(packed, byte, whole, scale, scale, False)
            new0_low, new1_low, new2_low, root_low = _update_elements(
                param, grad, low_index, low_valid, old0_low, old1_low, old2_low, s, rounds, key_a, key_b,
                start + round_shift + low_index, RULE, P_DTYPE, G_DTYPE, ROUND,
            )  # fmt: skip
            new0_high, new1_high, new2_high, root_high = _update_elements(
                param, grad, high_index, high_valid, old0_high, old1_high, old2_high, s, rounds, key_a, key_b,
                start + round_shift + high_index, RULE, P_DTYPE, G_DTYPE, ROUND,
            )  # fmt: skip
            if RANK1:
                _encode_4bit(
                    moments, byte, whole, new0_low, new0_high,
                    _reciprocal(_normalizers(row_statistics, 2, low_row, low_col, low_valid)),
                    _reciprocal(_normalizers(row_statistics, 2, high_row, high_col, high_valid)), True,
                )  # fmt: skip
                _encode_4bit(
                    seconds, byte, whole, root_low, root_high,
                    _inverse_root(_normalizers(row_statistics, 3, low_row, low_col, low_valid)),
                    _inverse_root(_normalizers(row_statistics, 3, high_row, high_col, high_valid)), False,
                )  # fmt: skip
            else:
                _encode_4bit_blocks(
                    buffers, 0, offset, byte, whole, scale_index, valid, new0_low, new0_high, root_low, root_high, True
                )
                if RULE != 1:
                    _encode_4bit_blocks(
                        buffers, 1, offset, byte, whole, scale_index, valid, new1_low, new1_high, root_low, root_high,
                        SLOW,
                    )  # fmt: skip
                if SLOW:
                    _encode_4bit_blocks(
                        buffers, 2, offset, byte, whole, scale_index, valid, new2_low, new2_high, root_low, root_high,
                        False,
                    )  # fmt: skip


@triton.jit(do_not_specialize=["programs"])
def _gather_batch_kernel(
    table, scalars, param_addresses, grad_addresses, buffer_addresses, statistic_addresses, programs,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, SCALARS: tl.constexpr, G_DTYPE: tl.constexpr,
):  # fmt: skip
    """Gather the next rank-1 statistics of AdamW's states over segment ``program_id(0)`` of a batch whose gradients
    have dtype ``G_DTYPE`` (segments of other dtypes are left to other launches), ``ROWS`` blocks at a time as
    :func:`_update_batch_kernel` tiles them: decode both states with the current normalizers, advance the moments,
    raise the next maxima of the elements' rows and columns. Writes nothing else."""
    tensor, start, length, page, offset, s = _segment_entry(table, scalars, tl.program_id(0), SCALARS)
    matches = tl.load(param_addresses + tensor * 2 + 1) % 3 == G_DTYPE
    grad = tl.load(grad_addresses + tensor).to(tl.pointer_type(tl.int8)) + start * (4 if G_DTYPE == 0 else 2)
    moment_bytes = tl.load(buffer_addresses + page * 2).to(tl.pointer_type(tl.uint8)) + offset // 2
    second_bytes = tl.load(buffer_addresses + page * 2 + 1).to(tl.pointer_type(tl.uint8)) + offset // 2
    row_statistics = statistic_addresses + tensor * 9  # STATISTICS_COLUMNS
    columns = tl.load(row_statistics + 8)
    blocks = tl.where(matches, (length + BLOCK - 1) // BLOCK, 0)
    for base in range(tl.program_id(1) * ROWS, blocks, programs * ROWS):
        block = base + tl.arange(0, ROWS)
        whole = (block < blocks)[:, None]
        byte = block[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        moment_codes = tl.load(moment_bytes + byte, mask=whole, other=0).to(tl.int32)
        second_codes = tl.load(second_bytes + byte, mask=whole, other=0).to(tl.int32)
        for half in tl.static_range(2):
            # byte i of a block holds element i (low nibble) and element i + BLOCK // 2 (high nibble)
            index = byte + block[:, None] * (BLOCK // 2) + half * (BLOCK // 2)
            valid = whole & (index < length)
            element_row = (start + index) // columns
            element_col = start + index - element_row * columns
            moment_scale = _normalizers(row_statistics, 0, element_row, element_col, valid)
            second_scale = _normalizers(row_statistics, 1, element_row, element_col, valid)
            moment = _decode(((moment_codes >> (4 * half)) & 15).to(tl.float32), moment_scale, 4, True)
            second = _decode(((second_codes >> (4 * half)) & 15).to(tl.float32), second_scale, 4, False)
            moment, second = _adamw_moments(_load_float(grad, index, valid, G_DTYPE), moment, second, s)
            _raise_maxima(row_statistics, 2, element_row, element_col, moment, valid)
            _raise_maxima(row_statistics, 3, element_row, element_col, second, valid)


# The first-use self-check ---------------------------------------------------------------------------------------

_SELF_CHECKS: dict[tuple, str | None] = {}
"""The verdicts of :func:`self_check` in this process, by (rule name, codecs, parameter dtype, gradient dtype,
device): ``None`` where it passed, else why it failed."""

_CHECK_SCALARS = {
    "adamw": adamw_scalars({"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1, "eps": 1e-8}, step=3),
    "lion": {"lr": 1e-3, "decay": 0.9999, "direction_weight": 0.1, "avg_weight": 0.01},
    "ademamix": ademamix_scalars(
        {"lr": 1e-2, "betas": (0.9, 0.999, 0.9999), "alpha": 5.0, "t_alpha": 10, "t_beta3": 10, "eps": 1e-8,
         "weight_decay": 0.1},
        step=3,
    ),
}  # fmt: skip
"""The rules' scalars in the self-check: a learning rate that moves every parameter by much less than itself."""


def lerp_rounds_once() -> bool:
    """Whether the eager PyTorch kernels on this CPU compute lerp as one fused multiply-add, as the Triton kernels
    do (every CPU capability but x86's ``default``), so that their results agree bitwise."""
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
    return not x86 or torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX")


def self_check(
    kernel: TritonKernel, device: torch.device, param_dtype: torch.dtype, grad_dtype: torch.dtype
) -> str | None:
    """Update a small synthetic batch with ``kernel`` on ``device`` and with the eager PyTorch kernel on the CPU;
    return ``None`` where the parameter, codes, scales and fp32 state agree (:func:`_disagreement`), else why not.

    The batch: one tensor of two and a half blocks and one element (a partial last block), in two segments on one
    page (the first at the page's end, the second, with the partial block, at its start), whose state holds random
    codes over scales of several orders of magnitude and one block of zeros; bf16 parameters are updated twice, with
    stochastic rounding of the second segment and without. For rank-1 normalized state the tensor is 5 rows of
    ``block_size / 2 + 3`` columns (segments start and end inside rows) with row and column maxima over several
    orders of magnitude, one of them zero: the statistics :meth:`TritonKernel.gather_batch` gathers are checked first
    (against :func:`~hf_paged.kernels.pytorch.gather_in_buffers`), then the updates with those of the reference. A
    few KiB on the device. A launch that raises is a failure, but for running out of memory, which is raised."""
    block = kernel.block_size
    shape = (5, block // 2 + 3) if kernel.rank1 else None
    length = shape[0] * shape[1] if kernel.rank1 else 2 * block + block // 2 + 1
    page_format = PageFormat(kernel.codecs)
    tail_blocks = -(-(length - block) // block)
    capacity = (tail_blocks + 1) * block
    generator = torch.Generator().manual_seed(27)
    param = torch.randn(length, generator=generator).to(param_dtype)
    magnitudes = 10.0 ** torch.randint(-4, 1, (length,), generator=generator)
    grad = (torch.randn(length, generator=generator) * magnitudes).to(grad_dtype)
    buffers = random_page_buffers(page_format, capacity, generator)
    scalars = {
        name: float(torch.tensor(value, dtype=torch.float32))
        for name, value in _CHECK_SCALARS[kernel.rule_name].items()
    }
    scalar_table = torch.tensor([[scalars[name] for name in kernel.scalar_names]], dtype=torch.float32)
    # (element start, elements, page offset) of the two segments
    segments = [(0, block, tail_blocks * block), (block, length - block, 0)]
    table = torch.tensor([[0, start, count, 0, offset, 0] for start, count, offset in segments])
    exact = lerp_rounds_once()
    statistics = None
    if kernel.rank1:
        statistics = Rank1Statistics(shape, 2)
        for maxima in (*statistics.rows, *statistics.cols):
            maxima.copy_(torch.rand(maxima.numel(), generator=generator))
            maxima.mul_(10.0 ** torch.randint(-4, 1, (maxima.numel(),), generator=generator))
        statistics.rows[0][1] = 0.0
        actual_statistics = [t.to(device, copy=True) for t in statistics.batch_entry()]
        for start, count, offset in segments:
            gather_in_buffers(
                adamw_moments_, kernel.codecs, grad[start : start + count], buffers, offset, scalars, statistics, start
            )
        batch = PageBatch(
            [param.to(device)], [grad.to(device)], [tuple(buffer.to(device) for buffer in buffers)], table.to(device),
            scalar_table.to(device), statistics=[tuple(actual_statistics)],
        )  # fmt: skip
        failure = _launch_failure(kernel, batch, None)
        if failure is not None:
            return failure
        expected = [*statistics.next_rows, *statistics.next_cols]
        actual = [actual_statistics[index].cpu() for index in (4, 6, 5, 7)]
        for index, (actual_maxima, expected_maxima) in enumerate(zip(actual, expected)):
            differing = _disagreement(actual_maxima, expected_maxima, False, exact)
            if differing:
                name = f"the next {'column' if index >= 2 else 'row'} maxima of state {index % 2}"
                return f"{name} differ from the PyTorch kernel's in {differing} of {expected_maxima.numel()} elements"
    keys = step_keys(seed=27, step=3)
    roundings = [None, keys] if param_dtype == torch.bfloat16 else [None]
    for rounding in roundings:
        expected_param, expected_buffers = param.clone(), [buffer.clone() for buffer in buffers]
        for start, count, offset in segments:
            segment_rounding = None if rounding is None or start == 0 else ElementRounding(*rounding, start)
            update_in_buffers(
                kernel.rule, kernel.codecs, expected_param[start : start + count], grad[start : start + count],
                expected_buffers, offset, scalars, segment_rounding, statistics, start,
            )  # fmt: skip
        actual_param = param.to(device)
        actual_buffers = [buffer.to(device) for buffer in buffers]
        rounding_table = None if rounding is None else torch.tensor([[-1, -1], list(rounding)])
        batch = PageBatch(
            [actual_param],
            [grad.to(device)],
            [tuple(actual_buffers)],
            table.to(device),
            scalar_table.to(device),
            None if rounding_table is None else rounding_table.to(device),
            None if statistics is None else [tuple(t.to(device, copy=True) for t in statistics.batch_entry())],
        )
        failure = _launch_failure(kernel, batch, 0)
        if failure is not None:
            return failure
        results = [actual_param.cpu(), *(buffer.cpu() for buffer in actual_buffers)]
        names = ["the parameter", *(f"state buffer {index}" for index in range(len(buffers)))]
        for name, actual, expected in zip(names, results, [expected_param, *expected_buffers]):
            packed = kernel.bits == 4 and expected.dtype == torch.uint8
            differing = _disagreement(actual, expected, packed, exact)
            if differing:
                how = "with" if rounding is not None else "without"
                return (
                    f"{name} differs from the PyTorch kernel's in {differing} of {expected.numel()} elements "
                    f"({how} stochastic rounding)"
                )
    return None


def _launch_failure(kernel: TritonKernel, batch: PageBatch, round_shift: int | None) -> str | None:
    """Launch ``kernel`` on ``batch`` (see :meth:`TritonKernel._launch`) and wait for it on the batch's device (which
    may not be the current one); ``None`` where it ran, else the error it raised, in a line. Running out of memory is
    raised."""
    device = batch.params[0].device
    try:
        kernel._launch(batch, round_shift)
        if device.type != "cpu":
            torch.get_device_module(device).synchronize(device)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # noqa: BLE001 (any error of the launch is a verdict on the kernel)
        message = str(error).strip()
        return f"{type(error).__name__}: {message.splitlines()[0] if message else ''}"
    return None


def _disagreement(actual: torch.Tensor, expected: torch.Tensor, packed: bool, exact: bool) -> int:
    """The number of elements of ``actual`` that differ from ``expected``: in their bits where ``exact``, else by more
    than the module's bound allows (a lerp rounded twice: an ulp of its product ``w (g - m)``, at most ``2**-22`` of
    the largest magnitude, and one of its result): a code by more than one (each nibble of ``packed`` 4-bit codes
    apart), a value by more than ``2**-20`` of ``expected``'s largest finite magnitude plus 4 ulps of its own (one
    ulp of its dtype for bf16 and fp16). NaN agrees with NaN only."""
    if exact:
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[expected.element_size()]
        return int((actual.view(bits) != expected.view(bits)).sum())
    if not expected.is_floating_point():
        if packed:
            actual = torch.stack([actual & 15, actual >> 4])
            expected = torch.stack([expected & 15, expected >> 4])
        return int(((actual.int() - expected.int()).abs() > 1).sum())
    magnitude = expected.abs()
    ulp = (torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude).float()
    finite = magnitude[magnitude.isfinite()]
    largest = float(finite.max()) if finite.numel() else 0.0
    allowed = ulp * (4 if expected.dtype == torch.float32 else 1) + 2**-20 * largest
    nan = expected.isnan()
    close = (actual.float() - expected.float()).abs() <= allowed
    agree = torch.where(nan, actual.isnan(), close | (actual == expected))
    return int((~agree).sum())


# The kernel object ------------------------------------------------------------------------------------------------


class TritonKernel:
    """The Triton kernel of a rule's 8-bit, 4-bit or fp32 state, or of AdamW's rank-1 normalized 4-bit state:
    :meth:`update_batch` updates a :class:`PageBatch` in one launch per parameter and gradient dtype present (usually
    one), and for rank-1 state :meth:`gather_batch` gathers its next statistics in one launch per gradient dtype;
    called on one segment (the optimizer's per-segment path) it updates that segment in one launch. Segments it
    cannot take (a device without Triton, a rank-1 state's segments one by one) go to ``fallback``, a
    :class:`~hf_paged.kernels.pytorch.SegmentKernel`, through copies that put them back if it fails.

    Every argument is checked before the first launch and a launch allocates nothing on the device besides its
    tables of addresses (made before it), so a call updates its segments whole or, on an error, not at all.
    """

    writes_after_allocating = True
    """Every allocation of a call comes before its first write, so the optimizer's step needs no undo copy."""

    def __init__(self, rule: UpdateRule, codecs: tuple[Codec, ...], fallback) -> None:
        kind = triton_rule(rule, codecs)
        if kind is None:
            raise ValueError(f"no Triton kernel for {rule.__name__} on {', '.join(type(c).__name__ for c in codecs)}")
        self.rule_name, self.bits, self.block_size = kind
        self.rule = rule
        self.codecs = codecs
        self.rank1 = isinstance(codecs[0], Rank1Normalized4bitCodec)
        """Whether the state is rank-1 normalized (its batches carry statistics; :meth:`gather_batch` takes them)."""
        self.fallback = fallback
        self.scalar_names: tuple[str, ...] = _RULES[rule][2]
        self._buffer_specs = [spec for codec in codecs for spec in codec.buffer_specs(self.block_size)]
        self._constants: dict[tuple[int, bool], dict[str, int | bool]] = {}
        """The update kernel's specialization by dtype pair code and rounding (see :meth:`_update_constants`)."""

    @property
    def compiled(self) -> bool:
        """Whether the fallback runs compiled, which also sizes the chunks the optimizer hands it."""
        return self.fallback.compiled

    def takes_batch(self, device: torch.device, param_dtype: torch.dtype, grad_dtype: torch.dtype) -> bool:
        """Whether segments of ``param_dtype`` parameters with ``grad_dtype`` gradients on pages of ``device`` run
        here: fp32, bf16 or fp16 tensors on a device the Triton kernels run on (:func:`runs_on`), whose
        combination passed its first-use self-check (:meth:`passes_self_check`)."""
        return (
            param_dtype in _DTYPES
            and grad_dtype in _DTYPES
            and runs_on(device)
            and self.passes_self_check(device, param_dtype, grad_dtype)
        )

    def passes_self_check(self, device: torch.device, param_dtype: torch.dtype, grad_dtype: torch.dtype) -> bool:
        """Whether this kernel's results on ``param_dtype`` parameters with ``grad_dtype`` gradients on ``device``
        agree with the PyTorch kernel's: :func:`self_check` at the first call per combination and process (logged
        once where it fails), its verdict afterwards. Under ``FakeTensorMode`` (a memory plan), where no kernel
        computes, nothing is checked. A check that runs out of memory raises and is run again at the next call."""
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, torch.get_device_module(device).current_device())
        key = (self.rule_name, self.codecs, param_dtype, grad_dtype, device)
        if key not in _SELF_CHECKS:
            if torch._guards.detect_fake_mode() is not None:
                return True
            failure = self_check(self, device, param_dtype, grad_dtype)
            _SELF_CHECKS[key] = failure
            if failure is not None:
                logger.warning(
                    "hf_paged: the Triton kernel of the %s update of %s state failed its first-use check on %s with "
                    "%s parameters and %s gradients (%s); these segments take the PyTorch kernels from now on "
                    "(HF_PAGED_KERNELS=torch chooses them everywhere)",
                    self.rule.__name__,
                    ", ".join(type(codec).__name__ for codec in self.codecs),
                    device,
                    param_dtype,
                    grad_dtype,
                    failure,
                )
        return _SELF_CHECKS[key] is None

    def table_device(self, device: torch.device) -> torch.device:
        """Where a batch's table, scalars and rounding keys live: on the pages' device, which the kernel reads."""
        return device

    def allocates_nothing(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether a call on ``param`` and ``grad`` allocates no temporaries of their size, so that a segment of any
        length is updated in one call: where it runs here, not in the fallback (which takes rank-1 segments)."""
        return not self.rank1 and self.takes_batch(param.device, param.dtype, grad.dtype)

    def __call__(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        encoded: Sequence[EncodedSegment],
        scalars: dict,
        rounding: ElementRounding | None = None,
    ) -> None:
        """Update one segment (``param`` and ``grad`` shaped ``(blocks, block_size)``, or flat for fp32 state);
        ``scalars`` floats or 0-d fp32 CPU tensors; ``rounding`` rounds a bf16 ``param`` stochastically. A rank-1
        state's segment (``encoded`` with its normalizers appended) goes to the fallback. Its tables reach the device
        from pinned memory without the host waiting (:func:`~hf_paged.device.values_to_device`)."""
        if self.rank1 or not self.takes_batch(param.device, param.dtype, grad.dtype):
            update_or_undo(self.fallback, param, grad, encoded, scalars, rounding)
            return
        device = param.device
        arrays = tuple(array.reshape(-1) for segment in encoded for array in segment)
        table = values_to_device([0, 0, param.numel(), 0, 0, 0], torch.int64, device).view(1, 6)
        values = [float(scalars[name]) for name in self.scalar_names]
        scalar_row = values_to_device(values, torch.float32, device).view(1, len(values))
        rounds = rounding is not None and param.dtype == torch.bfloat16
        keys = values_to_device([int(rounding.key_a), int(rounding.key_b)], torch.int64, device) if rounds else None
        rounding_row = None if keys is None else keys.view(1, 2)
        segment = PageBatch([param.reshape(-1)], [grad.reshape(-1)], [arrays], table, scalar_row, rounding_row)
        self._launch(segment, int(rounding.start) if rounds else 0)

    def update_batch(self, batch: PageBatch) -> None:
        """Update every segment of ``batch`` (see :mod:`hf_paged.kernels.batch`)."""
        self._launch(batch, 0)

    def gather_batch(self, batch: PageBatch) -> None:
        """Raise the next row and column maxima of ``batch.statistics`` to the magnitudes of the state this step
        computes for every segment of ``batch`` (rank-1 normalized state only; see :mod:`hf_paged.kernels.batch`)."""
        self._launch(batch, None)

    def prepare(
        self,
        device: torch.device,
        backend: HostToDevice,
        numels: Sequence[int],
        shapes: dict[int, tuple[int, int]],
        pages: Sequence[tuple[Page, Sequence[tuple[int, Segment]]]],
    ) -> TritonLaunches:
        """The launches of this kernel over ``pages`` of a step plan on ``device`` (see :class:`TritonLaunches`):
        ``numels`` gives the elements of each tensor by its index in the plan, ``shapes`` the local shape of each
        rank-1 normalized one, ``pages`` each page with its ``(tensor index, segment)`` pairs; ``backend`` writes
        tables into pinned host memory and copies them to the device. Everything is checked here, once."""
        return TritonLaunches(self, device, backend, numels, shapes, pages)

    def _launch(self, batch: PageBatch, round_shift: int | None) -> None:
        """Check ``batch``, then launch the update kernel once per parameter and gradient dtype pair it holds, the
        rounding index of element ``i`` of a segment being ``START + round_shift + i``; or, where ``round_shift`` is
        ``None``, the gathering kernel of rank-1 statistics once per gradient dtype."""
        device = self._check(batch, round_shift is None)
        if batch.segments == 0:
            return
        tensors = len(batch.params)
        # one table of addresses, copied to the device at once, each section at a 16-byte boundary: (address, dtype
        # pair) per parameter, an address per gradient, the page buffers' addresses page by page, and for rank-1 state
        # the statistics' addresses and number of columns per tensor (STATISTICS_COLUMNS each)
        params = [value for p, g in zip(batch.params, batch.grads) for value in (p.data_ptr(), _pair_code(p, g))]
        grads = _padded([g.data_ptr() for g in batch.grads])
        buffers = _padded([buffer.data_ptr() for buffers in batch.buffers for buffer in buffers])
        statistics = [
            value
            for entry in (batch.statistics if self.rank1 else ())
            for value in (*(maxima.data_ptr() for maxima in entry), entry[1].numel())
        ]
        addresses = values_to_device(params + grads + buffers + statistics, torch.int64, device)
        first_buffer = len(params) + len(grads)
        first_statistic = first_buffer + len(buffers)
        longest = min(max(p.numel() for p in batch.params), max(self._capacity(b) for b in batch.buffers))
        self._run(
            device,
            batch.table,
            batch.scalars,
            batch.rounding,
            addresses[: 2 * tensors],
            addresses[2 * tensors : 3 * tensors],
            addresses[first_buffer:first_statistic],
            addresses[first_statistic:] if self.rank1 else addresses,
            batch.segments,
            longest,
            sorted({_pair_code(p, g) for p, g in zip(batch.params, batch.grads)}),
            round_shift,
        )

    def _run(
        self,
        device: torch.device,
        table: torch.Tensor,
        scalars: torch.Tensor,
        rounding: torch.Tensor | None,
        param_addresses: torch.Tensor,
        grad_addresses: torch.Tensor,
        buffer_addresses: torch.Tensor,
        statistic_addresses: torch.Tensor,
        segments: int,
        longest: int,
        pairs: Sequence[int],
        round_shift: int | None,
    ) -> None:
        """Launch the update kernel over ``segments`` rows of ``table`` once per dtype pair code in ``pairs`` (or, where
        ``round_shift`` is ``None``, the gathering kernel once per gradient dtype among them), each segment split
        between programs as its ``longest`` elements need. Every tensor starts at a 16-byte boundary, so that Triton
        compiles one variant of each kernel, the one the first-use self-check ran."""
        rows = max(1, TILE_ELEMENTS // self.block_size)
        programs = max(1, min(-(-longest // (rows * self.block_size)), MAX_PROGRAMS_PER_SEGMENT))
        options = {} if INTERPRETED else {"enable_fp_fusion": False}
        on_device = (
            contextlib.nullcontext()
            if INTERPRETED or device.type == "cpu"
            else torch.get_device_module(device).device(device)
        )
        with on_device:
            if round_shift is None:
                for grad_dtype in sorted({pair % 3 for pair in pairs}):
                    _gather_batch_kernel[(segments, programs)](
                        table,
                        scalars,
                        param_addresses,
                        grad_addresses,
                        buffer_addresses,
                        statistic_addresses,
                        programs,
                        BLOCK=self.block_size,
                        ROWS=rows,
                        SCALARS=len(self.scalar_names),
                        G_DTYPE=grad_dtype,
                        **options,
                    )
                return
            for pair in pairs:
                _update_batch_kernel[(segments, programs)](
                    table,
                    scalars,
                    table if rounding is None else rounding,
                    param_addresses,
                    grad_addresses,
                    buffer_addresses,
                    statistic_addresses,
                    round_shift,
                    programs,
                    **self._update_constants(pair, rounding is not None, rows, options),
                )

    def _update_constants(
        self, pair: int, rounding: bool, rows: int, options: dict[str, bool]
    ) -> dict[str, int | bool]:
        """The update kernel's specialization for the dtype ``pair`` code, with or without a ``rounding`` table, and
        ``options`` (made once for each: a launch per page batch reads it)."""
        key = (pair, rounding)
        constants = self._constants.get(key)
        if constants is None:
            param_dtype, grad_dtype = divmod(pair, 3)
            constants = self._constants[key] = {
                "RULE": _RULE_CODES[self.rule_name],
                "BITS": self.bits,
                "BLOCK": self.block_size,
                "ROWS": rows,
                "BUFFERS": len(self._buffer_specs),
                "SCALARS": len(self.scalar_names),
                "P_DTYPE": param_dtype,
                "G_DTYPE": grad_dtype,
                "ROUND": rounding and param_dtype == _DTYPES[torch.bfloat16],
                "RANK1": self.rank1,
                **options,
            }
        return constants

    def _capacity(self, buffers: tuple[torch.Tensor, ...]) -> int:
        """Elements of state a page's buffers hold."""
        return buffers[0].numel() * (2 if self.bits == 4 else 1)

    def _check(self, batch: PageBatch, gathering: bool = False) -> torch.device:
        """Raise ValueError where ``batch`` breaks the contract or this kernel's formats (for ``gathering``
        rank-1 statistics, where the state is not rank-1 normalized); return its device."""
        batch.check_shapes()
        if gathering and not self.rank1:
            raise ValueError("gather_batch takes batches of rank-1 normalized state only")
        if not batch.params:
            raise ValueError("PageBatch: no parameters")
        device = batch.params[0].device
        for name, tensors in (("params", batch.params), ("grads", batch.grads)):
            for tensor in tensors:
                if tensor.device != device or not tensor.is_contiguous():
                    raise ValueError(f"PageBatch: {name} must be contiguous tensors on {device}")
                if tensor.dtype not in _DTYPES:
                    raise ValueError(f"PageBatch: {name} must be fp32, bf16 or fp16, got {tensor.dtype}")
        for param, grad in zip(batch.params, batch.grads):
            if param.numel() != grad.numel():
                raise ValueError(f"PageBatch: a gradient has {grad.numel()} elements, its parameter {param.numel()}")
        if not runs_on(device):
            raise ValueError(f"the Triton kernels do not run on {device}")
        capacity = None
        for buffers in batch.buffers:
            if len(buffers) != len(self._buffer_specs) or any(
                buffer.device != device or buffer.dtype != dtype or buffer.dim() != 1 or not buffer.is_contiguous()
                for buffer, (_, dtype) in zip(buffers, self._buffer_specs)
            ):
                raise ValueError(
                    f"PageBatch: each page's buffers must be flat contiguous tensors on {device} of dtypes "
                    f"{[str(dtype) for _, dtype in self._buffer_specs]}"
                )
            capacity = self._capacity(buffers)
            specs = [spec for codec in self.codecs for spec in codec.buffer_specs(capacity)]
            if [buffer.numel() for buffer in buffers] != [numel for numel, _ in specs]:
                raise ValueError(f"PageBatch: a page's buffers do not hold {capacity} elements of this state")
        for name, tensor in (("table", batch.table), ("scalars", batch.scalars), ("rounding", batch.rounding)):
            if tensor is not None and (tensor.device != device or not tensor.is_contiguous()):
                raise ValueError(f"PageBatch: {name} must be contiguous on {device}, the pages' device")
        if batch.scalars.shape[1] != len(self.scalar_names):
            raise ValueError(f"PageBatch: scalars must have {len(self.scalar_names)} columns {self.scalar_names}")
        if self.rank1:
            self._check_statistics(batch, device)
        if device.type == "cpu":
            self._check_table(batch)
        return device

    def _check_statistics(self, batch: PageBatch, device: torch.device) -> None:
        """Raise ValueError where a rank-1 ``batch`` lacks statistics or where a tensor's do not fit its parameter:
        contiguous on ``device``, each state's row maxima (current and next) of one length, its column maxima of
        another, their product the parameter's number of elements."""
        if batch.statistics is None:
            raise ValueError("PageBatch: rank-1 normalized state needs the tensors' statistics")
        for param, entry in zip(batch.params, batch.statistics):
            rows, cols = entry[0].numel(), entry[1].numel()
            if any(maxima.device != device or not maxima.is_contiguous() for maxima in entry):
                raise ValueError(f"PageBatch: statistics must be contiguous tensors on {device}, the pages' device")
            if any(maxima.numel() != (rows, cols)[index % 2] for index, maxima in enumerate(entry)):
                raise ValueError("PageBatch: a tensor's statistics give its states different shapes")
            if rows * cols != param.numel():
                raise ValueError(
                    f"PageBatch: statistics of a {rows} x {cols} tensor for a parameter of {param.numel()} elements"
                )

    def _check_table(self, batch: PageBatch) -> None:
        """Raise ValueError where a row of a CPU ``batch``'s table points outside its tensors, pages or scalars.
        (Tables on an accelerator are not read back, which would wait for it: their builder checks them.)"""
        table = batch.table
        if table.numel() == 0:
            return
        tensor, start, length = table[:, TENSOR], table[:, START], table[:, LENGTH]
        page, offset, row = table[:, PAGE], table[:, OFFSET], table[:, ROW]
        if not (
            0 <= tensor.min()
            and tensor.max() < len(batch.params)
            and 0 <= page.min()
            and page.max() < len(batch.buffers)
        ):
            raise ValueError("PageBatch: a segment's tensor or page index is out of range")
        if not (0 <= row.min() and row.max() < batch.scalars.shape[0]):
            raise ValueError("PageBatch: a segment's scalar row is out of range")
        numels = torch.tensor([p.numel() for p in batch.params])[tensor]
        capacities = torch.tensor([self._capacity(b) for b in batch.buffers])[page]
        blocks = (length + self.block_size - 1) // self.block_size
        extent = length if self.bits == 32 else blocks * self.block_size
        if (start < 0).any() or (length < 0).any() or (start + length > numels).any():
            raise ValueError("PageBatch: a segment reaches outside its parameter")
        if (offset < 0).any() or (offset + extent > capacities).any():
            raise ValueError("PageBatch: a segment reaches outside its page")
        if self.bits != 32 and (offset % self.block_size != 0).any():
            raise ValueError(
                f"PageBatch: a segment's page offset is not a multiple of the block size, {self.block_size}"
            )


class TritonLaunches:
    """The launches of one :class:`TritonKernel` over one device's pages of a step plan.

    What they need that does not change between steps is built and checked once, here: each page's rows of the
    segment table (its segments' tensor, first element, length, offset in the page and scalar row; the tensor's
    number among this object's tensors stands for both), the longest segment of each page, each segment within its
    tensor and its page. A step then checks only what a step can change (which tensors it updates in place, their
    dtypes), and writes into pinned host memory only what changes, copied to the device without the host waiting
    (``backend``, :class:`~hf_paged.kernels.batch.HostToDevice`):

    - per step (:meth:`begin_step`): one table of the tensors' addresses and dtype pairs (and for rank-1 state, their
      statistics' addresses), and one of their rules' scalars, a row per tensor;
    - once, at the first launch: every page's rows, in page order, each page numbered by its position here, and a
      table of every page's buffer addresses at that position, both on the device;
    - per batch (:meth:`update`, :meth:`gather`): the addresses of its pages' buffers. A batch of pages that follow
      one another here (a streamed batch, or every page resident) takes its rows as a slice of the table of all
      rows, and its addresses are copied into their place in the table of addresses; another batch gets a table of
      its own, its rows and addresses. The batch of the pages resident at a step's start keeps its tables while no
      page moves (the store's ``version`` stays), so that a step with every page resident copies no batch table;
    - with stochastic rounding, each batch's segments' keys.

    Args:
        kernel: the kernel launched.
        device: the pages' device.
        backend: writes pinned host tables and copies them to the device.
        numels: the elements of each tensor, by its index in the plan.
        shapes: the local shape of each rank-1 normalized tensor, by its index in the plan.
        pages: each page with the ``(tensor index, segment)`` pairs it holds.
    """

    def __init__(
        self,
        kernel: TritonKernel,
        device: torch.device,
        backend: HostToDevice,
        numels: Sequence[int],
        shapes: dict[int, tuple[int, int]],
        pages: Sequence[tuple[Page, Sequence[tuple[int, Segment]]]],
    ) -> None:
        self.kernel = kernel
        self.device = device
        self.backend = backend
        self.tensors: list[int] = []
        """The plan's index of each tensor these launches update, in the order of the step's tables."""
        number: dict[int, int] = {}
        self._position: dict[int, int] = {}
        """Each page's position among these launches' pages, by page index: its number in the tables of all pages."""
        self._first_segment: list[int] = []
        """The number of the first segment of the page at each position in the table of all rows, and their count."""
        self._rows: dict[int, list[int]] = {}
        self._segment_counts: dict[int, int] = {}
        self._page_tensors: dict[int, list[int]] = {}
        self._longest: dict[int, int] = {}
        block = kernel.block_size
        segments_before = 0
        for page, segments in pages:
            if page.format.codecs != kernel.codecs:
                raise ValueError(f"page {page.index} holds another state format than this kernel's")
            rows: list[int] = []
            for index, segment in segments:
                if index not in number:
                    number[index] = len(self.tensors)
                    self.tensors.append(index)
                extent = segment.length if kernel.bits == 32 else -(-segment.length // block) * block
                if segment.start < 0 or segment.length <= 0 or segment.start + segment.length > numels[index]:
                    raise ValueError(f"a segment of page {page.index} reaches outside its tensor")
                if segment.offset < 0 or segment.offset + extent > page.capacity:
                    raise ValueError(f"a segment reaches outside page {page.index}")
                if kernel.bits != 32 and segment.offset % block:
                    raise ValueError(f"a segment's offset in page {page.index} is not a multiple of {block}")
                local = number[index]
                rows += (local, segment.start, segment.length, len(self._position), segment.offset, local)
            self._first_segment.append(segments_before)
            segments_before += len(segments)
            self._position[page.index] = len(self._position)
            self._rows[page.index] = rows
            self._segment_counts[page.index] = len(segments)
            self._page_tensors[page.index] = sorted({number[index] for index, _ in segments})
            self._longest[page.index] = min(max(segment.length for _, segment in segments), page.capacity)
        if kernel.rank1:
            for index in self.tensors:
                rows_count, cols = shapes[index]
                if rows_count * cols != numels[index]:
                    raise ValueError(f"statistics of a {rows_count} x {cols} tensor for {numels[index]} elements")
        self._first_segment.append(segments_before)
        self._buffers = len(kernel._buffer_specs)
        self._scalar_names = kernel.scalar_names
        self._layouts: dict[tuple[int, ...], _BatchLayout] = {}
        """By the page indices of a batch launched before: what its tables take (a streamed step brings the same
        pages in the same batches at every step)."""
        self._all_rows: torch.Tensor | None = None
        """On the device: every page's rows, in page order (made at the first launch)."""
        self._all_addresses: torch.Tensor | None = None
        """On the device: every page's buffer addresses, at its position (each batch's written before its launch)."""
        self._step: _StepTables | None = None
        self._resident: tuple[int, list[Page], _BatchTables] | None = None

    def begin_step(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        rows: Sequence[int],
        scalars: Sequence[dict[str, float]],
        keys: dict[int, tuple[int, int]],
        statistics: dict[int, tuple[torch.Tensor, ...]],
    ) -> None:
        """Write this step's tables and copy them to the device: ``params`` and ``grads`` (the plan's local tensors,
        by index), each tensor's scalar ``rows`` into ``scalars`` (the rule's scalars of each row), the stochastic
        rounding ``keys`` of the tensors that round and the rank-1 ``statistics`` entries, by index. The batches
        launched this step take only tensors whose parameter and gradient are contiguous (others take the
        per-segment path)."""
        params = [params[index] for index in self.tensors]
        grads = [grads[index] for index in self.tensors]
        address = _address_of(params[0])
        pairs = [
            _DTYPES[p.dtype] * 3 + _DTYPES[g.dtype] if p.dtype in _DTYPES and g.dtype in _DTYPES else -1
            for p, g in zip(params, grads)
        ]
        values = [value for p, pair in zip(params, pairs) for value in (address(p), pair)]
        values += _padded([address(g) for g in grads])
        if self.kernel.rank1:
            for index in self.tensors:
                entry = statistics.get(index)
                values += (0,) * STATISTICS_COLUMNS if entry is None else (*map(address, entry), entry[1].numel())
        backend = self.backend
        addresses = backend.to_device(backend.pinned_tensor(values, torch.int64))
        tensors = len(self.tensors)
        distinct = sorted({rows[index] for index in self.tensors})
        position = {row: number for number, row in enumerate(distinct)}
        scalar_rows = torch.tensor(
            [[scalars[row][name] for name in self._scalar_names] for row in distinct], dtype=torch.float32
        ).reshape(len(distinct), len(self._scalar_names))
        row_of = torch.tensor([position[rows[index]] for index in self.tensors], dtype=torch.int64)
        scalar_table = backend.pinned_empty((tensors, len(self._scalar_names)), torch.float32)
        torch.index_select(scalar_rows, 0, row_of, out=scalar_table)
        rounding = None
        if any(index in keys for index in self.tensors):
            rounding = torch.tensor(
                [keys.get(index, (NO_ROUNDING, NO_ROUNDING)) for index in self.tensors], dtype=torch.int64
            ).reshape(tensors, 2)
        first_statistic = 3 * tensors + tensors % 2
        self._step = _StepTables(
            param_addresses=addresses[: 2 * tensors],
            grad_addresses=addresses[2 * tensors : 3 * tensors],
            statistic_addresses=addresses[first_statistic:] if self.kernel.rank1 else addresses,
            scalars=backend.to_device(scalar_table),
            keys=rounding,
            pairs=pairs,
            distinct_pairs=sorted(set(pairs)),
            address=address,
        )

    def update(self, pages: Sequence[Page], version: int) -> None:
        """Update every segment of ``pages`` (resident, of this kernel's format and device) in one launch per dtype
        pair; ``version`` is the store's count of page moves (:attr:`~hf_paged.store.PageStore.generation`)."""
        self._launch(pages, version, 0)

    def gather(self, pages: Sequence[Page], version: int) -> None:
        """Gather the next rank-1 statistics over every segment of ``pages`` (see :meth:`TritonKernel.gather_batch`)."""
        self._launch(pages, version, None)

    def _launch(self, pages: Sequence[Page], version: int, round_shift: int | None) -> None:
        step = self._step
        batch = self._batch(pages, version, step.address)
        layout = batch.layout
        pairs = step.distinct_pairs
        if len(pairs) > 1:
            pairs = sorted({step.pairs[tensor] for page in pages for tensor in self._page_tensors[page.index]})
        rounding = None
        if step.keys is not None and round_shift is not None:
            if layout.tensor_column is None:
                layout.tensor_column = torch.tensor(layout.rows[TENSOR::TABLE_COLUMNS], dtype=torch.int64)
            host = self.backend.pinned_empty((layout.segments, 2), torch.int64)
            torch.index_select(step.keys, 0, layout.tensor_column, out=host)
            rounding = self.backend.to_device(host)
        self.kernel._run(
            self.device,
            batch.table,
            step.scalars,
            rounding,
            step.param_addresses,
            step.grad_addresses,
            batch.buffer_addresses,
            step.statistic_addresses,
            layout.segments,
            layout.longest,
            pairs,
            round_shift,
        )

    def _batch(self, pages: Sequence[Page], version: int, address: Callable[[torch.Tensor], int]) -> _BatchTables:
        """The tables of a batch of ``pages``, on the device: made once while the same pages stay where they are (the
        store's ``version`` unchanged)."""
        cached = self._resident
        if cached is not None and cached[0] == version and cached[1] == pages:
            return cached[2]
        key = tuple([page.index for page in pages])
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = self._layout(pages)
        addresses: list[int] = []
        for page in pages:
            buffers = page.device  # PageBuffers, which know their addresses, or any sequence of buffers
            addresses += buffers.addresses(address) if hasattr(buffers, "addresses") else map(address, buffers)
        backend = self.backend
        if layout.span is None:
            rows = layout.rows
            values = backend.to_device(backend.pinned_tensor(rows + _padded(addresses), torch.int64))
            batch = _BatchTables(layout, values[: len(rows)], values[len(rows) :])
        elif address is _no_address:  # a memory plan: its launches do nothing, its fake pages have no addresses
            batch = _BatchTables(layout, self._all_rows, self._all_addresses)
        else:
            if layout.tables is None:
                first, end = layout.segment_span
                layout.addresses, layout.tables = (
                    self._all_addresses[layout.span[0] : layout.span[1]],
                    _BatchTables(layout, self._all_rows[first:end], self._all_addresses),
                )
            backend.copy_into(layout.addresses, backend.pinned_tensor(addresses, torch.int64))
            batch = layout.tables
        self._resident = (version, list(pages), batch)
        return batch

    def _layout(self, pages: Sequence[Page]) -> _BatchLayout:
        """What the tables of a batch of ``pages`` take: for pages that follow one another here, a slice of the table
        of all rows and their place in the table of all addresses (both made at the first batch); for others, their
        rows, each page numbered by its position in the batch."""
        positions = [self._position[page.index] for page in pages]
        first, last = positions[0], positions[-1]
        longest = max(self._longest[page.index] for page in pages)
        if positions == list(range(first, last + 1)):
            rows = list(itertools.chain.from_iterable(self._rows[page.index] for page in pages))
            if self._all_rows is None:
                # made together: a failed allocation (an out-of-memory error the step recovers from) leaves neither
                backend = self.backend
                every_row = [value for page_rows in self._rows.values() for value in page_rows]
                all_rows = backend.to_device(backend.pinned_tensor(every_row, torch.int64)).view(-1, TABLE_COLUMNS)
                every_address = [0] * len(self._position) * self._buffers
                all_addresses = backend.to_device(backend.pinned_tensor(_padded(every_address), torch.int64))
                self._all_rows, self._all_addresses = all_rows, all_addresses
            segment_span = (self._first_segment[first], self._first_segment[last + 1])
            segments = segment_span[1] - segment_span[0]
            return _BatchLayout(
                rows, segments, longest, (first * self._buffers, (last + 1) * self._buffers), segment_span
            )
        rows = list(itertools.chain.from_iterable(self._rows[page.index] for page in pages))
        counts = self._segment_counts
        rows[PAGE::TABLE_COLUMNS] = [position for position, page in enumerate(pages) for _ in range(counts[page.index])]
        return _BatchLayout(rows, len(rows) // TABLE_COLUMNS, longest)


@dataclass(slots=True)
class _StepTables:
    """A step's tables of :class:`TritonLaunches`: on the device, the tensors' addresses and dtype pair codes, their
    gradients' and (rank-1) statistics' addresses, and the scalars, a row per tensor; on the host, each tensor's
    rounding keys (``None`` where none rounds) and dtype pair code, and how to read an address."""

    param_addresses: torch.Tensor
    grad_addresses: torch.Tensor
    statistic_addresses: torch.Tensor
    scalars: torch.Tensor
    keys: torch.Tensor | None
    pairs: list[int]
    distinct_pairs: list[int]
    address: Callable[[torch.Tensor], int]


@dataclass(slots=True)
class _BatchLayout:
    """What the tables of a batch of :class:`TritonLaunches` take, the same at every step: its rows on the host, its
    number of segments and longest one (elements); for pages that follow one another, the span of their addresses in
    the table of all addresses (entries) and of their rows in the table of all rows (segments), and, made at the
    batch's first launch, that span of addresses on the device and the batch's tables (``None`` for other pages);
    and (once a step with stochastic rounding asks) each row's tensor as a host tensor."""

    rows: list[int]
    segments: int
    longest: int
    span: tuple[int, int] | None = None
    segment_span: tuple[int, int] | None = None
    addresses: torch.Tensor | None = None
    tables: _BatchTables | None = None
    tensor_column: torch.Tensor | None = None


@dataclass(slots=True)
class _BatchTables:
    """A batch's tables of :class:`TritonLaunches` on the device: its segment rows and the buffer addresses they
    number pages into."""

    layout: _BatchLayout
    table: torch.Tensor
    buffer_addresses: torch.Tensor


def _address_of(tensor: torch.Tensor):
    """How to read the address of tensors like ``tensor``: its data pointer, or 0 for a fake tensor (a memory plan
    traces a step whose launches do nothing)."""
    return _no_address if isinstance(tensor, FakeTensor) else torch.Tensor.data_ptr


def _no_address(tensor: torch.Tensor) -> int:
    return 0
