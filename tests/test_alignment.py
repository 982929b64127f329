"""Every view a kernel takes starts at a 16-byte boundary (issue 30, point 1).

Compiled kernels assume inputs aligned to 16 bytes as the first call's were; a misaligned one is copied in and out
at every call, and before torch 2.8 the writes into that copy were lost (pytorch#152425). The kernels here are
wrapped so that every tensor they take (parameter and gradient slices, each state's values, codes and scales) is
checked, on a model whose tensors are packed several to a page and cut between pages at uneven element counts.
"""

from __future__ import annotations

import pytest
import torch
from conftest import OPTIMIZERS, regression_batches
from test_paging import assert_same_result

from hf_paged import kernels
from hf_paged.testing import simulated_streams

PAGE_SIZE = 1024
ALIGNMENT = 16
"""Bytes: the alignment Inductor assumes of its inputs (torch._inductor.utils.ALIGNMENT)."""


def odd_model(dtype: torch.dtype) -> torch.nn.Module:
    """An MLP whose tensors have element counts that are not multiples of 4, 16 or a block (20 -> 70 -> 45 -> 3)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 70), torch.nn.GELU(), torch.nn.Linear(70, 45), torch.nn.GELU(), torch.nn.Linear(45, 3)
    )
    return model.to(dtype)


def odd_kwargs(name: str, **paging) -> dict:
    kwargs = {"lr": 1e-3 if "Lion" in name else 1e-2, "page_size": PAGE_SIZE, "compiled": False, **paging}
    if name.endswith(("8bit", "4bit")):
        kwargs.update(block_size=64, **{f"min_{name[-4]}bit_size": 256})
    return kwargs


def train(model, optimizer, steps: int, dtype: torch.dtype) -> None:
    for inputs, targets in regression_batches(steps, dtype=dtype):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs).float(), targets.float()).backward()
        optimizer.step()


@pytest.fixture
def kernel_views(monkeypatch):
    """The misaligned tensors every kernel call took (a list of descriptions) and the kernels called."""
    misaligned: list[str] = []
    called: set[str] = set()

    def check(kernel: str, tensors) -> None:
        called.add(kernel)
        for position, tensor in enumerate(tensors):
            if tensor.data_ptr() % ALIGNMENT:
                misaligned.append(f"{kernel} argument {position} {tuple(tensor.shape)} {tensor.dtype} at "
                                  f"data_ptr % 16 = {tensor.data_ptr() % ALIGNMENT}")

    def wrap_segment_kernel(cls, name):
        original = cls.__call__

        def call(self, param, grad, encoded, scalars):
            tensors = [param, grad, *(array for arrays in encoded for array in arrays)]
            check(name, tensors + [value for value in scalars.values() if isinstance(value, torch.Tensor)])
            return original(self, param, grad, encoded, scalars)

        monkeypatch.setattr(cls, "__call__", call)

    wrap_segment_kernel(kernels.SegmentKernel, "segment kernel")
    wrap_segment_kernel(kernels.HostKernel, "host kernel")
    update_batch = kernels.HostKernel.update_batch

    def batch_call(self, batch):
        buffers = [buffer for page in batch.buffers for buffer in page]
        check("host batch kernel", [*batch.params, *batch.grads, *buffers])
        return update_batch(self, batch)

    monkeypatch.setattr(kernels.HostKernel, "update_batch", batch_call)
    fused = torch._fused_adamw_

    def fused_adamw(*lists, **options):
        check("fused AdamW", [tensor for tensors in lists for tensor in tensors])
        return fused(*lists, **options)

    monkeypatch.setattr(torch, "_fused_adamw_", fused_adamw)
    return misaligned, called


@pytest.mark.parametrize("native", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_view_a_kernel_takes_is_16_byte_aligned(name, dtype, native, kernel_views, monkeypatch):
    monkeypatch.setenv("HF_PAGED_NATIVE", native)
    misaligned, called = kernel_views
    model = odd_model(dtype)
    optimizer = OPTIMIZERS[name](model.parameters(), **odd_kwargs(name, device_budget=PAGE_SIZE))
    train(model, optimizer, 2, dtype)
    assert called
    assert not misaligned, misaligned[:5]
    # the layout packs several tensors into a page and cuts tensors between pages
    pages = optimizer._store.pages
    assert max(len(page.segments) for page in pages) > 1
    assert max(len(optimizer._layout[param].segments) for param in model.parameters()) > 1


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_padding_between_segments_is_less_than_16_bytes_a_buffer(name, block_size):
    model = odd_model(torch.bfloat16)
    kwargs = odd_kwargs(name)
    if "block_size" in kwargs:
        kwargs["block_size"] = block_size
    optimizer = OPTIMIZERS[name](model.parameters(), **kwargs)
    train(model, optimizer, 1, torch.bfloat16)
    for page in optimizer._store.pages:
        end = 0
        for segment in page.segments:
            gap = segment.offset - end
            assert gap >= 0 and segment.offset % page.format.offset_alignment == 0
            assert all(numel * dtype.itemsize < ALIGNMENT for numel, dtype in page.format.buffer_specs(gap))
            end = segment.offset + -(-segment.length // page.format.alignment) * page.format.alignment
        # a page is left when the next cut would not fit: by less than one alignment of each kind
        assert 0 <= page.capacity - end < page.format.offset_alignment + page.format.split_alignment
    for param in model.parameters():
        segments = optimizer._layout[param].segments
        for page, segment in segments[:-1]:
            assert segment.length % page.format.split_alignment == 0


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_aligned_pages_stream_and_resume_bitwise(name):
    """Paging through the simulated streams under a one-page budget, and a resume from a state dict, give bitwise
    the run of an unlimited budget."""
    dtype = torch.bfloat16
    reference = odd_model(dtype)
    reference_optimizer = OPTIMIZERS[name](reference.parameters(), **odd_kwargs(name))
    train(reference, reference_optimizer, 4, dtype)

    model = odd_model(dtype)
    with simulated_streams():
        optimizer = OPTIMIZERS[name](model.parameters(), **odd_kwargs(name, device_budget=PAGE_SIZE))
        batches = regression_batches(4, dtype=dtype)
        for inputs, targets in batches[:2]:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs).float(), targets.float()).backward()
            optimizer.step()
        resumed = OPTIMIZERS[name](model.parameters(), **odd_kwargs(name, device_budget=PAGE_SIZE))
        resumed.load_state_dict(optimizer.state_dict())
        for inputs, targets in batches[2:]:
            resumed.zero_grad()
            torch.nn.functional.mse_loss(model(inputs).float(), targets.float()).backward()
            resumed.step()
        assert resumed.paging_stats()["page_outs"] > 0
    assert_same_result(model, resumed, reference, reference_optimizer)
