"""The memory probe, its marks and peaks, and the automatic device budget of the optimizers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import hf_paged
from hf_paged.budget import AutoBudget
from hf_paged.device import HostMemory
from hf_paged.integrations.trainer import parse_optim_args
from hf_paged.memory import CAPACITY_ENV, MemoryProbe, probe_for

from memory_utils import GIB, ScriptedMemory

MIB = 2**20


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_probe_of_missing_accelerator_raises_instead_of_reading_zero():
    assert torch.cuda.memory_allocated() == 0  # what the probe must not pass on as a measurement
    with pytest.raises(RuntimeError, match="'cuda'.*no cuda device"):
        MemoryProbe("cuda")


def test_host_probe_reads_this_process():
    host = HostMemory()
    probe = MemoryProbe("cpu")
    with open("/proc/self/status") as status:
        rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    assert abs(probe.allocated() - rss_kib * 1024) < 64 * MIB
    assert probe.capacity == host.total() > probe.allocated()
    assert 0 < probe.free() <= probe.capacity
    assert probe.host_resident() == pytest.approx(probe.allocated(), abs=64 * MIB)


def _touch(nbytes: int) -> torch.Tensor:
    return torch.ones(nbytes // 4, dtype=torch.float32)


@pytest.mark.skipif(not HostMemory().can_reset_peak, reason="needs /proc/self/clear_refs")
def test_host_peaks_between_overlapping_marks():
    probe = MemoryProbe("cpu")
    start = probe.allocated()
    probe.mark("outer")
    big = _touch(256 * MIB)
    del big
    probe.mark("inner")
    small = _touch(64 * MIB)
    del small
    outer, inner = probe.peak("outer"), probe.peak("inner")
    assert outer >= start + 240 * MIB
    assert probe.allocated() + 56 * MIB <= inner < start + 200 * MIB
    probe.mark("after")
    assert probe.peak("after") < start + 64 * MIB


def test_scripted_peaks_with_resets_are_exact_for_every_mark():
    memory = ScriptedMemory(level=1 * GIB)
    probe = MemoryProbe("cpu", memory=memory)
    probe.mark("step")
    memory.spike(5 * GIB, after=2 * GIB)
    probe.mark("optimizer")
    memory.spike(3 * GIB, after=2 * GIB)
    assert probe.peak("optimizer") == 3 * GIB
    assert probe.peak("step") == 5 * GIB
    assert memory.resets == 2


def test_scripted_peaks_without_resets_leave_the_global_peak_alone():
    memory = ScriptedMemory(level=1 * GIB)
    memory.spike(8 * GIB, after=1 * GIB)
    probe = MemoryProbe("cpu", memory=memory, reset_peaks=False)
    probe.mark("phase")
    memory.spike(4 * GIB, after=2 * GIB)
    probe.sample()
    assert probe.peak("phase") == 2 * GIB  # below the earlier global peak: only what was sampled
    memory.spike(9 * GIB, after=1 * GIB)
    assert probe.peak("phase") == 9 * GIB  # a new global high is exact
    assert memory.resets == 0 and memory.peak() == 9 * GIB


def test_capacity_from_argument_environment_and_device(monkeypatch):
    memory = ScriptedMemory(total=16 * GIB)
    monkeypatch.delenv(CAPACITY_ENV, raising=False)
    assert MemoryProbe("cpu", memory=memory).capacity == 16 * GIB
    monkeypatch.setenv(CAPACITY_ENV, "6GiB")
    assert MemoryProbe("cpu", memory=memory).capacity == 6 * GIB
    assert MemoryProbe("cpu", capacity="2GiB", memory=memory).capacity == 2 * GIB
    with pytest.raises(ValueError, match="capacity must be more than 0"):
        MemoryProbe("cpu", capacity=0, memory=memory)
    monkeypatch.setenv(CAPACITY_ENV, "lots")
    with pytest.raises(ValueError, match=CAPACITY_ENV):
        _ = MemoryProbe("cpu", memory=memory).capacity
    for empty in ("0", "0GiB"):  # refused as capacity=0 is
        monkeypatch.setenv(CAPACITY_ENV, empty)
        with pytest.raises(ValueError, match=f"{CAPACITY_ENV} must be more than 0 bytes"):
            _ = MemoryProbe("cpu", memory=memory).capacity


def test_probe_for_shares_one_probe_per_device():
    assert probe_for("cpu") is probe_for(torch.device("cpu"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"safety_margin": 1.0}, "safety_margin"),
        ({"safety_margin": -0.1}, "safety_margin"),
        ({"window": 0}, "window"),
        ({"capacity": "big"}, "capacity"),
    ],
)
def test_auto_budget_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AutoBudget(**kwargs)


def test_auto_budget_arithmetic():
    memory = ScriptedMemory(total=10 * GIB, level=3 * GIB)
    budget = AutoBudget(safety_margin=0.1, window=2, probe=MemoryProbe("cpu", memory=memory))
    assert budget.usable == 9 * GIB
    assert budget.resting_budget() is None
    budget.observe(6 * GIB)
    budget.observe(7 * GIB)
    assert budget.resting_budget() == 2 * GIB
    budget.observe(5 * GIB)  # the window forgets 6 GiB, keeps 7 GiB
    assert budget.predicted_peak == 7 * GIB
    budget.observe(4 * GIB)
    assert budget.resting_budget() == 4 * GIB
    # during a step: 3 GiB allocated of which 1 GiB is optimizer state, 1 GiB workspace
    assert budget.step_budget(state_bytes=1 * GIB, workspace=1 * GIB, minimum=MIB) == 6 * GIB
    memory.set_level(12 * GIB)
    assert budget.step_budget(state_bytes=0, workspace=0, minimum=MIB) == MIB


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 64))


def test_auto_budget_evicts_after_each_step_and_streams_during_it():
    """With room for no state between steps, the state rests on the host and streams in for every step."""
    reference, model = _model(), _model()
    memory = ScriptedMemory(total=1 * GIB, level=900 * MIB)
    auto = AutoBudget(safety_margin=0.0, probe=MemoryProbe("cpu", memory=memory))
    paged = hf_paged.PagedAdamW(model.parameters(), lr=1e-2, page_size="16KiB", device_budget=auto)
    unlimited = hf_paged.PagedAdamW(reference.parameters(), lr=1e-2, page_size="16KiB")
    for step in range(3):
        inputs = torch.randn(4, 128)
        for net, optimizer in ((model, paged), (reference, unlimited)):
            net(inputs).square().mean().backward()
            memory.spike(1100 * MIB, after=950 * MIB)  # the forward/backward peak leaves nothing for state
            optimizer.step()
            optimizer.zero_grad()
        stats = paged.paging_stats()
        pages = stats["pages_total"]
        assert stats["device_bytes"] == 0 and stats["device_budget"] == 0
        assert stats["page_outs"] == pages * (step + 1)
        assert stats["page_ins"] == pages * step
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)


def test_auto_budget_keeps_what_fits_and_follows_the_measurements():
    model = _model()
    memory = ScriptedMemory(total=1 * GIB, level=100 * MIB)
    auto = AutoBudget(safety_margin=0.0, window=1, probe=MemoryProbe("cpu", memory=memory))
    optimizer = hf_paged.PagedAdamW(model.parameters(), page_size="16KiB", device_budget=auto)
    state_bytes = sum(p.numel() for p in model.parameters()) * 8
    model(torch.randn(4, 128)).sum().backward()
    memory.spike(600 * MIB, after=150 * MIB)
    optimizer.step()
    assert optimizer.device_budget == 1 * GIB - 600 * MIB
    assert optimizer.paging_stats()["device_bytes"] >= state_bytes
    budget = 1 * GIB - 600 * MIB
    memory.set_level(1 * GIB - 100 * 2**10)  # a spike now leaves room for less than the state
    memory.set_level(150 * MIB)
    optimizer.step()  # no gradients changed: the step still measures and rebudgets
    assert optimizer.device_budget < budget
    assert optimizer.paging_stats()["device_bytes"] <= optimizer.device_budget


def test_set_device_budget_switches_between_auto_and_fixed():
    optimizer = hf_paged.PagedAdamW8bit(_model().parameters(), page_size="16KiB")
    optimizer.set_device_budget("auto")
    auto = optimizer.auto_budget
    assert isinstance(auto, AutoBudget)
    with pytest.raises(ValueError, match="budget='lots' is not a size"):
        optimizer.set_device_budget("lots")
    assert optimizer.auto_budget is auto  # a bad budget leaves the optimizer as it was
    optimizer.set_device_budget("64KiB")
    assert optimizer.auto_budget is None and optimizer.device_budget == 64 * 2**10
    assert optimizer.prepare_forward() == 0
    with pytest.raises(ValueError, match="device_budget='autp' is not a size.*'auto'"):
        hf_paged.PagedAdamW(_model().parameters(), device_budget="autp")


def test_optim_args_accept_auto():
    assert parse_optim_args({"device_budget": "auto"}, hf_paged.PagedAdamW8bit) == {"device_budget": "auto"}
    assert parse_optim_args({"device_budget": "AUTO"}, hf_paged.PagedLion) == {"device_budget": "auto"}


class SharedDevice(ScriptedMemory):
    """A scripted device whose level is the activations of the moment plus every optimizer's state on it (kept
    up to date by a page observer), with ``other_process`` bytes held by another process."""

    def __init__(self, total: int, other_process: int = 0) -> None:
        super().__init__(total=total)
        self.other_process = other_process
        self.activations = 0
        self.optimizers: list = []
        self.peaks_with_state: list[int] = []

    def attach(self, optimizer) -> None:
        self.optimizers.append(optimizer)
        optimizer._store.add_observer(lambda operation, page: self.update())

    def update(self) -> None:
        self.set_level(self.activations + sum(o.paging_stats()["device_bytes"] for o in self.optimizers))

    def forward_backward(self, activations: int) -> None:
        self.activations = activations
        self.update()
        self.peaks_with_state.append(self.level)
        self.activations = 0
        self.update()

    def free(self) -> int:
        return self.total() - self.level - self.other_process


def _two_layer(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))  # 8320 parameters, 65 KiB of state


@pytest.mark.parametrize("other_process", [0, 20 * 4096])
def test_automatic_budgets_of_two_optimizers_and_another_process_share_one_device(other_process):
    """Two optimizers with automatic budgets on one device of 60 pages, activations of 30 pages and, in one case,
    another process holding 20 pages: at every forward/backward peak everything fits on the device."""
    page, capacity, activations = 4096, 60 * 4096, 30 * 4096
    device = SharedDevice(total=capacity, other_process=other_process)
    probe = MemoryProbe("cpu", memory=device)
    models = [_two_layer(0), _two_layer(1)]
    optimizers = [
        hf_paged.PagedAdamW(
            model.parameters(), lr=1e-2, page_size=page, device_budget=AutoBudget(safety_margin=0.0, probe=probe)
        )
        for model in models
    ]
    for optimizer in optimizers:
        device.attach(optimizer)
    inputs = torch.randn(4, 64)
    for _ in range(6):
        for model in models:
            model(inputs).square().mean().backward()
        device.forward_backward(activations)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for optimizer in optimizers:
        assert optimizer.auto_budget.predicted_peak >= activations
    assert max(device.peaks_with_state) + other_process <= capacity, device.peaks_with_state
    state = sum(o.paging_stats()["pages_total"] for o in optimizers) * page
    assert state + activations + other_process > capacity  # not everything fits: the budgets had to share


def test_one_automatic_budget_is_not_taken_by_two_optimizers():
    """Each optimizer's budget is its share of the room: one AutoBudget for two would give each all of it."""
    probe = MemoryProbe("cpu", memory=ScriptedMemory())
    shared = AutoBudget(probe=probe)
    first = hf_paged.PagedAdamW(_two_layer(0).parameters(), page_size=4096, device_budget=shared)
    with pytest.raises(ValueError, match="device_budget: this AutoBudget already sets another optimizer's budget"):
        hf_paged.PagedAdamW(_two_layer(1).parameters(), page_size=4096, device_budget=shared)
    first.set_device_budget(None)  # handed back: another optimizer may take it
    hf_paged.PagedAdamW(_two_layer(1).parameters(), page_size=4096, device_budget=shared)


