"""The Triton kernels' first-use self-check (hf_paged/kernels/triton_kernels.py ``self_check``) on the CPU under
Triton's interpreter: a kernel whose launch fails or whose results differ from the eager PyTorch kernel's makes its
combination take the PyTorch kernels, logged once, and the optimizer then trains bitwise as with
``HF_PAGED_KERNELS=torch``; a correct kernel passes once per combination and takes the page batches.

The miscompiles are simulated: a launch that corrupts one element of the parameter after the kernel ran, or a kernel
that raises Triton's ``OutOfResources`` at its launch (as a compilation for a GPU without enough shared memory does).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from conftest import train
from test_triton_kernels import TRITON_KERNELS, assert_same, build, codecs_of
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.runtime.errors import OutOfResources

from hf_paged.kernels import SegmentKernel
from hf_paged.kernels.rules import adamw_update_, lion_update_

LOGGER = "hf_paged.kernels.triton_kernels"


@pytest.fixture
def fresh_checks(monkeypatch):
    """HF_PAGED_KERNELS=triton, TRITON_INTERPRET=1, no self-check verdicts yet in this process, and the calls of
    ``self_check`` and of the step's page batches (``TritonLaunches.update``) counted: ``{"checks":
    [...combinations], "batches": [count]}``."""
    module = TRITON_KERNELS
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    monkeypatch.setattr(module, "_SELF_CHECKS", {})
    calls = {"checks": [], "batches": [0]}
    check, update = module.self_check, module.TritonLaunches.update

    def counted_check(kernel, device, param_dtype, grad_dtype):
        calls["checks"].append((kernel.rule_name, kernel.codecs, param_dtype, grad_dtype, device))
        return check(kernel, device, param_dtype, grad_dtype)

    def counted_update(self, pages, version):
        calls["batches"][0] += 1
        return update(self, pages, version)

    monkeypatch.setattr(module, "self_check", counted_check)
    monkeypatch.setattr(module.TritonLaunches, "update", counted_update)
    return calls


def corrupt_one_element(monkeypatch):
    """Every launch adds 1 to the first element of its batch's first parameter after the kernel ran."""
    launch = TRITON_KERNELS.TritonKernel._launch

    def corrupting(self, batch, round_shift):
        launch(self, batch, round_shift)
        batch.params[0][0] += 1.0

    monkeypatch.setattr(TRITON_KERNELS.TritonKernel, "_launch", corrupting)
    return "the parameter differs from the PyTorch kernel's in 1 of"


def fail_to_compile(monkeypatch):
    """The kernel raises Triton's OutOfResources at its launch, before it runs."""

    class Uncompilable:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(1 << 20, 1 << 16, "shared memory")

            return launch

    monkeypatch.setattr(TRITON_KERNELS, "_update_batch_kernel", Uncompilable())
    return "OutOfResources: out of resource: shared memory"


@pytest.mark.parametrize(
    ("name", "miscompile"),
    [("PagedAdamW8bit", corrupt_one_element), ("PagedLion", fail_to_compile), ("PagedAdamW4bit", corrupt_one_element)],
)
def test_a_kernel_that_fails_its_check_falls_back_and_trains_as_the_pytorch_kernels(
    fresh_checks, monkeypatch, caplog, name, miscompile
):
    """Three steps of two optimizers with a miscompiled Triton kernel: bitwise the parameters and state of
    HF_PAGED_KERNELS=torch, no batch reaches the Triton kernel, one warning that names the reason.

    Without the check the corrupted kernel's results would differ from the PyTorch kernels' (an element moved by 1),
    and the uncompilable one would raise out of the step."""
    monkeypatch.setenv("HF_PAGED_KERNELS", "torch")
    reference_model, reference, batches = build(name)
    train(reference_model, reference, batches[:3])

    reason = miscompile(monkeypatch)
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    checked = []
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):
            model, optimizer, batches = build(name)
            train(model, optimizer, batches[:3])
            assert_same(model, optimizer, reference_model, reference)
            checked.append(list(fresh_checks["checks"]))
    assert fresh_checks["batches"] == [0]
    # each combination checked once for both optimizers (PagedAdamW4bit's: three, as its small tensors keep fp32
    # state and its first layer, whose rows are shorter than a block, 8-bit state)
    assert checked[0] == checked[1] and len(set(checked[0])) == len(checked[0]) == (3 if "4bit" in name else 1)
    warnings = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert len(warnings) == len(checked[0]), warnings
    for warning in warnings:
        assert "failed its first-use check" in warning and reason in warning, warning


