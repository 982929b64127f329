"""The step's executor: it streams the pages of a :class:`~hf_paged.optim.plan.StepPlan` through the devices and
updates them, keeps track of how far the step got, keeps every update whole or undone, and recovers from an
out-of-memory error inside the step.

For each batch of resident pages of one page format, a kernel that takes batches
(:mod:`hf_paged.kernels.batch`) updates all their segments in one call; others update segment by segment, in chunks
that each update whole or not at all. :class:`~hf_paged.optim.adamw.PagedAdamW`'s fp32 parameters with fp32 state
take PyTorch's fused AdamW first (``update_pages_fast``).
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..codecs import ADDRESS_ALIGNMENT, Rank1Normalized4bitCodec, Rank1Statistics, to_blocks
from ..kernels import SegmentKernel, prepare_scalars, update_or_undo
from ..kernels.batch import PageBatch
from ..memory import probe_for
from ..recovery import Recovery, device_out_of_memory, empty_device_cache, is_out_of_memory
from ..sizes import format_size
from ..stochastic_rounding import ElementRounding, parameter_seed, step_keys
from ..store import Page, Segment
from ._params import StridedElements, StridedRange, flat_elements
from .layout import local_tensor
from .plan import StepPlan, segment_slices

if TYPE_CHECKING:
    from .base import PagedOptimizer

logger = logging.getLogger(__name__)

WorkItem = tuple[Segment, torch.Tensor, torch.Tensor, float, dict[str, Any]]
"""One segment's update in a step: the segment, its parameter and gradient elements (flat views; for a contiguous
tensor in one segment, the parameter and gradient as they are, any shape), the step, the group (as the step reads
it: a copy with a tensor ``lr`` read as a float, once per step)."""

StateViews = Callable[[Page, Segment], tuple[Any, ...]]
"""The views of a segment's state in its page's device buffers, one encoded segment per codec."""


def run_step(optimizer: PagedOptimizer, plan: StepPlan, grads: list[torch.Tensor], compiled: bool) -> None:
    """Update the tensors of ``plan`` with their local gradients ``grads``: every page, through
    ``optimizer._stream_pages``, retrying after an out-of-memory error (``optimizer.oom_retries`` times) with the
    pages left under a smaller budget. The step counts of the tensors updated in full advance, even when the step
    stops part way."""
    run = StepRun(optimizer, plan, grads, compiled)
    budgets = {device: store.device_budget for device, store in optimizer._store.stores.items()}
    recoveries = 0
    try:
        if optimizer._auto_budgets:
            optimizer._begin_auto_step()
        while True:
            pages = [page for page in plan.pages if not run.progress.page_done(page)]
            if not pages:
                break
            try:
                optimizer._stream_pages(pages, run)
            except RuntimeError as error:  # torch.OutOfMemoryError is one
                if not is_out_of_memory(error) or recoveries >= optimizer.oom_retries:
                    error.add_note(run.progress.describe(recoveries))
                    raise
                recoveries += 1
                recover_in_step(optimizer, error, recoveries, len(pages))
                del error
    finally:
        run.release()
        run.progress.advance_step_counts()
        if recoveries:
            for device, budget in budgets.items():
                if device not in optimizer._auto_budgets:
                    optimizer._store.stores[device].set_budget(budget)
        if optimizer._auto_budgets:  # after a step that raised too: a loop that goes on gets the forward's budget
            optimizer._end_auto_step()


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
        after = f" after {recoveries} recoveries from out-of-memory errors" if recoveries else ""
        if not done and not started:
            return f"hf-paged: the optimizer step stopped{after} before updating any parameter; nothing changed"
        return (
            f"hf-paged: the optimizer step stopped{after} having updated {len(done)} of {len(self.plan.params)} "
            f"parameters in full (their step counts advanced) and {started} in part (whole chunks of elements; their "
            "step counts did not advance). Every chunk is either updated or as it was, but the optimizer is not at a "
            "step's end: resume from a checkpoint rather than go on training"
        )


class StepRun:
    """One step over a plan: its step counts, scalars, gradients, work items and progress.

    Args:
        optimizer: the optimizer stepping.
        plan: its plan for this step.
        grads: the local gradient of each tensor of ``plan`` (any shape).
        compiled: whether segment kernels run compiled.
    """

    def __init__(self, optimizer: PagedOptimizer, plan: StepPlan, grads: list[torch.Tensor], compiled: bool) -> None:
        self.optimizer = optimizer
        self.plan = plan
        self.grads = grads
        self.compiled = compiled
        states = [optimizer.state[param] for param in plan.params]
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
        self._rule_scalars: list[dict[str, float]] = [
            optimizer.rule_scalars(self.groups[group], step) for group, step in self.row_keys
        ]
        self._segment_scalars: dict[int, dict[str, float | torch.Tensor]] = {}
        self._scalar_tables: dict[tuple[tuple[str, ...], torch.device], torch.Tensor] = {}
        self._kernels: dict[tuple[int, torch.device], Any] = {}
        """Each page format's kernel by device, the formats by ``id`` (the pages hold them through the step)."""
        self._fast_verdicts: dict[tuple[int, torch.device, frozenset], bool] = {}
        self._batch_verdicts: dict[tuple[int, torch.device, tuple[torch.dtype, torch.dtype]], bool] = {}
        self.rounding_keys = _rounding_keys(plan, self.groups, self.steps)
        """The stochastic rounding keys of this step, by tensor index, of the bf16 tensors that round."""
        devices = {(local_tensor(param).device, step) for param, step in zip(plan.params, self.steps)}
        # Made once per step: a tensor built from a number on a device per page would wait for a host copy.
        self.step_tensors = {key: torch.full((), key[1], dtype=torch.float32, device=key[0]) for key in devices}
        self._flat_params: list[torch.Tensor | StridedElements | None] = [None] * len(plan.params)
        self._param_slices: list[list[torch.Tensor | StridedRange] | None] = [None] * len(plan.params)
        self._flat_grads: list[torch.Tensor | StridedElements | None] = [None] * len(plan.params)
        self._grad_slices: list[list[torch.Tensor | StridedRange] | None] = [None] * len(plan.params)
        self._strided = {
            index
            for index, (param, grad) in enumerate(zip(plan.params, grads))
            if not grad.is_contiguous() or not local_tensor(param).is_contiguous()
        }
        self._dtypes = {(local_tensor(param).dtype, grad.dtype) for param, grad in zip(plan.params, grads)}
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
            local = local_tensor(self.plan.params[index])
            flat = local if local.dim() == 1 and local.is_contiguous() else flat_elements(local)
            self._flat_params[index] = flat
        return flat

    def whole(self, index: int) -> bool:
        """Whether tensor ``index`` is one segment whose parameter and gradient are contiguous: its work item holds
        them as they are (no view), and its fp32 state views come in the parameter's shape."""
        return len(self.plan.segments[index]) == 1 and index not in self._strided

    def param_slices(self, index: int) -> list[torch.Tensor | StridedRange]:
        """Tensor ``index``'s elements of each of its segments, in order."""
        slices = self._param_slices[index]
        if slices is None:
            if self.whole(index):
                slices = [local_tensor(self.plan.params[index])]
            else:
                segments = [segment for _, segment in self.plan.segments[index]]
                slices = segment_slices(self.flat_param(index), segments)
            self._param_slices[index] = slices
        return slices

    def state_views(self, page: Page, segment: Segment) -> tuple[Any, ...]:
        """The views of ``segment``'s state (the plan's, kept while the page is resident), fp32 values in the shape
        of the parameter of a :meth:`whole` tensor, as its work item holds it."""
        index = self.plan.tensor_index(segment)
        shape = None
        if self.whole(index):
            shape = local_tensor(self.plan.params[index]).shape
            if len(shape) == 1:
                shape = None
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

    def scalar_table(self, names: tuple[str, ...], device: torch.device) -> torch.Tensor:
        """The rules' scalars of this step's rows in ``names`` order, fp32 on ``device`` (made once per step)."""
        key = (names, device)
        table = self._scalar_tables.get(key)
        if table is None:
            values = [[scalars[name] for name in names] for scalars in self._rule_scalars]
            table = torch.tensor(values, dtype=torch.float32)
            if not names:
                table = table.reshape(len(values), 0)
            if device.type != "cpu":
                table = table.to(device)
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
        moments = self.optimizer.moments_rule()
        # every tensor's next maxima zeroed in one call: a call per buffer would be four operator calls per tensor
        torch._foreach_zero_(
            [maxima for statistics in self.plan.statistics.values() for maxima in statistics.next_maxima]
        )
        pages = [
            page
            for page in self.plan.pages
            if any(index in self.plan.statistics for index in self.plan.page_tensors[page.index])
        ]
        with contextlib.closing(self.optimizer._store.stream(pages)) as batches:
            for batch in batches:
                by_kernel: dict[int, tuple[Any, list[Page]]] = {}
                for page in batch:
                    kernel = self.kernel(page)
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
                        gather_segment_statistics(
                            self.optimizer, moments, page, arrays, segment, grad, scalars, statistics
                        )
                for kernel, batch_pages in by_kernel.values():
                    kernel.gather_batch(self.page_batch(kernel, batch_pages))
        self._statistics_gathered = True

    # Updates ---------------------------------------------------------------------------------------------

    def stream(self, pages: list[Page]) -> None:
        """Stream ``pages`` through the devices and update them, after the step's rank-1 statistics are gathered; on
        an error, no page is left in flight."""
        self.gather_statistics()
        with contextlib.closing(self.optimizer._store.stream(pages)) as batches:
            for batch in batches:
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

        fast = [page for page in pages if self.takes_pages_fast(page)]
        batch = [(page, [item for item, _ in gather(page)]) for page in fast if gather(page)]
        left = [
            page for page, _ in self.optimizer.update_pages_fast(batch, self.step_tensors, finished, self.state_views)
        ]
        taken = {page.index for page in fast}
        left += [page for page in pages if page.index not in taken]
        by_kernel: dict[int, tuple[Any, list[Page]]] = {}
        segment_pages = []
        for page in left:
            kernel = self.kernel(page)
            if self._takes_batch(kernel, page):
                by_kernel.setdefault(id(kernel), (kernel, []))[1].append(page)
            else:
                segment_pages.append((kernel, page))
        for kernel, batch_pages in by_kernel.values():
            self.update_batch(kernel, batch_pages)
        for kernel, page in segment_pages:
            arrays = page.format.arrays(page.device)
            for (segment, param_slice, grad_slice, _, _), strided in gather(page):
                index = self.plan.tensor_index(segment)
                try:
                    update_segment(
                        self.optimizer,
                        kernel,
                        page,
                        arrays,
                        segment,
                        param_slice,
                        grad_slice,
                        self.segment_scalars(index),
                        self.progress,
                        self.rounding_keys.get(index),
                        self.plan.statistics.get(index),
                    )
                finally:
                    if strided is not None:
                        strided.scatter(param_slice)

    def takes_pages_fast(self, page: Page) -> bool:
        """Whether the optimizer's multi-tensor kernel takes ``page`` (asked once per step for each page format,
        device and set of dtypes)."""
        dtypes = self.page_dtypes(page)
        key = (id(page.format), page.device[0].device, frozenset(dtypes))
        verdict = self._fast_verdicts.get(key)
        if verdict is None:
            verdict = self._fast_verdicts[key] = self.optimizer.takes_pages_fast(page, dtypes)
        return verdict

    def kernel(self, page: Page) -> SegmentKernel | Any:
        """The kernel of ``page``'s format and device (the optimizer's choice, asked once per step for each)."""
        key = (id(page.format), page.device[0].device)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = self.optimizer._kernel_for(page, self.compiled)
        return kernel

    def _takes_batch(self, kernel: Any, page: Page) -> bool:
        """Whether ``kernel`` updates ``page`` in a batch: it takes batches of every parameter and gradient dtype on
        the page (asked once per step for each kernel, device and dtypes), none of them goes through a copy, and no
        segment of it was updated by a segment kernel."""
        takes_batch = getattr(kernel, "takes_batch", None)
        if takes_batch is None or self.progress.touched(page) or self.has_strided(page):
            return False
        device = page.device[0].device
        for dtypes in self.page_dtypes(page):
            key = (id(kernel), device, dtypes)
            verdict = self._batch_verdicts.get(key)
            if verdict is None:
                verdict = self._batch_verdicts[key] = takes_batch(device, *dtypes)
            if not verdict:
                return False
        return True

    def page_dtypes(self, page: Page) -> set[tuple[torch.dtype, torch.dtype]]:
        """The parameter and gradient dtypes of the tensors with segments on ``page``."""
        if len(self._dtypes) == 1:
            return self._dtypes
        return {
            (local_tensor(self.plan.params[index]).dtype, self.grads[index].dtype)
            for index in self.plan.page_tensors[page.index]
        }

    def update_batch(self, kernel: Any, pages: list[Page]) -> None:
        """One call of ``kernel``'s ``update_batch`` for every segment of ``pages`` (one format, one device): whole
        or, where it raises, not at all."""
        kernel.update_batch(self.page_batch(kernel, pages))
        self.progress.finish_pages(pages)

    def page_batch(self, kernel: Any, pages: list[Page]) -> PageBatch:
        """The :class:`~hf_paged.kernels.batch.PageBatch` of every segment of ``pages`` (one format, one device) for
        ``kernel``."""
        device = kernel.table_device(pages[0].device[0].device)
        table, tensors = self.plan.batch_table(pages, self.rows)
        rounding = self.plan.rounding_table(pages, self.plan.page_segments, self.rounding_keys)
        if device.type != "cpu":
            table = table.to(device)
            rounding = None if rounding is None else rounding.to(device)
        statistics = None
        if isinstance(pages[0].format.codecs[0], Rank1Normalized4bitCodec):
            statistics = [self.plan.statistics[index].batch_entry() for index in tensors]
        return PageBatch(
            params=[local_tensor(self.plan.params[index]) for index in tensors],
            grads=[self.grads[index] for index in tensors],
            buffers=[page.device for page in pages],
            table=table,
            scalars=self.scalar_table(tuple(kernel.scalar_names), device),
            rounding=rounding,
            statistics=statistics,
        )


