"""Parity, paging invariance and the budget on CUDA: pinned host pages, one copy stream per direction.

The paging tests run on a busy device: large pages, and a long kernel queued on the compute stream before each
``step()`` and ``evict()``, so that every copy is issued while the compute work it must follow is still queued and
every update while its page-in is still running. Mutation checks remove each ordering guard of
:class:`~hf_paged.device.StreamBackend` (``wait_stream``, ``order_after``, the event record) and see the tests fail.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, regression_batches
from kernel_paths import pin_kernel_path, record_kernel_paths

import hf_paged

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = torch.device("cuda")


def train_on(model, optimizer, batches):
    for inputs, targets in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs.to(DEVICE)), targets.to(DEVICE)).backward()
        optimizer.step()


def run(name: str, **paging):
    model = make_mlp().to(DEVICE)
    optimizer = OPTIMIZERS[name](decay_groups(model), **optimizer_kwargs(name, **paging))
    train_on(model, optimizer, regression_batches(6))
    return model, optimizer


BIG_PAGE = 8 * 2**20
"""Bytes of a page on the busy device: a copy of one takes hundreds of microseconds, an update of it far less."""

SLEEP_CYCLES = 50_000_000
"""GPU clock cycles of the kernel queued before each step() and evict() (tens of milliseconds)."""


def make_wide_mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """An MLP (1024 -> 4096 -> 4096 -> 1024, 25M parameters) on the GPU: several 8 MiB pages of any state format."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096),
        torch.nn.GELU(),
        torch.nn.Linear(4096, 4096),
        torch.nn.GELU(),
        torch.nn.Linear(4096, 1024),
    )
    return model.to(DEVICE, dtype)


