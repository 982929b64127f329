"""State codecs: how one state tensor (an Adam moment, Lion's momentum) is stored in a page.

A codec owns buffers of a page for ``capacity`` elements and turns a segment of them into fp32 values
(:meth:`decode`) and back (:meth:`encode`). Update rules never see the encoding. Blockwise codecs see a
segment as a ``(blocks, block_size)`` matrix, so that a compiled kernel has a static inner dimension.

* :class:`Float32Codec` stores fp32 values as they are; decoding returns a view, so updates are in place.
* :class:`Blockwise8bitCodec` stores one 8-bit code per element and one fp32 scale per block of
  ``block_size`` elements (the block's largest magnitude). A code ``q`` stands for the value

  .. math::
      x = s \\cdot \\operatorname{sign}(q) \\, \\left(\\frac{|q|}{q_{max}}\\right)^{p}

  with ``q`` an int8 in [-127, 127] for a signed state (first moments: ``p = 2``) and a uint8 in
  [0, 255] for a non-negative state (second moments: ``p = 4``). The power map spends its codes where
  the values are dense: near zero for momenta, over many orders of magnitude for squared gradients.
  Encoding rounds to the nearest code in the ``|x / s| ** (1/p)`` domain, and a positive value of a
  non-negative state never rounds to zero (a zero second moment under a non-zero first moment would
  make Adam's step explode). A block whose values are all zero has scale zero and decodes to zeros.

A state's bytes per element are ``1 + 4 / block_size``: 2.03125 bytes per parameter for AdamW's two
moments with blocks of 256.

* :class:`Blockwise4bitCodec` stores two 4-bit codes per byte and one fp32 scale per block (the block's
  largest magnitude), after Li et al., "Memory Efficient Optimizers with 4-bit States" (NeurIPS 2023).
  A signed state (first moments) uses the 15 codes ``q`` in [-7, 7] of a quadratic map that contains
  zero, encoded by rounding to the nearest value; a non-negative state (second moments) uses 16 codes
  ``q`` in [0, 15] of a quartic map that excludes zero, encoded by rounding to the nearest level in the
  ``sqrt(x / s)`` domain:

  .. math::
      x_{signed} = s \\, \\frac{q \\, |q|}{49}, \\qquad x_{non-negative} = s \\left(\\frac{q + 1}{16}\\right)^{4}

  Excluding zero from the second moment's map keeps a small squared gradient from becoming zero in the
  denominator of Adam's step (the paper's "zero-point problem"); including it in the first moment's map
  keeps a zero momentum from moving the parameter. The second moment rounds to the level nearest in the domain of
  Adam's denominator, ``sqrt(x / s)``, not in the map's own ``(x / s) ** (1/4)``: each threshold between two levels
  sits higher, so more values take the lower level and steps are a little larger (1-4% on average on synthetic
  second moments). Of the thresholds measured on ``benchmarks/fidelity.py``'s grid, it alone keeps 4-bit AdamW
  closer to fp32 AdamW than torchao's ``AdamW4bit`` in every cell of the task whose loss gaps stand out from rounding
  noise (README.md, Fidelity). A state's bytes per element are ``0.5 + 4 / block_size``: 1.0625 bytes per parameter
  for AdamW's two moments with blocks of 128.

A non-finite value never makes a scale non-finite (:meth:`_BlockScaled.block_scales`): a NaN is stored as zero (as
the smallest level in the 4-bit non-negative map, which has no zero) and an infinity as the largest code with the
largest fp32 value as scale, which a non-negative state reads back as infinity (:func:`scaled`): a second moment
whose square overflowed stays infinite, as torch's, and its element's later steps are m / inf = 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .blocks import BufferSpec, packing
from .rounding import ieee_sqrt

FLOAT32_MAX = torch.finfo(torch.float32).max

ADDRESS_ALIGNMENT = 16
"""Bytes to which every view a kernel takes is aligned (when its buffer is): compiled kernels assume inputs aligned
to 16 bytes as the first call's were, and copy any that are not in and out at every call."""

