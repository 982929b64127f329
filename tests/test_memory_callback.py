"""MemorySpikeCallback: spike detection and budget decisions on a scripted sequence, and real Trainer runs."""

from __future__ import annotations

import glob
import json
import logging
import os
from functools import partial
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import Trainer, TrainerControl, TrainerState

import hf_paged
import hf_paged.memory
from hf_paged.budget import AutoBudget
from hf_paged.callbacks import MemorySpikeCallback
from hf_paged.callbacks.spikes import SpikeDetector
from hf_paged.memory import MemoryProbe

from memory_utils import GIB, ScriptedMemory
from trainer_utils import tiny_llama, token_dataset, training_args

KIB = 2**10
MIB = 2**20


def test_detector_flags_steps_above_the_robust_baseline():
    detector = SpikeDetector(window=5, warmup=3, margin=0.1)
    peaks = [100, 102, 180, 101, 99, 150, 100, 109, 120]
    flagged = [detector.observe(step, peak) for step, peak in enumerate(peaks, start=1)]
    assert [spike.step for spike in flagged if spike] == [6, 9]  # step 3 falls in the warm-up
    assert detector.spikes[0].size == 150 - 101 and detector.spikes[1].size == 120 - 101
    restored = SpikeDetector(window=5, warmup=3, margin=0.1)
    restored.load_state(json.loads(json.dumps(detector.state())))
    assert restored.baseline() == detector.baseline() and restored.spikes == detector.spikes


@pytest.mark.parametrize(
    "kwargs", [{"window": 0}, {"warmup": 0}, {"margin": -1.0}, {"sigmas": float("nan")}, {"window": 3, "warmup": 4}]
)
def test_detector_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=f"^{next(reversed(kwargs))} must be"):
        SpikeDetector(**kwargs)


def test_a_window_as_long_as_the_warmup_judges_peaks():
    """A warm-up that fills the window judges the peaks after it (a longer one, which no window of peaks could
    reach, is refused above)."""
    detector = SpikeDetector(window=3, warmup=3)
    flagged = [detector.observe(step, peak) for step, peak in enumerate([100, 100, 100, 10_000], start=1)]
    assert [spike.step for spike in flagged if spike] == [4]
    with pytest.raises(ValueError, match=r"^warmup must be at most window \(3\)"):
        MemorySpikeCallback(window=3)


class _Args:
    device = torch.device("cpu")
    skip_memory_metrics = True

    def __init__(self, output_dir):
        self.output_dir = str(output_dir)


def run_step(callback, args, state, optimizer, forward_backward) -> None:
    """One training step through the callback's events as the Trainer sends them; ``forward_backward()`` runs
    between the step's start and the optimizer's."""
    control = TrainerControl()
    callback.on_step_begin(args, state, control, optimizer=optimizer)
    forward_backward()
    callback.on_pre_optimizer_step(args, state, control, optimizer=optimizer)
    optimizer.step()
    optimizer.zero_grad()
    callback.on_optimizer_step(args, state, control, optimizer=optimizer)
    state.global_step += 1
    callback.on_step_end(args, state, control, optimizer=optimizer)


def _forward_backward(model, memory, peak: float, after: float) -> None:
    """The model's forward and backward, the scripted memory peaking at ``peak`` bytes and left at ``after``."""
    model(torch.randn(2, 256)).sum().backward()
    memory.spike(int(peak), after=int(after))


