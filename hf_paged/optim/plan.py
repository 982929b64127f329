"""The step plan: what a step over the same tensors, groups and pages reuses from the step before.

A plan is built when the layout changes (a first step, tensors swapped or dropped, a param group added, a state
dict loaded) or when the tensors that have gradients, or their groups, change; the optimizer keeps it while they
hold. It holds each page's segments, the page batches' segment tables (:class:`~hf_paged.kernels.batch.PageBatch`),
the views of the state that segments read and the launches a device kernel prepared over its pages (built and
checked once, see :class:`~hf_paged.kernels.triton_kernels.TritonLaunches`), so that a step does Python work and
operator calls in proportion to tensors and page batches, not to segments or chunks. It holds what the step takes
from the optimizer (:class:`StepParts`) and no view of a parameter or gradient: a parameter given new memory between
steps (``param.data = ...``, ``model.to(...)``) frees its old memory at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..codecs import Float32Codec, PageFormat
from ..kernels import UpdateRule
from ..kernels.batch import NO_ROUNDING
from ..store import Page, Segment
from ..stores import DeviceStores
from ._params import StridedElements, StridedRange
from .layout import StateLayout

_EXACT_STEPS = 2.0**24
"""fp32 step counts are whole numbers that one more step advances by one below this."""


def _shaped(arrays: tuple[torch.Tensor, ...], offset: int, shape: torch.Size) -> tuple[torch.Tensor, ...]:
    """The fp32 values of a segment from element ``offset`` of a page's 1-D ``arrays``, in ``shape``: one view each (an
    ``as_strided``, not a slice and a view: a streamed page's views are made again at each step)."""
    strides = [1] * len(shape)
    for dim in range(len(shape) - 1, 0, -1):
        strides[dim - 1] = strides[dim] * shape[dim]
    return tuple(array.as_strided(shape, strides, array.storage_offset() + offset) for array in arrays)


def segment_slices(
    flat: torch.Tensor | StridedElements, segments: Sequence[Segment]
) -> list[torch.Tensor | StridedRange]:
    """The elements of each of ``segments`` (which cover ``flat`` in order): ``flat`` itself for one segment, else
    one split (one operator call) of a contiguous tensor, or a range of a non-contiguous one per segment."""
    if len(segments) == 1:
        return [flat if isinstance(flat, torch.Tensor) else flat[0 : segments[0].length]]
    if isinstance(flat, torch.Tensor):
        return list(flat.split([segment.length for segment in segments]))
    return [flat[segment.start : segment.start + segment.length] for segment in segments]


@dataclass(frozen=True)
class StepParts:
    """What a step takes from its optimizer, handed to the step plan once: the executor reaches nothing else of it.

    Attributes:
        stores: the page stores, one per device.
        kernel: the kernel of a page format on a device, ``kernel(format, device, compiled)`` (its family read at
            each call: ``HF_PAGED_KERNELS`` may change between steps).
        rule_scalars: the rule's scalars of a param group at a step, ``rule_scalars(group, step)``.
        moments_rule: the states' part of the update rule, with which rank-1 normalized state gathers its statistics
            (``None`` where no state is rank-1 normalized).
        chunk_elements: elements of a segment one call of a segment kernel updates, ``chunk_elements(format,
            compiled)``.
        takes_pages_fast: whether the optimizer's multi-tensor kernel takes a page of these (parameter, gradient)
            dtypes, ``takes_pages_fast(page, dtypes)``.
        update_pages_fast: the optimizer's multi-tensor kernel over pages' work items (see
            :meth:`~hf_paged.optim.base.PagedOptimizer.update_pages_fast`).
    """

    stores: DeviceStores
    kernel: Callable[[PageFormat, torch.device, bool], Any]
    rule_scalars: Callable[[dict[str, Any], float], dict[str, float]]
    moments_rule: UpdateRule | None
    chunk_elements: Callable[[PageFormat, bool], int]
    takes_pages_fast: Callable[..., bool]
    update_pages_fast: Callable[..., list]