def test_an_optimizer_that_leaves_automatic_budgets_no_longer_shares_the_device():
    """Even where its AutoBudget lives on (the user's, kept to read its measurements)."""
    probe = MemoryProbe("cpu", memory=ScriptedMemory())
    budgets = [AutoBudget(probe=probe), AutoBudget(probe=probe)]
    optimizers = [
        hf_paged.PagedAdamW(_two_layer(seed).parameters(), page_size=4096, device_budget=budget)
        for seed, budget in enumerate(budgets)
    ]
    assert not budgets[1].alone() and budgets[1].share() == 0.5
    optimizers[0].set_device_budget("1MiB")
    assert budgets[1].alone() and budgets[1].share() == 1.0


def test_a_plan_for_another_device_is_refused_when_the_budget_binds():
    """A plan given to the constructor is checked once the budget knows its device: a plan of the CPU (``plan``'s
    default device) on a budget measuring an accelerator is a mistake the budget names."""
    cuda_plan = SimpleNamespace(device="cuda", forward_backward_peak_without_state=1 * GIB)
    with pytest.raises(ValueError, match="planned_peak: the plan is for cuda, this budget measures cpu"):
        hf_paged.PagedAdamW(_two_layer(0).parameters(), device_budget=AutoBudget(planned_peak=cuda_plan))


