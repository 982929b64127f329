"""Resuming from a Trainer checkpoint loads a paged optimizer's state to the CPU, under any world size."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

import hf_paged  # noqa: F401  (registers the optimizer names and the resume path)

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
