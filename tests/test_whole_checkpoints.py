"""With an hf-paged optimizer, the Trainer names a checkpoint ``checkpoint-N`` only once it is written whole: a save that
fails or is killed leaves ``_partial-checkpoint-N``, which neither ``get_last_checkpoint`` nor
``resume_from_checkpoint=True`` takes. Otherwise a checkpoint, its rotation and the best one are the Trainer's own.
(Several processes, and a process killed during a save: tests/test_rank_failure.py.)"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

import hf_paged  # noqa: F401  (registers the optimizer names and the checkpoint writing)
from hf_paged.recovery import paged_optimizer_of

from trainer_utils import tiny_llama, token_dataset, training_args


class FailingSave(TrainerCallback):
    """Records what the output folder holds while the checkpoint of each step is written (once its model weights are:
    the optimizer's ``state_dict``), and raises there at step ``fail_at``."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.during: dict[int, list[str]] = {}

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        def saving(optimizer):
            self.during[state.global_step] = sorted(os.listdir(args.output_dir))
            if state.global_step == self.fail_at:
                raise OSError(28, "injected: No space left on device")

        paged_optimizer_of(optimizer).register_state_dict_pre_hook(saving)


def train(output, optim="hf_paged_adamw_8bit", callbacks=(), resume=None, **overrides) -> Trainer:
    settings = {"optim": optim, "save_strategy": "steps", "save_steps": 2, "learning_rate": 1e-2, **overrides}
    trainer = Trainer(
        model=tiny_llama(),
        args=training_args(output, **settings),
        train_dataset=token_dataset(16),
        eval_dataset=token_dataset(8, seed=1),
        callbacks=list(callbacks),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def folders(output) -> list[str]:
    return sorted(name for name in os.listdir(output) if os.path.isdir(os.path.join(output, name)))


def test_a_failed_save_leaves_no_checkpoint_and_resume_takes_the_last_whole_one(tmp_path):
    failing = FailingSave(fail_at=4)
    with pytest.raises(OSError, match="injected"):
        train(tmp_path, callbacks=[failing])
    assert failing.during == {2: ["_partial-checkpoint-2"], 4: ["_partial-checkpoint-4", "checkpoint-2"]}
    assert folders(tmp_path) == ["_partial-checkpoint-4", "checkpoint-2"]
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    resumed = FailingSave()
    trainer = train(tmp_path, callbacks=[resumed], resume=True)
    assert trainer.state.global_step == 4
    assert resumed.during == {4: ["_partial-checkpoint-4", "checkpoint-2"]}  # written anew, the old one removed first
    assert folders(tmp_path) == ["checkpoint-2", "checkpoint-4"]


def test_checkpoints_and_their_rotation_are_the_trainers(tmp_path):
    """A checkpoint per step with ``save_total_limit=2``: the same folders are kept, with the same files, as with
    torch's AdamW (the rotation runs again once a checkpoint has its name)."""
    for optim in ("hf_paged_adamw_8bit", "adamw_torch"):
        train(tmp_path / optim, optim=optim, save_steps=1, save_total_limit=2)
    paged, torch_ = tmp_path / "hf_paged_adamw_8bit", tmp_path / "adamw_torch"
    assert folders(paged) == folders(torch_) == ["checkpoint-3", "checkpoint-4"]
    for name in folders(paged):
        assert sorted(os.listdir(paged / name)) == sorted(os.listdir(torch_ / name))
        assert "_partial" not in (paged / name / "trainer_state.json").read_text()


def test_an_existing_checkpoint_folder_gets_the_files(tmp_path):
    """A folder that a subclass (TRL's asynchronous trainers) or transformers' just-in-time checkpoint begins before
    the save keeps what it holds and gets the checkpoint's files."""
    (tmp_path / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "checkpoint-2" / "rollout_state.json").write_text("{}")
    train(tmp_path, max_steps=2)
    assert folders(tmp_path) == ["checkpoint-2"]
    written = set(os.listdir(tmp_path / "checkpoint-2"))
    assert {"rollout_state.json", "model.safetensors", "optimizer.pt", "trainer_state.json"} <= written


def test_the_best_checkpoint_is_the_trainers(tmp_path):
    """``save_strategy="best"`` with ``save_total_limit=1`` and ``load_best_model_at_end``: the same checkpoint is kept
    and named best, in the trainer and in its saved state, as with torch's AdamW."""
    best = {
        "save_strategy": "best",
        "eval_strategy": "steps",
        "eval_steps": 1,
        "metric_for_best_model": "loss",
        "save_total_limit": 1,
        "load_best_model_at_end": True,
    }
    kept = {}
    for optim in ("hf_paged_adamw_8bit", "adamw_torch"):
        output = tmp_path / optim
        trainer = train(output, optim=optim, **best)
        kept[optim] = (folders(output), os.path.basename(trainer.state.best_model_checkpoint))
        saved = (output / kept[optim][1] / "trainer_state.json").read_text()
        assert f'"best_model_checkpoint": "{output / kept[optim][1]}"' in saved
    assert kept["hf_paged_adamw_8bit"] == kept["adamw_torch"]
    assert kept["adamw_torch"][1] in kept["adamw_torch"][0]


def test_other_optimizers_keep_the_trainers_saving(tmp_path):
    during = []

    class Spy(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            optimizer.optimizer.register_state_dict_pre_hook(
                lambda _: during.append(sorted(os.listdir(args.output_dir)))
            )

    train(tmp_path, optim="adamw_torch", callbacks=[Spy()], max_steps=2)
    assert during == [["checkpoint-2"]]  # written in place, as transformers does
    assert torch.load(tmp_path / "checkpoint-2" / "optimizer.pt", weights_only=True)["state"]
