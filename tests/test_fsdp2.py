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

STEPS, SAVE_AT = 5, 3


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """The results of ``fsdp2_train.py`` for every optimizer, from one two-process run."""
    folder = tmp_path_factory.mktemp("fsdp2")
    output = folder / "result.pt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
        os.path.join(REPO, "tests", "scripts", "fsdp2_train.py"),
        "--optimizers", *sorted(OPTIMIZERS), "--steps", str(STEPS), "--save-at", str(SAVE_AT),
        "--checkpoint", str(folder / "checkpoints"), "--output", str(output),
    ]
    environment = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(output, weights_only=True)


def unsharded(optimizer_name: str, steps: int) -> dict[str, torch.Tensor]:
    model = build_model()
    optimizer = make_optimizer(optimizer_name, model.parameters())
    for inputs, targets in batches(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return {name: param.detach() for name, param in model.named_parameters()}


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_fsdp2_checkpoint_round_trip_with_uneven_shards_is_exact(two_ranks, optimizer_name):
    sharded = two_ranks[optimizer_name]
    # Every state entry (8-bit state as fp32 values) and every page (codes and scales) loads bitwise as
    # saved, and the resumed run equals the uninterrupted one bitwise.
    assert sharded["mismatches"] == []
    assert sharded["state_like_params"]
    assert sharded["paging"]["page_outs"] > 0


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_fsdp2_two_ranks_match_unsharded_run(two_ranks, optimizer_name):
    # The 8-bit blocks fall on the same elements sharded and unsharded, and both ranks choose 8-bit state
    # for the uneven weight from its global size, so only the gradients' summation order differs.
    reference = unsharded(optimizer_name, steps=STEPS)
    for name, expected in reference.items():
        actual = two_ranks[optimizer_name]["params"][name]
        assert ((actual - expected).norm() / expected.norm()).item() < 1e-6, name
