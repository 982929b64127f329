"""A step that fails part way (issue 19): no page is left in flight; each chunk is updated whole or not at all and a
parameter's step count advances with its last chunk; an out-of-memory error at any allocation of the step is
recovered with bitwise the result of a step without it."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    OPTIMIZERS,
    decay_groups,
    make_mlp,
    optimizer_kwargs,
    regression_batches,
    train,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hf_paged
from hf_paged.budget import AutoBudget
from hf_paged.memory import MemoryProbe
from hf_paged.store import PageState
from hf_paged.testing import simulated_streams

from memory_utils import GIB, ScriptedMemory

BUDGETS = {"no budget": None, "two pages": 2 * 4096}
SAMPLED_FAILURES = 10
"""Allocations of a step at which an out-of-memory error is injected, per optimizer and budget (spread evenly)."""


class FailingAllocations(TorchDispatchMode):
    """Count the operations that return a new tensor (an allocation) and make those numbered in ``at`` (from 1)
    raise ``torch.OutOfMemoryError``, as a failed allocation would: such an operation writes only its new output.

    ``in_step`` is the count when the step's first page was streamed (``None`` if none was)."""

    def __init__(self, at: set[int] = frozenset()) -> None:
        super().__init__()
        self.at = set(at)
        self.count = 0
        self.in_step: int | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func._schema.is_mutable:
            return result
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor) and t.numel()]
        if any(t.untyped_storage().data_ptr() not in inputs for t in outputs):
            self.count += 1
            if self.count in self.at:
                raise torch.OutOfMemoryError(f"injected at allocation {self.count}")
        return result


def build(name, budget, retries=8):
    model = make_mlp()
    optimizer = OPTIMIZERS[name](decay_groups(model), **optimizer_kwargs(name, device_budget=budget))
    optimizer.oom_retries = retries
    return model, optimizer


def mark_streaming(optimizer, mode: FailingAllocations) -> None:
    """Set ``mode.in_step`` when the step first streams pages (the page stores' ``stream``)."""
    stream = optimizer._store.stream

    def marked(*args, **kwargs):
        if mode.in_step is None:
            mode.in_step = mode.count
        return stream(*args, **kwargs)

    optimizer._store.stream = marked


def failing_step(model, optimizer, batch, mode: FailingAllocations) -> None:
    inputs, targets = batch
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    with mode:
        optimizer.step()


def snapshot(model, optimizer):
    """The parameters in the optimizer's order (its state dict's numbering) and the state dict."""
    params = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]
    assert len(params) == len(list(model.parameters()))
    return params, copy.deepcopy(optimizer.state_dict())


