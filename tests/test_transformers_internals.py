"""Fails loudly when a transformers release moves the optimizer tables that registration relies on."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import transformers
from transformers import trainer_optimizer, training_args

from hf_paged.integrations import _transformers_internals as internals
from hf_paged.integrations.trainer import check_training_arguments, split_optim_args


def test_optimizer_names_enum_has_the_tables_we_extend():
    names = training_args.OptimizerNames
    for table in ("_member_map_", "_member_names_", "_value2member_map_"):
        assert hasattr(names, table), f"transformers {transformers.__version__}: OptimizerNames.{table} is gone"
    assert issubclass(names, str)


def test_handler_table_and_context_are_as_expected():
    assert isinstance(trainer_optimizer._OPTIMIZER_HANDLERS, dict)
    fields = {field.name for field in dataclasses.fields(trainer_optimizer.OptimizerContext)}
    assert {"args", "optimizer_kwargs", "adam_kwargs", "optim_args"} <= fields


def test_registered_names_have_our_handlers():
    for name in ("hf_paged_adamw_32bit", "hf_paged_adamw_8bit", "hf_paged_lion_32bit", "hf_paged_lion_8bit"):
        member = training_args.OptimizerNames(name)
        assert member.value == name and member.name == name.upper()
        assert internals.optimizer_handler(name).__module__ == "hf_paged.integrations.trainer"
    assert internals.optimizer_handler("no_such_optimizer") is None


def test_missing_tables_give_an_error_naming_the_version(monkeypatch):
    monkeypatch.delattr(trainer_optimizer, "_OPTIMIZER_HANDLERS")
    with pytest.raises(internals.RegistrationError, match=rf"transformers {transformers.__version__}.*_OPTIMIZER_HANDLERS"):
        internals.set_optimizer_handler("hf_paged_adamw_8bit", lambda context: None)


def test_trainer_loads_optimizers_through_the_method_we_replace():
    from transformers import trainer

    method = trainer.Trainer._load_optimizer_and_scheduler
    assert method.hf_paged_original is not None, "hf_paged did not replace Trainer._load_optimizer_and_scheduler"
    for name in internals._TRAINER_LOAD_NAMES:
        assert hasattr(trainer, name), f"transformers {transformers.__version__}: transformers.trainer.{name} is gone"
    source = inspect.getsource(trainer.Trainer)
    for flag in ("is_deepspeed_enabled", "is_fsdp_enabled"):
        assert f"self.{flag} =" in source, f"transformers {transformers.__version__}: Trainer.{flag} is gone"
    # What the replacement exists for: the Trainer's own method maps the state to args.device with several ranks.
    assert "self.args.device if self.args.world_size > 1" in inspect.getsource(method.hf_paged_original)


def test_missing_trainer_names_give_an_error_naming_the_version(monkeypatch):
    from transformers import trainer

    monkeypatch.setattr(trainer.Trainer, "_load_optimizer_and_scheduler", lambda self, checkpoint: None)
    monkeypatch.delattr(trainer, "SCHEDULER_NAME")
    with pytest.raises(internals.RegistrationError, match=rf"resume.*transformers {transformers.__version__}.*SCHEDULER_NAME"):
        internals.load_optimizer_state_on_cpu(lambda optimizer: True)


def test_checkpoints_are_written_through_the_methods_we_redirect():
    """Every write of ``Trainer._save_checkpoint`` into the checkpoint's folder goes through a method that
    ``write_checkpoints_whole`` redirects to the partial folder; the best checkpoint and the rotation are as it
    expects."""
    from transformers import trainer

    method = trainer.Trainer._save_checkpoint
    assert method.hf_paged_original is not None, "hf_paged did not wrap Trainer._save_checkpoint"
    source = inspect.getsource(method.hf_paged_original)
    writes = set(re.findall(r"self\.([\w.]+)\((?:os\.path\.join\()?output_dir\b", source))
    assert writes == {*internals._CHECKPOINT_WRITERS, "state.save_to_json", "_push_from_checkpoint"}, writes
    assert "output_dir = os.path.join(run_dir, checkpoint_folder)" in source
    assert 'checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"' in source
    assert "if os.path.exists(best_checkpoint_dir):" in source
    assert "rotate_checkpoints(" in source


def test_missing_save_methods_give_an_error_naming_the_version(monkeypatch):
    from transformers import trainer

    monkeypatch.setattr(trainer.Trainer, "_save_checkpoint", lambda self, model, trial: None)
    monkeypatch.delattr(trainer.Trainer, "_save_rng_state")
    with pytest.raises(internals.RegistrationError, match=rf"checkpoints whole.*{transformers.__version__}.*_save_rng"):
        internals.write_checkpoints_whole(lambda trainer: True)


def test_training_arguments_are_checked_after_post_init_and_set_optimizer():
    for method in ("__post_init__", "set_optimizer"):
        wrapped = getattr(training_args.TrainingArguments, method)
        assert wrapped._hf_paged_check is check_training_arguments, method
        assert callable(wrapped.__wrapped__)


@pytest.mark.parametrize("text", [None, "", "a=1", "a=1,b=2", " device_budget = 2GiB , prefetch=1 "])
def test_optim_args_split_as_transformers_does(text):
    assert split_optim_args(text) == trainer_optimizer._parse_optim_args(text)


def test_missing_training_arguments_give_an_error_naming_the_version(monkeypatch):
    monkeypatch.setattr(training_args, "TrainingArguments", None)
    with pytest.raises(internals.RegistrationError, match=r"TrainingArguments.__post_init__"):
        internals.check_training_arguments_with(check_training_arguments)


def test_a_callback_finds_the_trainer_running_it(tmp_path):
    from transformers import Trainer, TrainerCallback

    from trainer_utils import tiny_llama, token_dataset, training_args

    found = []

    class Finder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.look()

        def look(self):
            found.append(internals.calling_trainer())

    trainer = Trainer(
        model=tiny_llama(), args=training_args(tmp_path, max_steps=1), train_dataset=token_dataset(4), callbacks=[Finder()]
    )
    trainer.train()
    assert found == [trainer]


def test_trl_keeps_the_per_micro_batch_metrics_that_a_replay_rewinds(tmp_path):
    pytest.importorskip("trl")
    from test_oom_recovery import sft_trainer

    from hf_paged.callbacks import MemorySpikeCallback

    trainer = sft_trainer(tmp_path, "page_size=16KiB", MemorySpikeCallback(plot=False))
    assert isinstance(trainer._metrics["train"], dict) and isinstance(trainer._total_train_tokens, int)
    marks = internals.trainer_metric_marks(trainer)
    trainer._metrics["train"]["entropy"].append(1.0)
    trainer._metrics["train"]["num_tokens"] = [7]
    trainer._total_train_tokens += 7
    internals.rewind_trainer_metrics(trainer, marks)
    assert dict(trainer._metrics["train"]) == marks["metrics"] and trainer._total_train_tokens == marks["total_train_tokens"]
    trainer._metrics = {"train": None}
    with pytest.raises(TypeError, match="_metrics to map 'train' to lists"):
        internals.trainer_metric_marks(trainer)
