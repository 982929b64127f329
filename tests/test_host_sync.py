"""The step's page loop never makes the host wait for the device (design rule 8), checked on the CPU.

On CUDA, a tensor built from a Python number on the device is a blocking copy from pageable memory, and
``.item()`` (or ``bool``, ``float``, ``tolist``) of a device tensor waits for the stream. The page loop must
do neither: every call that would is recorded here while a page is being updated.
tests/test_gpu.py runs the same steps under ``torch.cuda.set_sync_debug_mode("error")`` and records the event,
stream and device synchronizations that mode lets pass; tests/test_async_backend.py counts the host's waits for
page-ins on the simulated stream device.
"""

from __future__ import annotations

import pytest
import torch
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, regression_batches, train
from torch.overrides import TorchFunctionMode

_FROM_NUMBERS = {torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor, torch.full}
"""Factories that build a tensor from Python numbers: a host-to-device copy or fill when given a device."""

_NEW_FROM_NUMBERS = {torch.Tensor.new_tensor, torch.Tensor.new_full}
"""Methods that build a tensor from Python numbers on their tensor's device."""

_TO_HOST = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.nonzero,
}
"""Calls that read a tensor's values on the host (a device sync for a device tensor)."""


class HostSyncRecorder(TorchFunctionMode):
    """Records every call that would make the host wait for the device were the tensors on an accelerator."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FROM_NUMBERS and kwargs.get("device") is not None:
            self.calls.append(f"{func.__name__}(..., device={kwargs['device']})")
        elif func in _NEW_FROM_NUMBERS or func in _TO_HOST:
            self.calls.append(f"Tensor.{func.__name__}")
        return func(*args, **kwargs)


def record_page_loop(optimizer) -> HostSyncRecorder:
    """Record while each page yielded by the optimizer's store is updated (not before or after the loop)."""
    recorder = HostSyncRecorder()
    stream = optimizer._store.stream

    def recorded_stream(pages):
        for page in stream(pages):
            with recorder:
                yield page

    optimizer._store.stream = recorded_stream
    return recorder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", [None, 2 * 4096])
def test_page_loop_builds_no_device_tensor_from_numbers_and_reads_nothing_back(optimizer_name, dtype, budget):
    model = make_mlp(dtype=dtype)
    optimizer = OPTIMIZERS[optimizer_name](
        decay_groups(model), **optimizer_kwargs(optimizer_name, device_budget=budget)
    )
    recorder = record_page_loop(optimizer)
    train(model, optimizer, regression_batches(2, dtype=dtype))
    assert optimizer.paging_stats()["pages_total"] > 2
    assert recorder.calls == []
