"""The step's temporaries stay within the workspace the optimizer reserves: a few pages, whatever the sizes."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import OPTIMIZERS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hf_paged.kernels import compile_available


class PeakAllocation(TorchDispatchMode):
    """Bytes of the storages that operators allocate under this mode and that are still alive, and their peak.

    A storage counts from the operator that returned it (not one of its inputs: views and in-place results
    are not new) until it is freed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: weakref.WeakSet = weakref.WeakSet()

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        result = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(result):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if id(storage) in inputs or storage in self._tracked:
                continue
            self._tracked.add(storage)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, storage.nbytes())
        return result


def make_params(numel: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """One large parameter over several pages, and small ones (fp32 state, a partial last block)."""
    torch.manual_seed(0)
    sizes = (numel, 1024 + 37, 300, 5)
    return [torch.nn.Parameter(torch.randn(size, dtype=dtype)) for size in sizes]


def stepped(name: str, dtype: torch.dtype, page_size: int, steps: int = 2, compiled: bool = False):
    params = make_params(2 * page_size, dtype)
    kwargs = {"page_size": page_size, "compiled": compiled}
    if name.endswith("8bit"):
        kwargs.update(block_size=256, min_8bit_size=1024)
    optimizer = OPTIMIZERS[name](params, **kwargs)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(dtype)
        optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [4 * 2**10, 32 * 2**10])
def test_step_temporaries_fit_the_reserved_workspace(optimizer_name, dtype, page_size):
    _, optimizer = stepped(optimizer_name, dtype, page_size)  # pages resident: only temporaries allocate
    assert optimizer.paging_stats()["pages_total"] >= 4
    with PeakAllocation() as allocation:
        optimizer.step()
    assert allocation.live == 0
    assert 0 < optimizer.step_workspace <= 3 * page_size
    assert allocation.peak <= optimizer.step_workspace, (allocation.peak / page_size, "pages")


def test_chunked_update_is_bitwise_the_whole_segment_update(optimizer_name, monkeypatch):
    chunked, _ = stepped(optimizer_name, torch.bfloat16, 4 * 2**10, steps=3)
    monkeypatch.setattr(OPTIMIZERS[optimizer_name], "_chunk_elements", lambda self, page_format, compiled: 2**40)
    whole, _ = stepped(optimizer_name, torch.bfloat16, 4 * 2**10, steps=3)
    for mine, theirs in zip(chunked, whole):
        assert torch.equal(mine, theirs)


def allocated_peak(step) -> int:
    """The peak bytes of CPU memory that ``step()`` allocates and holds, from the profiler's memory events.

    The CPU allocator reports every allocation, those of a compiled kernel's buffers included, which a
    dispatch mode does not see. Python's cyclic garbage collector is kept out of the step: garbage that earlier tests
    left in reference cycles, freed during it, would count against the step's own allocations.
    """
    gc.collect()
    gc.disable()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
            step()
    finally:
        gc.enable()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in profile.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


@pytest.mark.skipif(not compile_available(torch.device("cpu")), reason="no C++ compiler for torch.compile")
@pytest.mark.parametrize(
    "name, dtype",
    [
        ("PagedAdamW8bit", torch.float32),
        ("PagedAdamW8bit", torch.bfloat16),
        ("PagedAdamW4bit", torch.float32),
        ("PagedLion8bit", torch.bfloat16),
        ("PagedAdamW", torch.bfloat16),
    ],
)
def test_compiled_step_temporaries_fit_the_reserved_workspace(name, dtype):
    torch._dynamo.reset()  # Dynamo keeps at most 8 graphs of the kernel function per process, then runs it eagerly
    page_size = 64 * 2**10
    _, optimizer = stepped(name, dtype, page_size, compiled=True)
    assert optimizer.compiled
    peak = allocated_peak(optimizer.step)
    assert 0 < optimizer.step_workspace <= 3 * page_size
    assert 0 < peak <= optimizer.step_workspace, (peak / page_size, "pages")


def test_resident_pages_of_non_contiguous_parameters_copy_one_page_at_a_time():
    """With every page resident (one batch), the contiguous copies of transposed weights are made page by page,
    as when pages stream: 8 transposed 512x512 weights are 8 MiB, a page's share 128 KiB (and as much of gradient)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(512, 512).t()) for _ in range(8)]
    page_size = 256 * 2**10
    optimizer = OPTIMIZERS["PagedAdamW"](params, page_size=page_size)
    for param in params:
        param.grad = torch.randn(512, 512).t()
    optimizer.step()  # lays out the pages (the state's own 16 MiB)
    with PeakAllocation() as allocation:
        optimizer.step()  # every page resident: one batch
    assert optimizer.paging_stats()["pages_total"] == optimizer.paging_stats()["pages_resident"] == 64
    assert allocation.peak <= 3 * page_size, (allocation.peak / page_size, "pages")