def test_scripted_sequence_drives_spikes_budget_and_warning(tmp_path, monkeypatch, caplog):
    """Forward/backward peaks with two spikes: the callback flags them and the budget makes room."""
    memory = ScriptedMemory(total=4 * GIB, level=1 * GIB)
    monkeypatch.setitem(hf_paged.memory._probes, "cpu", MemoryProbe("cpu", memory=memory))
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optimizer = hf_paged.PagedAdamW(model.parameters(), page_size="16KiB", device_budget=AutoBudget(window=3))
    callback = MemorySpikeCallback(window=4, warmup=3, spike_margin=0.1, safety_margin=0.25)
    args, state, control = _Args(tmp_path), TrainerState(), TrainerControl()
    peaks = [int(gib * GIB) for gib in (2.0, 2.0, 2.1, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 3.7)]
    peaks[4] = 3 * GIB + 256 * 2**10  # with 514 KiB of state resident: leaves 258 KiB of the 3 GiB usable
    callback.on_train_begin(args, state, control, optimizer=optimizer)
    budgets = []
    with caplog.at_level(logging.WARNING):
        for peak in peaks:
            run_step(callback, args, state, optimizer, partial(_forward_backward, model, memory, peak, 1.2 * GIB))
            budgets.append(optimizer.device_budget)
    rows = callback.rows
    assert [row["step"] for row in rows if row["spike"]] == [5, 10]
    assert [row["forward_backward_peak"] for row in rows] == peaks
    # the budget: 3 GiB usable (4 GiB less 25%) less the highest of the last 3 peaks without state
    state_bytes = [row["state_bytes_after_step"] for row in rows]
    for step, budget in enumerate(budgets):
        window = range(max(0, step - 2), step + 1)
        predicted = max(peaks[i] - (rows[i]["state_bytes_forward"] or 0) for i in window)
        assert budget == max(0, 3 * GIB - predicted)
        assert state_bytes[step] <= budget
    assert rows[4]["state_bytes_after_step"] < rows[3]["state_bytes_after_step"]  # evicted for the spike's window
    warnings = [record for record in caplog.records if "within 10% of the device capacity" in record.message]
    assert len(warnings) == 1 and "step 10" in warnings[0].message  # 3.7 GiB is within 10% of 4 GiB
    assert callback.summary()["spikes"] == 2


def _train(tmp_path, callback, **overrides):
    args = training_args(tmp_path, optim="hf_paged_adamw_8bit", **overrides)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset(32), callbacks=[callback])
    trainer.train()
    return trainer


def _tensorboard_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (event_file,) = glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True)
    events = EventAccumulator(event_file)
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_trainer_run_logs_memory_to_history_tensorboard_and_files(tmp_path):
    callback = MemorySpikeCallback(warmup=2)
    trainer = _train(
        tmp_path,
        callback,
        max_steps=4,
        gradient_accumulation_steps=2,
        report_to=["tensorboard"],
    )
    assert trainer.callback_handler.callbacks[0] is callback
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 4
    optimizer = trainer.optimizer.optimizer
    for entry in logged:
        assert entry["memory/forward_backward_peak_gib"] > 0 and entry["memory/optimizer_step_peak_gib"] > 0
        assert entry["memory/capacity_gib"] == hf_paged.memory.probe_for("cpu").capacity / GIB
        assert entry["memory/optimizer_device_bytes"] == optimizer.paging_stats()["device_bytes"] > 0
        assert entry["memory/spikes"] == 0
    scalars = _tensorboard_scalars(tmp_path / "runs")
    assert [step for step, _ in scalars["train/memory/forward_backward_peak_gib"]] == [1, 2, 3, 4]
    device_bytes = scalars["train/memory/optimizer_device_bytes"]
    assert [value for _, value in device_bytes] == [entry["memory/optimizer_device_bytes"] for entry in logged]
    with open(tmp_path / "memory_timeline.jsonl") as file:
        rows = [json.loads(line) for line in file]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(row["micro_batches"] == 2 for row in rows)
    assert [row["forward_backward_peak"] / GIB for row in rows] == [
        entry["memory/forward_backward_peak_gib"] for entry in logged
    ]
    with Image.open(tmp_path / "memory_timeline.png") as image:
        assert image.format == "PNG" and image.size == (1000, 600)
    summary = callback.summary()
    assert summary["steps"] == 4 and summary["plot_path"] == str(tmp_path / "memory_timeline.png")


def test_auto_budget_with_small_capacity_pages_out_before_forward_and_in_during_step(tmp_path, caplog):
    reference = _train(tmp_path / "unlimited", MemorySpikeCallback(plot=False), max_steps=4)
    callback = MemorySpikeCallback(device_capacity="1MiB", plot=False)
    with caplog.at_level(logging.WARNING):
        trainer = _train(tmp_path / "auto", callback, max_steps=4, optim_args="device_budget=auto")
    rows = callback.rows
    pages = trainer.optimizer.optimizer.paging_stats()["pages_total"]
    for row in rows[1:]:
        assert row["state_bytes_forward"] == 0 and row["device_budget"] == 0
        assert row["page_ins_during_step"] == pages
        assert row["page_outs"] == pages and row["bytes_to_host"] > 0
    assert rows[0]["page_outs"] == pages  # even the first step ends with the state on the host
    assert sum("within 10% of the device capacity" in record.message for record in caplog.records) == 1
    for mine, theirs in zip(trainer.model.parameters(), reference.model.parameters()):
        assert torch.equal(mine, theirs)  # paging never changes results


