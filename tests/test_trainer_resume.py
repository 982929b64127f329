"""Resuming from a Trainer checkpoint loads a paged optimizer's state to the CPU, under any world size, and
MemorySpikeCallback's measurements into the callback the user holds."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

import hf_paged  # (registers the optimizer names and the resume path)
import hf_paged.memory
from hf_paged.callbacks import MemorySpikeCallback
from hf_paged.memory import MemoryProbe
from hf_paged.recovery import paged_optimizer_of

from memory_utils import GIB, ScriptedMemory
from trainer_utils import tiny_llama, token_dataset, training_args


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint after two steps of ``hf_paged_adamw_8bit``."""
    output = tmp_path_factory.mktemp("resume")
    args = training_args(output, optim="hf_paged_adamw_8bit", max_steps=2, save_strategy="steps", save_steps=2)
    Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset(8)).train()
    return output / "checkpoint-2"


class _Stop(Exception):
    """Raised by the ``torch.load`` spy to stop before the loaded state is used."""


def _load_as_rank_of_two(monkeypatch, trainer, checkpoint, device, stop: bool = False) -> list:
    """Run the Trainer's optimizer loading as one of two ranks on ``device``; the ``map_location`` of each load."""
    locations = []
    real_load = torch.load

    def load(*args, **kwargs):
        locations.append(kwargs.get("map_location"))
        if stop:
            raise _Stop
        return real_load(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
        patch.setattr(TrainingArguments, "device", property(lambda self: device))
        patch.setattr(torch, "load", load)
        try:
            trainer._load_optimizer_and_scheduler(str(checkpoint))
        except _Stop:
            pass
    return locations


def test_resume_under_several_ranks_loads_paged_state_to_the_cpu(monkeypatch, checkpoint):
    """Defect: with ``world_size > 1`` the Trainer loaded ``optimizer.pt`` onto ``args.device``."""
    trainer = Trainer(
        model=tiny_llama(),
        args=training_args(checkpoint.parent, optim="hf_paged_adamw_8bit", max_steps=4),
        train_dataset=token_dataset(8),
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    # The meta device stands for the accelerator: state loaded onto it would hold no values.
    locations = _load_as_rank_of_two(monkeypatch, trainer, checkpoint, torch.device("meta"))
    assert locations[0] == "cpu"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    loaded = trainer.optimizer.state_dict()
    assert loaded["state"].keys() == saved["state"].keys() and loaded["state"]
    for index, entry in saved["state"].items():
        assert loaded["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            assert loaded["state"][index][key].device.type == "cpu" and torch.equal(loaded["state"][index][key], value)
    assert trainer.lr_scheduler.state_dict() == torch.load(checkpoint / "scheduler.pt", weights_only=True)


def test_other_optimizers_keep_the_trainers_loading(monkeypatch, checkpoint):
    trainer = Trainer(
        model=tiny_llama(),
        args=training_args(checkpoint.parent, optim="adamw_torch", max_steps=4),
        train_dataset=token_dataset(8),
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    device = torch.device("meta")
    assert _load_as_rank_of_two(monkeypatch, trainer, checkpoint, device, stop=True) == [device]


def _memory_callbacks(trainer) -> list:
    return [callback for callback in trainer.callback_handler.callbacks if isinstance(callback, MemorySpikeCallback)]


def _train_with_callback(output, callback, resume=None, **overrides) -> Trainer:
    args = training_args(
        output, optim="hf_paged_adamw_8bit", max_steps=4, save_strategy="steps", save_steps=2, **overrides
    )
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset(32), callbacks=[callback])
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _linear_plan() -> hf_paged.MemoryPlan:
    def build(model: torch.nn.Module) -> hf_paged.PagedAdamW:
        return hf_paged.PagedAdamW(model.parameters(), page_size="16KiB", compiled=False)

    return hf_paged.plan(
        lambda: torch.nn.Linear(64, 64), lambda: torch.randn(2, 64), build, loss=lambda net, batch: net(batch).sum()
    )


def test_restored_callback_state_goes_to_the_users_callback_which_keeps_working(tmp_path):
    """Defect: restore_callback_states_from_checkpoint=True replaced the user's callback with one the Trainer built."""
    first = MemorySpikeCallback(warmup=2, plot=False)
    _train_with_callback(tmp_path / "first", first)
    planned = _linear_plan()
    mine = MemorySpikeCallback(warmup=2, plot=False, plan=planned)
    # another output directory: no timeline to read back, the measurements come from the checkpoint only
    trainer = _train_with_callback(
        tmp_path / "second",
        mine,
        resume=str(tmp_path / "first" / "checkpoint-2"),
        optim_args="device_budget=auto",
        restore_callback_states_from_checkpoint=True,
    )
    assert _memory_callbacks(trainer) == [mine] and trainer.callback_handler.callbacks[0] is mine
    assert mine.summary()["steps"] == 2 and [row["step"] for row in mine.rows] == [3, 4]
    saved_peaks = [row["forward_backward_peak"] for row in first.rows[:2]]
    assert list(mine.detector.peaks) == saved_peaks + [row["forward_backward_peak"] for row in mine.rows]
    assert mine.plan is planned  # the plan itself, not its peaks only, reaches the automatic budget
    assert trainer.optimizer.optimizer.auto_budget.planned_peak == planned.peak_without_state("forward_backward")
    assert all("memory/forward_backward_peak_gib" in entry for entry in trainer.state.log_history if "loss" in entry)


def test_restored_callback_state_with_its_timeline_counts_every_step(tmp_path):
    first = MemorySpikeCallback(warmup=2, plot=False)
    _train_with_callback(tmp_path, first)
    mine = MemorySpikeCallback(warmup=2, plot=False)
    trainer = _train_with_callback(
        tmp_path, mine, resume=str(tmp_path / "checkpoint-2"), restore_callback_states_from_checkpoint=True
    )
    assert _memory_callbacks(trainer) == [mine]
    assert mine.summary()["steps"] == 4 and mine.rows[:2] == first.rows[:2]
    assert len(mine.detector.peaks) == 4


SCRIPTED_PEAKS = [2, 2, 2, 2, 4, 2, 2, 4]
"""Forward/backward peaks of steps 1-8 (GiB): spikes at steps 5 and 8 once 3 steps have warmed up."""


def _train_scripted(output, callback, resume=None) -> Trainer:
    """Train 8 steps (a checkpoint at step 6) whose forward/backward peaks the probe reads from SCRIPTED_PEAKS, with
    the optimizer's pages on the device on top, as an accelerator's memory holds them (a resumed run's state comes
    back to the device in its first step, not before its forward)."""
    args = training_args(output, optim="hf_paged_adamw_8bit", max_steps=8, save_strategy="steps", save_steps=6)
    model = tiny_llama()
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(64), callbacks=[callback])
    memory = hf_paged.memory.probe_for("cpu")._memory

    def forward_peak(*_) -> None:
        state = paged_optimizer_of(trainer.optimizer).paging_stats()["device_bytes"]
        memory.spike(int(SCRIPTED_PEAKS[trainer.state.global_step] * GIB) + state, GIB)

    model.register_forward_hook(forward_peak)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_a_default_resume_rebuilds_the_spike_detector_from_the_timeline(tmp_path, monkeypatch):
    """Defect: after a resume the detector started empty (warm-up again, earlier spikes forgotten)."""
    monkeypatch.setitem(hf_paged.memory._probes, "cpu", MemoryProbe("cpu", memory=ScriptedMemory(64 * GIB, GIB)))
    uninterrupted = MemorySpikeCallback(window=5, warmup=3, plot=False)
    _train_scripted(tmp_path, uninterrupted)
    assert [spike.step for spike in uninterrupted.detector.spikes] == [5, 8]
    resumed = MemorySpikeCallback(window=5, warmup=3, plot=False)
    trainer = _train_scripted(tmp_path, resumed, resume=str(tmp_path / "checkpoint-6"))
    assert [row["step"] for row in resumed.rows] == list(range(1, 9))
    assert resumed.detector.spikes == uninterrupted.detector.spikes
    assert list(resumed.detector.peaks) == list(uninterrupted.detector.peaks)
    assert [row["spike"] for row in resumed.rows] == [row["spike"] for row in uninterrupted.rows]
    assert resumed.summary()["spikes"] == 2
    (last,) = [entry for entry in trainer.state.log_history if entry.get("step") == 8 and "loss" in entry]
    assert last["memory/spikes"] == 2 and last["memory/spike_gib"] == 2.0