EncodedSegment = tuple[torch.Tensor, ...]
"""The arrays of one segment's encoded state: views into a page's buffers."""


@dataclass(frozen=True)
class Float32Codec:
    """State stored as fp32 values, 4 bytes per element."""

    alignment: int = 1
    fields: tuple[str, ...] = ("",)
    saved_like_param: ClassVar[bool] = True
    """Whether the first field holds one entry per element, so that it is saved shaped like the parameter."""

    @property
    def address_alignment(self) -> int:
        """Elements: a segment starting at a multiple of it starts at a multiple of ``ADDRESS_ALIGNMENT`` bytes of
        the values."""
        return ADDRESS_ALIGNMENT // torch.float32.itemsize

    def buffer_specs(self, capacity: int) -> tuple[BufferSpec, ...]:
        """The buffers that hold ``capacity`` elements of this state: the fp32 values."""
        return ((capacity, torch.float32),)

    def select(self, arrays: EncodedSegment, offset: int, length: int) -> EncodedSegment:
        """The views of ``length`` elements from element ``offset`` of a page's buffers for this state."""
        (values,) = arrays
        return (values[offset : offset + length],)

    def decode(self, encoded: EncodedSegment) -> torch.Tensor:
        """fp32 values of a segment (here a view: updating it updates the page)."""
        return encoded[0]

    def block_scales(self, values: torch.Tensor) -> None:
        """fp32 values need no scales."""

    def encode(self, values: torch.Tensor, encoded: EncodedSegment, block_scales: None = None) -> None:
        """Store fp32 ``values`` into a segment."""
        if values.data_ptr() != encoded[0].data_ptr():
            encoded[0].copy_(values)

    def field_lengths(self, length: int) -> tuple[int, ...]:
        """Elements of each saved field for a segment of ``length`` elements."""
        return (length,)

    def field_offsets(self, start: int) -> tuple[int, ...]:
        """Where a segment starting at element ``start`` of its parameter begins in each saved field."""
        return (start,)

    def field_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32,)


class _BlockScaled:
    """What the blockwise codecs share: segments of whole blocks, each block scaled by its largest magnitude."""

    block_size: int

    @property
    def alignment(self) -> int:
        return self.block_size

    @property
    def address_alignment(self) -> int:
        """Elements: a segment starting at a multiple of it starts at a multiple of ``ADDRESS_ALIGNMENT`` bytes of
        the codes. (Its scales, 4 bytes a block, start there only at every fourth block: a kernel takes an aligned
        copy of them otherwise, a few bytes, rather than pages padded by up to 3 blocks a segment.)"""
        (code_bytes, _), _ = self.buffer_specs(self.block_size)  # one block's codes
        return ADDRESS_ALIGNMENT * self.block_size // code_bytes

    def block_scales(self, values: torch.Tensor) -> torch.Tensor:
        """The scales of fp32 ``values`` shaped ``(blocks, block_size)``: each block's largest finite magnitude.

        A NaN counts as zero and an infinity as the largest fp32 value, so that one non-finite value never makes
        its block's scale, and so every value the block decodes to in later steps, non-finite (a non-negative state
        reads the infinity back, see :func:`scaled`).
        """
        return values.abs().nan_to_num_(nan=0.0, posinf=FLOAT32_MAX).amax(dim=1)