def test_callback_state_survives_resume(tmp_path):
    first = MemorySpikeCallback(warmup=2, plot=False)
    _train(tmp_path, first, max_steps=4, save_strategy="steps", save_steps=2)
    with open(tmp_path / "checkpoint-2" / "trainer_state.json") as file:
        saved = json.load(file)["stateful_callbacks"]["MemorySpikeCallback"]
    assert saved["args"]["warmup"] == 2 and len(saved["attributes"]["detector_state"]["peaks"]) == 2
    second = MemorySpikeCallback(warmup=2, plot=False)
    args = training_args(
        tmp_path,
        optim="hf_paged_adamw_8bit",
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        restore_callback_states_from_checkpoint=True,
    )
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset(32), callbacks=[second])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    (restored,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MemorySpikeCallback)]
    assert len(restored.detector.peaks) == 4
    with open(tmp_path / "memory_timeline.jsonl") as file:
        assert [json.loads(line)["step"] for line in file] == [1, 2, 3, 4]


def test_a_callback_used_for_a_second_run_from_the_start_measures_it_afresh(tmp_path):
    """As ``Trainer.hyperparameter_search`` reuses the callbacks for every trial: the second run's timeline, detector
    and summary hold its own steps only, not the first run's too."""
    callback = MemorySpikeCallback(warmup=2, plot=False)
    for run in ("first", "second"):
        _train(tmp_path / run, callback, max_steps=3)
        with open(tmp_path / run / "memory_timeline.jsonl") as file:
            assert [json.loads(line)["step"] for line in file] == [1, 2, 3]
        assert [row["step"] for row in callback.rows] == [1, 2, 3] and len(callback.detector.peaks) == 3
        assert callback.summary()["steps"] == 3


class _DeviceWithPages:
    """A simulated accelerator's memory: what training allocates (``level``) plus the optimizer's resident pages."""

    can_reset_peak = True

    def __init__(self, total: int) -> None:
        self._total, self.level, self.optimizer, self._peak = total, 0, None, 0

    def allocated(self) -> int:
        pages = self.optimizer.paging_stats()["device_bytes"] if self.optimizer is not None else 0
        self._peak = max(self._peak, self.level + pages)
        return self.level + pages

    reserved = resident = allocated

    def peak(self) -> int:
        self.allocated()
        return self._peak

    def reset_peak(self) -> None:
        self._peak = 0
        self.allocated()

    def total(self) -> int:
        return self._total

    def free(self) -> int:
        return self._total - self.allocated()

    def set(self, level: int) -> None:
        self.level = level
        self.allocated()


def test_state_an_automatic_budget_lets_back_is_no_spike(tmp_path, monkeypatch):
    """One real spike (step 6) makes the automatic budget move the state to the host until the spike leaves its
    window; the state's return raises the measured peaks again by its bytes, which is the optimizer's own doing,
    not a spike: only step 6 is flagged (before, every step of the state's return was)."""
    memory = _DeviceWithPages(total=4 * MIB)
    monkeypatch.setitem(hf_paged.memory._probes, "cpu", MemoryProbe("cpu", memory=memory))
    model = torch.nn.Linear(256, 256)  # 514 KiB of fp32 AdamW state
    optimizer = hf_paged.PagedAdamW(
        model.parameters(), page_size="64KiB", device_budget=AutoBudget(window=6, probe=hf_paged.memory._probes["cpu"])
    )
    memory.optimizer = optimizer
    callback = MemorySpikeCallback(window=8, warmup=3, plot=False, oom_retries=0)
    args = training_args(tmp_path, optim="adamw_torch")
    state = TrainerState()
    callback.on_train_begin(args, state, TrainerControl(), optimizer=optimizer)
    memory.set(1000 * KIB)
    for step in range(1, 21):
        callback.on_step_begin(args, state, TrainerControl(), optimizer=optimizer)
        memory.set((3600 if step == 6 else 3000) * KIB)  # the activations' peak
        memory.set(1000 * KIB)
        model(torch.randn(4, 256)).sum().backward()
        callback.on_pre_optimizer_step(args, state, TrainerControl(), optimizer=optimizer)
        optimizer.step()
        optimizer.zero_grad()
        callback.on_optimizer_step(args, state, TrainerControl(), optimizer=optimizer)
        state.global_step += 1
        callback.on_step_end(args, state, TrainerControl(), optimizer=optimizer)
    resident = [row["state_bytes_forward"] for row in callback.rows]
    assert min(resident[6:]) < resident[-1] == max(resident)  # the state left the device and came back
    assert [spike.step for spike in callback.detector.spikes] == [6]


