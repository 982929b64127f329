"""What a step on the accelerator path sends to the device (design rule 8, issue 36), checked on the CPU.

On CUDA a copy to the device from pageable host memory, or one with ``non_blocking=False``, is a copy followed by a
stream synchronize: the host waits for every kernel queued so far, and page copies stop running ahead of the
updates. Here the pages live on a simulated stream device (:class:`~hf_paged.testing.SimulatedStreamBackend`), which
knows which host memory is pinned and which memory is the device's, and the Triton kernels run under Triton's
interpreter: every tensor a launch reads (its tables of segments, addresses, scalars and rounding keys) must be
device memory, copied there by the backend from pinned memory; every page copy must come from pinned memory. Before
issue 36 the executor and ``TritonKernel._launch`` handed the kernels tables built in pageable host memory (on CUDA,
copied with ``.to(device)``), which this test catches.

Every pointer a launch passes also starts at a 16-byte boundary: Triton compiles a kernel once per pattern of
pointer alignments, and a variant the first-use self-check did not run would run unchecked (the address table put
the page buffers' addresses at byte ``24 * tensors``).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, regression_batches, train
from test_rank1 import build as build_rank1
from test_triton_kernels import TRITON_KERNELS, build
from triton_cases import CASES

from hf_paged.device import StreamBackend, SyncBackend
from hf_paged.kernels import stubbed_triton_kernels
from hf_paged.testing import simulated_streams

BUDGETS = {"no budget": None, "one page": 4096, "three pages": 3 * 4096}


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    """``TRITON_INTERPRET=1`` while a test runs: Triton imports some of its modules at a kernel's first launch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


class Launches:
    """Every launch of the Triton update and gather kernels while active: the tensors each passed."""

    def __init__(self, monkeypatch) -> None:
        self.tensors: list[list[torch.Tensor]] = []
        for name in ("_update_batch_kernel", "_gather_batch_kernel"):
            monkeypatch.setattr(TRITON_KERNELS, name, self._recording(getattr(TRITON_KERNELS, name)))

    def _recording(self, kernel):
        launches = self

        class Recorded:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    launches.tensors.append([arg for arg in args if isinstance(arg, torch.Tensor)])
                    return kernel[grid](*args, **kwargs)

                return launch

        return Recorded()


def steps_on_simulated_streams(monkeypatch, build_optimizer, steps: int = 3):
    """Steps of ``build_optimizer()``'s optimizer on a simulated stream device with the Triton kernels, the first
    (which lays the pages out and runs the first-use self-checks, on tensors of their own) not recorded: the launches
    of the others, and the device's backend."""
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    with simulated_streams(delay=1e-4) as backends:
        model, optimizer, batches = build_optimizer()
        train(model, optimizer, batches[:1])
        launches = Launches(monkeypatch)
        train(model, optimizer, batches[1:steps])
        (backend,) = backends
        return launches, backend, optimizer


def assert_every_launch_reads_device_memory_from_pinned_copies(launches: Launches, backend) -> None:
    assert launches.tensors
    for number, tensors in enumerate(launches.tensors):
        for tensor in tensors:
            assert backend.holds(tensor), (number, tensor.dtype, tuple(tensor.shape))
    assert backend.pageable_copies == []
    assert backend.hazards == []


@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_step_copies_to_the_device_only_from_pinned_memory(monkeypatch, name, budget):
    """Every optimizer, without a budget and with budgets that stream pages: what the kernels read came to the
    device from pinned memory through the backend, and so did every page."""
    launches, backend, optimizer = steps_on_simulated_streams(
        monkeypatch, lambda: build(name, device_budget=BUDGETS[budget])
    )
    assert_every_launch_reads_device_memory_from_pinned_copies(launches, backend)
    if budget == "one page":
        assert optimizer.paging_stats()["page_ins"] > 0


@pytest.mark.parametrize("budget", [None, 1008])
def test_a_rank1_step_copies_to_the_device_only_from_pinned_memory(monkeypatch, budget):
    """PagedAdamW4bit(normalization="rank1"): its statistics pass too."""

    def rank1():
        model, optimizer = build_rank1(budget=budget)
        return model, optimizer, regression_batches(3)

    launches, backend, _ = steps_on_simulated_streams(monkeypatch, rank1)
    assert_every_launch_reads_device_memory_from_pinned_copies(launches, backend)


def test_every_pointer_a_launch_passes_is_16_byte_aligned(monkeypatch):
    """The self-checks (one tensor, an odd number) and steps with odd and even numbers of tensors per launch: every
    tensor a launch passes starts at a 16-byte boundary, so each kernel has one variant, the one the self-check ran."""
    monkeypatch.setattr(TRITON_KERNELS, "_SELF_CHECKS", {})
    launches = Launches(monkeypatch)
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    for name in sorted(CASES):
        model, optimizer, batches = build(name, device_budget=3 * 4096)
        train(model, optimizer, batches[:2])
    model, optimizer = build_rank1()
    train(model, optimizer, regression_batches(2))
    assert len(launches.tensors) > 20
    misaligned = [
        (number, position)
        for number, tensors in enumerate(launches.tensors)
        for position, tensor in enumerate(tensors)
        if tensor.data_ptr() % 16
    ]
    assert misaligned == []


