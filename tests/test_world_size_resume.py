"""A checkpoint saved on one number of ranks resumes on another (issue 28 point 2), with gloo on the CPU.

- FSDP2 through the Trainer (``tests/scripts/fsdp2_world_size.py``): the Trainer's sharded (DCP) checkpoint saved
  on 2 ranks resumes on 1, and one saved on 1 on 2; DCP reshards the optimizer's fp32 DTensor state dict.
- DeepSpeed ZeRO-2 and ZeRO-3 (``tests/scripts/deepspeed_world_size.py``): a checkpoint converted with
  ``python -m deepspeed.checkpoint.ds_to_universal`` resumes with ``"checkpoint": {"load_universal": true}``, 2 ranks
  to 1 and 1 to 2.

After each load every rank checks every parameter: weights and step as saved, and each state equal to the saved
state as the optimizer's codec encodes it on the new shards (bitwise for fp32 state; 8-bit and 4-bit state: the
saved decoded values encoded and decoded again on the new sharding). Training then goes on with the losses of a
control started from the same weights and state on the new number of ranks' global batches: the same optimizer,
on the full model in one process, loaded with ``load_state_dict``.

The default run has FSDP2's case of 8-bit state from 2 ranks to 1; the rest of the matrix, DeepSpeed's included, is
marked slow
(``HF_PAGED_SLOW=1 python -m pytest -q tests/test_world_size_resume.py``). Before hf-paged's DeepSpeed adapter
wrote fp32 moments into the checkpoint, ``ds_to_universal`` stopped with ``KeyError: 'exp_avg'`` on an 8-bit or
4-bit client, and nothing moved the moments that a universal load puts in ``optimizer.state[partition]`` into a
paged client's pages.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "scripts")
ENVIRONMENT = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_PAGED_COMPILE": "0"}

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (pip install deepspeed)"
)

DIRECTIONS = {"2to1": (2, 1), "1to2": (1, 2)}
QUANTIZED_RTOL = {"8bit": 2e-4, "4bit": 2e-3}
"""How far the losses after the first resumed step may move from the control's where DeepSpeed's flat partitions
put 8-bit and 4-bit blocks across parameters (the control's blocks stay within each parameter)."""


def run(command: list[str], timeout: int) -> None:
    result = subprocess.run(
        command, check=False, cwd=REPO, capture_output=True, text=True, env=ENVIRONMENT, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-4000:]


def launch(script: str, ranks: int, *arguments: str) -> None:
    """``script`` on ``ranks`` processes (``torchrun --standalone``: a free port of its own)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    run([*command, os.path.join(SCRIPTS, script), *arguments], timeout=600)


def cases(default: tuple[str, str], names: list[str], kinds: list[str]) -> list:
    """Every (name, direction), the ``default`` one in the default run and the others marked slow."""
    return [
        pytest.param(name, direction, marks=() if (name, direction) == default else pytest.mark.slow)
        for name in names
        for direction in kinds
    ]


def assert_resumed_like_the_control(result: dict, name: str, quantized_across_params: bool) -> None:
    """All checks of every rank found no difference, and the losses follow the control's."""
    for rank, found in enumerate(result["ranks"]):
        assert found["differences"] and set(found["differences"].values()) == {0.0}, (rank, found["differences"])
    losses, control = result["losses"], result["control"]
    assert len(losses) == len(control) == 3, result
    torch.testing.assert_close(losses[0], control[0], rtol=1e-6, atol=0)  # the loaded weights alone
    bits = next((bits for bits in QUANTIZED_RTOL if bits in name), None)
    rtol = QUANTIZED_RTOL[bits] if bits and quantized_across_params else 1e-5
    torch.testing.assert_close(losses, control, rtol=rtol, atol=0)


FSDP2_OPTIMS = ["adamw_torch", "hf_paged_adamw_32bit", "hf_paged_adamw_8bit", "hf_paged_adamw_4bit"]


@pytest.mark.parametrize(("optim", "direction"), cases(("hf_paged_adamw_8bit", "2to1"), FSDP2_OPTIMS, list(DIRECTIONS)))
def test_fsdp2_trainer_checkpoint_resumes_on_another_number_of_ranks(tmp_path, optim, direction):
    saved_on, resumed_on = DIRECTIONS[direction]
    folder = str(tmp_path)
    launch("fsdp2_world_size.py", saved_on, "save", "--optim", optim, "--folder", folder)
    output = os.path.join(folder, "resumed.pt")
    launch("fsdp2_world_size.py", resumed_on, "resume", "--optim", optim, "--folder", folder, "--output", output)
    result = torch.load(output, weights_only=True)
    assert len(result["ranks"]) == resumed_on
    assert all(found["sharded"] for found in result["ranks"]), result["ranks"]  # FSDP2 shards on the new mesh
    assert_resumed_like_the_control(result, optim, quantized_across_params=False)


DEEPSPEED_CONFIGS = ["adamw_torch", "adamw_32bit", "adamw_8bit", "adamw_4bit"]


@needs_deepspeed
@pytest.mark.slow  # about 20 s a case; the default run keeps FSDP2's case, and DeepSpeed's same-rank resume
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize(("config", "direction"), cases(("adamw_8bit", "2to1"), DEEPSPEED_CONFIGS, list(DIRECTIONS)))
def test_deepspeed_universal_checkpoint_resumes_on_another_number_of_ranks(tmp_path, stage, config, direction):
    saved_on, resumed_on = DIRECTIONS[direction]
    folder = str(tmp_path)
    common = ["--stage", str(stage), "--config", config, "--folder", folder]
    launch("deepspeed_world_size.py", saved_on, "save", *common)
    convert = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state"]
    source, target = os.path.join(folder, "global_step3"), os.path.join(folder, "global_step3_universal")
    run([*convert, "--input_folder", source, "--output_folder", target], timeout=300)
    output = os.path.join(folder, "resumed.pt")
    launch("deepspeed_world_size.py", resumed_on, "resume", *common, "--output", output)
    result = torch.load(output, weights_only=True)
    assert len(result["ranks"]) == resumed_on
    if config != "adamw_torch":
        assert all(found["state_keys"] == ["step"] for found in result["ranks"]), result["ranks"]
    assert_resumed_like_the_control(result, config, quantized_across_params=True)
