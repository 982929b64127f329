"""A page's block: its buffers packed in one allocation, each at a :data:`BUFFER_ALIGNMENT` boundary.

The page store counts a page's bytes as its block's, and backends allocate exactly that block, so that what is
counted against the device budget is what the device holds.
"""

from __future__ import annotations

import functools

import torch

BufferSpec = tuple[int, torch.dtype]
"""A buffer to allocate: its number of elements and dtype."""

BUFFER_ALIGNMENT = 16
"""Bytes to which each buffer of a page's block is aligned (every view a kernel takes starts at such a boundary)."""


@functools.cache
def packing(specs: tuple[BufferSpec, ...]) -> tuple[tuple[int, ...], int]:
    """The byte offset of each buffer of ``specs`` in one block, each at a :data:`BUFFER_ALIGNMENT` boundary, and
    the block's bytes."""
    offsets, end = [], 0
    for numel, dtype in specs:
        offset = -(-end // BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT
        offsets.append(offset)
        end = offset + numel * dtype.itemsize
    return tuple(offsets), end
