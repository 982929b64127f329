"""The strategy ``hf-paged train --plan`` plans for in a launch of several processes (``launch_setup``): what the
run's config and accelerate's launch variables ask for, as the Trainer would train it."""

from __future__ import annotations

import json

import pytest
import torch

import hf_paged.cli
import hf_paged.cli.train
from hf_paged.cli.config import ConfigError, load_config
from hf_paged.cli.plan import launch_setup, setup_from_config
from hf_paged.cli.train import training_device


def _setup(*overrides: str):
    return setup_from_config(load_config(None, list(overrides)))


def _zero(stage: int, optimizer: str = "none", param: str = "none") -> str:
    config = {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": optimizer}}}
    config["zero_optimization"]["offload_param"] = {"device": param}
    return f"training.deepspeed={json.dumps(config)}"


def test_one_process_is_planned_as_it_is() -> None:
    setup = _setup()
    assert launch_setup(setup, 1, "cuda", {"ACCELERATE_USE_FSDP": "true"}) is setup


def test_one_process_under_deepspeed_is_planned_with_its_zero_stage() -> None:
    """DeepSpeed runs one process under ZeRO too (accelerate's DeepSpeed mode does not need several processes)."""
    planned = launch_setup(_setup(_zero(3)), 1, "cuda", {})
    assert (planned.world_size, planned.strategy) == (1, "zero3")


def test_a_launch_without_sharding_is_ddp_of_its_processes() -> None:
    planned = launch_setup(_setup(), 4, "cuda", {})
    assert (planned.world_size, planned.strategy) == (4, "ddp")


@pytest.mark.parametrize(
    ("environ", "strategy"),
    [
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, "fsdp2"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"}, "fsdp2_offload"),
        ({"ACCELERATE_USE_FSDP": "false", "FSDP_VERSION": "2"}, "ddp"),
    ],
)
def test_accelerates_fsdp_variables(environ: dict[str, str], strategy: str) -> None:
    planned = launch_setup(_setup(), 2, "cuda", environ)
    assert (planned.world_size, planned.strategy) == (2, strategy)


def test_fsdp_on_the_cpu_is_planned_as_the_ddp_accelerate_runs() -> None:
    """accelerate keeps a CPU run's distributed type MULTI_CPU and drops its FSDP plugin (see
    tests/scripts/fsdp2_trainer.py): the processes train with DDP."""
    environ = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    assert launch_setup(_setup(), 2, "cpu", environ).strategy == "ddp"
    assert launch_setup(_setup("training.fsdp=full_shard"), 2, "cpu", {}).strategy == "ddp"


def test_the_trainers_fsdp_arguments() -> None:
    planned = launch_setup(_setup("training.fsdp=full_shard offload", "training.fsdp_config={version: 2}"), 8, "cuda")
    assert (planned.world_size, planned.strategy) == (8, "fsdp2_offload")
    assert launch_setup(_setup("training.fsdp=full_shard"), 2, "cuda", {}).strategy == "fsdp2"  # version 2: default


@pytest.mark.parametrize(
    ("fsdp_config", "strategy"),
    [
        ("{cpu_offload: true}", "fsdp2_offload"),
        ("{fsdp_cpu_offload: true}", "fsdp2_offload"),  # TrainingArguments drops the fsdp_ prefix of a key
        ("{fsdp_version: 1}", None),
        ("FILE", "fsdp2_offload"),  # a JSON file, as TrainingArguments reads one
        ("{cpu_offload: false}", "fsdp2"),  # with fsdp "full_shard offload": the config's key wins, as in the Trainer
        ("{cpu_offload: 'true'}", "fsdp2_offload"),
    ],
)
def test_the_trainers_fsdp_config_as_the_trainer_reads_it(tmp_path, fsdp_config: str, strategy: str | None) -> None:
    if fsdp_config == "FILE":
        fsdp_config = str(tmp_path / "fsdp.json")
        (tmp_path / "fsdp.json").write_text(json.dumps({"fsdp_version": 2, "fsdp_cpu_offload": True}))
    fsdp = "full_shard offload" if "false" in fsdp_config else "full_shard"
    setup = _setup(f"training.fsdp={fsdp}", f"training.fsdp_config={fsdp_config}")
    if strategy is None:
        with pytest.raises(ConfigError, match="FSDP version 1 is not planned"):
            launch_setup(setup, 2, "cuda", {})
    else:
        assert launch_setup(setup, 2, "cuda", {}).strategy == strategy
    missing = _setup("training.fsdp=full_shard", f"training.fsdp_config={tmp_path / 'missing.json'}")
    with pytest.raises(ConfigError, match="training.fsdp_config: cannot read"):
        launch_setup(missing, 2, "cuda", {})


@pytest.mark.parametrize(
    ("overrides", "environ"),
    [
        (("training.fsdp=shard_grad_op",), {}),
        (("training.fsdp=full_shard", "training.fsdp_config={reshard_after_forward: false}"), {}),
        ((), {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false"}),
    ],
)
def test_fsdp2_keeping_the_gathered_weights_after_forward_is_refused(overrides, environ) -> None:
    """FSDP2 without resharding after forward holds every layer's gathered weights to the backward; the planner's
    FSDP2 reshards them, so such a run trains without a plan rather than with a plan that is short of them."""
    with pytest.raises(ConfigError, match="FSDP2 without resharding after forward .* is not planned"):
        launch_setup(_setup(*overrides), 2, "cuda", environ)


def test_a_flag_that_is_not_a_boolean_is_named() -> None:
    setup = _setup("training.fsdp=full_shard", "training.fsdp_config={reshard_after_forward: maybe}")
    with pytest.raises(ConfigError, match="reshard_after_forward must be true or false, got 'maybe'"):
        launch_setup(setup, 2, "cuda", {})
    environ = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "sometimes"}
    with pytest.raises(ConfigError, match="FSDP_OFFLOAD_PARAMS must be true or false"):
        launch_setup(_setup(), 2, "cuda", environ)


def test_fsdp_version_1_is_refused_with_the_version() -> None:
    with pytest.raises(ConfigError, match="FSDP version 1 is not planned"):
        launch_setup(_setup(), 2, "cuda", {"ACCELERATE_USE_FSDP": "true"})  # accelerate's default version


@pytest.mark.parametrize(
    ("override", "strategy"),
    [
        (_zero(2), "zero2"),
        (_zero(2, "cpu"), "zero2_offload"),
        (_zero(3), "zero3"),
        (_zero(3, "cpu"), "zero3_offload_optimizer"),
        (_zero(3, "cpu", "cpu"), "zero3_offload"),
    ],
)
def test_the_zero_stage_and_offload_of_training_deepspeed(override: str, strategy: str) -> None:
    planned = launch_setup(_setup(override), 2, "cpu", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})
    assert (planned.world_size, planned.strategy) == (2, strategy)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (_zero(1), "ZeRO stage 1 is not planned"),
        (_zero(3, "none", "cpu"), "ZeRO stage 3 with parameters but not the optimizer offloaded is not planned"),
    ],
)
def test_zero_that_is_not_planned_is_named(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"training.deepspeed: {message}"):
        launch_setup(_setup(override), 2, "cuda", {})


