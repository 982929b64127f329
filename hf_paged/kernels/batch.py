"""The batch contract: everything one kernel call needs to update the segments of a batch of resident pages.

A :class:`PageBatch` holds the segments of pages of ONE page format (one codec tuple) on one device. A kernel that
takes batches has

- ``takes_batch(device, param_dtype, grad_dtype) -> bool``: whether it updates segments of parameters of
  ``param_dtype`` with gradients of ``grad_dtype`` on pages of ``device`` in batches; where it does not, the
  optimizer keeps the per-segment path (``kernel(param, grad, encoded, scalars, rounding)``);
- ``scalar_names: tuple[str, ...]``: the rule's scalars in the order of the columns of :attr:`PageBatch.scalars`
  (the names of the rule's keyword arguments, e.g. :func:`~hf_paged.kernels.rules.adamw_scalars`);
- ``table_device(device) -> torch.device``: where the batch's ``table``, ``scalars`` and ``rounding`` live for pages
  on ``device``: the CPU for the host kernels, the pages' device for device kernels (Triton);
- ``update_batch(batch) -> None``: updates every segment of the batch whole, partial last blocks included (bitwise
  as the per-segment path pads them), or, on any error, none: it checks everything before its first write and
  allocates nothing after it, so the optimizer needs no undo copy. Its results are bitwise those of the
  per-segment kernel of the same family (paging and batching never change results).

A kernel for an accelerator's pages may also have ``prepare(device, backend, numels, shapes, pages)``: the launches
over a step plan's pages of one device, with what they need that does not change between steps built and checked
once (:class:`~hf_paged.kernels.triton_kernels.TritonLaunches`); the optimizer's step then calls their
``begin_step``, ``update(pages, version)`` and ``gather(pages, version)`` instead of building a :class:`PageBatch`,
with the same results.

Segments of one batch must not overlap: neither two ranges of one parameter nor two ranges of one page's state
(counted in whole blocks for blockwise formats).

Rank-1 normalized state (:class:`~hf_paged.codecs.Rank1Normalized4bitCodec`, AdamW only): the pages hold the packed
codes of each state and no scales, and :attr:`PageBatch.statistics` gives each tensor's row and column maxima. A
kernel that takes such batches also has

- ``gather_batch(batch) -> None``: for every element of every segment, decode each state with its current normalizer,
  advance the moments as the rule does (:func:`~hf_paged.kernels.rules.adamw_moments_`), and raise the next row and
  column maxima of each state to the new value's magnitude (a NaN counts as 0, an infinity as the largest fp32 value);
  it writes nothing else (not the parameters, not the pages). The caller zeroes the next maxima first, and calls
  ``update_batch`` once every segment of every tensor concerned has been gathered.

and its ``update_batch`` decodes with the current normalizers and encodes with the next ones. Element ``(i, j)`` of a
state's tensor (flat element ``i * cols + j``) has normalizer ``min(rows[i], cols[j])`` (fp32), which stands where a
block's scale stands in :class:`~hf_paged.codecs.Blockwise4bitCodec`'s maps; the elements that pad a segment's
partial last block have normalizer 0 (they decode to 0, and encode to the code of 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

TENSOR, START, LENGTH, PAGE, OFFSET, ROW = range(6)
"""The columns of :attr:`PageBatch.table`: the segment's index into ``params``/``grads``; its first element in that
tensor, counted in its flat (row-major) element order; its number of elements; its page's index into ``buffers``; its first element in that page (a
multiple of the block size for blockwise formats); its row of ``scalars``."""

TABLE_COLUMNS = 6

ROUNDING_COLUMNS = 2
"""The columns of :attr:`PageBatch.rounding`: a segment's two 32-bit stochastic rounding keys (``key_a``,
``key_b`` of :func:`~hf_paged.stochastic_rounding.step_keys`), or ``-1`` in both where the segment does not round."""

NO_ROUNDING = -1


class HostToDevice(Protocol):
    """How a kernel's tables reach the pages' device without the host waiting (a page store's device backend,
    :class:`~hf_paged.device.SyncBackend`): written into pinned host memory, then copied on the compute stream."""

    def pinned_tensor(self, values: Sequence[int] | Sequence[float], dtype: torch.dtype) -> torch.Tensor: ...

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor: ...

    def to_device(self, host: torch.Tensor) -> torch.Tensor: ...

    def copy_into(self, device: torch.Tensor, host: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class PageBatch:
    """The segments of a batch of resident pages of one page format on one device, for one kernel call.

    Attributes:
        params: whole local parameter tensors, contiguous and of any shape (a segment addresses them by element
            index in their flat, row-major order; no 1-D view is needed), each fp32, bf16 or fp16, on the pages'
            device. A non-contiguous parameter is not batched: the optimizer updates it segment by segment through
            a contiguous copy.
        grads: their gradients, at the same positions, contiguous and of any shape (the parameter's or another
            with as many elements), each fp32, bf16 or fp16.
        buffers: the buffers of each page of the batch (``page.device``), in the page format's buffer order
            (:meth:`~hf_paged.codecs.PageFormat.buffer_specs`: codec after codec, e.g. codes then scales).
        table: int64, shape ``(segments, 6)``, columns :data:`TENSOR`, :data:`START`, :data:`LENGTH` (elements),
            :data:`PAGE`, :data:`OFFSET` (elements), :data:`ROW`; on the kernel's ``table_device``.
        scalars: fp32, shape ``(rows, len(kernel.scalar_names))``: one row per (param group, step) with the rule's
            scalars (as :meth:`~hf_paged.optim.base.PagedOptimizer.rule_scalars` gives them, each rounded once to
            fp32) in the kernel's ``scalar_names`` order; on the kernel's ``table_device``.
        rounding: int64, shape ``(segments, 2)``, the stochastic rounding keys of each segment of a bf16 parameter
            whose group rounds stochastically (:data:`NO_ROUNDING` in both columns for every other segment), or
            ``None`` where no segment rounds; on the kernel's ``table_device``. Element ``i`` of a segment is
            rounded as element ``START + i`` of its parameter.
        statistics: the rank-1 statistics of each tensor (see below), ``None`` for other formats.
    """

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    buffers: list[tuple[torch.Tensor, ...]]
    table: torch.Tensor
    scalars: torch.Tensor
    rounding: torch.Tensor | None = None
    statistics: list[tuple[torch.Tensor, ...]] | None = None
    """For rank-1 normalized state, one tuple per entry of :attr:`params`: ``(rows_0, cols_0, rows_1, cols_1,
    next_rows_0, next_cols_0, next_rows_1, next_cols_1)``, the current and next row and column maxima of each state
    (fp32, contiguous, on the pages' device; state 0 is the first moment); the tensor's local shape is
    ``(rows_0.numel(), cols_0.numel())``. ``None`` for other formats."""

    @property
    def segments(self) -> int:
        """The number of segments (rows of :attr:`table`)."""
        return self.table.shape[0]

    def check_shapes(self) -> None:
        """Raise ValueError where the fields' lengths, shapes or dtypes break the contract (not their values:
        the kernel checks those, e.g. table entries within bounds)."""
        if len(self.grads) != len(self.params):
            raise ValueError(f"PageBatch: grads has {len(self.grads)} tensors, params {len(self.params)}")
        if self.table.dtype != torch.int64 or self.table.dim() != 2 or self.table.shape[1] != TABLE_COLUMNS:
            raise ValueError(
                f"PageBatch: table must be int64 of shape (segments, {TABLE_COLUMNS}), got {self.table.dtype} "
                f"of shape {tuple(self.table.shape)}"
            )
        if self.scalars.dtype != torch.float32 or self.scalars.dim() != 2:
            raise ValueError(
                f"PageBatch: scalars must be fp32 of shape (rows, scalars), got {self.scalars.dtype} "
                f"of shape {tuple(self.scalars.shape)}"
            )
        if self.statistics is not None and (
            len(self.statistics) != len(self.params)
            or any(len(entry) != 8 or any(t.dtype != torch.float32 for t in entry) for entry in self.statistics)
        ):
            raise ValueError(
                f"PageBatch: statistics must hold, for each of the {len(self.params)} params, 8 fp32 tensors (the "
                "current and next row and column maxima of both states)"
            )
        if self.rounding is not None and (
            self.rounding.dtype != torch.int64 or tuple(self.rounding.shape) != (self.segments, ROUNDING_COLUMNS)
        ):
            raise ValueError(
                f"PageBatch: rounding must be None or int64 of shape ({self.segments}, {ROUNDING_COLUMNS}), got "
                f"{self.rounding.dtype} of shape {tuple(self.rounding.shape)}"
            )
