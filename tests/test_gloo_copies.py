"""What gloo allocates for FSDP2's reduce-scatter on the CPU, which a plan (traced with a fake process group, as NCCL
runs) leaves out: a copy of the input, made on gloo's worker thread and freed there when the collective's work ends.

How long the copy outlives the call depends on how far that thread got, so real CPU runs of a parameter-heavy model
measure one decoder layer's gradients above the plan in some ranks' forward and backward and not in others (README.md,
Planning memory, "Across N GPUs"). The test pins the mechanism the README gives: while a gloo reduce-scatter runs, the
process holds one copy of its input beside the input and the output (measured: 4,194,304 bytes more than before
the call, for an input of 4,194,304 bytes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import multiprocessing

import device_memory

INPUT_ELEMENTS = 1 << 20
"""fp32 elements of the reduce-scatter's input (4 MiB)."""
WORLD_SIZE = 2


def _rank(rank: int, store_file: str, output: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    device_memory.install()
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        inputs = torch.ones(INPUT_ELEMENTS)
        outputs = torch.empty(INPUT_ELEMENTS // WORLD_SIZE)
        dist.barrier()
        before = device_memory.live()
        device_memory.reset_peak()
        dist.reduce_scatter_tensor(outputs, inputs)
        during = device_memory.peak() - before
        assert torch.equal(outputs, torch.full_like(outputs, WORLD_SIZE))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(output, f"rank{rank}.json").write_text(json.dumps({"during": during}))


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
def test_a_gloo_reduce_scatter_holds_a_copy_of_its_input_while_it_runs(tmp_path: Path) -> None:
    device_memory.build()
    multiprocessing.spawn(
        _rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD_SIZE, join=True, start_method="spawn"
    )
    input_bytes = INPUT_ELEMENTS * 4
    for rank in range(WORLD_SIZE):
        during = json.loads((tmp_path / f"rank{rank}.json").read_text())["during"]
        assert input_bytes <= during < 2 * input_bytes, (rank, during, input_bytes)
