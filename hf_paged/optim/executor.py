"""The step's executor: it streams the pages of a :class:`~hf_paged.optim.plan.StepPlan` through the devices and
updates them, keeps track of how far the step got, keeps every update whole or undone, and recovers from an
out-of-memory error inside the step. It takes everything from the plan (the kernels, stores, rule and chunking the
optimizer handed it, :class:`~hf_paged.optim.plan.StepParts`) and nothing from the optimizer.

The stores hand out pages in batches: the resident pages in one, then the others a prefetch window at a time (the
pages whose copies were started together). For each batch and page format, a kernel that takes batches
(:mod:`hf_paged.kernels.batch`) updates all their segments in one call, through launches prepared with the plan
where the kernel has them (the Triton kernels: one launch per batch, its tables copied to the device from pinned
memory); others update segment by segment, in chunks that each update whole or not at all.
:class:`~hf_paged.optim.adamw.PagedAdamW`'s fp32 parameters with fp32 state take PyTorch's fused AdamW first
(``update_pages_fast``).
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ..codecs import ADDRESS_ALIGNMENT, Rank1Normalized4bitCodec, Rank1Statistics, to_blocks
from ..kernels import SegmentKernel, prepare_scalars, update_or_undo
from ..kernels.batch import HostToDevice, PageBatch
from ..memory import probe_for
from ..recovery import Recovery, device_out_of_memory, empty_device_cache, is_out_of_memory
from ..sizes import format_size
from ..stochastic_rounding import ElementRounding, parameter_seed, step_keys
from ..store import Page, PageStore, Segment
from ..stores import DeviceStores
from ._params import StridedElements, StridedRange, flat_elements
from .layout import local_tensor
from .plan import StepPlan, segment_slices

logger = logging.getLogger(__name__)

WorkItem = tuple[Segment, torch.Tensor, torch.Tensor, float, dict[str, Any]]
"""One segment's update in a step: the segment, its parameter and gradient elements (flat views; for a contiguous
tensor in one segment, the parameter and gradient as they are, any shape; for one cut at whole rows, the segment's
rows), the step, the group (as the step reads
it: a copy with a tensor ``lr`` read as a float, once per step)."""

StateViews = Callable[[Page, Segment], tuple[Any, ...]]
"""The views of a segment's state in its page's device buffers, one encoded segment per codec."""


def run_step(
    plan: StepPlan,
    grads: list[torch.Tensor],
    states: list[dict[str, Any]],
    compiled: bool,
    oom_retries: int,
    on_oom_recovery: Callable[[Recovery], None] | None = None,
) -> None:
    """Update the tensors of ``plan`` with their local gradients ``grads``: every page, streamed through the devices,
    retrying after an out-of-memory error (``oom_retries`` times; ``on_oom_recovery`` hears of each) with the pages
    left under a smaller budget, which the caller restores. ``states`` are the tensors' ``optimizer.state`` entries,
    whose step counts (made at a tensor's first step) advance for the tensors updated in full, even when the step
    stops part way. The step's own allocations (its step counts read, its step tensors) are retried as its pages are."""
    run: StepRun | None = None
    pages = plan.pages
    recoveries = 0
    try:
        while True:
            try:
                if run is None:
                    run = StepRun(plan, grads, states, compiled)
                pages = run.progress.pages_left()
                if not pages:
                    break
                run.stream(pages)
            except RuntimeError as error:  # torch.OutOfMemoryError is one
                if not is_out_of_memory(error) or recoveries >= oom_retries:
                    note = stopped_before_any_update(recoveries) if run is None else run.progress.describe(recoveries)
                    error.add_note(note)
                    raise
                recoveries += 1
                recover_in_step(plan.stores, error, recoveries, oom_retries, len(pages), on_oom_recovery)
                del error
    finally:
        if run is not None:
            run.release()
            run.progress.advance_step_counts()


class StepProgress:
    """How far one step got: the pages updated in full, the elements of each segment updated, and so which tensors
    are updated in full.

    A tensor's step count advances once every segment of it is finished, so a step that stops part way leaves the
    counts of the tensors it did not finish as they were.
    """

    def __init__(self, plan: StepPlan, step_counts: list[torch.Tensor], steps: list[float]) -> None:
        self.plan = plan
        self.step_counts = step_counts
        self.steps = steps
        self._pages_done: set[int] = set()
        self._touched: set[int] = set()
        self._reached: dict[int, int] = {}
        self._finished: set[int] = set()
        self._advanced = False

    def touched(self, page: Page) -> bool:
        """Whether a segment of ``page`` was updated in part or whole by a segment kernel."""
        return page.index in self._touched

    def reached(self, segment: Segment) -> int:
        """Elements of ``segment`` updated so far."""
        return self._reached.get(id(segment), 0)

    def reach(self, page: Page, segment: Segment, elements: int) -> None:
        self._reached[id(segment)] = elements
        self._touched.add(page.index)

    def finish(self, page: Page, segment: Segment) -> None:
        self.reach(page, segment, segment.length)
        self._finished.add(id(segment))

    def finished(self, segment: Segment) -> bool:
        return id(segment) in self._finished

    def finish_pages(self, pages: list[Page]) -> None:
        """Record that every segment of ``pages`` is updated (a batch kernel's call)."""
        self._pages_done.update(page.index for page in pages)

    def pages_left(self) -> list[Page]:
        """The plan's pages not updated in full, in order."""
        if not self._pages_done and not self._finished:
            return list(self.plan.pages)
        return [page for page in self.plan.pages if not self.page_done(page)]

    def any_touched(self) -> bool:
        """Whether a segment kernel has updated any segment (so that some pages may hold segments in part)."""
        return bool(self._touched)

    def page_done(self, page: Page) -> bool:
        if page.index in self._pages_done:
            return True
        return all(id(segment) in self._finished for _, segment in self.plan.page_segments[page.index])

    def _segment_done(self, page: Page, segment: Segment) -> bool:
        return page.index in self._pages_done or id(segment) in self._finished

    def _done_tensors(self) -> list[int]:
        if len(self._pages_done) == len(self.plan.pages):
            return list(range(len(self.plan.params)))
        return [
            index
            for index, segments in enumerate(self.plan.segments)
            if all(self._segment_done(page, segment) for page, segment in segments)
        ]

    def advance_step_counts(self) -> None:
        """Advance the step counts of the tensors updated in full (once)."""
        if self._advanced:
            return
        self._advanced = True
        done = self._done_tensors()
        for index in done:
            statistics = self.plan.statistics.get(index)
            if statistics is not None:
                statistics.commit()
        if done:
            torch._foreach_add_([self.step_counts[index] for index in done], 1.0)
            self.plan.record_steps(done, self.step_counts, self.steps)

    def describe(self, recoveries: int) -> str:
        """A note for an error that stops the step: what it updated, and what that means for the state."""
        done = set(self._done_tensors())
        started = sum(
            1
            for index, segments in enumerate(self.plan.segments)
            if index not in done
            and any(self._segment_done(page, segment) or self.reached(segment) for page, segment in segments)
        )
        if not done and not started:
            return stopped_before_any_update(recoveries)
        return (
            f"hf-paged: the optimizer step stopped{_after_recoveries(recoveries)} having updated {len(done)} of {len(self.plan.params)} "
            f"parameters in full (their step counts advanced) and {started} in part (whole chunks of elements; their "
            "step counts did not advance). Every chunk is either updated or as it was, but the optimizer is not at a "
            "step's end: resume from a checkpoint rather than go on training"
        )


def stopped_before_any_update(recoveries: int) -> str:
    """A note for an error that stops the step before it updated anything, after ``recoveries`` recoveries."""
    after = _after_recoveries(recoveries)
    return f"hf-paged: the optimizer step stopped{after} before updating any parameter; nothing changed"


def _after_recoveries(recoveries: int) -> str:
    return f" after {recoveries} recoveries from out-of-memory errors" if recoveries else ""


class StepRun:
    """One step over a plan: its step counts, scalars, gradients, work items and progress.

    Args:
        plan: the plan of this step.
        grads: the local gradient of each tensor of ``plan`` (any shape).
        states: the ``optimizer.state`` entry of each tensor of ``plan``.
        compiled: whether segment kernels run compiled.
    """

    def __init__(self, plan: StepPlan, grads: list[torch.Tensor], states: list[dict[str, Any]], compiled: bool) -> None:
        self.plan = plan
        self.parts = plan.parts
        self.grads = grads
        self.compiled = compiled
        for state in states:
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
        step_counts = [state["step"] for state in states]
        self.steps = plan.next_steps(step_counts)
        """Each tensor's step this step (its count + 1), as floats."""
        self.progress = StepProgress(plan, step_counts, self.steps)
        self.groups = [_read_once(group) for group in plan.distinct_groups]
        row_of: dict[tuple[int, float], int] = {}
        self.rows: list[int] = []
        """Each tensor's scalar row: its (group, step) pair's index in :attr:`row_keys`."""
        for group, step in zip(plan.group_of, self.steps):
            self.rows.append(row_of.setdefault((group, step), len(row_of)))
        self.row_keys = list(row_of)
        rule_scalars = self.parts.rule_scalars
        self._rule_scalars: list[dict[str, float]] = [
            rule_scalars(self.groups[group], step) for group, step in self.row_keys
        ]
        self._segment_scalars: dict[int, dict[str, float | torch.Tensor]] = {}
        self._scalar_tables: dict[tuple[tuple[str, ...], torch.device], torch.Tensor] = {}
        self._routes: dict[int, tuple[Any, bool | None, torch.device]] = {}
        """By the plan's index of a page format and device: its kernel, whether the multi-tensor kernel takes its
        pages, and the device of their buffers."""
        self._launches: dict[tuple[int, str], Any] = {}
        """By kernel (``id``) and device: its prepared launches begun for this step, ``None`` where it has none."""
        self._prepared_kinds: dict[int, tuple[Any, PageStore] | None] = {}
        """By the plan's index of a page format and device: see :meth:`_prepared`."""
        self._fast_verdicts: dict[tuple[int, torch.device, frozenset], bool] = {}
        self._batch_verdicts: dict[tuple[int, torch.device, tuple[torch.dtype, torch.dtype]], bool] = {}
        self.rounding_keys = _rounding_keys(plan, self.groups, self.steps)
        """The stochastic rounding keys of this step, by tensor index, of the bf16 tensors that round."""
        self.params = [local_tensor(param) for param in plan.params]
        """Each tensor's local elements (a DTensor's shard), as the step updates them."""
        devices = {(param.device, step) for param, step in zip(self.params, self.steps)}
        # Made once per step: a tensor built from a number on a device per page would wait for a host copy.
        self.step_tensors = {key: torch.full((), key[1], dtype=torch.float32, device=key[0]) for key in devices}
        self._flat_params: list[torch.Tensor | StridedElements | None] = [None] * len(plan.params)
        self._param_slices: list[list[torch.Tensor | StridedRange] | None] = [None] * len(plan.params)
        self._flat_grads: list[torch.Tensor | StridedElements | None] = [None] * len(plan.params)
        self._grad_slices: list[list[torch.Tensor | StridedRange] | None] = [None] * len(plan.params)
        self._strided = {
            index
            for index, (param, grad) in enumerate(zip(self.params, grads))
            if not grad.is_contiguous() or not param.is_contiguous()
        }
        self._dtypes = {(param.dtype, grad.dtype) for param, grad in zip(self.params, grads)}
        self._statistics_gathered = not plan.statistics

    # Per-tensor views ------------------------------------------------------------------------------------
    #
    # Made at most once per step, only for the segments that the multi-tensor and segment kernels update (a batch
    # kernel takes the tensors as they are), and dropped when the step ends (:meth:`release`): nothing keeps a
    # parameter's memory alive between steps.

    def flat_param(self, index: int) -> torch.Tensor | StridedElements:
        """Tensor ``index``'s local elements, flat (a view made once this step; a 1-D tensor as it is)."""
        flat = self._flat_params[index]
        if flat is None:
            local = self.params[index]
            flat = local if local.dim() == 1 and local.is_contiguous() else flat_elements(local)
            self._flat_params[index] = flat
        return flat

    def whole(self, index: int) -> bool:
        """Whether tensor ``index`` is one segment whose parameter and gradient are contiguous: its work item holds
        them as they are (no view), and its fp32 state views come in the parameter's shape."""
        return len(self.plan.segments[index]) == 1 and index not in self._strided

    def in_rows(self, index: int) -> bool:
        """Whether tensor ``index`` is in several segments of whole rows (slices along its first dimension, see
        :attr:`~hf_paged.optim.plan.StepPlan.row_splits`) and its parameter and gradient are contiguous: its work
        items hold one split of each (no flat view), and its fp32 state views come in the segments' shapes."""
        return index in self.plan.row_splits and index not in self._strided

    def param_slices(self, index: int) -> list[torch.Tensor | StridedRange]:
        """Tensor ``index``'s elements of each of its segments, in order."""
        slices = self._param_slices[index]
        if slices is None:
            if self.whole(index):
                slices = [self.params[index]]
            elif self.in_rows(index):
                slices = list(self.params[index].split(self.plan.row_splits[index]))
            else:
                segments = [segment for _, segment in self.plan.segments[index]]
                slices = segment_slices(self.flat_param(index), segments)
            self._param_slices[index] = slices
        return slices

    def state_views(self, page: Page, segment: Segment) -> tuple[Any, ...]:
        """The views of ``segment``'s state (the plan's, kept while the page is resident), fp32 values in the shape
        its work item's parameter has: the parameter's of a :meth:`whole` tensor, the segment's rows of one
        :meth:`in_rows`."""
        index = self.plan.tensor_index(segment)
        shape = None
        if self.whole(index):
            shape = self.params[index].shape
            if len(shape) == 1:
                shape = None
        elif self.in_rows(index):
            shape = self.params[index].shape
            shape = torch.Size((segment.length // (shape.numel() // shape[0]), *shape[1:]))
        return self.plan.state_views(page, segment, shape)

    def release(self) -> None:
        """Drop this step's views of the parameters and gradients (at the step's end, whether it raised or not)."""
        for views in (self._flat_params, self._param_slices, self._flat_grads, self._grad_slices):
            views[:] = [None] * len(views)

    def flat_grad(self, index: int) -> torch.Tensor | StridedElements:
        """Tensor ``index``'s gradient, flat (a view made once this step; a 1-D gradient as it is)."""
        flat = self._flat_grads[index]
        if flat is None:
            grad = self.grads[index]
            flat = grad if grad.dim() == 1 and grad.is_contiguous() else flat_elements(grad)
            self._flat_grads[index] = flat
        return flat

    def grad_slices(self, index: int) -> list[torch.Tensor | StridedRange]:
        """Tensor ``index``'s gradient elements of each of its segments, in order."""
        slices = self._grad_slices[index]
        if slices is None:
            if self.whole(index):
                slices = [self.grads[index]]
            elif self.in_rows(index):
                slices = list(self.grads[index].split(self.plan.row_splits[index]))
            else:
                segments = [segment for _, segment in self.plan.segments[index]]
                slices = segment_slices(self.flat_grad(index), segments)
            self._grad_slices[index] = slices
        return slices

    def items(self, page: Page) -> list[WorkItem]:
        """The work items of ``page``'s segments that are not finished."""
        items = []
        for index, segment in self.plan.page_segments[page.index]:
            if self.progress.finished(segment):
                continue
            position = self.plan.position(segment)
            param_slice = self.param_slices(index)[position]
            grad_slice = self.grad_slices(index)[position]
            group = self.groups[self.plan.group_of[index]]
            items.append((segment, param_slice, grad_slice, self.steps[index], group))
        return items

    def segment_scalars(self, index: int) -> dict[str, float | torch.Tensor]:
        """The rule's scalars of tensor ``index`` as a segment kernel takes them (made once per group and step)."""
        row = self.rows[index]
        scalars = self._segment_scalars.get(row)
        if scalars is None:
            scalars = prepare_scalars(self._rule_scalars[row], self.compiled)
            self._segment_scalars[row] = scalars
        return scalars

    def scalar_table(self, names: tuple[str, ...], device: torch.device, backend: HostToDevice) -> torch.Tensor:
        """The rules' scalars of this step's rows in ``names`` order, fp32 on ``device`` (made once per step; copied
        there by ``backend``)."""
        key = (names, device)
        table = self._scalar_tables.get(key)
        if table is None:
            values = [[scalars[name] for name in names] for scalars in self._rule_scalars]
            table = torch.tensor(values, dtype=torch.float32)
            if not names:
                table = table.reshape(len(values), 0)
            if device.type != "cpu":
                table = _to_device(backend, table)
            self._scalar_tables[key] = table
        return table

    def has_strided(self, page: Page) -> bool:
        """Whether ``page`` holds a segment of a non-contiguous parameter or gradient (updated through a copy)."""
        return bool(self._strided) and any(index in self._strided for index in self.plan.page_tensors[page.index])

    # Rank-1 statistics ------------------------------------------------------------------------------------

    def gather_statistics(self) -> None:
        """Gather the rank-1 statistics of the states this step computes, for the tensors whose state is rank-1
        normalized: their pages are streamed through the devices and read (not written) a chunk at a time, each
        chunk's state decoded and advanced by the optimizer's :meth:`~hf_paged.optim.base.PagedOptimizer.moments_rule`
        as the update will advance it. Once per step, before any update: a rank-1 state is encoded with the
        statistics of the whole new state, which no page alone knows. Each call that does not complete starts over
        (an out-of-memory recovery calls it again)."""
        if self._statistics_gathered:
            return
        moments = self.parts.moments_rule
        # every tensor's next maxima zeroed in one call: a call per buffer would be four operator calls per tensor
        torch._foreach_zero_(
            [maxima for statistics in self.plan.statistics.values() for maxima in statistics.next_maxima]
        )
        pages = [
            page
            for page in self.plan.pages
            if any(index in self.plan.statistics for index in self.plan.page_tensors[page.index])
        ]
        with contextlib.closing(self.plan.stores.stream(pages)) as batches:
            for batch in batches:
                by_kernel: dict[int, tuple[Any, list[Page]]] = {}
                for page in batch:
                    kernel = self.route(page)[0]
                    if hasattr(kernel, "gather_batch") and self._takes_batch(kernel, page):
                        by_kernel.setdefault(id(kernel), (kernel, []))[1].append(page)
                        continue
                    arrays = page.format.arrays(page.device)
                    for index, segment in self.plan.page_segments[page.index]:
                        grad = self.grad_slices(index)[self.plan.position(segment)]
                        if isinstance(grad, StridedRange):
                            grad = grad.gather()
                        scalars = self._rule_scalars[self.rows[index]]
                        statistics = self.plan.statistics[index]
                        chunk = self.parts.chunk_elements(page.format, False)
                        gather_segment_statistics(moments, page, arrays, segment, grad, scalars, statistics, chunk)
                for kernel, batch_pages in by_kernel.values():
                    launches = self.launches(kernel, batch_pages[0])
                    if launches is None:
                        kernel.gather_batch(self.page_batch(kernel, batch_pages))
                    else:
                        launches.gather(batch_pages, self.plan.stores.store_of(batch_pages[0]).generation)
        self._statistics_gathered = True

    # Updates ---------------------------------------------------------------------------------------------

    def stream(self, pages: list[Page]) -> None:
        """Stream ``pages`` through the devices and update them, after the step's rank-1 statistics are gathered; on
        an error, no page is left in flight."""
        self.gather_statistics()
        with contextlib.closing(self.plan.stores.stream(pages)) as batches:
            for batch in batches:
                if not self._strided:
                    self.update_pages(batch)
                    continue
                # Pages of non-contiguous parameters are updated one at a time: their contiguous copies stay within
                # one page's share of the parameters, however many pages are resident.
                whole = [page for page in batch if not self.has_strided(page)]
                one_by_one = [[page] for page in batch if self.has_strided(page)]
                for pages_at_once in ([whole] if whole else []) + one_by_one:
                    self.update_pages(pages_at_once)

    def update_pages(self, pages: list[Page]) -> None:
        """Update the segments of resident ``pages`` that are not finished: a multi-tensor kernel where the
        optimizer has one (it allocates nothing, so each of its calls updates its segments whole), then one call of
        a batch kernel per page format where the kernel takes batches, else segment by segment, chunk by chunk,
        each chunk whole or not at all. A non-contiguous parameter's copy is written back after each segment's
        update, whether it finished or not."""
        by_kind: dict[int, list[Page]] = {}
        kind_of = self.plan.page_kind
        for page in pages:
            by_kind.setdefault(kind_of[page.index], []).append(page)
        if len(self._dtypes) == 1 and not self._strided and not self.progress.any_touched():
            prepared = [self._prepared(kind, kind_pages[0]) for kind, kind_pages in by_kind.items()]
            if None not in prepared:
                for (launches, store), kind_pages in zip(prepared, by_kind.values()):
                    launches.update(kind_pages, store.generation)
                    self.progress.finish_pages(kind_pages)
                return
        gathered: dict[int, list[tuple[WorkItem, StridedRange | None]]] = {}
        page_of: dict[int, Page] = {}
        strided_of: dict[int, StridedRange | None] = {}

        def gather(page: Page) -> list[tuple[WorkItem, StridedRange | None]]:
            if page.index not in gathered:
                gathered[page.index] = [_gathered(item) for item in self.items(page)]
                for item, strided in gathered[page.index]:
                    page_of[id(item[0])], strided_of[id(item[0])] = page, strided
            return gathered[page.index]

        def finished(items: list[WorkItem]) -> None:
            for segment, param_slice, *_ in items:
                if strided_of[id(segment)] is not None:
                    strided_of[id(segment)].scatter(param_slice)
                self.progress.finish(page_of[id(segment)], segment)

        fast: list[Page] = []
        for kind, kind_pages in list(by_kind.items()):
            verdict = self.route(kind_pages[0])[1]
            if verdict is None:
                verdicts = [self.takes_pages_fast(page) for page in kind_pages]
                fast += [page for page, taken in zip(kind_pages, verdicts) if taken]
                by_kind[kind] = [page for page, taken in zip(kind_pages, verdicts) if not taken]
            elif verdict:
                fast += kind_pages
                del by_kind[kind]
        if fast:
            batch = [(page, [item for item, _ in gather(page)]) for page in fast if gather(page)]
            for page, _ in self.parts.update_pages_fast(batch, self.step_tensors, finished, self.state_views):
                by_kind.setdefault(kind_of[page.index], []).append(page)
        segment_pages = []
        for kind_pages in by_kind.values():
            if not kind_pages:
                continue
            kernel = self.route(kind_pages[0])[0]
            batched, one_by_one = self._batchable(kernel, kind_pages)
            if batched:
                self.update_batch(kernel, batched)
            segment_pages += [(kernel, page) for page in one_by_one]
        for kernel, page in segment_pages:
            arrays = page.format.arrays(page.device)
            chunk = self.parts.chunk_elements(page.format, kernel.compiled)
            for (segment, param_slice, grad_slice, _, _), strided in gather(page):
                index = self.plan.tensor_index(segment)
                try:
                    update_segment(
                        kernel,
                        page,
                        arrays,
                        segment,
                        param_slice,
                        grad_slice,
                        self.segment_scalars(index),
                        self.progress,
                        chunk,
                        self.rounding_keys.get(index),
                        self.plan.statistics.get(index),
                    )
                finally:
                    if strided is not None:
                        strided.scatter(param_slice)

    def _prepared(self, kind: int, page: Page) -> tuple[Any, PageStore] | None:
        """In a step of one dtype pair with no segment updated in part: the prepared launches that update the pages of
        ``kind`` (``page``'s format and device) in batches, and their store; ``None`` where those pages go another
        way (asked once per step for each kind)."""
        if kind in self._prepared_kinds:
            return self._prepared_kinds[kind]
        kernel, fast, _ = self.route(page)
        prepared = None
        if not fast and self._batchable(kernel, [page])[0]:
            launches = self.launches(kernel, page)
            if launches is not None:
                prepared = (launches, self.plan.stores.store_of(page))
        self._prepared_kinds[kind] = prepared
        return prepared

    def route(self, page: Page) -> tuple[Any, bool | None, torch.device]:
        """The kernel of ``page``'s format and device (the optimizer's choice), whether the optimizer's multi-tensor
        kernel takes pages of them (``None`` where the step has tensors of several dtypes: asked per set of dtypes),
        and the device of their buffers: asked once per step for each format and device."""
        kind = self.plan.page_kind[page.index]
        route = self._routes.get(kind)
        if route is None:
            device = page.device[0].device
            kernel = self.parts.kernel(page.format, device, self.compiled)
            fast = self.parts.takes_pages_fast(page, self._dtypes) if len(self._dtypes) == 1 else None
            route = self._routes[kind] = (kernel, fast, device)
        return route

    def launches(self, kernel: Any, page: Page) -> Any:
        """``kernel``'s prepared launches over the plan's pages of ``page``'s format and device, begun for this step
        (once), or ``None`` for a kernel without them (see :meth:`~hf_paged.optim.plan.StepPlan.launches`)."""
        device = self.plan.kinds[self.plan.page_kind[page.index]][1]
        key = (id(kernel), device)
        if key in self._launches:
            return self._launches[key]
        launches = self.plan.launches(kernel, device)
        if launches is not None:
            launches.begin_step(
                self.params,
                self.grads,
                self.rows,
                self._rule_scalars,
                self.rounding_keys,
                {index: statistics.batch_entry() for index, statistics in self.plan.statistics.items()},
            )
        self._launches[key] = launches  # once begun: an error while beginning leaves it to the next attempt
        return launches

    def takes_pages_fast(self, page: Page) -> bool:
        """Whether the optimizer's multi-tensor kernel takes ``page`` (asked once per step for each page format,
        device and set of dtypes)."""
        if len(self._dtypes) == 1:
            return self.route(page)[1]
        dtypes = self.page_dtypes(page)
        key = (id(page.format), self.route(page)[2], frozenset(dtypes))
        verdict = self._fast_verdicts.get(key)
        if verdict is None:
            verdict = self._fast_verdicts[key] = self.parts.takes_pages_fast(page, dtypes)
        return verdict

    def _batch_verdict(self, kernel: Any, device: torch.device, dtypes: tuple[torch.dtype, torch.dtype]) -> bool:
        key = (id(kernel), device, dtypes)
        verdict = self._batch_verdicts.get(key)
        if verdict is None:
            verdict = self._batch_verdicts[key] = kernel.takes_batch(device, *dtypes)
        return verdict

    def _batchable(self, kernel: Any, pages: list[Page]) -> tuple[list[Page], list[Page]]:
        """``pages`` (of one format and device) split into those ``kernel`` updates in a batch and the others (see
        :meth:`_takes_batch`): no question per page in a step of one dtype pair, no copies and no segment kernel."""
        if not hasattr(kernel, "takes_batch"):
            return [], pages
        if len(self._dtypes) == 1 and not self._strided and not self.progress.any_touched():
            dtypes = next(iter(self._dtypes))
            return (pages, []) if self._batch_verdict(kernel, self.route(pages[0])[2], dtypes) else ([], pages)
        verdicts = [self._takes_batch(kernel, page) for page in pages]
        return (
            [page for page, taken in zip(pages, verdicts) if taken],
            [page for page, taken in zip(pages, verdicts) if not taken],
        )

    def _takes_batch(self, kernel: Any, page: Page) -> bool:
        """Whether ``kernel`` updates ``page`` in a batch: it takes batches of every parameter and gradient dtype on
        the page (asked once per step for each kernel, device and dtypes), none of them goes through a copy, and no
        segment of it was updated by a segment kernel."""
        if not hasattr(kernel, "takes_batch") or self.progress.touched(page) or self.has_strided(page):
            return False
        device = self.route(page)[2]
        return all(self._batch_verdict(kernel, device, dtypes) for dtypes in self.page_dtypes(page))

    def page_dtypes(self, page: Page) -> set[tuple[torch.dtype, torch.dtype]]:
        """The parameter and gradient dtypes of the tensors with segments on ``page``."""
        if len(self._dtypes) == 1:
            return self._dtypes
        return {(self.params[index].dtype, self.grads[index].dtype) for index in self.plan.page_tensors[page.index]}

    def update_batch(self, kernel: Any, pages: list[Page]) -> None:
        """One call of ``kernel``'s ``update_batch`` (or of its prepared launches) for every segment of ``pages`` (one
        format, one device): whole or, where it raises, not at all."""
        launches = self.launches(kernel, pages[0])
        if launches is None:
            kernel.update_batch(self.page_batch(kernel, pages))
        else:
            launches.update(pages, self.plan.stores.store_of(pages[0]).generation)
        self.progress.finish_pages(pages)

    def page_batch(self, kernel: Any, pages: list[Page]) -> PageBatch:
        """The :class:`~hf_paged.kernels.batch.PageBatch` of every segment of ``pages`` (one format, one device) for
        ``kernel``."""
        device = kernel.table_device(self.route(pages[0])[2])
        backend = self.plan.stores.store_of(pages[0]).backend
        table, tensors = self.plan.batch_table(pages, self.rows)
        rounding = self.plan.rounding_table(pages, self.plan.page_segments, self.rounding_keys)
        if device.type != "cpu":
            table = _to_device(backend, table)
            rounding = None if rounding is None else _to_device(backend, rounding)
        statistics = None
        if isinstance(pages[0].format.codecs[0], Rank1Normalized4bitCodec):
            statistics = [self.plan.statistics[index].batch_entry() for index in tensors]
        return PageBatch(
            params=[self.params[index] for index in tensors],
            grads=[self.grads[index] for index in tensors],
            buffers=[page.device for page in pages],
            table=table,
            scalars=self.scalar_table(tuple(kernel.scalar_names), device, backend),
            rounding=rounding,
            statistics=statistics,
        )


def _to_device(backend: HostToDevice, host: torch.Tensor) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``backend``'s device, through pinned memory: the host does not wait."""
    pinned = backend.pinned_empty(host.shape, host.dtype)
    pinned.copy_(host)
    return backend.to_device(pinned)


_NUMBERS = ("lr", "eps", "weight_decay", "alpha")
"""The numeric hyperparameters of a group that a step reads (with each of ``betas``)."""


def _read_once(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` as one step reads it: its numbers as Python floats, read here once per step. A tensor ``lr`` (as
    schedulers keep it for capturable optimizers) is read once: reading a device tensor waits for the device, and each
    page reading it would stall the host and stop page copies from overlapping the updates. A NumPy number (a
    scheduler computed in NumPy) would carry its own precision into the rule's scalars."""
    read = {key: float(group[key]) for key in _NUMBERS if key in group and type(group[key]) is not float}
    betas = group.get("betas")
    if betas is not None and any(type(beta) is not float for beta in betas):
        read["betas"] = tuple(float(beta) for beta in betas)
    return {**group, **read} if read else group


def _rounding_keys(plan: StepPlan, groups: list[dict[str, Any]], steps: list[float]) -> dict[int, tuple[int, int]]:
    """The stochastic rounding keys of this step, by tensor index, of each bf16 tensor whose group sets
    ``bf16_stochastic_round``: from the group's ``stochastic_round_seed``, the tensor's position in its group and
    the step (see :mod:`hf_paged.stochastic_rounding`)."""
    keys: dict[int, tuple[int, int]] = {}
    positions: dict[int, dict[int, int]] = {}
    for index, (param, group_index) in enumerate(zip(plan.params, plan.group_of)):
        group = groups[group_index]
        if not group.get("bf16_stochastic_round", False) or local_tensor(param).dtype != torch.bfloat16:
            continue
        if group_index not in positions:
            positions[group_index] = {id(tensor): position for position, tensor in enumerate(group["params"])}
        seed = parameter_seed(group.get("stochastic_round_seed", 0), positions[group_index][id(param)])
        keys[index] = step_keys(seed, int(steps[index]))
    return keys


def _gathered(item: WorkItem) -> tuple[WorkItem, StridedRange | None]:
    """A work item with its range of a non-contiguous parameter or gradient copied to a contiguous tensor, and
    the parameter's range to write the copy back to after the update (``None`` for a contiguous parameter)."""
    segment, param_slice, grad_slice, *rest = item
    strided = None
    if isinstance(param_slice, StridedRange):
        strided, param_slice = param_slice, param_slice.gather()
    if isinstance(grad_slice, StridedRange):
        grad_slice = grad_slice.gather()
    return (segment, param_slice, grad_slice, *rest), strided


def update_whole(
    kernel: SegmentKernel,
    param: torch.Tensor,
    grad: torch.Tensor,
    encoded: list[tuple[torch.Tensor, ...]],
    scalars: dict[str, float | torch.Tensor],
    rounding: ElementRounding | None,
) -> None:
    """Run ``kernel`` so that it updates ``param`` and the ``encoded`` state whole or not at all.

    A kernel may allocate temporaries after it has written some of its outputs (an eager update writes the
    parameter, then encodes the state; a compiled one allocates between its kernels), so an out-of-memory error
    could stop it half way. Unless the kernel says it allocates nothing after its first write
    (``writes_after_allocating``), what it writes is copied first and copied back if it fails: the copies are
    allocated before anything is written, and putting them back allocates nothing.
    """
    if getattr(kernel, "writes_after_allocating", False):
        kernel(param, grad, encoded, scalars, *(() if rounding is None else (rounding,)))
        return
    update_or_undo(kernel, param, grad, encoded, scalars, rounding)


def update_aligned(
    kernel: SegmentKernel,
    param: torch.Tensor,
    grad: torch.Tensor,
    encoded: list[tuple[torch.Tensor, ...]],
    scalars: dict[str, float | torch.Tensor],
    rounding: ElementRounding | None,
) -> None:
    """:func:`update_whole` with each ``encoded`` array that does not start at a 16-byte boundary (a chunk's scales,
    4 bytes a block, where the chunk does not start at every fourth block) replaced by an aligned copy, written back
    once the update succeeded: a compiled kernel assumes aligned inputs."""
    copies = []
    aligned = []
    for arrays in encoded:
        aligned_arrays = []
        for array in arrays:
            if array.data_ptr() % ADDRESS_ALIGNMENT:
                copies.append((array, array.clone()))
                array = copies[-1][1]
            aligned_arrays.append(array)
        aligned.append(tuple(aligned_arrays))
    update_whole(kernel, param, grad, aligned, scalars, rounding)
    for array, copy_of_array in copies:
        array.copy_(copy_of_array)


def update_segment(
    kernel: SegmentKernel,
    page: Page,
    arrays: list[tuple[torch.Tensor, ...]],
    segment: Segment,
    param: torch.Tensor,
    grad: torch.Tensor,
    scalars: dict[str, float | torch.Tensor],
    progress: StepProgress,
    chunk_elements: int,
    keys: tuple[int, int] | None = None,
    statistics: Rank1Statistics | None = None,
) -> None:
    """Run ``kernel`` on the elements of a segment that ``progress`` has not reached: its whole blocks in place,
    chunk by chunk (``chunk_elements`` at a time, or in one call where the kernel allocates nothing), each chunk
    whole or not at all; a partial
    last block through padded copies. With stochastic rounding ``keys``, each chunk rounds its bf16 elements by
    their index in the parameter. ``param`` and ``grad`` are the segment's elements (flat, or the whole tensors of
    a tensor in one segment, read in their flat order). A rank-1 normalized state's ``statistics`` give each chunk
    its normalizers (see :class:`~hf_paged.codecs.Rank1Statistics`).

    Every tensor the kernel takes starts at a 16-byte boundary: the layout aligns the parameter, gradient, values
    and codes of each chunk (see :class:`~hf_paged.codecs.PageFormat`), and scales that start elsewhere go
    through an aligned copy."""
    if param.dim() != 1:  # a tensor in one segment comes as it is
        param = param.view(-1)
    if grad.dim() != 1:
        grad = grad.view(-1)
    codecs = page.format.codecs
    alignment = page.format.alignment
    body = segment.length - segment.length % alignment
    chunk = max(alignment, body) if kernel.allocates_nothing(param, grad) else chunk_elements
    for start in range(progress.reached(segment), body, chunk):
        end = min(start + chunk, body)
        encoded = [codec.select(array, segment.offset + start, end - start) for codec, array in zip(codecs, arrays)]
        if statistics is not None:
            encoded = statistics.attach(encoded, segment.start + start, end - start, alignment)
        param_chunk, grad_chunk = to_blocks(param[start:end], alignment), to_blocks(grad[start:end], alignment)
        rounding = None if keys is None else ElementRounding(*keys, segment.start + start)
        update_aligned(kernel, param_chunk, grad_chunk, encoded, scalars, rounding)
        progress.reach(page, segment, end)
    if body < segment.length:
        tail = segment.length - body
        encoded = [codec.select(array, segment.offset + body, tail) for codec, array in zip(codecs, arrays)]
        if statistics is not None:
            encoded = statistics.attach(encoded, segment.start + body, tail, alignment)
        padded = to_blocks(param[body:], alignment)
        rounding = None if keys is None else ElementRounding(*keys, segment.start + body)
        update_aligned(kernel, padded, to_blocks(grad[body:], alignment), encoded, scalars, rounding)
        param[body:].copy_(padded.view(-1)[:tail])
    progress.finish(page, segment)


def gather_segment_statistics(
    moments: Callable[..., None],
    page: Page,
    arrays: list[tuple[torch.Tensor, ...]],
    segment: Segment,
    grad: torch.Tensor,
    scalars: dict[str, float],
    statistics: Rank1Statistics,
    chunk: int,
) -> None:
    """Take the rank-1 statistics of the states a step computes for ``segment`` (flat gradient elements ``grad``)
    into ``statistics``, ``chunk`` elements at a time, writing nothing but them."""
    if grad.dim() != 1:
        grad = grad.view(-1)
    codecs = page.format.codecs
    alignment = page.format.alignment
    for start in range(0, segment.length, chunk):
        end = min(start + chunk, segment.length)
        first = segment.start + start
        encoded = [codec.select(array, segment.offset + start, end - start) for codec, array in zip(codecs, arrays)]
        encoded = statistics.attach(encoded, first, end - start, alignment, gathering=True)
        states = [codec.decode(segment_arrays) for codec, segment_arrays in zip(codecs, encoded)]
        moments(to_blocks(grad[start:end], alignment).float(), *states, **scalars)
        for state, values in enumerate(states):
            statistics.observe(state, first, values)


def recover_in_step(
    stores: DeviceStores,
    error: RuntimeError,
    attempt: int,
    retries: int,
    pages_left: int,
    on_oom_recovery: Callable[[Recovery], None] | None,
) -> None:
    """After an out-of-memory error in the step: give the state back to the host, free cached memory and lower
    each device's budget for the rest of the step (halved, and one page at the last of ``retries``)."""
    traceback.clear_frames(error.__traceback__)  # the failed chunk's temporaries
    held = {device: store.device_bytes for device, store in stores.stores.items()}
    evicted = stores.evict()
    last = attempt >= retries
    for device, store in stores.stores.items():
        empty_device_cache(torch.device(device))
        budget = held[device] if store.device_budget is None else min(store.device_budget, held[device])
        store.set_budget(store.max_page_bytes if last else max(store.max_page_bytes, budget // 2))
    devices = list(stores.stores)
    ran_out = device_out_of_memory(error, devices) or devices[0]
    recovery = Recovery(
        step=None,
        micro_batch=None,
        micro_batches_replayed=0,
        attempt=attempt,
        state_bytes_evicted=evicted,
        other_bytes=max(0, probe_for(torch.device(ran_out)).allocated() - stores.stores[ran_out].device_bytes),
        error=error,
        phase="optimizer step",
    )
    logger.warning(
        "hf-paged: out of memory in the optimizer step; moved %s of optimizer state to the host, freed cached "
        "memory, updating the %d page(s) left under a budget of %s (retry %d of %d)",
        format_size(evicted),
        pages_left,
        format_size(stores.device_budget or 0),
        attempt,
        retries,
    )
    if on_oom_recovery is not None:
        on_oom_recovery(recovery)
