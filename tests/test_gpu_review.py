"""CUDA checks of issue 30, points 1 to 4: aligned kernel inputs, one compiled function per rule and format,
out-of-memory learning per device, one read of a tensor learning rate per step.

Each runs where a CUDA device exists (the two-device test where two do); the CPU tests of the same points are
tests/test_alignment.py, tests/test_compiled.py, tests/test_oom_devices.py and tests/test_tensor_lr.py. The tests of
the compiled PyTorch kernels pin them (tests/kernel_paths.py; tests/test_kernel_paths.py runs the pins on the CPU):
where Triton runs, its kernels would take every page and those tests would never reach ``torch.compile``.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from conftest import OPTIMIZERS, make_mlp, optimizer_kwargs, regression_batches
from kernel_paths import pin_kernel_path, record_kernel_paths
from test_alignment import ALIGNMENT, odd_kwargs, odd_model
from test_compiled import _Recompiles, fresh_kernels  # noqa: F401 (a fixture)
from test_tensor_lr import ScalarReads, groups

import hf_paged
from hf_paged import kernels
from hf_paged.budget import AutoBudget
from hf_paged.memory import MemoryProbe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = torch.device("cuda")


def _train(model, optimizer, steps: int, dtype: torch.dtype) -> None:
    for inputs, targets in regression_batches(steps, dtype=dtype):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs.to(DEVICE)).float(), targets.to(DEVICE).float()).backward()
        optimizer.step()


def _misaligned_kernel_inputs(monkeypatch) -> list[str]:
    """Wrap the segment kernel and the fused AdamW call; return the list their misaligned tensor inputs fill."""
    misaligned: list[str] = []

    def check(kernel, tensors):
        misaligned.extend(
            f"{kernel} {tuple(tensor.shape)} {tensor.dtype} at data_ptr % 16 = {tensor.data_ptr() % ALIGNMENT}"
            for tensor in tensors
            if tensor.data_ptr() % ALIGNMENT
        )

    segment_call = kernels.SegmentKernel.__call__

    def call(self, param, grad, encoded, scalars):
        check("segment kernel", [param, grad, *(array for arrays in encoded for array in arrays)])
        return segment_call(self, param, grad, encoded, scalars)

    monkeypatch.setattr(kernels.SegmentKernel, "__call__", call)
    fused = torch._fused_adamw_

    def fused_adamw(*lists, **options):
        check("fused AdamW", [tensor for tensors in lists for tensor in tensors])
        return fused(*lists, **options)

    monkeypatch.setattr(torch, "_fused_adamw_", fused_adamw)
    return misaligned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_kernels_take_aligned_views_and_update_every_segment_on_cuda(optimizer_name, dtype, monkeypatch):
    """Point 1. Pages hold several tensors of uneven sizes, cut between pages, under a one-page budget. Every view a
    kernel takes is 16-byte aligned, and the compiled run matches an eager one: a misaligned input that Inductor
    copied without copying the writes back (torch < 2.8) would leave segments without their update, which a
    comparison of compiled with compiled cannot see."""
    if not kernels.compile_available(DEVICE):
        pytest.skip("no usable Triton for torch.compile")
    misaligned = _misaligned_kernel_inputs(monkeypatch)
    paths = record_kernel_paths(monkeypatch)
    results = {}
    for compiled in (False, True):
        pin_kernel_path(monkeypatch, "compiled" if compiled else "eager")  # the Triton kernels would take every page
        model = odd_model(dtype).to(DEVICE)
        kwargs = odd_kwargs(optimizer_name, device_budget=1024, compiled=compiled)
        optimizer = OPTIMIZERS[optimizer_name](model.parameters(), **kwargs)
        _train(model, optimizer, 3, dtype)
        assert optimizer.paging_stats()["page_outs"] > 0
        assert max(len(page.segments) for page in optimizer._store.pages) > 1
        results[compiled] = [param.detach().float().cpu() for param in model.parameters()]
    assert not misaligned, misaligned[:5]
    assert paths["compiled"] > 0 and paths["eager"] > 0 and "triton" not in paths, paths
    start = [param.detach().float() for param in odd_model(dtype).parameters()]
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for eager, compiled, initial in zip(results[False], results[True], start):
        torch.testing.assert_close(compiled, eager, rtol=tolerance, atol=tolerance)
        left_behind = ((compiled == initial) & (eager != initial)).float().mean().item()
        assert left_behind < 0.01, f"{left_behind:.0%} of a parameter's elements missed updates the eager run made"


def _oom_on(device: torch.device) -> None:
    """Raise the allocator's own out-of-memory error on ``device``: ask for more than it has."""
    torch.empty(torch.cuda.get_device_properties(device).total_memory * 2, dtype=torch.uint8, device=device)


def _learning_run(model, optimizer, fail_on: torch.device | None, forward):
    """Two steps through OOMRecovery; the second step's first micro-batch runs out of memory on ``fail_on`` once.
    Returns the predicted peaks before and after the second step's micro-batches and the state each device held
    when it failed."""
    recovery = hf_paged.OOMRecovery(optimizer, retries=2)
    held: dict[str, int] = {}
    failed = [False]

    def forward_backward(inputs, targets):
        forward(model, inputs, targets).backward()
        if fail_on is not None and recovery.step == 1 and not failed[0]:
            failed[0] = True
            stats = optimizer.paging_stats()["devices"]
            held.update({device: stats[device]["device_bytes"] for device in stats})
            _oom_on(fail_on)

    predicted = []
    for step, (inputs, targets) in enumerate(regression_batches(2)):
        optimizer.zero_grad(set_to_none=True)
        predicted.append({device: auto.predicted_peak for device, auto in optimizer.auto_budgets.items()})
        with recovery.window(step):
            recovery.run(forward_backward, inputs, targets)
        predicted.append({device: auto.predicted_peak for device, auto in optimizer.auto_budgets.items()})
        optimizer.step()
    return predicted[2], predicted[3], held