def test_a_streamed_batch_copies_only_its_pages_addresses(monkeypatch):
    """Issue 36: every page's segment rows reach the device once, at the first launch. A batch of pages that follow
    one another, as a streamed batch does, takes its rows as a slice of them and copies to the device only its pages'
    buffer addresses, into their place in a table kept there: a streamed step makes no table per batch (launches
    stubbed: what is counted is what reaches the device)."""
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    name = "PagedAdamW8bit"
    with stubbed_triton_kernels(), simulated_streams(delay=0) as backends:
        model = make_mlp(hidden=256)
        kwargs = optimizer_kwargs(name, device_budget=4 * 4096, prefetch=2)
        optimizer = OPTIMIZERS[name](decay_groups(model), compiled=False, **kwargs)
        batches = regression_batches(3)
        train(model, optimizer, batches[:2])
        (backend,) = backends
        made: list[torch.Tensor] = []
        copied: list[torch.Tensor] = []
        monkeypatch.setattr(backend, "to_device", _recording(backend.to_device, made))
        monkeypatch.setattr(backend, "copy_into", _recording(backend.copy_into, copied))
        page_ins = optimizer.paging_stats()["page_ins"]
        train(model, optimizer, batches[2:])
        streamed = optimizer.paging_stats()["page_ins"] - page_ins
        formats = len({id(page.format) for page in optimizer._store.pages})
    assert streamed >= 20
    assert len(made) <= 3 * formats, [tuple(host.shape) for host in made]
    buffers = max(len(page.specs) for page in optimizer._store.pages)
    streamed_batches = [host for host in copied if host.numel() <= 2 * buffers]  # two pages' buffer addresses
    assert len(streamed_batches) >= streamed / 2 and len(copied) - len(streamed_batches) <= formats
    assert backend.pageable_copies == [] and backend.hazards == []


def _recording(copy, hosts: list[torch.Tensor]):
    def recorded(*tensors: torch.Tensor):
        hosts.append(tensors[-1])
        return copy(*tensors)

    return recorded


def test_the_stream_backend_copies_from_pinned_memory_without_waiting(monkeypatch):
    """On a device with streams the backend's tables are pinned and copied with ``non_blocking=True`` (the simulated
    device above checks what reaches the backend; this checks what the backend asks of PyTorch)."""
    made = []
    empty = torch.empty

    def pinned_empty(*args, pin_memory=False, **kwargs):
        made.append(pin_memory)
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", pinned_empty)
    backend = SimpleNamespace(device=torch.device("cuda", 0), pins_host_memory=StreamBackend.pins_host_memory)
    backend.pinned_empty = functools.partial(SyncBackend.pinned_empty, backend)
    for values, dtype in (([1, 2], torch.int64), ([0.5, 3.0], torch.float32)):
        host = SyncBackend.pinned_tensor(backend, values, dtype)
        assert (host.tolist(), host.dtype) == (values, dtype)
    assert made == [True, True]
    host = SimpleNamespace(to=lambda device, **kwargs: (device, kwargs))
    assert StreamBackend.to_device(backend, host) == (torch.device("cuda", 0), {"non_blocking": True})
    copies = []
    StreamBackend.copy_into(backend, SimpleNamespace(copy_=lambda source, **kwargs: copies.append(kwargs)), host)
    assert copies == [{"non_blocking": True}]


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_pinned_tensors_hold_what_torch_tensor_makes_of_the_values(dtype):
    """The backend's tables (converted through an ``array`` for int64 and fp32) hold the values ``torch.tensor``
    makes of them: addresses beyond 2**32, fp32 rounding of Python floats, no values at all."""
    cases = [[], [0, 2**47 + 16, -(2**40), 7], [0.1, 1e-40, 3.4e38, -2.5]]
    for values in cases:
        if dtype == torch.int64 and any(isinstance(value, float) for value in values):
            continue
        made = SyncBackend(torch.device("cpu")).pinned_tensor(values, dtype)
        expected = torch.tensor(values, dtype=dtype)
        assert made.dtype == dtype and made.shape == expected.shape and torch.equal(made, expected)


def test_page_buffers_know_their_addresses():
    """A block's buffers' addresses: its address plus each buffer's offset, as the buffers' own data pointers;
    read again with another reader (a fake tensor's reads 0)."""
    backend = SyncBackend(torch.device("cpu"))
    buffers = backend.empty_device([(100, torch.uint8), (3, torch.float32), (5, torch.int64)])
    assert buffers.addresses() == [buffer.data_ptr() for buffer in buffers]
    assert all(address % 16 == 0 for address in buffers.addresses())
    assert buffers.addresses(lambda tensor: 0) == list(buffers.offsets)