def test_an_automatic_budget_names_a_capacity_it_cannot_have():
    with pytest.raises(ValueError, match=r"capacity must be at least 1 byte \(None: the device's\), got 0"):
        AutoBudget(capacity=0)
    unbound = AutoBudget(planned_peak="1GiB")
    for read in (lambda: unbound.usable, unbound.resting_budget):
        with pytest.raises(ValueError, match="capacity: this AutoBudget measures no device yet"):
            read()
    assert AutoBudget(capacity="2GiB", safety_margin=0.5).usable == 1 * GIB


def test_a_copy_keeps_the_measured_peaks_and_leaves_the_original_measuring(monkeypatch):
    import copy

    import hf_paged.memory

    memory = ScriptedMemory(total=1 * GIB, level=100 * MIB)
    monkeypatch.setitem(hf_paged.memory._probes, "cpu", MemoryProbe("cpu", memory=memory))  # the shared probe
    model = _model()
    optimizer = hf_paged.PagedAdamW(model.parameters(), page_size="16KiB", device_budget="auto")
    optimizer.auto_budget.safety_margin = 0.0
    model(torch.randn(4, 128)).sum().backward()
    memory.spike(600 * MIB, after=150 * MIB)
    optimizer.step()
    assert optimizer.auto_budget.predicted_peak is not None
    memory.spike(700 * MIB, after=150 * MIB)  # the original's next forward/backward
    duplicate = copy.deepcopy(optimizer)
    assert duplicate.auto_budget.predicted_peak == optimizer.auto_budget.predicted_peak
    optimizer.step()  # measured from the end of its own last step, whatever the copy marked since
    assert optimizer.auto_budget.predicted_peak >= 700 * MIB - 100 * MIB


