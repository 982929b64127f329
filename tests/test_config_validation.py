"""Config values that the run would reject later are rejected where the config is read, with exit status 2."""

from __future__ import annotations

import pytest

from hf_paged.cli import main
from hf_paged.cli.config import ConfigError, load_config

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