def _scripted_steps(tmp_path, monkeypatch, callback, peaks, optimizer_factory=None):
    """Run ``callback`` over steps whose forward/backward and optimizer-step peaks the probe reports as scripted."""
    memory = ScriptedMemory(total=64 * GIB, level=1 * GIB)
    monkeypatch.setitem(hf_paged.memory._probes, "cpu", MemoryProbe("cpu", memory=memory))
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = (optimizer_factory or torch.optim.AdamW)(model.parameters())
    args, state, control = _Args(tmp_path), TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control, optimizer=optimizer)
    for forward_backward, step in peaks:
        callback.on_step_begin(args, state, control, optimizer=optimizer)
        model(torch.randn(2, 64)).sum().backward()
        memory.spike(forward_backward, after=1 * GIB)
        callback.on_pre_optimizer_step(args, state, control, optimizer=optimizer)
        optimizer.step()
        optimizer.zero_grad()
        memory.spike(step, after=1 * GIB)
        callback.on_optimizer_step(args, state, control, optimizer=optimizer)
        state.global_step += 1
        callback.on_step_end(args, state, control, optimizer=optimizer)
    callback.on_train_end(args, state, control, optimizer=optimizer)
    return optimizer


def _plan_warnings(caplog):
    return [record.message for record in caplog.records if "differ from the plan" in record.message]


def test_measured_peaks_within_ten_percent_of_the_plan_are_not_warned_of(tmp_path, monkeypatch, caplog):
    callback = MemorySpikeCallback(plot=False, plan={"forward_backward": "2GiB", "optimizer_step": "1.5GiB"})
    peaks = [(int(2.1 * GIB), int(1.45 * GIB)), (int(1.95 * GIB), int(1.4 * GIB)), (3 * GIB, 3 * GIB)]
    with caplog.at_level(logging.INFO):
        _scripted_steps(tmp_path, monkeypatch, callback, peaks)
    assert not _plan_warnings(caplog)
    # the first two steps, as planned: step 3's higher peaks come after them
    assert callback.plan_differences == pytest.approx({"forward_backward": 0.05, "optimizer_step": -1 / 30})


def test_measured_peaks_off_the_plan_by_more_than_ten_percent_warn_once(tmp_path, monkeypatch, caplog):
    callback = MemorySpikeCallback(plot=False, plan={"forward_backward": 2 * GIB, "optimizer_step": 1.5 * GIB})
    peaks = [(int(2.5 * GIB), int(1.45 * GIB))] * 4
    with caplog.at_level(logging.WARNING):
        _scripted_steps(tmp_path, monkeypatch, callback, peaks)
    (warning,) = _plan_warnings(caplog)
    assert "first 2 steps" in warning
    assert "forward+backward 2.5 GiB measured, 2.0 GiB planned (+25.0%)" in warning
    assert "optimizer step 1.4 GiB measured, 1.5 GiB planned (-3.3%)" in warning


def test_a_plan_is_handed_to_the_automatic_budget_and_not_compared_with_resident_memory(tmp_path, caplog):
    def build(model: torch.nn.Module) -> hf_paged.PagedAdamW:
        return hf_paged.PagedAdamW(model.parameters(), page_size="16KiB", compiled=False)

    def model() -> torch.nn.Module:
        return torch.nn.Linear(64, 64)

    planned = hf_paged.plan(model, lambda: torch.randn(2, 64), build, loss=lambda net, batch: net(batch).sum())
    optimizer = hf_paged.PagedAdamW(model().parameters(), page_size="16KiB", device_budget="auto")
    callback = MemorySpikeCallback(plot=False, plan=planned)
    args, state, control = _Args(tmp_path), TrainerState(), TrainerControl()
    with caplog.at_level(logging.INFO):
        callback.on_train_begin(args, state, control, optimizer=optimizer)  # the real CPU probe: resident memory
    assert optimizer.auto_budget.planned_peak == planned.peak_without_state("forward_backward") > 0
    assert callback.planned_peaks == {
        "forward_backward": planned.forward_backward_peak,
        "optimizer_step": planned.optimizer_step_peak,
    }
    assert (
        sum("plan is not compared with the measured peaks on cpu" in record.message for record in caplog.records) == 1
    )
    callback.on_train_end(args, state, control, optimizer=optimizer)
    assert callback.plan_differences is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"safety_margin": float("nan")}, r"safety_margin must be None or a fraction in \[0, 1\), got nan"),
        ({"safety_margin": float("inf")}, r"safety_margin must be None or a fraction in \[0, 1\), got inf"),
        ({"safety_margin": 1.0}, r"safety_margin must be None or a fraction in \[0, 1\), got 1.0"),
        ({"safety_margin": "0.1"}, r"safety_margin must be None or a fraction in \[0, 1\), got '0.1'"),
        ({"warn_fraction": float("nan")}, r"warn_fraction must be a fraction in \(0, 1\], got nan"),
        ({"spike_margin": float("inf")}, "^spike_margin must be a finite number >= 0, got inf"),
        ({"spike_margin": -1}, "^spike_margin must be a finite number >= 0, got -1"),
        ({"device_capacity": float("inf")}, "device_capacity must be a finite, non-negative size, got inf"),
        ({"device_capacity": 0}, r"device_capacity must be at least 1 byte \(None: the device's\), got 0"),
    ],
)
def test_callback_rejects_numbers_out_of_range_when_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MemorySpikeCallback(**kwargs)


