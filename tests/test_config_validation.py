"""Config values that the run would reject later are rejected where the config is read, with exit status 2."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from hf_paged.callbacks import MemorySpikeCallback
from hf_paged.cli import main
from hf_paged.cli.config import ConfigError, MemoryConfig, load_config
from hf_paged.cli.train import memory_callback

BAD_VALUES = [
    ("memory.device_capacity=-5", "memory.device_capacity", "must be a size of at least 1 byte"),
    ("memory.device_capacity=24 GB of RAM", "memory.device_capacity", "must be a size of at least 1 byte"),
    ("memory.device_capacity=0", "memory.device_capacity", "must be a size of at least 1 byte"),
    ("memory.spike_margin=.inf", "memory.spike_margin", "must be a finite number"),
    ("lora.lora_dropout=.nan", "lora.lora_dropout", "must be a finite number"),
    ("lora.lora_dropout=nan", "lora.lora_dropout", "must be a finite number"),
    ("training.learning_rate=.inf", "training.learning_rate", "must be a finite number"),
    ("training.max_grad_norm=-.inf", "training.max_grad_norm", "must be a finite number"),
    ("training.lr_scheduler_kwargs={min_lr: .nan}", "training.lr_scheduler_kwargs", "must be a finite number"),
]


@pytest.mark.parametrize("override, key, message", BAD_VALUES)
def test_bad_values_are_rejected_where_the_config_is_read(override, key, message):
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(overrides=[override])
    assert str(raised.value).startswith(f"{key} in --set {override}")


@pytest.mark.parametrize("override, key, message", BAD_VALUES)
def test_bad_values_exit_with_status_2_before_anything_runs(override, key, message, capsys):
    assert main(["train", "--print-config", "--set", override]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"hf-paged: error: {key} in --set {override}" in captured.err


def test_bad_values_in_a_file_name_the_file(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("memory:\n  device_capacity: 24 GB of RAM\n")
    assert main(["train", "--print-config", str(path)]) == 2
    assert f"memory.device_capacity in {path} must be a size" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, attribute, value",
    [
        ("memory.device_capacity=24GiB", "device_capacity", "24GiB"),
        ("memory.device_capacity=1024", "device_capacity", 1024),
        ("memory.spike_margin=0.25", "spike_margin", 0.25),
    ],
)
def test_good_values_are_kept_as_written(override, attribute, value):
    assert getattr(load_config(overrides=[override]).memory, attribute) == value


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["training.gradient_accumulation_steps=0"], "training.gradient_accumulation_steps must be an integer >= 1"),
        (["training.per_device_train_batch_size=0"], "training.per_device_train_batch_size must be an integer >= 1"),
        (["memory.window=3"], r"memory.warmup must be at most memory.window \(3\)"),
        (["memory.window=4", "memory.warmup=6"], r"memory.warmup must be at most memory.window \(4\)"),
        (["model.tiny.hidden_size=12", "model.tiny.num_attention_heads=4"], "model.tiny: hidden_size must be"),
        (["model.tiny.num_key_value_heads=3"], "model.tiny: hidden_size must be"),
        (["training.eval_strategy=steps"], "training.eval_strategy must be 'no', got 'steps'"),
        (
            ["memory.simulate_spike_at=2", "memory.enabled=false"],
            "memory.simulate_spike_at needs the memory callback's",
        ),
        (
            ["memory.simulate_spike_at=2", "memory.oom_retries=0"],
            "memory.simulate_spike_at needs the memory callback's",
        ),
    ],
)
def test_values_the_run_would_reject_together_are_rejected_where_the_config_is_read(overrides, message, capsys):
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config(overrides=overrides)
    arguments = [argument for override in overrides for argument in ("--set", override)]
    assert main(["train", "--print-config", *arguments]) == 2
    assert f"hf-paged: error: {message.replace(chr(92), '')}" in capsys.readouterr().err
    assert load_config(overrides=["memory.window=3", "memory.warmup=3"]).memory.window == 3


def test_a_path_that_starts_at_the_home_directory_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(overrides=["data.path=~/data.jsonl", "model.name=~/model", "tokenizer.name=~/tokenizer"])
    assert (config.data.path, config.model.name, config.tokenizer.name) == tuple(
        str(tmp_path / name) for name in ("data.jsonl", "model", "tokenizer")
    )
    assert load_config(overrides=["model.name=org/model~1"]).model.name == "org/model~1"


def _values_around_bounds() -> list[tuple[str, float]]:
    """Each bounded field of ``memory`` that the callback takes, with values at, just inside and just outside its
    bounds."""
    taken = inspect.signature(MemorySpikeCallback).parameters
    cases = []
    for item in dataclasses.fields(MemoryConfig):
        bounds = item.metadata.get("bounds")
        if bounds is None or item.name not in taken:
            continue
        low, high = bounds[:2]
        edges = [low] if high is None else [low, (low + high) / 2, high]
        for value in (edge + offset for edge in edges for offset in (-0.5, 0, 0.5)):
            cases.append((item.name, int(value) if item.type == "int" and value % 1 == 0 else value))
    return cases


@pytest.mark.parametrize("name, value", _values_around_bounds())
def test_the_config_takes_a_memory_value_exactly_when_the_callback_does(name, value):
    # warmup 1 is within every window the callback takes
    arguments = {name: value, **({"warmup": 1} if name == "window" else {})}
    try:
        config = load_config(overrides=[f"memory.{key}={setting}" for key, setting in arguments.items()])
    except ConfigError:
        config = None
    try:
        MemorySpikeCallback(**arguments)
    except (TypeError, ValueError):
        assert config is None
    else:
        assert config is not None and memory_callback(config) is not None


@pytest.mark.parametrize("key", ["save_strategy", "logging_strategy", "eval_strategy"])
def test_a_strategy_written_no_is_the_word_no_though_yaml_reads_a_boolean(tmp_path, key):
    """YAML 1.1 reads an unquoted ``no`` as False, which a strategy refused ("must be one of 'no', ..., got False")."""
    assert load_config(overrides=[f"training.{key}=no"]).training[key] == "no"
    path = tmp_path / "run.yaml"
    path.write_text(f"training:\n  {key}: no\n")
    assert load_config(path).training[key] == "no"
    with pytest.raises(ConfigError, match=f"training.{key} in --set training.{key}=yes must be one of"):
        load_config(overrides=[f"training.{key}=yes"])