def assert_same(actual, expected):
    (params, state), (expected_params, expected_state) = actual, expected
    for param, expected_param in zip(params, expected_params):
        assert torch.equal(param, expected_param)
    assert state["state"].keys() == expected_state["state"].keys()
    for index, entry in state["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, expected_state["state"][index][key]), (index, key)


def allocations_of_a_step(name, budget) -> FailingAllocations:
    model, optimizer = build(name, budget)
    batches = regression_batches(2)
    train(model, optimizer, batches[:1])
    mode = FailingAllocations()
    mark_streaming(optimizer, mode)
    failing_step(model, optimizer, batches[1], mode)
    return mode


def assert_stopped_in_whole_chunks(model, optimizer, error, before, after, at) -> int:
    """After a step that raised ``error``: every element as before or as after the step, the step count advanced
    exactly for the parameters updated in full, a note saying how many (or nothing, where nothing changed), and no
    page in flight. Returns the number of parameters updated in full."""
    params, state = snapshot(model, optimizer)
    finished = 0
    for index, (param, old, new) in enumerate(zip(params, before[0], after[0])):
        assert torch.where(param == old, True, param == new).all(), (at, index)
        step = state["state"][index]["step"]
        if step == after[1]["state"][index]["step"]:
            finished += 1
            assert torch.equal(param, new), (at, index)
        else:
            assert step == before[1]["state"][index]["step"], (at, index)
    note = "\n".join(getattr(error, "__notes__", []))
    if finished == 0 and all(torch.equal(p, old) for p, old in zip(params, before[0])):
        assert "updated" not in note
    else:
        assert f"updated {finished} of {len(params)} parameters in full" in note, at
    assert not [
        page for store in optimizer._store.stores.values() for page in store.pages if page.state is PageState.PAGING_IN
    ]
    return finished


@pytest.mark.parametrize("name", ["PagedAdamW", "PagedLion"])
def test_what_a_step_allocates_follows_when_its_write_backs_are_seen_complete(name):
    """Why the tests below count a step's allocations on simulated streams whose completion follows the program
    (``"waited"`` or ``"instant"``): a write-back seen complete early lets the step reuse its host block for the next
    one rather than allocate another, so on ``"timed"`` streams one run may count either (a clean-clone CI run counted
    5 allocations of PagedAdamW's step, then found no fifth to fail), while each of the others counts alike."""

    def allocations(completion: str) -> int:
        with simulated_streams(completion=completion):
            return allocations_of_a_step(name, BUDGETS["two pages"]).count

    waited, instant = allocations("waited"), allocations("instant")
    assert instant < waited
    assert (allocations("waited"), allocations("instant")) == (waited, instant)


STREAMS = [("no budget", "waited"), ("two pages", "waited"), ("two pages", "instant")]
"""Budgets, and when the simulated streams see copies complete: a step that streams pages fails at its allocations
with write-backs seen late and early."""


@pytest.mark.parametrize(("budget", "completion"), STREAMS)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_out_of_memory_error_at_any_allocation_of_the_step_is_recovered_bitwise(name, budget, completion):
    """Step 2 fails at one allocation (its step counts read, a page, a gathered copy, a chunk's temporaries, a saved
    copy, a write-back): the step is finished under a smaller budget and steps 2 and 3 equal those of a run without
    the error. Every allocation before the first page is streamed fails in turn, then a sample of the others."""
    with simulated_streams(completion=completion):
        counted = allocations_of_a_step(name, BUDGETS[budget])
        assert counted.in_step is not None and counted.in_step >= 1  # the step counts are read before any page
        reference_model, reference = build(name, BUDGETS[budget])
        batches = regression_batches(3)
        train(reference_model, reference, batches[:2])
        after_two = snapshot(reference_model, reference)
        train(reference_model, reference, batches[2:])
        after_three = snapshot(reference_model, reference)
        streamed = []
        if counted.count > counted.in_step:  # resident pages updated by the host kernels allocate nothing
            streamed = torch.linspace(counted.in_step + 1, counted.count, SAMPLED_FAILURES).tolist()
        points = sorted({*range(1, counted.in_step + 1), *(round(x) for x in streamed)})
        for at in points:
            model, optimizer = build(name, BUDGETS[budget])
            recoveries = []
            optimizer.on_oom_recovery = recoveries.append
            train(model, optimizer, batches[:1])
            failing_step(model, optimizer, batches[1], FailingAllocations({at}))
            assert [r.phase for r in recoveries] == ["optimizer step"], at
            assert_same(snapshot(model, optimizer), after_two)
            assert optimizer.device_budget == BUDGETS[budget]  # a fixed budget is back after the step
            train(model, optimizer, batches[2:])
            assert_same(snapshot(model, optimizer), after_three)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_that_cannot_recover_leaves_whole_chunks_and_counts_of_finished_parameters(name):
    """With no retries, a failure part way leaves every element as before or as after the step, the step count
    advanced exactly for the parameters updated in full, and a note saying so; earlier failures change nothing."""
    with simulated_streams(completion="waited"):
        counted = allocations_of_a_step(name, BUDGETS["two pages"])
        batches = regression_batches(2)
        reference_model, reference = build(name, BUDGETS["two pages"])
        train(reference_model, reference, batches[:1])
        before = snapshot(reference_model, reference)
        train(reference_model, reference, batches[1:])
        after = snapshot(reference_model, reference)
        for at in range(1, counted.count + 1, max(1, counted.count // SAMPLED_FAILURES)):
            model, optimizer = build(name, BUDGETS["two pages"], retries=0)
            train(model, optimizer, batches[:1])
            with pytest.raises(torch.OutOfMemoryError, match="injected") as raised:
                failing_step(model, optimizer, batches[1], FailingAllocations({at}))
            assert_stopped_in_whole_chunks(model, optimizer, raised.value, before, after, at)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_failed_page_allocation_leaves_no_page_in_flight(name):
    with simulated_streams(completion="waited"):
        model = make_mlp()
        optimizer = OPTIMIZERS[name](decay_groups(model), **optimizer_kwargs(name, device_budget=4 * 4096))
        optimizer.oom_retries = 0
        train(model, optimizer, regression_batches(1))
        optimizer.evict()
        (store,) = optimizer._store.stores.values()
        calls = [0]
        empty_device = store.backend.empty_device

        def allocate(specs):
            calls[0] += 1
            if calls[0] == 3:  # the second page prefetched while the first is updated
                raise torch.OutOfMemoryError("injected: page allocation")
            return empty_device(specs)

        store.backend.empty_device = allocate
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            train(model, optimizer, regression_batches(1))
        assert not [page for page in store.pages if page.state is PageState.PAGING_IN]
        optimizer.evict()
        stats = optimizer.paging_stats()
        assert stats["device_bytes"] == 0 and stats["pages_resident"] == 0
        optimizer.set_device_budget(4096)  # one page streamed at a time
        train(model, optimizer, regression_batches(1))
        assert optimizer.paging_stats()["device_bytes"] <= 4096


def test_recoveries_in_the_step_are_reported_through_oom_recovery_and_limited_by_its_retries():
    model, optimizer = build("PagedAdamW8bit", BUDGETS["two pages"])
    reported = []
    recovery = hf_paged.OOMRecovery(optimizer, retries=1, on_recovery=reported.append)
    assert optimizer.oom_retries == 1
    batches = regression_batches(3)
    train(model, optimizer, batches[:1])
    counted = allocations_of_a_step("PagedAdamW8bit", BUDGETS["two pages"])
    with recovery.window(step=2):
        failing_step(model, optimizer, batches[1], FailingAllocations({counted.in_step + 1}))
    assert recovery.recoveries == 1 and [(r.phase, r.step) for r in reported] == [("optimizer step", 2)]

    mode = FailingAllocations({counted.in_step + 1})
    streams = []
    stream = optimizer._store.stream

    def fail_again_when_retried(*args, **kwargs):
        streams.append(mode.count)
        if len(streams) == 2:
            mode.at.add(mode.count + 1)  # the retry's first allocation fails too: more than retries=1 allows
        return stream(*args, **kwargs)

    optimizer._store.stream = fail_again_when_retried
    with pytest.raises(torch.OutOfMemoryError) as raised:
        failing_step(model, optimizer, batches[2], mode)
    assert len(streams) == 2
    assert "the optimizer step stopped after 1 recoveries" in "\n".join(raised.value.__notes__)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_kernel_that_fails_after_writing_leaves_its_chunk_as_it_was(compiled, monkeypatch):
    """A segment kernel that fails once it has written its chunk (as a compiled kernel may, allocating between its
    kernels) is undone, and the recovered step equals one without the failure."""
    name = "PagedAdamW8bit"
    batches = regression_batches(3)

    def run(fail_at):
        model = make_mlp()
        optimizer = OPTIMIZERS[name](decay_groups(model), **optimizer_kwargs(name, compiled=compiled))
        train(model, optimizer, batches[:1])
        calls = [0]
        real = hf_paged.optim.base.segment_kernel

        def failing(rule, codecs, compiled_kernel, device):
            kernel = real(rule, codecs, compiled_kernel, device)

            def call(*args):
                kernel(*args)
                calls[0] += 1
                if calls[0] == fail_at:
                    raise torch.OutOfMemoryError("injected after the kernel's writes")

            call.compiled, call.allocates_nothing = kernel.compiled, kernel.allocates_nothing
            return call

        monkeypatch.setattr(hf_paged.optim.base, "segment_kernel", failing)
        train(model, optimizer, batches[1:])
        monkeypatch.undo()
        return snapshot(model, optimizer), calls[0]

    expected, calls = run(fail_at=None)
    assert calls > 2
    for fail_at in (1, calls // 2, calls):
        assert_same(run(fail_at)[0], expected)


ADAMW = ("PagedAdamW", "PagedAdamW8bit", "PagedAdamW4bit")
"""The optimizers whose fp32 pages run PyTorch's fused AdamW kernel, one call per param group and device."""


def fail_fused_calls(monkeypatch, at: set[int], error: Exception) -> list[int]:
    """Make the calls numbered in ``at`` (from 1) of the fused AdamW kernel raise ``error`` before they write, as a
    failed allocation or launch would; return the count of calls (one element, updated as they come)."""
    real = hf_paged.optim.adamw.adamw_update_multi_
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] in at:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_paged.optim.adamw, "adamw_update_multi_", failing)
    return calls


def fused_calls_of_a_step(name, budget, monkeypatch) -> int:
    model, optimizer = build(name, budget)
    batches = regression_batches(2)
    train(model, optimizer, batches[:1])
    calls = fail_fused_calls(monkeypatch, set(), RuntimeError())
    train(model, optimizer, batches[1:])
    monkeypatch.undo()
    return calls[0]


@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("name", ADAMW)
def test_an_error_in_a_later_fused_call_leaves_whole_parameters_and_says_so(name, budget, monkeypatch):
    """The decay and no-decay groups of resident pages take one fused call each: an error in the second leaves the
    first call's parameters updated in full with their step counts and state advanced, the others (state included)
    as they were or, streamed a page per call, updated in whole pages, and a note that counts them; an error in the
    first call changes nothing."""
    calls = fused_calls_of_a_step(name, BUDGETS[budget], monkeypatch)
    assert calls >= 2
    batches = regression_batches(2)
    reference_model, reference = build(name, BUDGETS[budget])
    train(reference_model, reference, batches[:1])
    before = snapshot(reference_model, reference)
    train(reference_model, reference, batches[1:])
    after = snapshot(reference_model, reference)
    for at in sorted({1, 2, calls}):
        model, optimizer = build(name, BUDGETS[budget], retries=0)
        train(model, optimizer, batches[:1])
        fail_fused_calls(monkeypatch, {at}, RuntimeError("injected in a fused call"))
        with pytest.raises(RuntimeError, match="injected") as raised:
            train(model, optimizer, batches[1:])
        monkeypatch.undo()
        finished = assert_stopped_in_whole_chunks(model, optimizer, raised.value, before, after, at)
        assert (finished == 0) == (at == 1), at
        state = snapshot(model, optimizer)[1]["state"]
        for index, entry in state.items():
            old, new = before[1]["state"][index], after[1]["state"][index]
            for key, value in entry.items():
                if entry["step"] == new["step"]:
                    assert torch.equal(value, new[key]), (at, index, key)
                else:
                    assert torch.where(value == old[key], True, value == new[key]).all(), (at, index, key)


@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("name", ADAMW)
def test_an_out_of_memory_error_in_a_later_fused_call_is_recovered_bitwise(name, budget, monkeypatch):
    """The recovery updates what the failed call and those after it had left, once: steps 2 and 3 equal those of a
    run without the error."""
    calls = fused_calls_of_a_step(name, BUDGETS[budget], monkeypatch)
    batches = regression_batches(3)
    reference_model, reference = build(name, BUDGETS[budget])
    train(reference_model, reference, batches[:2])
    after_two = snapshot(reference_model, reference)
    train(reference_model, reference, batches[2:])
    after_three = snapshot(reference_model, reference)
    for at in sorted({2, calls}):
        model, optimizer = build(name, BUDGETS[budget])
        recoveries = []
        optimizer.on_oom_recovery = recoveries.append
        train(model, optimizer, batches[:1])
        fail_fused_calls(monkeypatch, {at}, torch.OutOfMemoryError("injected in a fused call"))
        train(model, optimizer, batches[1:2])
        monkeypatch.undo()
        assert [r.phase for r in recoveries] == ["optimizer step"], at
        assert_same(snapshot(model, optimizer), after_two)
        train(model, optimizer, batches[2:])
        assert_same(snapshot(model, optimizer), after_three)


def test_a_loop_that_goes_on_after_a_failed_step_gets_the_automatic_budget_of_a_good_step(monkeypatch):
    """After a step that raises, the state is evicted down to the budget of the coming forward/backward and that
    forward/backward is measured from the step's end, as after a good step: the failed step's own memory neither
    runs the forward under the step's budget nor counts as a forward/backward peak."""
    mib = 2**20

    def run(fail: bool) -> list[tuple[int | None, int, int | None]]:
        model = make_mlp()
        memory = ScriptedMemory(total=1 * GIB, level=100 * mib)
        auto = AutoBudget(safety_margin=0.0, window=1, probe=MemoryProbe("cpu", memory=memory))
        optimizer = hf_paged.PagedAdamW(decay_groups(model), lr=1e-2, page_size=4096, device_budget=auto)
        real = hf_paged.optim.adamw.adamw_update_multi_
        failing = [False]

        def kernel(*args, **kwargs):
            memory.spike(900 * mib, after=150 * mib)  # the step's own peak, above every forward/backward's
            if failing[0]:
                raise RuntimeError("injected in a fused call")
            return real(*args, **kwargs)

        monkeypatch.setattr(hf_paged.optim.adamw, "adamw_update_multi_", kernel)
        seen = []
        for step, (batch, peak) in enumerate(zip(regression_batches(4), (600, 500, 400, 300))):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
            memory.spike(peak * mib, after=150 * mib)  # forward and backward
            failing[0] = fail and step == 1
            try:
                optimizer.step()
            except RuntimeError as error:
                assert failing[0] and "injected" in str(error)
            seen.append((optimizer.device_budget, optimizer.paging_stats()["device_bytes"], auto.predicted_peak))
        monkeypatch.undo()
        return seen

    expected = run(fail=False)
    state_bytes = expected[-1][1]  # all of it: these budgets keep every page on the device
    resting = [(1024 - 600) * mib] + [(1024 - peak) * mib + state_bytes for peak in (500, 400, 300)]
    assert [budget for budget, _, _ in expected] == resting  # the peak of each forward/backward, state excluded
    assert run(fail=True) == expected