@pytest.mark.parametrize(
    "plan, error, message",
    [
        ({"forward_backward": 1}, ValueError, "plan must give bytes for exactly the phases"),
        ({"forward_backward": 1, "optimizer_step": "big"}, ValueError, r"plan\['optimizer_step'\]"),
        ([1, 2], TypeError, "plan must be a MemoryPlan or a mapping"),
    ],
)
def test_callback_rejects_a_bad_plan(plan, error, message):
    with pytest.raises(error, match=message):
        MemorySpikeCallback(plan=plan)


def test_a_run_whose_automatic_budget_moved_state_to_the_host_is_not_compared(tmp_path, monkeypatch, caplog):
    callback = MemorySpikeCallback(plot=False, plan={"forward_backward": 1 * GIB, "optimizer_step": 1 * GIB})
    peaks = [(2 * GIB, 2 * GIB)] * 2  # no room for optimizer state in 1 GiB: the budget keeps it on the host

    def paged(params):
        return hf_paged.PagedAdamW(params, page_size="16KiB", device_budget=AutoBudget(capacity="1GiB"))

    with caplog.at_level(logging.INFO):
        optimizer = _scripted_steps(tmp_path, monkeypatch, callback, peaks, optimizer_factory=paged)
    assert optimizer.paging_stats()["host_bytes"] > 0
    assert not _plan_warnings(caplog) and callback.plan_differences is None
    assert any("automatic budget kept optimizer state on the host" in record.message for record in caplog.records)


def test_the_planned_peaks_survive_a_restore_of_the_callback():
    callback = MemorySpikeCallback(plan={"forward_backward": "2GiB", "optimizer_step": 3 * GIB})
    restored = MemorySpikeCallback(**json.loads(json.dumps(callback.state()))["args"])  # as the Trainer restores it
    assert restored.planned_peaks == callback.planned_peaks == {"forward_backward": 2 * GIB, "optimizer_step": 3 * GIB}


def _not_paged_warnings(caplog):
    return [record.message for record in caplog.records if "is not an hf-paged optimizer" in record.message]


def test_an_optimizer_that_is_not_hf_paged_is_warned_of_once_with_what_it_skips(tmp_path, caplog):
    callback = MemorySpikeCallback(plot=False)
    args = training_args(tmp_path, optim="adamw_torch", max_steps=2)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset(8), callbacks=[callback])
    with caplog.at_level(logging.WARNING):
        trainer.train()
        trainer.train()  # the same callback again: already said
    (warning,) = _not_paged_warnings(caplog)
    assert "AdamW" in warning and "out-of-memory recovery" in warning and "memory/optimizer_device_bytes" in warning
    assert not hasattr(trainer, "_hf_paged_oom_recovery")  # what the warning says is skipped is skipped
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all("memory/forward_backward_peak_gib" in entry for entry in logged)
    assert not any("memory/optimizer_device_bytes" in entry for entry in logged)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _train(tmp_path / "paged", MemorySpikeCallback(plot=False), max_steps=1)
    assert not _not_paged_warnings(caplog)


