"""The planner traces a paged optimizer's step in time that does not grow with its chunks, and stays exact.

Pages on an accelerator take the PyTorch kernels, one call per chunk of ``page_size / 16`` elements (eager): at 16 KiB
pages a chunk is 1024 elements, and an 8B model's QLoRA adapters are tens of thousands of chunks. The planner traces
each kind of kernel call (its argument shapes and dtypes) once and adds the temporaries of the others without running
them, so the kernels it runs do not grow with the model; the plan stays that of a trace of every call, which the
profiler's truth checks on the CPU, where the same PyTorch kernels run with the host kernels off.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hf_paged
from hf_paged.kernels import pytorch as pytorch_kernels
from hf_paged.planner import OPTIMIZER_STEP, plan

from plan_utils import check_plan, measured_peaks

PAGE_SIZE = "16KiB"
CHUNK = 1024
"""Elements of an eager kernel call at 16 KiB pages."""


class _SquaredMean(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.inner(inputs).pow(2).mean()


def _stack(layers: int, width: int = 256) -> nn.Module:
    """``layers`` square linear layers of ``width``: ``layers * width * (width + 1)`` parameters."""
    return _SquaredMean(nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))))


def _batch() -> torch.Tensor:
    return torch.randn(4, 256)


def _paged_optimizer(name: str):
    """Builds hf-paged's optimizer ``name`` of a model in 16 KiB pages, eager, its 1024-element layers quantized."""

    def build(model: nn.Module) -> torch.optim.Optimizer:
        arguments = {"min_8bit_size": 1024} if name.endswith("8bit") else {}
        if name.endswith("4bit"):
            arguments = {"min_4bit_size": 1024}
        return getattr(hf_paged, name)(model.parameters(), page_size=PAGE_SIZE, compiled=False, **arguments)

    return build


@pytest.mark.parametrize("optimizer_name", ["PagedAdamW8bit", "PagedLion"])
def test_kernels_traced_do_not_grow_with_the_chunks(monkeypatch: pytest.MonkeyPatch, optimizer_name: str) -> None:
    """A CUDA plan with the PyTorch kernels (eager; where Triton does not import) of 2 and of 8 layers at 16 KiB
    pages: 4x the chunks, a handful of kernel updates traced for either; the optimizer state and the step's peak grow
    as the model does."""
    monkeypatch.setenv("HF_PAGED_KERNELS", "torch")
    updates: list[int] = []
    original = pytorch_kernels.update_segment

    def counted(*args, **kwargs) -> None:
        updates.append(args[2].numel())
        original(*args, **kwargs)

    monkeypatch.setattr(pytorch_kernels, "update_segment", counted)

    optimizer = _paged_optimizer(optimizer_name)
    traced = {}
    plans = {}
    for layers in (2, 8):
        updates.clear()
        plans[layers] = plan(lambda layers=layers: _stack(layers), _batch, optimizer, steps=2, device="cuda")
        traced[layers] = len(updates)
    # Chunks are whole blocks up to CHUNK elements, the last of a segment shorter: a few lengths, however many chunks.
    chunks = 2 * 2 * 256 * 256 // CHUNK  # two steps of the 2-layer model's weights alone
    assert max(traced.values()) <= 8, f"kernel updates traced: {traced}, against {chunks}+ chunks for 2 layers"
    assert plans[8].optimizer_state_bytes > 3.9 * plans[2].optimizer_state_bytes
    assert plans[8].optimizer_step_peak > plans[2].optimizer_step_peak


@pytest.mark.parametrize("optimizer_name", ["PagedAdamW8bit", "PagedAdamW4bit", "PagedLion"])
def test_chunked_kernels_planned_as_measured(monkeypatch: pytest.MonkeyPatch, optimizer_name: str) -> None:
    """With the host kernels off, CPU pages take the PyTorch kernels chunk by chunk, as on an accelerator: the plan,
    each kind of chunk traced once, matches the peaks of a real run, every chunk run, from the profiler."""
    monkeypatch.setenv("HF_PAGED_NATIVE", "0")

    def build() -> nn.Module:
        return _stack(3)

    optimizer = _paged_optimizer(optimizer_name)
    planned = plan(build, _batch, optimizer)
    torch.manual_seed(0)
    assert not check_plan(planned, measured_peaks(build, _batch, optimizer))
    step = planned.peak(OPTIMIZER_STEP).by_kind
    assert step["temporaries"] > 0, "a chunk's decoded state"