def test_a_real_out_of_memory_error_teaches_its_device_on_cuda():
    """Point 3 on one GPU: the allocator's message names the device, whose budget learns the failed need."""
    device = f"cuda:{torch.cuda.current_device()}"
    model = make_mlp().to(device)
    budget = AutoBudget(probe=MemoryProbe(device))  # a probe of its own: no other optimizer's state counts
    optimizer = hf_paged.PagedAdamW8bit(model.parameters(), **optimizer_kwargs("PagedAdamW8bit", device_budget=budget))

    def forward(model, inputs, targets):
        return torch.nn.functional.mse_loss(model(inputs.to(device)), targets.to(device))

    before, after, held = _learning_run(model, optimizer, torch.device(device), forward)
    auto = optimizer.auto_budgets[device]
    assert held[device] > 0 and before[device] < auto.capacity // 2
    assert after[device] == auto.capacity - held[device]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_an_out_of_memory_error_on_the_second_gpu_teaches_that_gpu_only():
    """Point 3: state on two GPUs (as ``device_map="auto"``), a real out-of-memory error on cuda:1. cuda:1 learns
    from its own state; cuda:0's prediction does not move."""
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)
    mlp = make_mlp()
    model = torch.nn.ModuleDict({"first": mlp[:2].to(first), "rest": mlp[2:].to(second)})

    def forward(model, inputs, targets):
        outputs = model["rest"](model["first"](inputs.to(first)).to(second))
        return torch.nn.functional.mse_loss(outputs, targets.to(second))

    budgets = {device: AutoBudget(probe=MemoryProbe(device)) for device in ("cuda:0", "cuda:1")}
    optimizer = hf_paged.PagedAdamW8bit(model.parameters(), **optimizer_kwargs("PagedAdamW8bit", device_budget=budgets))
    before, after, held = _learning_run(model, optimizer, second, forward)
    assert held["cuda:0"] > 0 and held["cuda:1"] > 0
    assert after["cuda:1"] == optimizer.auto_budgets["cuda:1"].capacity - held["cuda:1"]
    assert after["cuda:0"] == before["cuda:0"]


def test_a_cuda_tensor_lr_is_read_once_per_group_and_step(optimizer_name):
    """Point 4: a learning rate kept as a CUDA tensor (as schedulers keep it for capturable optimizers) is read on
    the host once per param group and step, under a one-page budget with many pages; the result is that of the
    float learning rates it holds."""
    base_lr = 1e-3 if "Lion" in optimizer_name else 1e-2
    kwargs = optimizer_kwargs(optimizer_name, device_budget=4096)
    kwargs.pop("lr")
    results = []
    for as_tensor in (True, False):
        model = make_mlp().to(DEVICE)

        def lr(index, as_tensor=as_tensor):
            value = torch.tensor(base_lr * (index + 1), device=DEVICE)
            return value if as_tensor else float(value)

        optimizer = OPTIMIZERS[optimizer_name](groups(model, lr), **kwargs)
        reads = []
        for inputs, targets in regression_batches(3):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs.to(DEVICE)), targets.to(DEVICE)).backward()
            lrs = {f"group {index}": group["lr"] for index, group in enumerate(optimizer.param_groups) if as_tensor}
            with ScalarReads(lrs) as counted:
                optimizer.step()
            reads.append(counted.reads)
        if as_tensor:
            assert len(optimizer._store.pages) > 2 and optimizer.paging_stats()["page_outs"] > 0
            assert reads == [Counter({"group 0": 1, "group 1": 1})] * 3
        results.append([param.detach().cpu() for param in model.parameters()])
    for with_tensor, with_float in zip(*results):
        assert torch.equal(with_tensor, with_float)


def test_every_rule_format_and_dtype_stays_compiled_on_cuda(fresh_kernels, caplog, monkeypatch):  # noqa: F811
    """Point 2: 8-bit AdamW, 8-bit Lion and 4-bit AdamW on fp32 and bf16 parameters in one process (with their fp32
    pages of small tensors, ten variants) compile a function per rule, format and device, each recompiled at most
    once (for the second dtype); one function shared by all recompiled for every variant and, past Dynamo's
    recompile limit (8), ran eagerly with the compiled chunks and workspace, without a word. The PyTorch kernels are
    pinned (the Triton kernels would take every page)."""
    pin_kernel_path(monkeypatch, "compiled")
    paths = record_kernel_paths(monkeypatch)
    with _Recompiles() as recompiles, caplog.at_level(logging.WARNING, logger="hf_paged.kernels.pytorch"):
        for name in ("PagedAdamW8bit", "PagedLion8bit", "PagedAdamW4bit"):
            for dtype in (torch.float32, torch.bfloat16):
                model = make_mlp(dtype=dtype).to(DEVICE)
                optimizer = getattr(hf_paged, name)(model.parameters(), compiled=True, **optimizer_kwargs(name))
                _train(model, optimizer, 3, dtype)
    assert not [record for record in caplog.records if "torch.compile failed" in record.getMessage()]
    assert max(Counter(recompiles.functions).values(), default=0) <= 1, Counter(recompiles.functions)
    assert paths["compiled"] > 0 and "triton" not in paths and "eager" not in paths, paths