def test_memory_metrics_go_to_training_logs_only(tmp_path):
    """Evaluation entries and the final summary carry no memory metrics; each training log covers its steps."""
    callback = MemorySpikeCallback(plot=False)
    args = training_args(
        tmp_path,
        optim="hf_paged_adamw_8bit",
        max_steps=5,
        logging_steps=3,
        eval_strategy="steps",
        eval_steps=2,
        report_to=["tensorboard"],
    )
    trainer = Trainer(
        model=tiny_llama(),
        args=args,
        train_dataset=token_dataset(32),
        eval_dataset=token_dataset(4, seed=1),
        callbacks=[callback],
    )
    trainer.train()
    history = trainer.state.log_history
    evaluations = [entry for entry in history if "eval_loss" in entry]
    (final,) = [entry for entry in history if "train_runtime" in entry]
    assert [entry["step"] for entry in evaluations][:2] == [2, 4]
    for entry in [*evaluations, final]:
        assert not [key for key in entry if key.startswith("memory/")], entry
    (training,) = [entry for entry in history if "loss" in entry]  # logging_steps=3: step 3 only
    assert training["step"] == 3
    peaks = [row["forward_backward_peak"] for row in callback.rows[:3]]
    assert training["memory/forward_backward_peak_gib"] == max(peaks) / GIB  # steps 1-3, none lost to step 2's eval
    scalars = _tensorboard_scalars(tmp_path / "runs")
    memory_tags = sorted(tag for tag in scalars if "memory/" in tag)
    assert memory_tags and all(tag.startswith("train/memory/") for tag in memory_tags)
    assert [step for step, _ in scalars["train/memory/forward_backward_peak_gib"]] == [3]


def test_the_readme_names_the_metrics_as_tensorboard_and_mlflow_show_them():
    """TensorBoard shows ``train/memory/*`` (transformers' rewrite_logs), MLflow the logged ``memory/*``."""
    from transformers.integrations.integration_utils import rewrite_logs

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Automatic budget and the memory-spike monitor\n")[1].split("\n## ")[0]
    bullets = [line for line in section.replace("\n  ", " ").splitlines() if line.startswith("- ")]
    (tensorboard,) = [line for line in bullets if "TensorBoard" in line]
    (mlflow,) = [line for line in bullets if "MLflow" in line]
    (shown,) = rewrite_logs({"memory/forward_backward_peak_gib": 1.0})
    assert shown == "train/memory/forward_backward_peak_gib" and f"`{shown}`" in tensorboard
    assert "`memory/...` as logged" in mlflow


class _SharedDevice(ScriptedMemory):
    """A device another process shares: what it takes (``other``) is not free."""

    other = 0

    def free(self) -> int:
        return self._total - self.level - self.other


def test_state_moved_at_a_step_s_start_counts_in_its_row_and_the_logged_totals(tmp_path, monkeypatch):
    """Another process takes memory between steps 2 and 3: the automatic budget falls to zero and the callback's
    own page-out before step 3's forward moves all of the state to the host. The rows, and the logged metrics,
    add up to what the optimizer moved (before, that page-out fell between two rows)."""
    memory = _SharedDevice(total=1 * GIB, level=100 * MIB)
    monkeypatch.setitem(hf_paged.memory._probes, "cpu", MemoryProbe("cpu", memory=memory))
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optimizer = hf_paged.PagedAdamW(model.parameters(), page_size="16KiB", device_budget=AutoBudget(safety_margin=0))
    callback = MemorySpikeCallback(plot=False, oom_retries=0)
    args, state, control = _Args(tmp_path), TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control, optimizer=optimizer)
    logged = {"memory/moved_to_host_gib": 0.0, "memory/moved_to_device_gib": 0.0}
    for step in range(1, 5):
        memory.other = 724 * MIB + 256 * KIB if step == 3 else 0
        run_step(callback, args, state, optimizer, partial(_forward_backward, model, memory, 300 * MIB, 110 * MIB))
        logs = {"loss": 1.0}
        callback.on_log(args, state, control, logs=logs)
        for key in logged:
            logged[key] += logs[key]
    stats = optimizer.paging_stats()
    assert callback.rows[2]["evicted_at_step_begin"] > 0
    for key in ("bytes_to_host", "bytes_to_device", "page_outs", "page_ins"):
        assert sum(row[key] for row in callback.rows) == stats[key]
    assert logged["memory/moved_to_host_gib"] * GIB == pytest.approx(stats["bytes_to_host"])
    assert logged["memory/moved_to_device_gib"] * GIB == pytest.approx(stats["bytes_to_device"])
