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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EncodedSegment = tuple[torch.Tensor, ...]
"""The arrays of one segment's encoded state: views into a page's buffers."""

BufferSpec = tuple[int, torch.dtype]
"""A page buffer: its number of elements and dtype."""


@dataclass(frozen=True)
class Float32Codec:
    """State stored as fp32 values, 4 bytes per element."""

    alignment: int = 1
    fields: tuple[str, ...] = ("",)

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

    def encode(self, values: torch.Tensor, encoded: EncodedSegment) -> None:
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


@dataclass(frozen=True)
class Blockwise8bitCodec:
    """State stored as 8-bit codes with an fp32 scale per block of ``block_size`` elements."""

    block_size: int
    signed: bool
    fields: tuple[str, ...] = ("codes", "scales")

    @property
    def alignment(self) -> int:
        return self.block_size

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
        return codes[offset : offset + blocks * self.block_size].view(blocks, self.block_size), scales[first : first + blocks]

    def decode(self, encoded: EncodedSegment) -> torch.Tensor:
        """fp32 values of a segment, shaped ``(blocks, block_size)``."""
        codes, scales = encoded
        normalized = codes.float() * (1.0 / self.max_code)
        if self.signed:
            magnitude = normalized * normalized.abs()
        else:
            squared = normalized * normalized
            magnitude = squared * squared
        return magnitude * scales.unsqueeze(1)

    def encode(self, values: torch.Tensor, encoded: EncodedSegment) -> None:
        """Store fp32 ``values`` shaped ``(blocks, block_size)`` into a segment's codes and scales."""
        codes, scales = encoded
        block_scales = values.abs().amax(dim=1)
        inverse = torch.where(block_scales > 0, block_scales.reciprocal(), torch.zeros_like(block_scales))
        normalized = values * inverse.unsqueeze(1)
        if self.signed:
            quantized = torch.round(normalized.abs().sqrt() * self.max_code) * normalized.sign()
        else:
            quantized = torch.round(normalized.sqrt().sqrt() * self.max_code)
            quantized = torch.maximum(quantized, (normalized > 0).to(quantized.dtype))
        codes.copy_(quantized)
        scales.copy_(block_scales)

    def field_lengths(self, length: int) -> tuple[int, ...]:
        return length, -(-length // self.block_size)

    def field_offsets(self, start: int) -> tuple[int, ...]:
        return start, start // self.block_size

    def field_dtypes(self) -> tuple[torch.dtype, ...]:
        return self.code_dtype, torch.float32


Codec = Float32Codec | Blockwise8bitCodec


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

    def buffer_specs(self, capacity: int) -> list[BufferSpec]:
        """The buffers of a page holding ``capacity`` elements, codec after codec."""
        return [spec for codec in self.codecs for spec in codec.buffer_specs(capacity)]

    def nbytes(self, capacity: int) -> int:
        """Bytes of a page holding ``capacity`` elements."""
        return sum(numel * dtype.itemsize for numel, dtype in self.buffer_specs(capacity))

    def capacity_for(self, page_bytes: int) -> int:
        """The most elements, a multiple of the alignment, whose page fits in ``page_bytes``."""
        return page_bytes // self.nbytes(self.alignment) * self.alignment

    def arrays(self, buffers: tuple[torch.Tensor, ...]) -> list[EncodedSegment]:
        """A page's buffers grouped by codec."""
        grouped, start = [], 0
        for codec in self.codecs:
            count = len(codec.buffer_specs(0))
            grouped.append(tuple(buffers[start : start + count]))
            start += count
        return grouped
