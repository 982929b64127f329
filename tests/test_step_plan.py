"""The step plan (issue 27 points 1 and 5): a step's operator calls grow with the tensors, not with the segments
or chunks their state is cut into.

A step counted with a ``TorchDispatchMode`` (every aten operator call) on a Llama-shaped layout of 48 tensors: page
batches of a kernel that takes batches (the host kernels) cost one call per batch and page format, and take the
parameters and gradients as they are (no view), so the count is a constant, the same with 4 KiB pages (three to
eight times the segments) as with 4 MiB pages (a few); PyTorch's fused AdamW (fp32 ``PagedAdamW``) takes a tensor in
one segment as it is, and views of each segment of a tensor in several (a reshape and a split of the parameter and
of the gradient, made each step: the plan keeps no view of a parameter between steps).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_paged
from hf_paged.kernels import segment_kernel
from hf_paged.native import host_kernels_enabled

SMALL_PAGE, LARGE_PAGE = "4KiB", "4MiB"


class OperatorCalls(TorchDispatchMode):
    """Counts every operator call dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.counts: dict[str, int] = {}
        """Calls by operator name (``view``, ``as_strided``, ...)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def llama_shapes(hidden: int = 64, layers: int = 5, vocab: int = 1000, mlp: int = 172) -> list[tuple[int, ...]]:
    """The parameter shapes of a Llama decoder (untied embeddings): 9 tensors a layer and 3 more."""
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(mlp, hidden), (mlp, hidden), (hidden, mlp), (hidden,), (hidden,)]
    return shapes + [(hidden,), (vocab, hidden)]


def operator_calls_of_a_step(name: str, dtype: torch.dtype, page_size: str) -> tuple[int, int, int]:
    """Operator calls of the third step of ``name`` on the Llama layout, the number of segments, and the number of
    tensors in more than one segment."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=generator).to(dtype).requires_grad_() for shape in llama_shapes()]
    for param in params:
        param.grad = (torch.randn(param.shape, generator=generator) * 1e-2).to(dtype)
    optimizer = getattr(hf_paged, name)(params, lr=1e-3, page_size=page_size, compiled=False)
    optimizer.step()
    optimizer.step()
    with OperatorCalls() as counted:
        optimizer.step()
    segments = sum(len(page.segments) for store in optimizer._store.stores.values() for page in store.pages)
    split = sum(1 for param in params if len(optimizer._layout[param].segments) > 1)
    return counted.calls, segments, split


BATCHED = ("PagedAdamW8bit", "PagedAdamW4bit", "PagedLion8bit", "PagedLion")