def _read_once(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` as one step reads it: a tensor ``lr`` (as schedulers keep it for capturable optimizers) read here,
    once per step, as a float. Reading a device tensor waits for the device; each page reading it would stall the
    host and stop page copies from overlapping the updates."""
    lr = group["lr"]
    return {**group, "lr": float(lr)} if isinstance(lr, torch.Tensor) else group


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
    optimizer: PagedOptimizer,
    kernel: SegmentKernel,
    page: Page,
    arrays: list[tuple[torch.Tensor, ...]],
    segment: Segment,
    param: torch.Tensor,
    grad: torch.Tensor,
    scalars: dict[str, float | torch.Tensor],
    progress: StepProgress,
    keys: tuple[int, int] | None = None,
    statistics: Rank1Statistics | None = None,
) -> None:
    """Run ``kernel`` on the elements of a segment that ``progress`` has not reached: its whole blocks in place,
    chunk by chunk (in one call where the kernel allocates nothing), each chunk whole or not at all; a partial
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
    if kernel.allocates_nothing(param, grad):
        chunk = max(alignment, body)
    else:
        chunk = optimizer._chunk_elements(page.format, kernel.compiled)
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
    optimizer: PagedOptimizer,
    moments: Callable[..., None],
    page: Page,
    arrays: list[tuple[torch.Tensor, ...]],
    segment: Segment,
    grad: torch.Tensor,
    scalars: dict[str, float],
    statistics: Rank1Statistics,
) -> None:
    """Take the rank-1 statistics of the states a step computes for ``segment`` (flat gradient elements ``grad``)
    into ``statistics``, chunk by chunk, writing nothing but them."""
    if grad.dim() != 1:
        grad = grad.view(-1)
    codecs = page.format.codecs
    alignment = page.format.alignment
    chunk = optimizer._chunk_elements(page.format, False)
    for start in range(0, segment.length, chunk):
        end = min(start + chunk, segment.length)
        first = segment.start + start
        encoded = [codec.select(array, segment.offset + start, end - start) for codec, array in zip(codecs, arrays)]
        encoded = statistics.attach(encoded, first, end - start, alignment, gathering=True)
        states = [codec.decode(segment_arrays) for codec, segment_arrays in zip(codecs, encoded)]
        moments(to_blocks(grad[start:end], alignment).float(), *states, **scalars)
        for state, values in enumerate(states):
            statistics.observe(state, first, values)


def recover_in_step(optimizer: PagedOptimizer, error: RuntimeError, attempt: int, pages_left: int) -> None:
    """After an out-of-memory error in the step: give the state back to the host, free cached memory and lower
    each device's budget for the rest of the step (halved, and one page at the last retry)."""
    traceback.clear_frames(error.__traceback__)  # the failed chunk's temporaries
    stores = optimizer._store
    held = {device: store.device_bytes for device, store in stores.stores.items()}
    evicted = stores.evict()
    last = attempt >= optimizer.oom_retries
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
        optimizer.oom_retries,
    )
    if optimizer.on_oom_recovery is not None:
        optimizer.on_oom_recovery(recovery)
