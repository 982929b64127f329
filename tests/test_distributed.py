"""Two CPU processes (gloo): DDP through ``accelerate launch`` with an unmodified script, and resume."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "scripts", "train_unmodified.py")

pytestmark = pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate's launcher is not on PATH")


def launch(output_dir, optim: str, *extra: str) -> list[dict]:
    command = [
        "accelerate", "launch", "--config_file", os.path.join(REPO, "configs", "accelerate", "ddp.yaml"),
        "--num_processes", "2", "--main_process_port", "29517", "-m", "hf_paged.run", SCRIPT,
        "--use_cpu", "--output_dir", str(output_dir), "--optim", optim,
        "--optim_args", "device_budget=48KiB,page_size=16KiB",
        "--per_device_train_batch_size", "2", "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2",
        "--seed", "0", *extra,
    ]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")]), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, check=False, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    # the ranks share one pipe, so another process's output may follow a row on the same line
    rows = [json.loads(row) for row in re.findall(r'\{"optimizer": [^}]*\}', result.stdout)]
    return sorted(rows, key=lambda row: row["rank"])


@pytest.mark.parametrize(
    ("optim", "optimizer_name"),
    [
        ("hf_paged_adamw_8bit", "PagedAdamW8bit"),
        # the same DDP path with another codec; 4-bit resume is covered in one process (tests/test_trainer.py)
        pytest.param("hf_paged_adamw_4bit", "PagedAdamW4bit", marks=pytest.mark.slow),
    ],
)
def test_ddp_two_processes_train_identically_and_resume(tmp_path, optim, optimizer_name):
    uninterrupted = launch(tmp_path / "full", optim)
    assert [row["rank"] for row in uninterrupted] == [0, 1]
    assert all(row["optimizer"] == optimizer_name for row in uninterrupted)
    assert uninterrupted[0]["checksum"] == uninterrupted[1]["checksum"]
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert (checkpoint / "optimizer.pt").exists()
    resumed = launch(tmp_path / "resumed", optim, "--resume_from_checkpoint", str(checkpoint))
    assert [row["checksum"] for row in resumed] == [row["checksum"] for row in uninterrupted]