def _host_kernels_take_batches(name: str) -> bool:
    if not host_kernels_enabled():
        return False
    optimizer = getattr(hf_paged, name)([torch.zeros(8, requires_grad=True)])
    return all(
        hasattr(segment_kernel(optimizer.update_rule(), page_format.codecs, False, torch.device("cpu")), "update_batch")
        for page_format in optimizer._formats.values()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", BATCHED)
def test_operator_calls_do_not_grow_with_segments(name, dtype):
    """With kernels that take page batches, a step costs the same operator calls at 4 KiB pages as at 4 MiB pages
    (three to eight times the segments), and a constant with no call per tensor: the step counts read (a stack and
    an add) and advanced (one foreach add), the step as a tensor, the scalars' table, one batch call per page format
    and the profiler's record of the step (9 calls on this layout)."""
    if not _host_kernels_take_batches(name):
        pytest.skip("the host kernels do not take page batches here")
    small, small_segments, _ = operator_calls_of_a_step(name, dtype, SMALL_PAGE)
    large, large_segments, _ = operator_calls_of_a_step(name, dtype, LARGE_PAGE)
    assert small_segments >= 3 * large_segments > 0
    assert small == large, (small, large)
    assert large <= 12, large


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_operator_calls_of_paged_adamw_are_bounded_by_tensors(dtype):
    """PagedAdamW (fp32 parameters: PyTorch's fused AdamW over the tensors in one segment as they are and views of
    the others' segments; bf16: the batch kernels where they are, else the segment kernels): at most four operator
    calls per tensor in several segments (a reshape and a split of its parameter and its gradient) and a constant,
    at any page size."""
    if dtype == torch.bfloat16 and not _host_kernels_take_batches("PagedAdamW"):
        pytest.skip("the host kernels do not take page batches here")
    for page_size in (SMALL_PAGE, LARGE_PAGE):
        calls, segments, split = operator_calls_of_a_step("PagedAdamW", dtype, page_size)
        assert calls <= 4 * split + 12, (page_size, calls, segments, split)


def test_tensors_cut_at_whole_rows_cost_one_split_of_the_parameter_and_one_of_the_gradient():
    """fp32 PagedAdamW on matrices of issue 27's Llama layout (rows of 512 elements) and vectors of other sizes in
    1 MiB pages: each matrix is cut between pages at whole rows (a row is far under 1/64 of a page), so PyTorch's fused
    AdamW takes slices of the parameter and gradient along their rows, one split of each per step (not a flat view and
    a split of each: 521 operator calls per step on that layout, now 265), and the result is bitwise torch's fused
    AdamW."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(1000,), (1536, 512), (512, 512), (200,), (256, 512), (512, 1536), (512,)] * 3
    values = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator) * 1e-2 for shape in shapes] for _ in range(3)]
    params = [value.clone().requires_grad_() for value in values]
    optimizer = hf_paged.PagedAdamW(params, lr=1e-3, page_size="1MiB", compiled=False)
    reference_params = [value.clone().requires_grad_() for value in values]
    reference = torch.optim.AdamW(reference_params, lr=1e-3, fused=True)
    for step, step_grads in enumerate(grads):
        for param, reference_param, grad in zip(params, reference_params, step_grads):
            param.grad, reference_param.grad = grad.clone(), grad.clone()
        reference.step()
        if step < 2:
            optimizer.step()
            continue
        with OperatorCalls() as counted:
            optimizer.step()
    split = [param for param in params if len(optimizer._layout[param].segments) > 1]
    assert len(split) >= 6
    assert all(segment.length % 512 == 0 for param in split for _, segment in optimizer._layout[param].segments)
    assert counted.calls <= 2 * len(split) + 12, (counted.calls, len(split))
    for param, expected in zip(params, reference_params):
        assert torch.equal(param, expected)


@pytest.mark.parametrize("name", ["PagedAdamW8bit", "PagedAdamW"])
def test_a_step_chooses_each_formats_kernel_once_not_each_pages(monkeypatch, name):
    """The kernel of a page format and device, whether it takes a page batch and whether the multi-tensor kernel
    takes a page are asked once per step for each format, device and set of dtypes, not for each page: on an
    accelerator's pages of an 8B model (3,890 pages) asking per page was most of the step's host time (130 ms of
    stubbed kernels against 20 ms, ``benchmarks/optimizer_step.py``'s accelerator table)."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=generator).requires_grad_() for shape in llama_shapes()]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator) * 1e-2
    optimizer = getattr(hf_paged, name)(params, lr=1e-3, page_size=SMALL_PAGE, compiled=False)
    asked = {"kernel": 0, "fast": 0, "batch": 0}
    kernel_for, takes_pages_fast = type(optimizer)._kernel_for, type(optimizer).takes_pages_fast

    def counted_kernel_for(self, *args, **kwargs):
        asked["kernel"] += 1
        kernel = kernel_for(self, *args, **kwargs)
        takes_batch = getattr(kernel, "takes_batch", None)
        if takes_batch is not None and not getattr(takes_batch, "counted", False):

            def counted_takes_batch(*batch_args, takes_batch=takes_batch):
                asked["batch"] += 1
                return takes_batch(*batch_args)

            counted_takes_batch.counted = True
            monkeypatch.setattr(kernel, "takes_batch", counted_takes_batch)
        return kernel

    def counted_takes_pages_fast(self, *args, **kwargs):
        asked["fast"] += 1
        return takes_pages_fast(self, *args, **kwargs)

    monkeypatch.setattr(type(optimizer), "_kernel_for", counted_kernel_for)
    monkeypatch.setattr(type(optimizer), "takes_pages_fast", counted_takes_pages_fast)
    optimizer.step()  # lays the pages out and builds the step plan, which takes the counted methods
    asked.update(dict.fromkeys(asked, 0))
    optimizer.step()
    pages = sum(len(store.pages) for store in optimizer._store.stores.values())
    formats = len(optimizer._formats)
    assert pages >= 4 * formats
    assert 0 < asked["kernel"] <= formats and asked["fast"] <= formats and asked["batch"] <= formats, (asked, pages)


def test_a_tensor_given_new_memory_between_steps_is_updated_there():
    """The plan keeps flat views of the parameters between steps; ``param.data = ...`` (same shape, new memory)
    makes the next step update the new memory, bitwise as an optimizer that never saw the old one would."""
    generator = torch.Generator().manual_seed(1)
    shapes = llama_shapes(layers=1)
    values = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(2)]

    def run(swap: bool) -> list[torch.Tensor]:
        params = [value.clone().requires_grad_() for value in values]
        optimizer = hf_paged.PagedAdamW8bit(params, lr=1e-2, page_size="16KiB", min_8bit_size=0, compiled=False)
        for step, step_grads in enumerate(grads):
            if swap and step == 1:
                for param in params:
                    param.data = param.data.clone()
            for param, grad in zip(params, step_grads):
                param.grad = grad.clone()
            optimizer.step()
        return [param.detach() for param in params]

    for swapped, kept in zip(run(swap=True), run(swap=False)):
        assert torch.equal(swapped, kept)


def test_a_streamed_pages_fp32_state_views_take_one_view_each():
    """fp32 PagedAdamW under a one-page budget: the pages not resident at a step's start are paged in, so their
    state views are made again; a segment in rows (or a whole matrix) takes one ``as_strided`` per moment, not a slice
    and a view of each: a step's ``view`` calls are its paged-in buffers' (one per buffer), and the result is bitwise
    torch's fused AdamW."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(96, 32), (64,), (40, 32)]
    params = [torch.randn(shape, generator=generator).requires_grad_() for shape in shapes]
    reference_params = [param.detach().clone().requires_grad_() for param in params]
    optimizer = hf_paged.PagedAdamW(params, lr=1e-3, page_size="16KiB", device_budget="16KiB", compiled=False)
    reference = torch.optim.AdamW(reference_params, lr=1e-3, fused=True)
    for step in range(3):
        for param, reference_param in zip(params, reference_params):
            grad = torch.randn(param.shape, generator=generator)
            param.grad, reference_param.grad = grad.clone(), grad
        reference.step()
        if step < 2:
            optimizer.step()
            continue
        with OperatorCalls() as counted:
            optimizer.step()
    shaped = [segment for param in params if param.dim() == 2 for _, segment in optimizer._layout[param].segments]
    assert len(shaped) > 2 and all(segment.length % 32 == 0 for segment in shaped)  # rows of 32: cut at whole rows
    pages = optimizer.paging_stats()["pages_total"]
    assert optimizer.paging_stats()["page_ins"] == 2 * (pages - 1)  # two steps of all pages but the resident one
    assert counted.counts.get("view", 0) <= 2 * pages, counted.counts  # each page's two buffers as fp32
    assert 0 < counted.counts.get("as_strided", 0) <= 2 * len(shaped), counted.counts
    for param, expected in zip(params, reference_params):
        assert torch.equal(param, expected)
