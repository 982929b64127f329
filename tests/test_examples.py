"""The QLoRA example scripts run offline and write a trained adapter and the memory timeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STEPS = 3


def run_example(script: str, output_dir: Path, *extra: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [sys.executable, str(EXAMPLES / script), "--output-dir", str(output_dir), "--max-steps", str(STEPS)]
    result = subprocess.run([*command, *extra], check=False, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]


def check_outputs(output_dir: Path) -> None:
    adapter = load_file(output_dir / "adapter_model.safetensors")
    lora_b = [tensor for name, tensor in adapter.items() if "lora_B" in name]
    # LoRA starts with B = 0: every B having moved away from zero shows the adapters were trained and saved.
    assert len(lora_b) == 14 and all(tensor.abs().sum() > 0 for tensor in lora_b)
    rows = [json.loads(line) for line in (output_dir / "memory_timeline.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert (output_dir / "memory_timeline.png").read_bytes().startswith(b"\x89PNG")


def test_trainer_example(tmp_path):
    data = tmp_path / "train.jsonl"
    records = [{"instruction": f"Count to {n}.", "response": " ".join(map(str, range(1, n + 1)))} for n in range(1, 9)]
    data.write_text("\n".join(json.dumps(record) for record in records) + "\n")
    run_example("train_trainer.py", tmp_path / "out", "--data", str(data))
    check_outputs(tmp_path / "out")


def test_sft_example(tmp_path):
    pytest.importorskip("trl")
    run_example("train_sft.py", tmp_path / "out")
    check_outputs(tmp_path / "out")


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("empty.json", "[]", "expected a non-empty list of records"),
        ("fields.jsonl", '{"instruction": "Hi"}\n', "record 0 needs string fields 'instruction' and 'response'"),
    ],
)
def test_bad_data_files_are_named(tmp_path, monkeypatch, name, text, match):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from train_trainer import read_records

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=f"--data {path}: {match}"):
        read_records(path)