def test_accelerates_deepspeed_variables(tmp_path) -> None:
    environ = {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
    }
    assert launch_setup(_setup(), 2, "cuda", environ).strategy == "zero3_offload_optimizer"
    config = tmp_path / "zero.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}}))
    environ = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config)}
    planned = launch_setup(_setup(), 2, "cuda", environ)
    assert planned.strategy == "zero2"
    assert planned.config.training["deepspeed"] == str(config)  # the plan reads its ZeRO settings


def test_the_training_device_is_found_without_starting_the_launchs_process_group(monkeypatch) -> None:
    """``train --plan`` plans before the Trainer's arguments exist (they start a launch's process group): the device
    is the one they would choose, the accelerator unless ``use_cpu`` or there is none."""
    monkeypatch.setattr(hf_paged.cli.train, "_accelerator_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    assert training_device(load_config(None, [])) == "cuda"
    assert training_device(load_config(None, ["training.use_cpu=true"])) == "cpu"
    monkeypatch.setattr(hf_paged.cli.train, "_accelerator_available", lambda: False)
    assert training_device(load_config(None, [])) == "cpu"


def test_a_launch_the_planner_does_not_model_trains_without_a_plan(monkeypatch, capsys) -> None:
    """``train --plan`` of a launch whose strategy is not modelled says so in one line and trains without a plan."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert hf_paged.cli._plan_training(load_config(None, [_zero(1)])) is None
    out = capsys.readouterr().out
    assert (
        out == "hf-paged train --plan: training.deepspeed: ZeRO stage 1 is not planned (stage 2, with or without "
        "optimizer offload, and stage 3, with no offload, the optimizer's or both, are); training without one\n"
    ), out


def test_accelerates_variables_are_read_as_accelerate_reads_them() -> None:
    """accelerate turns FSDP on only for ``ACCELERATE_USE_FSDP=true`` (any case), and reads the offload flag as a truth
    value (``1``, ``yes``, ``on``...)."""
    assert launch_setup(_setup(), 2, "cuda", {"ACCELERATE_USE_FSDP": "1", "FSDP_VERSION": "2"}).strategy == "ddp"
    environ = {"ACCELERATE_USE_FSDP": "True", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "1"}
    assert launch_setup(_setup(), 2, "cuda", environ).strategy == "fsdp2_offload"