def wide_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` fixed (input, target) batches for the wide MLP."""
    generator = torch.Generator().manual_seed(1)
    return [tuple(torch.randn(32, 1024, generator=generator) for _ in range(2)) for _ in range(steps)]


def train_on_a_busy_device(name: str, steps: int = 3, evict: bool = False, **paging):
    """Train the wide MLP with a long kernel queued on the compute stream before each step() (and evict()); the
    device bytes of its state are checked against the budget after every page operation."""
    model = make_wide_mlp()
    optimizer = OPTIMIZERS[name](decay_groups(model), **optimizer_kwargs(name, page_size=BIG_PAGE, **paging))
    budget = paging.get("device_budget")
    if budget is not None:
        optimizer._store.add_observer(lambda operation, page: _check_budget(optimizer, budget))
    for inputs, targets in wide_batches(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs.to(DEVICE)), targets.to(DEVICE)).backward()
        torch.cuda._sleep(SLEEP_CYCLES)
        optimizer.step()
        if evict:
            torch.cuda._sleep(SLEEP_CYCLES)
            optimizer.evict()
    torch.cuda.synchronize()
    return model, optimizer


def assert_paging_on_a_busy_device_matches_unlimited(name: str, prefetch: int, compiled: bool = False) -> None:
    """Paged (under a budget of two pages, and with every page evicted after each step) equals unlimited, bitwise."""
    reference_model, reference = train_on_a_busy_device(name, compiled=compiled)
    budget = 2 * BIG_PAGE
    paged_model, paged = train_on_a_busy_device(name, device_budget=budget, prefetch=prefetch, compiled=compiled)
    evicted_model, evicted = train_on_a_busy_device(name, evict=True, compiled=compiled)
    assert paged.paging_stats()["page_outs"] > 0 and evicted.paging_stats()["page_outs"] > 0
    assert paged.paging_stats()["device_bytes"] <= budget
    expected_state = reference.state_dict()
    for model, optimizer in ((paged_model, paged), (evicted_model, evicted)):
        for param, expected in zip(model.parameters(), reference_model.parameters(), strict=True):
            assert torch.equal(param, expected)
        assert_state_equal(optimizer.state_dict(), expected_state)


def _remove_guard(monkeypatch, guard: str) -> None:
    """Make one ordering guard of the CUDA backend a no-op."""
    from hf_paged.device import StreamBackend

    if guard == "wait_stream":  # copies no longer wait for the compute work queued before them
        monkeypatch.setattr(torch.cuda.Stream, "wait_stream", lambda self, stream: None)
    elif guard == "order_after":  # updates no longer wait for their page's copy
        monkeypatch.setattr(StreamBackend, "order_after", lambda self, event: None)
    else:  # events complete at once: nothing waits for a copy
        monkeypatch.setattr(torch.cuda.Event, "record", lambda self, stream=None: None)


def test_adamw_matches_torch_adamw_on_cuda():
    batches = regression_batches(50)
    reference = make_mlp().to(DEVICE)
    train_on(reference, torch.optim.AdamW(decay_groups(reference), lr=1e-2, foreach=False), batches)
    model = make_mlp().to(DEVICE)
    train_on(model, hf_paged.PagedAdamW(decay_groups(model), lr=1e-2, page_size=4096, device_budget=4096), batches)
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert ((param - expected).norm() / expected.norm()).item() < 1e-6


@pytest.mark.parametrize("prefetch", [0, 2])
def test_paging_on_a_busy_device_is_invariant_and_within_budget(optimizer_name, prefetch):
    assert_paging_on_a_busy_device_matches_unlimited(optimizer_name, prefetch)


def test_compiled_paging_on_a_busy_device_is_invariant(optimizer_name, monkeypatch):
    """The compiled PyTorch kernels (pinned: the Triton kernels would take every page)."""
    from hf_paged.kernels import compile_available

    if not compile_available(DEVICE):
        pytest.skip("no usable Triton for torch.compile")
    monkeypatch.setenv("HF_PAGED_COMPILE", "1")
    torch._dynamo.reset()
    compiled = pin_kernel_path(monkeypatch, "compiled")
    paths = record_kernel_paths(monkeypatch)
    assert_paging_on_a_busy_device_matches_unlimited(optimizer_name, prefetch=2, compiled=compiled)
    assert paths["compiled"] > 0 and "triton" not in paths, paths


@pytest.mark.parametrize("guard", ["wait_stream", "order_after", "event record"])
def test_the_busy_device_check_fails_without_each_ordering_guard(monkeypatch, guard):
    _remove_guard(monkeypatch, guard)
    with pytest.raises(AssertionError):
        assert_paging_on_a_busy_device_matches_unlimited("PagedAdamW", prefetch=2)


def test_paged_state_rests_in_pinned_host_memory_on_cuda(optimizer_name):
    _model, optimizer = run(optimizer_name, device_budget=2 * 4096, prefetch=2)
    assert any(page.host is not None and page.host[0].is_pinned() for page in optimizer._store.pages)
    saved = optimizer.state_dict()
    assert all(value.device.type == "cpu" for entry in saved["state"].values() for value in entry.values())


def _check_budget(optimizer, budget):
    assert optimizer._store.device_bytes <= budget


def assert_state_equal(state_a, state_b):
    for index, entry in state_a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, state_b["state"][index][key]), (index, key)


def test_cuda_probe_peaks_and_the_global_peak_left_alone():
    from hf_paged.memory import MemoryProbe

    probe = MemoryProbe(DEVICE, reset_peaks=False)
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEVICE)
    del big
    global_peak = torch.cuda.max_memory_allocated(DEVICE)
    probe.mark("phase")
    small = torch.empty(16 * 2**20, dtype=torch.uint8, device=DEVICE)
    probe.sample()
    del small
    assert probe.peak("phase") >= torch.cuda.memory_allocated(DEVICE) + 16 * 2**20
    assert torch.cuda.max_memory_allocated(DEVICE) == global_peak  # the Trainer's figure is intact
    exact = MemoryProbe(DEVICE)
    exact.mark("phase")
    spike = torch.empty(64 * 2**20, dtype=torch.uint8, device=DEVICE)
    del spike
    assert exact.peak("phase") >= torch.cuda.memory_allocated(DEVICE) + 64 * 2**20
    assert exact.capacity == torch.cuda.mem_get_info(DEVICE)[1]


def test_auto_budget_on_cuda_matches_unlimited():
    reference, _ = run("PagedAdamW8bit")
    auto, optimizer = run("PagedAdamW8bit", device_budget="auto")
    assert optimizer.auto_budget.probe.device == torch.device("cuda", torch.cuda.current_device())
    for mine, theirs in zip(auto.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)


def test_copy_streams_are_one_per_direction_on_cuda():
    from hf_paged.device import StreamBackend

    backend = StreamBackend(DEVICE)
    big_host = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
    big_device = torch.empty(2**30, dtype=torch.uint8, device=DEVICE)
    small_device = torch.ones(1024, device=DEVICE)
    small_host = torch.zeros(1024, pin_memory=True)
    torch.cuda.synchronize(DEVICE)
    page_in = backend.copy_to_device((big_device,), (big_host,))
    write_back = backend.copy_to_host((small_host,), (small_device,))
    write_back.synchronize()
    assert not page_in.query()  # the write-back did not queue behind the 1 GiB page-in
    assert torch.equal(small_host, torch.ones(1024))
    page_in.synchronize()


def test_page_ins_are_ordered_on_the_device_not_waited_for_by_the_host(optimizer_name):
    reference_model, reference = run(optimizer_name)
    model = make_mlp().to(DEVICE)
    paging = optimizer_kwargs(optimizer_name, device_budget=2 * 4096, prefetch=2)
    optimizer = OPTIMIZERS[optimizer_name](decay_groups(model), **paging)
    (store,) = optimizer._store.stores.values()
    backend = store.backend
    page_in_events, waited = [], []  # the events themselves, so that no id is reused
    copy_to_device, wait = backend.copy_to_device, backend.wait

    def recording_copy(dst, src):
        event = copy_to_device(dst, src)
        page_in_events.append(event)
        return event

    def recording_wait(event):
        waited.append(event)
        return wait(event)

    backend.copy_to_device, backend.wait = recording_copy, recording_wait
    train_on(model, optimizer, regression_batches(6))
    assert page_in_events and not {id(event) for event in page_in_events} & {id(event) for event in waited}
    for param, expected in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(param, expected)
    assert_state_equal(optimizer.state_dict(), reference.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_compiled_path_with_budget_and_prefetch_matches_unlimited(monkeypatch, optimizer_name, dtype):
    """The compiled PyTorch kernels, the default where Triton is not (pinned: on a machine with Triton its kernels
    are the default, see test_triton_path_with_budget_and_prefetch_matches_unlimited)."""
    monkeypatch.setenv("HF_PAGED_COMPILE", "1")  # compiled, although the test's state is small
    torch._dynamo.reset()  # a fresh recompile budget: both runs below take the same kernels
    pin_kernel_path(monkeypatch, "compiled")
    paths = record_kernel_paths(monkeypatch)

    def run_compiled(**paging):
        model = make_mlp(dtype=dtype).to(DEVICE)
        optimizer = OPTIMIZERS[optimizer_name](decay_groups(model), **optimizer_kwargs(optimizer_name, **paging))
        for inputs, targets in regression_batches(4, dtype=dtype):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs.to(DEVICE)).float(), targets.to(DEVICE).float()).backward()
            optimizer.step()
        return model, optimizer

    reference_model, reference = run_compiled()
    assert reference.compiled
    model, optimizer = run_compiled(device_budget=4096, prefetch=2)
    assert optimizer.paging_stats()["page_outs"] > 0
    for param, expected in zip(model.parameters(), reference_model.parameters()):
        assert param.dtype == dtype and torch.equal(param, expected)
    assert_state_equal(optimizer.state_dict(), reference.state_dict())
    assert paths["compiled"] > 0 and "triton" not in paths, paths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_triton_path_with_budget_and_prefetch_matches_unlimited(monkeypatch, optimizer_name, dtype, prefetch):
    """The Triton kernels, the default on a CUDA machine with Triton: streamed pages launched a prefetch window at a
    time (at most one launch per page format for the resident pages and one per ``prefetch`` streamed pages, and
    per dtype pair), bitwise the result without a budget."""
    from hf_paged.kernels import triton_module

    if triton_module() is None or not triton_module().runs_on(DEVICE):
        pytest.skip("the Triton kernels do not run here")
    pin_kernel_path(monkeypatch, "triton")

    def run_triton(**paging):
        model = make_mlp(dtype=dtype).to(DEVICE)
        optimizer = OPTIMIZERS[optimizer_name](decay_groups(model), **optimizer_kwargs(optimizer_name, **paging))
        for inputs, targets in regression_batches(4, dtype=dtype):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs.to(DEVICE)).float(), targets.to(DEVICE).float()).backward()
            optimizer.step()
        return model, optimizer

    reference_model, reference = run_triton()
    paths = record_kernel_paths(monkeypatch)
    model, optimizer = run_triton(device_budget=3 * 4096, prefetch=prefetch)
    stats = optimizer.paging_stats()
    assert stats["page_outs"] > 0
    formats = len({page.format for page in optimizer._store.pages})
    # four steps, each a batch of its resident pages and windows of the others (the first step's pages new)
    windows = 4 + -(-(stats["page_ins"] + stats["pages_total"]) // prefetch)
    assert paths["triton"] <= formats * windows, (paths, stats)
    # fp32 pages of fp32 tensors take PyTorch's fused AdamW: all of fp32 PagedAdamW's
    assert paths["triton"] > 0 or (optimizer_name == "PagedAdamW" and dtype == torch.float32), paths
    for param, expected in zip(model.parameters(), reference_model.parameters()):
        assert param.dtype == dtype and torch.equal(param, expected)
    assert_state_equal(optimizer.state_dict(), reference.state_dict())


def test_host_bytes_are_the_pinned_blocks_the_caching_host_allocator_holds():
    from hf_paged.device import StreamBackend

    backend = StreamBackend(DEVICE)
    specs = [(64 * 2**20 + 1, torch.uint8), (2**20 + 3, torch.float32)]
    before = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    buffers = backend.empty_host(specs)
    held = torch.cuda.host_memory_stats()["allocated_bytes.current"] - before
    assert held == backend.host_nbytes(specs) == 128 * 2**20
    assert all(buffer.is_pinned() and buffer.numel() == numel for buffer, (numel, _) in zip(buffers, specs))
    model = make_mlp().to(DEVICE)
    optimizer = hf_paged.PagedAdamW8bit(
        decay_groups(model), lr=1e-2, page_size=4096, block_size=64, min_8bit_size=256, device_budget=4096
    )
    train_on(model, optimizer, regression_batches(2))
    pages = [page for page in optimizer._store.pages if page.host is not None]
    assert optimizer.paging_stats()["host_bytes"] == sum(page.host[0].untyped_storage().nbytes() for page in pages)


def test_capacity_honours_the_per_process_memory_fraction_on_cuda():
    from hf_paged.memory import MemoryProbe

    total = torch.cuda.mem_get_info(DEVICE)[1]
    try:
        torch.cuda.set_per_process_memory_fraction(0.5, DEVICE)
        assert MemoryProbe(DEVICE).capacity == int(total * 0.5)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, DEVICE)
    assert MemoryProbe(DEVICE).capacity == total


def _steps_and_grads(model, batches):
    """Forward and backward of each batch on CUDA, yielding before each optimizer step."""
    for inputs, targets in batches:
        model.zero_grad()
        output = model(inputs.to(DEVICE, next(model.parameters()).dtype))
        torch.nn.functional.mse_loss(output.float(), targets.to(DEVICE).float()).backward()
        yield


class HostWaits:
    """Records the host's waits that ``set_sync_debug_mode`` does not flag: ``torch.cuda.Event.synchronize``
    (cudaEventSynchronize), ``torch.cuda.Stream.synchronize`` and ``torch.cuda.synchronize``, while recording."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[torch.cuda.Event] = []
        self.streams_and_devices: list[str] = []
        self._recording = False
        event_synchronize, stream_synchronize, synchronize = (
            torch.cuda.Event.synchronize,
            torch.cuda.Stream.synchronize,
            torch.cuda.synchronize,
        )

        def on_event(event):
            if self._recording:
                self.events.append(event)
            return event_synchronize(event)

        def on_stream(stream):
            if self._recording:
                self.streams_and_devices.append(f"stream {stream}")
            return stream_synchronize(stream)

        def on_device(device=None):
            if self._recording:
                self.streams_and_devices.append(f"device {device}")
            return synchronize(device)

        monkeypatch.setattr(torch.cuda.Event, "synchronize", on_event)
        monkeypatch.setattr(torch.cuda.Stream, "synchronize", on_stream)
        monkeypatch.setattr(torch.cuda, "synchronize", on_device)

    @contextlib.contextmanager
    def recording(self):
        self._recording = True
        try:
            yield
        finally:
            self._recording = False


def assert_step_never_synchronizes_the_host(monkeypatch, optimizer_name, path, budget, dtype):
    """Steps 3 and 4 on kernel ``path`` (see tests/kernel_paths.py), each behind a long kernel on the compute stream,
    neither sync under ``set_sync_debug_mode`` nor wait on the host for a page-in's event, a stream or the device;
    without a budget they wait for nothing. The steps take ``path`` (PagedAdamW's fp32 pages of fp32 tensors take
    fused AdamW whatever the path)."""
    compiled = pin_kernel_path(monkeypatch, path)
    paths = record_kernel_paths(monkeypatch)
    model = make_mlp(dtype=dtype).to(DEVICE)
    optimizer = OPTIMIZERS[optimizer_name](
        decay_groups(model), **optimizer_kwargs(optimizer_name, device_budget=budget, compiled=compiled)
    )
    waits = HostWaits(monkeypatch)
    page_in_events = []  # the events themselves, so that no id is reused
    for step, _ in enumerate(_steps_and_grads(model, regression_batches(4))):
        if step < 2:  # the first steps compile kernels and allocate pinned host pages
            optimizer.step()
            continue
        if step == 2:
            for store in optimizer._store.stores.values():
                _record_page_ins(store.backend, page_in_events)
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # the step's copies wait for it: none has completed when the step looks
        torch.cuda.set_sync_debug_mode("error")
        try:
            with waits.recording():
                optimizer.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert waits.streams_and_devices == []
    assert set(paths) <= {path, "fused"} and (paths[path] > 0 or optimizer_name == "PagedAdamW"), paths
    page_ins = {id(event) for event in page_in_events}
    assert not [event for event in waits.events if id(event) in page_ins]
    if budget is None:
        assert waits.events == []
    else:
        assert optimizer.paging_stats()["page_outs"] > 0 and page_in_events


def _record_page_ins(backend, events: list) -> None:
    copy_to_device = backend.copy_to_device

    def recording_copy(dst, src):
        event = copy_to_device(dst, src)
        events.append(event)
        return event

    backend.copy_to_device = recording_copy


@pytest.mark.parametrize("path", ["triton", "eager", "compiled"])
@pytest.mark.parametrize("budget", [None, 2 * 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_never_synchronizes_the_host(monkeypatch, optimizer_name, path, budget, dtype):
    from hf_paged.kernels import compile_available, triton_module

    if path == "compiled" and not compile_available(DEVICE):
        pytest.skip("no usable Triton for torch.compile")
    if path == "triton" and (triton_module() is None or not triton_module().runs_on(DEVICE)):
        pytest.skip("the Triton kernels do not run here")
    assert_step_never_synchronizes_the_host(monkeypatch, optimizer_name, path, budget, dtype)


def test_the_host_sync_check_catches_a_host_wait_for_a_page_in(monkeypatch):
    """A backend that makes the host wait for each page-in's event (which ``set_sync_debug_mode`` lets pass)."""
    from hf_paged.device import StreamBackend

    monkeypatch.setattr(StreamBackend, "order_after", lambda self, event: self.wait(event))
    with pytest.raises(AssertionError):
        assert_step_never_synchronizes_the_host(monkeypatch, "PagedAdamW", "eager", 2 * 4096, torch.float32)


@pytest.mark.parametrize("budget", [2 * 4096, "auto"])
def test_bf16_params_on_cuda_page_invariantly_and_match_the_cpu(optimizer_name, budget):
    batches = regression_batches(6, dtype=torch.bfloat16)
    results = []
    for device, paging in ((DEVICE, {}), (DEVICE, {"device_budget": budget}), (torch.device("cpu"), {})):
        model = make_mlp(dtype=torch.bfloat16).to(device)
        optimizer = OPTIMIZERS[optimizer_name](
            decay_groups(model), **optimizer_kwargs(optimizer_name, compiled=False, **paging)
        )
        for inputs, targets in batches:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs.to(device)).float(), targets.to(device).float()).backward()
            optimizer.step()
        results.append([param.detach().cpu() for param in model.parameters()])
    unlimited, paged, on_cpu = results
    for mine, theirs, reference in zip(paged, unlimited, on_cpu):
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, theirs)
        assert ((mine.float() - reference.float()).norm() / reference.float().norm()).item() < 2e-2


def test_default_compiled_path_on_cuda(optimizer_name, monkeypatch):
    """The PyTorch kernels (pinned: the Triton kernels would take every page) compiled where Triton is usable."""
    from hf_paged.kernels import compile_available

    monkeypatch.setenv("HF_PAGED_COMPILE", "1")
    pin_kernel_path(monkeypatch, "compiled")
    paths = record_kernel_paths(monkeypatch)
    default_model, default = run(optimizer_name)  # compiled=None: compiled where Triton is usable
    assert default.compiled == compile_available(DEVICE)
    assert "triton" not in paths and (paths["compiled"] > 0) == compile_available(DEVICE), paths
    eager_model, _ = run(optimizer_name, compiled=False)
    for param, expected in zip(default_model.parameters(), eager_model.parameters()):
        assert ((param - expected).norm() / expected.norm()).item() < 1e-3
    paged_model, paged = run(optimizer_name, device_budget=4096, prefetch=1)
    assert paged.paging_stats()["page_outs"] > 0
    for param, expected in zip(paged_model.parameters(), default_model.parameters()):
        assert torch.equal(param, expected)


@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_workspace_on_cuda_is_what_the_optimizer_reserves(optimizer_name, path, dtype, monkeypatch):
    """The PyTorch kernels' temporaries (pinned: the Triton kernels take none)."""
    from hf_paged.kernels import compile_available

    if path == "compiled" and not compile_available(DEVICE):
        pytest.skip("no usable Triton for torch.compile")
    compiled = pin_kernel_path(monkeypatch, path)
    paths = record_kernel_paths(monkeypatch)
    torch._dynamo.reset()  # Dynamo keeps at most 8 graphs of the kernel function per process, then runs it eagerly
    page_size = 256 * 2**10
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, dtype=dtype, device=DEVICE)) for n in (6 * 2**16 + 37, 300)]
    kwargs = {"page_size": page_size, "compiled": compiled}
    if optimizer_name.endswith("8bit"):
        kwargs.update(block_size=256, min_8bit_size=4096)
    optimizer = OPTIMIZERS[optimizer_name](params, **kwargs)
    for step in range(3):
        for param in params:
            param.grad = torch.randn_like(param)
        if step == 2:  # pages resident and kernels compiled: only the step's temporaries allocate
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(DEVICE)
            torch.cuda.reset_peak_memory_stats(DEVICE)
        optimizer.step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated(DEVICE) - before
    assert optimizer.step_workspace <= 3 * page_size
    assert extra <= optimizer.step_workspace, (extra / page_size, "pages")
    assert set(paths) <= {path, "fused"} and (paths[path] > 0 or optimizer_name == "PagedAdamW"), paths


def _split_mlp(devices):
    """make_mlp() with its first layer on ``devices[0]`` and the rest on ``devices[1]`` (as device_map="auto")."""

    class Split(torch.nn.Module):
        def __init__(self):
            super().__init__()
            mlp = make_mlp()
            self.first = mlp[:2].to(devices[0])
            self.rest = mlp[2:].to(devices[1])

        def forward(self, inputs):
            return self.rest(self.first(inputs.to(devices[0])).to(devices[1]))

    return Split()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("compiled", [False, None])
def test_parameters_on_two_cuda_devices(optimizer_name, compiled, monkeypatch):
    monkeypatch.setenv("HF_PAGED_COMPILE", "1")
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    batches = regression_batches(6)

    def fit(model, **paging):
        optimizer = OPTIMIZERS[optimizer_name](
            decay_groups(model), **optimizer_kwargs(optimizer_name, compiled=compiled, **paging)
        )
        for inputs, targets in batches:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets.to(devices[1])).backward()
            optimizer.step()
        return optimizer

    unlimited_model = _split_mlp(devices)
    unlimited = fit(unlimited_model)
    model = _split_mlp(devices)
    budgets = {"cuda:0": 4096, devices[1]: "8KiB"}
    optimizer = fit(model, device_budget=budgets)
    for param, expected in zip(model.parameters(), unlimited_model.parameters()):
        assert torch.equal(param, expected)
    assert_state_equal(optimizer.state_dict(), unlimited.state_dict())
    stats = optimizer.paging_stats()
    assert set(stats["devices"]) == {"cuda:0", "cuda:1"} and stats["page_outs"] > 0
    assert optimizer.device_budgets == {"cuda:0": 4096, "cuda:1": 8192}
    for device, store in optimizer._store.stores.items():
        assert store.device_bytes <= optimizer.device_budgets[device]
        for page in store.pages:
            if page.device is not None:
                assert all(buffer.device == torch.device(device) for buffer in page.device)

    single_model = make_mlp().to(devices[0])
    kwargs = optimizer_kwargs(optimizer_name, compiled=compiled)
    single = OPTIMIZERS[optimizer_name](decay_groups(single_model), **kwargs)
    single.load_state_dict(optimizer.state_dict())
    assert_state_equal(single.state_dict(), optimizer.state_dict())
    assert optimizer.evict() > 0 and optimizer.paging_stats()["device_bytes"] == 0


def test_blocks_with_a_subnormal_scale_encode_to_zero_codes_on_cuda():
    """Casting the infinite products of a subnormal scale's reciprocal to codes is undefined: on a GPU the codes
    could be anything, where the CPU happens to give zeros."""
    from hf_paged.codecs import Blockwise4bitCodec, Blockwise8bitCodec

    values = (torch.rand(2, 64, generator=torch.Generator().manual_seed(0)) - 0.5) * torch.tensor([[1e-39], [1.0]])
    values = values.to(DEVICE)
    for codec in (Blockwise8bitCodec(64, True), Blockwise4bitCodec(64, True)):
        encoded = tuple(torch.empty(n, dtype=dtype, device=DEVICE) for n, dtype in codec.buffer_specs(128))
        segment = codec.select(encoded, 0, 128)
        codec.encode(values, segment)
        decoded = codec.decode(segment)
        assert torch.equal(decoded[0], torch.zeros(64, device=DEVICE)) and decoded[1].abs().max() > 0


@pytest.mark.parametrize("path", ["triton", "eager", "compiled"])
def test_an_out_of_memory_error_inside_the_step_on_cuda_is_recovered_bitwise(optimizer_name, path, monkeypatch):
    """A page allocation of step 3 fails (the caching allocator's error, injected): the pages left are updated under
    a smaller budget, and the run equals one without the error, with pinned pages and copy streams, on each kernel
    path."""
    from hf_paged.kernels import triton_module

    if path == "triton" and (triton_module() is None or not triton_module().runs_on(DEVICE)):
        pytest.skip("the Triton kernels do not run here")
    kwargs = {"device_budget": 2 * 4096, "compiled": pin_kernel_path(monkeypatch, path)}
    expected_model, _ = run(optimizer_name, **kwargs)
    model = make_mlp().to(DEVICE)
    optimizer = OPTIMIZERS[optimizer_name](decay_groups(model), **optimizer_kwargs(optimizer_name, **kwargs))
    batches = regression_batches(6)
    train_on(model, optimizer, batches[:2])
    (store,) = optimizer._store.stores.values()
    allocate, calls = store.backend.empty_device, [0]

    def failing(specs):
        calls[0] += 1
        if calls[0] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return allocate(specs)

    store.backend.empty_device = failing
    recoveries = []
    optimizer.on_oom_recovery = recoveries.append
    train_on(model, optimizer, batches[2:3])
    store.backend.empty_device = allocate
    train_on(model, optimizer, batches[3:])
    assert len(recoveries) == 1
    for param, expected in zip(model.parameters(), expected_model.parameters()):
        assert torch.equal(param, expected)
    assert optimizer.paging_stats()["device_bytes"] <= 2 * 4096