class StepPlan:
    """The segments of the tensors a step updates, by page, and the views and tables built from them.

    Args:
        layout: the optimizer's layout, in which every one of ``params`` has pages.
        params: the tensors the step updates (those with gradients), in the step's order.
        groups: the param group of each of ``params``.
        parts: what the step takes from the optimizer.
    """

    def __init__(
        self, layout: StateLayout, params: Sequence[torch.Tensor], groups: Sequence[dict[str, Any]], parts: StepParts
    ) -> None:
        self.parts = parts
        self.stores = parts.stores
        self.params = list(params)
        self.groups = list(groups)
        self.distinct_groups: list[dict[str, Any]] = []
        """Each group once, in the order its first tensor comes."""
        group_index: dict[int, int] = {}
        self.group_of: list[int] = []
        """The index into :attr:`distinct_groups` of each tensor's group."""
        for group in self.groups:
            if id(group) not in group_index:
                group_index[id(group)] = len(self.distinct_groups)
                self.distinct_groups.append(group)
            self.group_of.append(group_index[id(group)])
        self.segments: list[list[tuple[Page, Segment]]] = [layout[param].segments for param in self.params]
        """Each tensor's pages and segments, in the tensor's element order."""
        by_page: dict[int, list[tuple[int, Segment]]] = {}
        pages: dict[int, Page] = {}
        for index, segments in enumerate(self.segments):
            for page, segment in segments:
                by_page.setdefault(page.index, []).append((index, segment))
                pages[page.index] = page
        self.pages = [pages[index] for index in sorted(pages)]
        """The pages the step updates, in index order."""
        self.page_segments = by_page
        """By page index: the ``(tensor index, segment)`` pairs of the page that the step updates."""
        self._located = {
            id(segment): (index, position)
            for index, segments in enumerate(self.segments)
            for position, (_, segment) in enumerate(segments)
        }
        self.page_tensors = {index: sorted({tensor for tensor, _ in pairs}) for index, pairs in by_page.items()}
        """By page index: the indices of the tensors with segments on the page."""
        self.statistics = {
            index: layout[param].statistics
            for index, param in enumerate(self.params)
            if layout[param].statistics is not None
        }
        """By tensor index: the rank-1 statistics of the tensors whose state is rank-1 normalized."""
        self.numels = [layout[param].numel for param in self.params]
        """Each tensor's local elements."""
        self.row_splits: dict[int, list[int]] = {}
        """By tensor index, for each tensor in several segments that are all whole rows (slices along its first
        dimension; see :func:`~hf_paged.optim.layout.cut_alignment`): the rows of each segment."""
        for index, (param, segments) in enumerate(zip(self.params, self.segments)):
            shape = layout[param].shape
            if len(segments) > 1 and len(shape) >= 2 and shape[0]:
                row = shape.numel() // shape[0]
                if all(segment.length % row == 0 for _, segment in segments):
                    self.row_splits[index] = [segment.length // row for _, segment in segments]
        kinds: dict[tuple[int, str], int] = {}
        self.kinds: list[tuple[PageFormat, str]] = []
        """Each (page format, device) pair of the plan's pages: a page batch holds pages of one of them."""
        self.page_kind: dict[int, int] = {}
        """By page index: its (format, device) pair's index in :attr:`kinds`."""
        for page in self.pages:
            device = self.stores.device_of(page)
            kind = kinds.get((id(page.format), device))
            if kind is None:
                kind = kinds[id(page.format), device] = len(self.kinds)
                self.kinds.append((page.format, device))
            self.page_kind[page.index] = kind
        self._steps: list[tuple[torch.Tensor, int, float] | None] = [None] * len(self.params)
        self._tables: dict[tuple[int, ...], tuple[tuple[int, ...], torch.Tensor, list[int]]] = {}
        self._state_views: dict[int, dict[int, tuple[torch.Size | None, tuple[Any, ...]]]] = {}
        self._launches: dict[tuple[int, str], tuple[Any, Any]] = {}

    def holds_for(self, params: Sequence[torch.Tensor], groups: Sequence[dict[str, Any]]) -> bool:
        """Whether the plan is that of a step over ``params`` in ``groups`` (the same objects, in order)."""
        return (
            len(params) == len(self.params)
            and all(new is old for new, old in zip(params, self.params))
            and all(new is old for new, old in zip(groups, self.groups))
        )

    def tensor_index(self, segment: Segment) -> int:
        """The index of the tensor ``segment`` belongs to."""
        return self._located[id(segment)][0]

    def position(self, segment: Segment) -> int:
        """The position of ``segment`` among its tensor's segments."""
        return self._located[id(segment)][1]

    # Step counts ----------------------------------------------------------------------------------------

    def next_steps(self, step_counts: Sequence[torch.Tensor]) -> list[float]:
        """Each tensor's step count plus one, as floats, read in one call per device and dtype: a count may have
        been written where its version does not show it (``count.data.copy_(...)``, as DeepSpeed restores a base
        optimizer's state). Only a fake count (a step under ``FakeTensorMode``, whose values cannot be read) that
        this plan advanced last (the same tensor, its version the one after the advance) is known without reading
        it."""
        steps: list[float] = [0.0] * len(step_counts)
        fake = []
        real: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, count in enumerate(step_counts):
            if not isinstance(count, FakeTensor):
                real.setdefault((count.device, count.dtype), []).append(index)
                continue
            known = self._steps[index]
            if known is not None and known[0] is count and known[1] == count._version:
                steps[index] = known[2] + 1.0
            else:
                fake.append(index)
        for indices in real.values():
            counts = [step_counts[index] for index in indices]
            added = torch.stack([count if count.dim() == 0 else count.reshape(()) for count in counts]).add_(1.0)
            for index, value in zip(indices, added.tolist()):
                steps[index] = value
        if fake:
            added = torch._foreach_add([step_counts[index] for index in fake], 1.0)
            for index, value in zip(fake, added):
                steps[index] = value.item()
        return steps

    def record_steps(self, indices: Sequence[int], step_counts: Sequence[torch.Tensor], steps: Sequence[float]) -> None:
        """Remember that the counts of tensors ``indices`` now hold ``steps`` (just advanced to them), so that the next
        step need not read those that are fake. Counts from 2**24 on, where fp32 stops counting by ones, are read."""
        for index in indices:
            count = step_counts[index]
            self._steps[index] = (count, count._version, steps[index]) if steps[index] < _EXACT_STEPS else None

    # Page batches ---------------------------------------------------------------------------------------

    def batch_table(self, pages: Sequence[Page], rows: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        """The segment table of ``pages`` as one :class:`~hf_paged.kernels.batch.PageBatch` (int64, CPU,
        ``(segments, 6)``) and the tensor indices its ``TENSOR`` column numbers, where tensor ``i`` reads scalar row
        ``rows[i]``. Built once per set of pages and rows, then reused."""
        key = tuple(page.index for page in pages)
        row_key = tuple(rows[index] for page in pages for index in self.page_tensors[page.index])
        cached = self._tables.get(key)
        if cached is not None and cached[0] == row_key:
            return cached[1], cached[2]
        position: dict[int, int] = {}
        tensors: list[int] = []
        entries = []
        for page_position, page in enumerate(pages):
            for index, segment in self.page_segments[page.index]:
                if index not in position:
                    position[index] = len(tensors)
                    tensors.append(index)
                entries.append(
                    (position[index], segment.start, segment.length, page_position, segment.offset, rows[index])
                )
        table = torch.tensor(entries, dtype=torch.int64).reshape(-1, 6)
        self._tables[key] = (row_key, table, tensors)
        return table, tensors

    def launches(self, kernel: Any, device: str) -> Any:
        """The prepared launches of ``kernel`` over this plan's pages of its format on ``device`` (its ``prepare``,
        see :mod:`hf_paged.kernels.batch`), made at the first step that asks and kept with the plan; ``None`` for a
        kernel without ``prepare``."""
        key = (id(kernel), device)
        cached = self._launches.get(key)
        if cached is not None and cached[0] is kernel:
            return cached[1]
        prepare = getattr(kernel, "prepare", None)
        launches = None
        if prepare is not None:
            pages = [
                (page, self.page_segments[page.index])
                for page in self.pages
                if self.kinds[self.page_kind[page.index]][1] == device and page.format.codecs == kernel.codecs
            ]
            shapes = {index: statistics.shape for index, statistics in self.statistics.items()}
            store = self.stores.stores[device]
            launches = prepare(torch.device(device), store.backend, self.numels, shapes, pages)
        self._launches[key] = (kernel, launches)
        return launches

    @staticmethod
    def rounding_table(
        pages: Sequence[Page], segments: dict[int, list[tuple[int, Segment]]], keys: dict[int, tuple[int, int]]
    ) -> torch.Tensor | None:
        """The stochastic rounding keys of the segments of ``pages`` in table order (``keys`` by tensor index, for
        the tensors that round), or ``None`` where none rounds."""
        if not keys:
            return None
        rows = [keys.get(index, (NO_ROUNDING, NO_ROUNDING)) for page in pages for index, _ in segments[page.index]]
        if all(row[0] == NO_ROUNDING for row in rows):
            return None
        return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)

    # State views ----------------------------------------------------------------------------------------

    def state_views(self, page: Page, segment: Segment, shape: torch.Size | None = None) -> tuple[Any, ...]:
        """The views of ``segment``'s state in ``page``'s device buffers, one encoded segment per codec, made once
        while the page stays resident (:meth:`forget_views` drops them when it leaves). With a ``shape`` (that of
        a tensor in one segment, handed to a multi-tensor kernel as it is), fp32 values come in that shape."""
        views = self._state_views.setdefault(page.index, {})
        cached = views.get(id(segment))
        if cached is None or cached[0] != shape:
            arrays = page.format.arrays(page.device)
            selected = tuple(
                _shaped(array, segment.offset, shape)
                if shape is not None and isinstance(codec, Float32Codec)
                else codec.select(array, segment.offset, segment.length)
                for codec, array in zip(page.format.codecs, arrays)
            )
            cached = (shape, selected)
            views[id(segment)] = cached
        return cached[1]

    def forget_views(self, page: Page) -> None:
        """Drop the state views of ``page``: its device buffers are going (written back or freed)."""
        self._state_views.pop(page.index, None)