def test_a_planned_peak_budgets_step_one_and_measured_peaks_take_over():
    memory = ScriptedMemory(total=10 * GIB, level=3 * GIB)
    budget = AutoBudget(safety_margin=0.1, window=2, probe=MemoryProbe("cpu", memory=memory), planned_peak="6GiB")
    assert budget.planned_peak == 6 * GIB
    assert budget.resting_budget() == 3 * GIB  # before any step: 9 GiB usable less the plan
    budget.observe(None)  # a step without an exact peak: the plan still stands
    assert budget.resting_budget() == 3 * GIB
    budget.observe(7 * GIB)  # a higher measured peak takes over at once; the plan has left the window
    assert budget.predicted_peak == 7 * GIB
    lower = AutoBudget(window=2, probe=MemoryProbe("cpu", memory=memory))
    lower.expect(6 * GIB)
    lower.observe(4 * GIB)
    assert lower.predicted_peak == 6 * GIB  # a lower one once the plan leaves the window
    lower.observe(4 * GIB)
    assert lower.predicted_peak == 4 * GIB


@pytest.mark.parametrize(
    "planned, error, message",
    [
        (-1, ValueError, "planned_peak"),
        ("lots", ValueError, "planned_peak"),
        (True, TypeError, "planned_peak must be bytes"),
    ],
)
def test_a_planned_peak_is_validated(planned, error, message):
    with pytest.raises(error, match=message):
        AutoBudget(planned_peak=planned)


def test_a_plan_budgets_the_forward_after_step_one():
    """The resting budget after step 1 leaves room for the planned peak where step 1 measured less (its batch, a
    warm-up), and the plan a budget takes is its forward/backward peak less the optimizer state it held."""

    def build(model: torch.nn.Module) -> hf_paged.PagedAdamW:
        return hf_paged.PagedAdamW(model.parameters(), page_size="16KiB", compiled=False)

    planned = hf_paged.plan(_model, lambda: torch.randn(4, 128), build, loss=lambda model, batch: model(batch).sum())
    from_plan = AutoBudget(probe=MemoryProbe("cpu", memory=ScriptedMemory()), planned_peak=planned)
    second_forward = planned.phases[2]  # step 2's forward and backward, beside the state of step 1
    assert second_forward.by_kind["optimizer_state"] > 0
    assert from_plan.planned_peak == second_forward.peak_bytes - second_forward.by_kind["optimizer_state"]
    with pytest.raises(ValueError, match="planned_peak: the plan is for cpu, this budget measures cuda"):
        AutoBudget(probe=MemoryProbe("cuda:0", memory=ScriptedMemory()), planned_peak=planned)
    budgets = []
    for plan_given in (False, True):
        memory = ScriptedMemory(total=1 * GIB, level=100 * MIB)
        auto = AutoBudget(safety_margin=0.0, probe=MemoryProbe("cpu", memory=memory))
        if plan_given:
            auto.expect("600MiB")
        model = _model()
        optimizer = hf_paged.PagedAdamW(model.parameters(), page_size="16KiB", device_budget=auto)
        model(torch.randn(4, 128)).sum().backward()
        memory.spike(400 * MIB, after=150 * MIB)  # step 1's forward/backward, lower than planned
        optimizer.step()
        budgets.append(optimizer.device_budget)
    assert budgets == [1 * GIB - 400 * MIB, 1 * GIB - 600 * MIB]
