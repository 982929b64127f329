"""``hf-paged train`` under ``accelerate launch`` with two CPU processes, as the README's command line runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DDP_CONFIG = ROOT / "configs" / "accelerate" / "ddp.yaml"
EXAMPLES, BATCH, PROCESSES = 16, 4, 2

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """One epoch of 16 examples in batches of 4 per process, launched as the README says (2 processes, no GPU), with
    ``--plan``."""
    tmp_path = tmp_path_factory.mktemp("cli-launch")
    output_dir = tmp_path / "out"
    overrides = [
        "training.max_steps=-1",
        "training.num_train_epochs=1",
        f"training.per_device_train_batch_size={BATCH}",
        "training.logging_steps=1",
        "training.disable_tqdm=true",
        "training.optim_args=device_budget=auto,page_size=64KiB,min_8bit_size=1024,compiled=false",
        f"data.max_samples={EXAMPLES}",
        "memory.plot=false",
    ]
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(DDP_CONFIG),
        "--num_processes", str(PROCESSES), "--main_process_port", "0",  # port 0: a free one
        "-m", "hf_paged.cli", "train", *(f"--set={override}" for override in overrides),
        "--output-dir", str(output_dir), "--plan",
    ]  # fmt: skip
    environment = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",  # the case of the issue: a machine without an accelerator
    }
    completed = subprocess.run(
        command, check=False, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed, output_dir


def test_processes_train_together_with_ddp_on_the_cpu(launch):
    """The two processes split the epoch (DistributedSampler): half the steps of one process, with the gradients
    averaged, and transformers sees a DISTRIBUTED run instead of two independent ones."""
    completed, output_dir = launch
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["steps"] == EXAMPLES // (BATCH * PROCESSES)  # one process alone would take 4 steps
    assert summary["processes"] == PROCESSES
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["log_history"][-1]["epoch"] == 1.0
    assert "parallel_mode != ParallelMode.DISTRIBUTED" not in completed.stderr
    assert "find_unused_parameters=True was specified" not in completed.stderr  # every adapter is used each step
    rows = [json.loads(line) for line in (output_dir / "memory_timeline.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]  # written by rank 0 only, once per step


def test_the_summary_and_messages_are_printed_once(launch):
    """Rank 0 prints the progress, hf-paged's messages, the Trainer's logs and the summary; the other rank nothing."""
    completed, output_dir = launch
    out = completed.stdout
    assert out.count("hf-paged train summary") == 1
    assert re.search(r"model +tiny with QLoRA \(4-bit base weights\) on cpu, 2 processes \(data parallel\)", out)
    assert "hf-paged: model 'tiny' with QLoRA (4-bit base weights) on cpu\n" in out
    assert json.loads((output_dir / "summary.json").read_text())["device"] == "cpu"
    messages = [line for line in (out + completed.stderr).splitlines() if line.startswith("hf-paged")]
    assert len(messages) >= 5 and len(messages) == len(set(messages)), messages
    assert out.count("'loss':") == 2  # the Trainer logs on rank 0 only
    assert completed.stderr.count("tokenizing: 100%") == 1  # datasets' progress bars: rank 0's only


def test_the_plan_is_one_ranks_of_the_launch(launch):
    """``--plan`` in a launch of two processes plans one rank of two under DDP (each process plans in a process of its
    own: the plan's fake process group of two ranks cannot live beside the launch's), printed once, by rank 0."""
    completed, _ = launch
    assert completed.stdout.count("hf-paged plan: ") == 1, completed.stdout
    header = next(line for line in completed.stdout.splitlines() if line.startswith("hf-paged plan: "))
    assert header.endswith("ddp on 2 GPUs (one rank's memory), on cpu"), header
    assert "training without one" not in completed.stdout


def test_the_first_process_tokenizes_and_the_others_read_its_cache(tmp_path):
    """Rank 0 loads and tokenizes the data while the other rank waits, then the other reads the ``datasets`` cache.
    Rank 0 is made slow: a rank that did not wait would tokenize first, and rank 0, reading that rank's cache, would
    show no progress bar (the launch test above failed so, now and then, before)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "tests" / "scripts" / "tokenize_once.py"), "--output-dir", str(tmp_path / "out"), "--delay", "3",
    ]  # fmt: skip
    environment = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    completed = subprocess.run(
        command, check=False, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    ranks = [json.loads((tmp_path / "out" / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0] == {"examples": EXAMPLES, "cache_reads": 0}  # rank 0 ran the map and the filter
    assert ranks[1] == {"examples": EXAMPLES, "cache_reads": 2}  # rank 1 read both from rank 0's cache