@pytest.mark.parametrize("optimizer_name", ["PagedAdamW", "PagedAdamW8bit", "PagedAdamW4bit", "PagedLion8bit"])
def test_a_trace_for_the_state_alone_runs_no_kernel_and_counts_the_same_state(
    monkeypatch: pytest.MonkeyPatch, optimizer_name: str
) -> None:
    """``step_temporaries=False`` (what the report's comparison of optimizers needs): no kernel update runs, and the
    state, paged and all, is that of the full trace; the step's peak leaves out the chunks' temporaries (fused AdamW,
    which fp32 parameters take, has none). The PyTorch kernels, as where Triton does not import."""
    monkeypatch.setenv("HF_PAGED_KERNELS", "torch")
    updates: list[int] = []
    original = pytorch_kernels.update_segment

    def counted(*args, **kwargs) -> None:
        updates.append(1)
        original(*args, **kwargs)

    monkeypatch.setattr(pytorch_kernels, "update_segment", counted)

    optimizer = _paged_optimizer(optimizer_name)

    def build() -> nn.Module:
        return _stack(2)

    full = plan(build, _batch, optimizer, steps=1, device="cuda")
    updates.clear()
    state_only = plan(build, _batch, optimizer, steps=1, device="cuda", step_temporaries=False)
    assert updates == []
    assert state_only.optimizer_state_bytes == full.optimizer_state_bytes > 0
    assert state_only.paged_state_bytes == full.paged_state_bytes > 0
    full_step, state_step = full.peak(OPTIMIZER_STEP), state_only.peak(OPTIMIZER_STEP)
    assert state_step.by_kind["optimizer_state"] == full_step.by_kind["optimizer_state"]
    if optimizer_name == "PagedAdamW":  # fp32 parameters: torch's fused AdamW, which allocates nothing
        assert state_step.peak_bytes == full_step.peak_bytes
    else:
        assert state_step.peak_bytes < full_step.peak_bytes


@pytest.mark.parametrize("optimizer_name", ["PagedLion", "PagedAdamW8bit", "PagedAdamW4bit", "PagedLion8bit"])
def test_a_cuda_plan_takes_the_triton_kernels_one_call_per_page_batch(
    monkeypatch: pytest.MonkeyPatch, optimizer_name: str
) -> None:
    """Where Triton imports, a CUDA plan traces the kernels a CUDA step takes, the Triton kernels: one batch call per
    page batch, no segment or chunk of the PyTorch kernels, the same state as the PyTorch kernels' plan and, since a
    launch allocates nothing but its tables, a step peak no higher than theirs."""
    pytest.importorskip("triton")
    from hf_paged.kernels.triton_kernels import TritonKernel, TritonLaunches

    segment_updates: list[int] = []
    batches: list[tuple[str, int]] = []
    original_segment = pytorch_kernels.update_segment
    original_kernel_batch, original_launches = TritonKernel.update_batch, TritonLaunches.update

    def counted_segment(*args, **kwargs) -> None:
        segment_updates.append(1)
        original_segment(*args, **kwargs)

    # a batch of pages goes to the Triton kernel's update_batch, or to the launches it prepared for the step
    def counted_kernel_batch(kernel: TritonKernel, batch) -> None:
        batches.append((TritonKernel.__name__, len(batch.buffers)))
        original_kernel_batch(kernel, batch)

    def counted_launches(launches: TritonLaunches, pages, version) -> None:
        batches.append((TritonKernel.__name__, len(pages)))
        original_launches(launches, pages, version)

    monkeypatch.setattr(pytorch_kernels, "update_segment", counted_segment)
    monkeypatch.setattr(TritonKernel, "update_batch", counted_kernel_batch)
    monkeypatch.setattr(TritonLaunches, "update", counted_launches)

    optimizer = _paged_optimizer(optimizer_name)

    def build() -> nn.Module:
        return _stack(2)

    with_triton = plan(build, _batch, optimizer, steps=2, device="cuda")
    assert segment_updates == [] and batches
    assert {kind for kind, _ in batches} == {TritonKernel.__name__}
    assert sum(pages for _, pages in batches) > len(batches), "calls take several pages"
    assert any("Triton kernels" in note for note in with_triton.notes)
    monkeypatch.setenv("HF_PAGED_KERNELS", "torch")
    with_torch = plan(build, _batch, optimizer, steps=2, device="cuda")
    assert not any("Triton kernels" in note for note in with_torch.notes)
    assert with_triton.optimizer_state_bytes == with_torch.optimizer_state_bytes
    assert with_triton.paged_state_bytes == with_torch.paged_state_bytes
    assert segment_updates, "the PyTorch kernels' plan updates segments"
    assert with_triton.optimizer_step_peak <= with_torch.optimizer_step_peak