@dataclass(frozen=True)
class Blockwise8bitCodec(_BlockScaled):
    """State stored as 8-bit codes with an fp32 scale per block of ``block_size`` elements."""

    block_size: int
    signed: bool
    fields: tuple[str, ...] = ("codes", "scales")
    saved_like_param: ClassVar[bool] = True

    @property
    def power(self) -> int:
        return 2 if self.signed else 4

    @property
    def max_code(self) -> int:
        return 127 if self.signed else 255

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.signed else torch.uint8

    def buffer_specs(self, capacity: int) -> tuple[BufferSpec, ...]:
        """The codes (one per element) and the fp32 scales (one per block)."""
        return (capacity, self.code_dtype), (capacity // self.block_size, torch.float32)

    def select(self, arrays: EncodedSegment, offset: int, length: int) -> EncodedSegment:
        """Codes as a ``(blocks, block_size)`` view and the blocks' scales, for the blocks ``length`` touches."""
        codes, scales = arrays
        blocks = -(-length // self.block_size)
        first = offset // self.block_size
        block_codes = codes[offset : offset + blocks * self.block_size].view(blocks, self.block_size)
        return block_codes, scales[first : first + blocks]

    def decode(self, encoded: EncodedSegment) -> torch.Tensor:
        """fp32 values of a segment, shaped ``(blocks, block_size)``."""
        codes, scales = encoded
        normalized = codes.float() * (1.0 / self.max_code)
        if self.signed:
            magnitude = normalized * normalized.abs()
        else:
            squared = normalized * normalized
            magnitude = squared * squared
        return scaled(magnitude, scales.unsqueeze(1), self.signed)

    def encode(self, values: torch.Tensor, encoded: EncodedSegment, block_scales: torch.Tensor | None = None) -> None:
        """Store fp32 ``values`` shaped ``(blocks, block_size)`` into a segment's codes and scales.

        ``block_scales`` are :meth:`block_scales` of ``values``, when the caller has them.
        """
        codes, scales = encoded
        if block_scales is None:
            block_scales = self.block_scales(values)
        if self.signed:
            normalized = saturate_(values * inverse_scales(block_scales).unsqueeze(1))
            quantized = torch.round(ieee_sqrt(normalized.abs()) * self.max_code) * normalized.sign()
        else:
            roots = fourth_roots(values, block_scales.unsqueeze(1))
            quantized = torch.round(roots * self.max_code)
            quantized = torch.maximum(quantized, (roots > 0).to(quantized.dtype))
        codes.copy_(quantized)
        scales.copy_(block_scales)

    def field_lengths(self, length: int) -> tuple[int, ...]:
        return length, -(-length // self.block_size)

    def field_offsets(self, start: int) -> tuple[int, ...]:
        return start, start // self.block_size

    def field_dtypes(self) -> tuple[torch.dtype, ...]:
        return self.code_dtype, torch.float32


@dataclass(frozen=True)
class Blockwise4bitCodec(_BlockScaled):
    """State stored as 4-bit codes, two per byte, with an fp32 scale per block of ``block_size`` elements.

    Byte ``i`` of a block's ``block_size // 2`` bytes holds element ``i`` of the block in its low nibble and
    element ``i + block_size // 2`` in its high nibble, so that packing and unpacking read and write whole
    half-blocks (saved codes therefore cover whole blocks).
    """

    block_size: int
    signed: bool
    fields: tuple[str, ...] = ("packed_codes", "scales")
    saved_like_param: ClassVar[bool] = False

    def buffer_specs(self, capacity: int) -> tuple[BufferSpec, ...]:
        """The packed codes (one byte per two elements) and the fp32 scales (one per block)."""
        return (capacity // 2, torch.uint8), (capacity // self.block_size, torch.float32)

    def select(self, arrays: EncodedSegment, offset: int, length: int) -> EncodedSegment:
        """Packed codes as a ``(blocks, block_size // 2)`` view and the scales of the blocks ``length`` touches."""
        packed, scales = arrays
        blocks = -(-length // self.block_size)
        first = offset // self.block_size
        start, half = offset // 2, self.block_size // 2
        return packed[start : start + blocks * half].view(blocks, half), scales[first : first + blocks]

    def decode(self, encoded: EncodedSegment) -> torch.Tensor:
        """fp32 values of a segment, shaped ``(blocks, block_size)``."""
        packed, scales = encoded
        return scaled(decode_4bit(packed, self.signed), scales.unsqueeze(1), self.signed)

    def encode(self, values: torch.Tensor, encoded: EncodedSegment, block_scales: torch.Tensor | None = None) -> None:
        """Store fp32 ``values`` shaped ``(blocks, block_size)`` into a segment's packed codes and scales.

        ``block_scales`` are :meth:`block_scales` of ``values``, when the caller has them.
        """
        packed, scales = encoded
        if block_scales is None:
            block_scales = self.block_scales(values)
        packed.copy_(encode_4bit(values, block_scales.unsqueeze(1), self.signed))
        scales.copy_(block_scales)

    def field_lengths(self, length: int) -> tuple[int, ...]:
        blocks = -(-length // self.block_size)
        return blocks * self.block_size // 2, blocks

    def field_offsets(self, start: int) -> tuple[int, ...]:
        return start // 2, start // self.block_size

    def field_dtypes(self) -> tuple[torch.dtype, ...]:
        return torch.uint8, torch.float32


@dataclass(frozen=True)
class Rank1Normalized4bitCodec:
    """State of a 2-D tensor stored as 4-bit codes, two per byte, each normalized by its own element's rank-1
    statistic instead of a block's scale (Li et al., NeurIPS 2023, "rank-1 normalization").

    For a state :math:`x` of shape ``(rows, cols)`` the statistics are the largest magnitude of each row and each
    column, :math:`r_i = \\max_j |x_{ij}|` and :math:`c_j = \\max_i |x_{ij}|` (:class:`Rank1Statistics`), and
    element :math:`(i, j)` is stored as the code of :math:`x_{ij} / \\min(r_i, c_j)`, which lies in [-1, 1], in the
    maps of :class:`Blockwise4bitCodec`. An outlier then widens the range of its own row and column only, not of a
    whole block. A state's bytes per element are ``0.5 + 8 (rows + cols) / (rows cols)`` (two sets of statistics).

    Pages hold the packed codes (by half-blocks of ``block_size`` elements, as :class:`Blockwise4bitCodec`); the
    statistics live with the tensor's layout. Whoever decodes or encodes a segment appends its elements' normalizers
    to the page's views: ``encoded = (packed, normalizers, new_normalizers)``, each normalizer array fp32 shaped
    ``(blocks, block_size)`` (:meth:`Rank1Statistics.normalizers`): the codes are read with the first and written
    with the second (those of the state being computed, whose statistics a step gathers before it encodes).
    """

    block_size: int
    signed: bool
    fields: tuple[str, ...] = ("packed_codes",)
    saved_like_param: ClassVar[bool] = False
    statistics_fields: ClassVar[tuple[str, ...]] = ("row_max", "col_max")
    """The saved fields of a tensor's statistics, after :attr:`fields`."""

    @property
    def alignment(self) -> int:
        return self.block_size

    @property
    def address_alignment(self) -> int:
        """Elements: a segment starting at a multiple of it starts its codes at a multiple of ``ADDRESS_ALIGNMENT``
        bytes (two elements a byte)."""
        return 2 * ADDRESS_ALIGNMENT

    def buffer_specs(self, capacity: int) -> tuple[BufferSpec, ...]:
        """The packed codes: one byte per two elements."""
        return ((capacity // 2, torch.uint8),)

    def select(self, arrays: EncodedSegment, offset: int, length: int) -> EncodedSegment:
        """Packed codes as a ``(blocks, block_size // 2)`` view, for the blocks ``length`` touches (normalizers not
        yet appended)."""
        (packed,) = arrays
        blocks = -(-length // self.block_size)
        start, half = offset // 2, self.block_size // 2
        return (packed[start : start + blocks * half].view(blocks, half),)

    def decode(self, encoded: EncodedSegment) -> torch.Tensor:
        """fp32 values of a segment, shaped ``(blocks, block_size)``: codes times their normalizers."""
        packed, normalizers = encoded[0], encoded[1]
        return scaled(decode_4bit(packed, self.signed), normalizers, self.signed)

    def block_scales(self, values: torch.Tensor) -> None:
        """Rank-1 codes have no block scales: the statistics come from the whole tensor."""

    def encode(self, values: torch.Tensor, encoded: EncodedSegment, block_scales: None = None) -> None:
        """Store fp32 ``values`` shaped ``(blocks, block_size)`` as codes of ``values / new_normalizers``."""
        packed, _, new_normalizers = encoded
        packed.copy_(encode_4bit(values, new_normalizers, self.signed))

    def field_lengths(self, length: int) -> tuple[int, ...]:
        blocks = -(-length // self.block_size)
        return (blocks * self.block_size // 2,)

    def field_offsets(self, start: int) -> tuple[int, ...]:
        return (start // 2,)

    def field_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.uint8,)


def rank1_eligible(shape: torch.Size | tuple[int, ...], block_size: int) -> bool:
    """Whether a tensor of ``shape`` takes rank-1 normalized 4-bit state: it is 2-D and its statistics (one fp32
    value per row and column, in two sets: those of the codes and those a step gathers, see
    :class:`Rank1Statistics`) take no more bytes than block scales would (one fp32 value per ``block_size``
    elements), so that its state stays within 0.5 + 4 / ``block_size`` bytes per element."""
    if len(shape) != 2:
        return False
    rows, cols = shape
    return rows > 0 and cols > 0 and 2 * (rows + cols) * block_size <= rows * cols


class Rank1Statistics:
    """The rank-1 statistics of one 2-D tensor's states (see :class:`Rank1Normalized4bitCodec`): per state, the
    largest finite magnitude of each row (``rows[state]``, fp32 of ``shape[0]``) and each column (``cols[state]``,
    of ``shape[1]``), those its codes are normalized by now. During a step, :meth:`begin` starts the statistics of
    the state the step computes (``next_rows``, ``next_cols``), :meth:`observe` gathers them from its values, and
    :meth:`commit` makes them the statistics of the codes once every element is encoded with them. The two sets of
    buffers are swapped, not reallocated: a step allocates no statistics.

    Args:
        shape: the tensor's (local) shape, ``(rows, cols)``.
        states: the number of states.
        device: where the statistics live (the tensor's device).
    """

    def __init__(self, shape: tuple[int, int], states: int, device: torch.device | str = "cpu") -> None:
        self.shape = (int(shape[0]), int(shape[1]))
        self.rows = [torch.zeros(self.shape[0], device=device) for _ in range(states)]
        self.cols = [torch.zeros(self.shape[1], device=device) for _ in range(states)]
        self.next_rows = [torch.zeros_like(rows) for rows in self.rows]
        self.next_cols = [torch.zeros_like(cols) for cols in self.cols]

    def batch_entry(self) -> tuple[torch.Tensor, ...]:
        """The statistics as a page batch takes them (:attr:`~hf_paged.kernels.batch.PageBatch.statistics`): the
        current row and column maxima of each state, then the next."""
        current = [t for pair in zip(self.rows, self.cols) for t in pair]
        following = [t for pair in zip(self.next_rows, self.next_cols) for t in pair]
        return (*current, *following)

    @property
    def next_maxima(self) -> list[torch.Tensor]:
        """The row and column maxima being gathered, of every state."""
        return [*self.next_rows, *self.next_cols]

    def begin(self) -> None:
        """Start gathering the statistics of the state being computed (from zero)."""
        torch._foreach_zero_(self.next_maxima)

    def observe(self, state: int, first: int, values: torch.Tensor) -> None:
        """Take the magnitudes of ``values`` (flat, or blocks whose padding past the tensor's end is zero), elements
        ``first`` on of the tensor, into the statistics of state ``state`` being gathered. A NaN counts as zero and
        an infinity as the largest fp32 value, as block scales count them."""
        _take_maxima(self.next_rows[state], self.next_cols[state], first, values)

    def set_from(self, state: int, values: torch.Tensor) -> None:
        """Set the statistics of state ``state``'s codes to those of its fp32 ``values`` (all of the tensor's
        elements, flat or shaped)."""
        self.rows[state].zero_()
        self.cols[state].zero_()
        _take_maxima(self.rows[state], self.cols[state], 0, values)

    def commit(self) -> None:
        """Make the gathered statistics those of the codes."""
        self.rows, self.next_rows = self.next_rows, self.rows
        self.cols, self.next_cols = self.next_cols, self.cols

    def normalizers(self, state: int, first: int, length: int, padded: int, new: bool = False) -> torch.Tensor:
        """The normalizers ``min(r_i, c_j)`` of elements ``first`` to ``first + length`` of state ``state`` (of the
        codes, or with ``new`` of the state being gathered), fp32 of ``padded`` elements: zero past ``length``."""
        rows_max = (self.next_rows if new else self.rows)[state]
        cols_max = (self.next_cols if new else self.cols)[state]
        pieces = [
            torch.minimum(rows_max[row : row + rows, None], cols_max[None, col_start:col_end]).reshape(-1)
            for row, rows, col_start, col_end, _ in _row_pieces(first, length, self.shape[1])
        ]
        if padded > length:
            pieces.append(rows_max.new_zeros(padded - length))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def attach(
        self, encoded: list[EncodedSegment], first: int, length: int, alignment: int, gathering: bool = False
    ) -> list[EncodedSegment]:
        """``encoded`` (one segment's packed codes per state, ``length`` elements from element ``first`` of the
        tensor) with each state's normalizers appended, shaped like its blocks: those of the codes, and those of the
        state being gathered (``None`` while ``gathering`` them)."""
        padded = -(-length // alignment) * alignment
        attached = []
        for state, arrays in enumerate(encoded):
            old = self.normalizers(state, first, length, padded).view(-1, alignment)
            new = None if gathering else self.normalizers(state, first, length, padded, new=True).view(-1, alignment)
            attached.append((*arrays, old, new))
        return attached


def _row_pieces(first: int, length: int, cols: int) -> list[tuple[int, int, int, int, int]]:
    """Elements ``first`` to ``first + length`` of a row-major matrix of ``cols`` columns as rectangles: ``(row,
    rows, col_start, col_end, offset)`` for ``rows`` rows from ``row``, columns ``col_start`` to ``col_end``, whose
    elements come ``offset`` on in the range (a partial first row, whole rows, a partial last row)."""
    pieces = []
    offset = 0
    row, col = divmod(first, cols)
    while offset < length:
        left = length - offset
        if col or left < cols:
            width = min(cols - col, left)
            pieces.append((row, 1, col, col + width, offset))
        else:
            width = left // cols * cols
            pieces.append((row, width // cols, 0, cols, offset))
        offset += width
        row, col = divmod(first + offset, cols)
    return pieces


def _take_maxima(rows_max: torch.Tensor, cols_max: torch.Tensor, first: int, values: torch.Tensor) -> None:
    """Raise ``rows_max`` and ``cols_max`` to the largest magnitudes in each row and column of ``values``, elements
    ``first`` on of a matrix of ``rows_max.numel()`` rows (values past its last element are ignored)."""
    cols = cols_max.numel()
    values = values.reshape(-1)[: rows_max.numel() * cols - first]
    magnitudes = values.abs().nan_to_num_(nan=0.0, posinf=FLOAT32_MAX).to(rows_max.device)
    for row, rows, col_start, col_end, offset in _row_pieces(first, magnitudes.numel(), cols):
        grid = magnitudes[offset : offset + rows * (col_end - col_start)].view(rows, col_end - col_start)
        row_slice, col_slice = rows_max[row : row + rows], cols_max[col_start:col_end]
        torch.maximum(row_slice, grid.amax(dim=1), out=row_slice)
        torch.maximum(col_slice, grid.amax(dim=0), out=col_slice)


Codec = Float32Codec | Blockwise8bitCodec | Blockwise4bitCodec | Rank1Normalized4bitCodec

QUANTIZED_CODECS: dict[int, type[Blockwise8bitCodec | Blockwise4bitCodec]] = {
    8: Blockwise8bitCodec,
    4: Blockwise4bitCodec,
}
"""The blockwise codec for each number of bits per element, built as ``codec(block_size, signed)``."""


def inverse_scales(block_scales: torch.Tensor) -> torch.Tensor:
    """``1 / block_scales``, and 0 for a block whose scale is zero or subnormal (its values all encode to zero).

    The reciprocal of a subnormal scale overflows to infinity, and casting the infinite or NaN products to
    integer codes is undefined: the CPU gives 0, a GPU may give any code.
    """
    smallest_normal = torch.finfo(block_scales.dtype).tiny
    return torch.where(block_scales >= smallest_normal, block_scales.reciprocal(), torch.zeros_like(block_scales))


def saturate_(normalized: torch.Tensor) -> torch.Tensor:
    """Values divided by their block's scale, in place: NaN to 0 and the rest clamped to [-1, 1].

    Finite values are within [-1, 1] already (but for an ulp); a NaN is stored as zero and an infinity as the
    block's largest code (see :meth:`_BlockScaled.block_scales` and :func:`scaled`), since casting them to integer
    codes is undefined.
    """
    return normalized.nan_to_num_(nan=0.0).clamp_(-1.0, 1.0)


def square_roots(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(values / scale) ** (1/2)`` of non-negative ``values`` shaped ``(blocks, block_size)``, in [0, 1], with
    ``scales`` broadcast against them (``(blocks, 1)``: one per block; ``(blocks, block_size)``: one per element).

    Taken as ``sqrt(values) / sqrt(scale)``: an update rule that needs ``sqrt(values)`` (Adam's denominator) shares
    it in a compiled kernel. A zero scale gives 0.
    """
    inverse_root = torch.where(scales > 0, scales.rsqrt(), torch.zeros_like(scales))
    return saturate_(ieee_sqrt(values) * inverse_root)


def fourth_roots(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(values / scale) ** (1/4)``: the square roots of :func:`square_roots`."""
    return ieee_sqrt(square_roots(values, scales))


def scaled(normalized: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 values of a state: its ``normalized`` values (in [-1, 1]) times their ``scales`` (broadcast against
    them: block scales or rank-1 normalizers).

    A non-negative state reads the largest fp32 value as +infinity: its largest code times a scale of the largest fp32
    value, which is how an infinity is stored (:meth:`_BlockScaled.block_scales`). So a second moment whose squared
    gradient overflowed stays infinite, as torch's, rather than decaying from 3.4e38 under a first moment of 0.1 g.
    (A finite value beside the infinity that takes the largest code, within 0.8% (8-bit) or 12% (4-bit) of 3.4e38,
    reads as infinity too.)
    """
    values = normalized * scales
    return values if signed else values.masked_fill_(values == FLOAT32_MAX, math.inf)


def decode_4bit(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    """The normalized fp32 values (in [-1, 1]) of 4-bit codes packed by half-blocks, ``packed`` shaped
    ``(blocks, block_size // 2)``, as ``(blocks, block_size)``: the maps of :class:`Blockwise4bitCodec`."""
    codes = torch.cat([packed & 15, packed >> 4], dim=1).float()
    if signed:
        levels = codes - 7
        return levels * levels.abs() * (1.0 / 49)
    root = (codes + 1) * (1.0 / 16)
    squared = root * root
    return squared * squared


def encode_4bit(values: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """The 4-bit codes of fp32 ``values`` shaped ``(blocks, block_size)`` divided by ``scales`` (broadcast against
    them; a zero scale encodes zero), packed by half-blocks: uint8 of shape ``(blocks, block_size // 2)``."""
    if signed:
        normalized = saturate_(values * inverse_scales(scales))
        # nearest level (k / 7)^2: |x| >= the midpoint of levels k - 1 and k iff 196 |x| - 1 >= (2k - 1)^2
        magnitude = torch.floor((ieee_sqrt(torch.relu(normalized.abs() * 196 - 1)) + 1) * 0.5)
        codes = magnitude.clamp(max=7) * normalized.sign() + 7
    else:
        # nearest level ((k + 1) / 16)^2 in the sqrt(x) domain: sqrt(x) >= the midpoint of codes k - 1 and k iff
        # 1024 sqrt(x) - 1 >= (2k + 1)^2; code 15 at most as sqrt(x) <= 1
        level = torch.floor((ieee_sqrt(torch.relu(square_roots(values, scales) * 1024 - 1)) + 1) * 0.5)
        codes = (level - 1).clamp(min=0)
    codes = codes.to(torch.uint8)
    half = values.shape[1] // 2
    return codes[:, :half] | (codes[:, half:] << 4)


def to_blocks(values: torch.Tensor, alignment: int) -> torch.Tensor:
    """Flat ``values`` as codecs see them: 1-D for ``alignment`` 1, else ``(blocks, alignment)``.

    A view when the length is a multiple of ``alignment``, else a zero-padded copy.
    """
    if alignment == 1:
        return values
    padding = -values.numel() % alignment
    if padding:
        values = torch.cat([values, values.new_zeros(padding)])
    return values.view(-1, alignment)


@dataclass(frozen=True)
class PageFormat:
    """The codecs of a page's states, in the order the update rule takes them, each with its own buffers."""

    codecs: tuple[Codec, ...]

    @property
    def alignment(self) -> int:
        return max(codec.alignment for codec in self.codecs)

    @property
    def offset_alignment(self) -> int:
        """Elements: a segment at a multiple of it in a page starts on a block and its views of the values and codes
        at multiples of ``ADDRESS_ALIGNMENT`` bytes."""
        return math.lcm(self.alignment, *(codec.address_alignment for codec in self.codecs))

    @property
    def split_alignment(self) -> int:
        """Elements: a tensor cut at multiples of it (between pages) has each part's parameter and gradient elements
        start at a multiple of ``ADDRESS_ALIGNMENT`` bytes, whatever their dtype (1 byte an element or more)."""
        return math.lcm(self.alignment, ADDRESS_ALIGNMENT)

    @property
    def chunk_alignment(self) -> int:
        """Elements: chunks of a segment that start at multiples of it start their parameter, gradient, values and
        codes aligned."""
        return math.lcm(self.offset_alignment, self.split_alignment)

    def buffer_specs(self, capacity: int) -> list[BufferSpec]:
        """The buffers of a page holding ``capacity`` elements, codec after codec."""
        return [spec for codec in self.codecs for spec in codec.buffer_specs(capacity)]

    def nbytes(self, capacity: int) -> int:
        """Bytes of the block of a page holding ``capacity`` elements (its buffers and their alignment padding)."""
        return packing(tuple(self.buffer_specs(capacity)))[1]

    def capacity_for(self, page_bytes: int) -> int:
        """The most elements, a multiple of the split alignment, whose page's block fits in ``page_bytes``."""
        step = self.split_alignment
        step_bytes = sum(numel * dtype.itemsize for numel, dtype in self.buffer_specs(step))
        capacity = page_bytes // step_bytes * step
        while capacity and self.nbytes(capacity) > page_bytes:
            capacity -= step
        return capacity

    def arrays(self, buffers: tuple[torch.Tensor, ...]) -> list[EncodedSegment]:
        """A page's buffers grouped by codec."""
        grouped, start = [], 0
        for codec in self.codecs:
            count = len(codec.buffer_specs(0))
            grouped.append(tuple(buffers[start : start + count]))
            start += count
        return grouped


def random_page_buffers(page_format: PageFormat, capacity: int, generator: torch.Generator) -> list[torch.Tensor]:
    """The buffers (CPU) of a page of ``capacity`` elements holding a state as training leaves it, to check kernels
    on: random codes of every value, fp32 values and scales over seven orders of magnitude (1e-6 to 1) and, for
    blockwise states, the page's first block all zero (codes and scale 0)."""
    buffers = []
    for numel, dtype in page_format.buffer_specs(capacity):
        if dtype == torch.float32:
            buffer = torch.rand(numel, generator=generator) * 10.0 ** torch.randint(
                -6, 1, (numel,), generator=generator
            )
        else:
            low, high = (-127, 128) if dtype == torch.int8 else (0, 256)
            buffer = torch.randint(low, high, (numel,), generator=generator, dtype=dtype)
        if page_format.alignment > 1:
            buffer[: numel * page_format.alignment // capacity] = 0
        buffers.append(buffer)
    return buffers
