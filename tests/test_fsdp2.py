"""FSDP2: paged optimizers update DTensor shards and save and load through torch.distributed.checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "scripts"))

from fsdp2_train import OPTIMIZERS, batches, build_model, make_optimizer  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def unsharded(optimizer_name: str, steps: int) -> dict[str, torch.Tensor]:
    model = build_model()
    optimizer = make_optimizer(optimizer_name, model.parameters(), page_size=1024)
    for inputs, targets in batches(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return {name: param.detach() for name, param in model.named_parameters()}


_DCP_OF_QUANTIZED_STATE = pytest.mark.xfail(
    strict=True,
    reason="known bug (hardening issue): quantized codes and scales are saved as this rank's plain tensors, which "
    "torch.distributed.checkpoint takes for replicated ones; sharded training itself matches the unsharded run",
)


@pytest.mark.parametrize(
    "optimizer_name",
    [
        pytest.param(name, marks=_DCP_OF_QUANTIZED_STATE) if name.endswith("bit") else name
        for name in sorted(OPTIMIZERS)
    ],
)
def test_fsdp2_two_ranks_with_checkpoint_match_unsharded_run(tmp_path, optimizer_name):
    output = tmp_path / "result.pt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
        os.path.join(REPO, "tests", "scripts", "fsdp2_train.py"),
        "--optimizer", optimizer_name, "--steps", "6", "--save-at", "3",
        "--checkpoint", str(tmp_path / "checkpoint"), "--output", str(output),
    ]
    environment = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    sharded = torch.load(output, weights_only=True)
    assert sharded["paging"]["page_outs"] > 0
    reference = unsharded(optimizer_name, steps=6)
    for name, expected in reference.items():
        actual = sharded["params"][name]
        assert ((actual - expected).norm() / expected.norm()).item() < 1e-6, name
    assert sharded["state_like_params"]
