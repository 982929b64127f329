"""The QLoRA example scripts run offline, write a trained adapter and the memory timeline, say where, and print no
third-party line a user cannot act on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
STEPS = 3
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

UNWANTED = {
    "torchao's optional extensions": re.compile(r"Failed to load .*torchao"),
    "the pytree notice": re.compile(r"is an Enum subclass"),
    "kernels-community's trust notice": re.compile(r"publisher trust|kernels-community"),
    "DeepSpeed's accelerator line": re.compile(r"Setting accelerator to CPU"),
    "pin_memory on the CPU": re.compile(r"pin_memory"),
    "the TqdmWarning of a notebook": re.compile(r"TqdmWarning|IProgress not found"),
    "a deprecation": re.compile(r"deprecat|FutureWarning", re.IGNORECASE),
    "TRL's dataset preparation bars": re.compile(
        r"(Adding EOS to|Tokenizing|Building labels for|Truncating|Dropping fully masked examples from) train dataset"
    ),
}
"""Third-party lines that ``hf-paged train`` keeps out, and the examples and the notebook must keep out too."""


def unwanted_lines(output: str) -> dict[str, list[str]]:
    """The lines of ``output`` that match each of :data:`UNWANTED`, by what they are."""
    lines = output.splitlines()
    found = {name: [line for line in lines if pattern.search(line)] for name, pattern in UNWANTED.items()}
    return {name: matches for name, matches in found.items() if matches}


def run_example(script: str, output_dir: Path, *extra: str, cwd: Path | None = None) -> str:
    """Run ``examples/<script>`` for a few steps, offline; return what it printed (stdout and stderr)."""
    command = [sys.executable, str(EXAMPLES / script), "--max-steps", str(STEPS)]
    if output_dir is not None:
        command += ["--output-dir", str(output_dir)]
    result = subprocess.run(
        [*command, *extra],
        check=False,
        cwd=cwd,
        env={**os.environ, **OFFLINE},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    output = result.stdout + result.stderr
    assert unwanted_lines(output) == {}
    return output


def said_where(output: str, output_dir: Path) -> bool:
    return f"adapter and memory timeline written to {output_dir.resolve()}" in output


def check_outputs(output_dir: Path) -> None:
    """A trained adapter and a memory timeline of every step, with its plot."""
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
    output = run_example("train_trainer.py", tmp_path / "out", "--data", str(data))
    check_outputs(tmp_path / "out")
    assert said_where(output, tmp_path / "out")


def test_sft_example_writes_to_the_ignored_folder_by_default(tmp_path):
    pytest.importorskip("trl")
    output = run_example("train_sft.py", None, cwd=tmp_path)
    output_dir = tmp_path / "examples-output" / "train_sft"
    check_outputs(output_dir)
    assert said_where(output, output_dir)
    output_file = "examples-output/train_sft/adapter_model.safetensors"
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "--no-index", output_file], check=False)
    assert ignored.returncode == 0  # git ignores the default output of the examples


def test_unwanted_lines_are_recognised():
    """The check above finds each kind of line, as the examples printed them before they filtered them."""
    printed = """\
Failed to load /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load
W1204 22:31:50.054000 5761 torch/utils/_pytree.py:630] <enum 'KernelPreference'> is an Enum subclass and is now
Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' because Hugging Face Hub is in
[2026-12-04 22:31:52,042] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.
dataloader.py:759: UserWarning: 'pin_memory' argument is set as true but no accelerator is found
tqdm/auto.py:21: TqdmWarning: IProgress not found. Please update jupyter and ipywidgets.
training_args.py:1541: FutureWarning: `gradient_checkpointing` is deprecated and will be removed in v6.
Tokenizing train dataset: 100%|██████████| 8/8 [00:00<00:00, 1594.87 examples/s]
hf_paged.qlora: QLoRA: 17,408 trainable of 132,800 parameters (13.11%); 14 4-bit linear layers in 0.05 MiB
"""
    assert {name: len(lines) for name, lines in unwanted_lines(printed).items()} == dict.fromkeys(UNWANTED, 1)


def test_importing_hf_paged_installs_no_filter():
    """``import hf_paged`` leaves the warnings filters and the third-party loggers as they were (torch, which it
    imports, adds filters of its own); the examples' explicit ``quiet.install()`` is what filters."""
    code = """
import logging, warnings
import torch
before = list(warnings.filters)
import hf_paged
from hf_paged.cli import quiet
loggers = [logging.getLogger(name) for name in quiet._FILTERS]
print(warnings.filters == before, any(logger.filters for logger in loggers))
quiet.install()
print(warnings.filters == before, all(logger.filters for logger in loggers))
"""
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert completed.stdout.split() == ["True", "False", "False", "True"]


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