@pytest.mark.parametrize("name", ["PagedAdamW8bit", "PagedLion"])
def test_a_correct_kernel_passes_its_check_once_and_takes_the_batches(fresh_checks, caplog, name):
    """Two optimizers of one combination: one self-check, passed, no warning, and every step's pages go to
    update_batch (the check does not count among them: it launches directly). Without the check nothing would be
    recorded as checked."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):
            model, optimizer, batches = build(name)
            train(model, optimizer, batches[:2])
    assert len(fresh_checks["checks"]) == 1  # one combination, checked once for both optimizers
    assert list(TRITON_KERNELS._SELF_CHECKS.values()) == [None]
    assert fresh_checks["batches"][0] >= 4  # at least one batch per step of each optimizer
    assert not [record for record in caplog.records if record.name == LOGGER]


def test_a_check_that_runs_out_of_memory_gives_no_verdict(fresh_checks, monkeypatch):
    """Running out of memory in the check's launch is raised (the step's recovery handles it) and recorded as
    nothing: the next call checks again, and passes. Counted as a failure, the kernel would fall back for good."""
    codecs = codecs_of("adamw", "8bit")
    kernel = TRITON_KERNELS.TritonKernel(adamw_update_, codecs, SegmentKernel(adamw_update_, codecs, False))
    launch = TRITON_KERNELS.TritonKernel._launch
    failures = [1]

    def out_of_memory_once(self, batch, round_shift):
        if failures[0]:
            failures[0] -= 1
            raise torch.OutOfMemoryError("injected")
        launch(self, batch, round_shift)

    monkeypatch.setattr(TRITON_KERNELS.TritonKernel, "_launch", out_of_memory_once)
    cpu = torch.device("cpu")
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        kernel.takes_batch(cpu, torch.float32, torch.float32)
    assert TRITON_KERNELS._SELF_CHECKS == {}
    assert kernel.takes_batch(cpu, torch.float32, torch.float32)
    assert len(fresh_checks["checks"]) == 2 and list(TRITON_KERNELS._SELF_CHECKS.values()) == [None]


def test_no_check_under_fake_tensors(fresh_checks):
    """A memory plan (FakeTensorMode) runs no check and records no verdict: the check's tensors would be fake, its
    launch would fail, and the combination would take the PyTorch kernels for good."""
    codecs = codecs_of("lion", "fp32")
    kernel = TRITON_KERNELS.TritonKernel(lion_update_, codecs, SegmentKernel(lion_update_, codecs, False))
    with FakeTensorMode():
        assert kernel.takes_batch(torch.device("cpu"), torch.float32, torch.float32)
    assert fresh_checks["checks"] == [] and TRITON_KERNELS._SELF_CHECKS == {}


def test_the_bound_without_a_fused_lerp(monkeypatch):
    """Where the CPU's lerp rounds twice the comparison allows an fp32 value 4 ulps plus 2**-20 of the tensor's
    largest magnitude, a bf16 parameter one ulp of bf16 and a code one step (each nibble of 4-bit codes apart), and
    no more; elsewhere it is bitwise."""
    disagreement = TRITON_KERNELS._disagreement
    values = torch.tensor([1.0, -1e-3, 0.0, float("nan")])
    near = values + torch.tensor([4 * 2**-23, 2**-21, 2**-21, 0.0])  # within 2**-20 of 1.0 plus 4 ulps
    far = values + torch.tensor([2**-19, -(2**-19), 2**-19, 0.0])
    assert disagreement(near, values, packed=False, exact=False) == 0
    assert disagreement(near, values, packed=False, exact=True) == 3  # NaN keeps its bits
    assert disagreement(far, values, packed=False, exact=False) == 3
    assert disagreement(torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("nan")]), packed=False, exact=False) == 1
    bf16 = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    next_bf16 = torch.nextafter(bf16, torch.full_like(bf16, 9.0))
    assert disagreement(next_bf16, bf16, packed=False, exact=False) == 0
    assert disagreement(torch.nextafter(next_bf16, torch.full_like(bf16, 9.0)), bf16, False, exact=False) == 2
    codes = torch.tensor([0x21, 0x77], dtype=torch.uint8)
    assert disagreement(torch.tensor([0x12, 0x88], dtype=torch.uint8), codes, packed=True, exact=False) == 0
    assert disagreement(torch.tensor([0x31, 0x79], dtype=torch.uint8), codes, packed=True, exact=False) == 1
    assert disagreement(torch.tensor([0x31, 0x79], dtype=torch.uint8), codes, packed=False, exact=False) == 2
    signed = torch.tensor([-127, 5], dtype=torch.int8)
    assert disagreement(torch.tensor([-126, 4], dtype=torch.int8), signed, packed=False, exact=False) == 0
    assert disagreement(torch.tensor([-125, 4], dtype=torch.int8), signed, packed=False, exact=False) == 1
    monkeypatch.setattr(TRITON_KERNELS.torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.setattr(TRITON_KERNELS.platform, "machine", lambda: "x86_64")
    assert not TRITON_KERNELS.lerp_rounds_once()
    monkeypatch.setattr(TRITON_KERNELS.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert TRITON_KERNELS.lerp_rounds_once()


def test_the_check_waits_for_the_device_of_its_batch(monkeypatch):
    """The self-check of a combination on ``cuda:1`` waits for ``cuda:1``, not for the current device (which is
    ``cuda:0`` unless the caller set it): a launch queued on another device would still be running when its results
    are compared."""
    synchronized = []

    class Module:
        @staticmethod
        def synchronize(device=None):
            synchronized.append(device)

    batch = SimpleNamespace(params=[SimpleNamespace(device=torch.device("cuda", 1))])
    kernel = SimpleNamespace(_launch=lambda batch, round_shift: None)
    monkeypatch.setattr(TRITON_KERNELS.torch, "get_device_module", lambda device: Module)
    assert TRITON_KERNELS._launch_failure(kernel, batch, 0) is None
    assert synchronized == [torch.device("cuda", 1)]
