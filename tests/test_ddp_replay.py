"""A DDP model whose modules run collectives of their own is not replayed (``hf_paged/ddp_replay.py``).

A rank that ran out of memory completes DDP's gradient all-reduces only; the collectives inside the model
(``SyncBatchNorm``'s, those of a module that sets ``replay_obstacle``) stay unmatched, so the replay is refused and
the error raised with a note saying why, also for a micro-batch inside ``no_sync``, which a rank would replay alone. A
process group of one rank runs the recovery's path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hf_paged
from hf_paged import ddp_replay
from hf_paged.recovery import not_recovered_reason

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class TensorParallelStandIn(torch.nn.Linear):
    """A layer that would all-reduce its output across ranks, flagged as the docs ask."""

    replay_obstacle = "it all-reduces its output across the tensor-parallel group"


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A gloo process group of this process alone, destroyed after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _recovering(
    middle: torch.nn.Module, **ddp_options: bool
) -> tuple[DistributedDataParallel, hf_paged.PagedAdamW, hf_paged.OOMRecovery]:
    """A seeded DDP model ``Linear, middle, Linear``, its optimizer and the recovery of its micro-batches."""
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 8), middle, torch.nn.Linear(8, 1)), **ddp_options
    )
    optimizer = hf_paged.PagedAdamW(model.parameters(), lr=1e-2)
    return model, optimizer, hf_paged.OOMRecovery(optimizer, model=model)


def _out_of_memory_once(times: int, where: str):
    """A module hook that raises an out-of-memory error the first ``times`` times it runs (in ``where``)."""
    errors_left = [times]

    def out_of_memory(module: torch.nn.Module, arguments: tuple) -> None:
        if errors_left[0]:
            errors_left[0] -= 1
            raise torch.OutOfMemoryError(f"injected in {where}")

    return out_of_memory


def _forward_backward(model: DistributedDataParallel, batch: torch.Tensor) -> torch.Tensor:
    """A micro-batch whose loss is computed from the output (which is dropped: the loss holds the graph)."""
    loss = model(batch).pow(2).mean()
    loss.backward()
    return loss.detach()


def fail_in_forward(middle: torch.nn.Module, synchronized: bool) -> BaseException:
    """Run a step of ``Linear, middle, Linear`` under DDP whose micro-batch (``synchronized`` or inside ``no_sync``)
    runs out of memory once, in ``middle``'s forward, and return the error ``OOMRecovery`` raised."""
    model, _, recovery = _recovering(middle)
    middle.register_forward_pre_hook(_out_of_memory_once(1, "forward"))
    gradient_sync = contextlib.nullcontext() if synchronized else model.no_sync()
    with pytest.raises(torch.OutOfMemoryError) as raised, recovery.window(1), gradient_sync:
        recovery.run(_forward_backward, model, torch.randn(4, 8))
    assert recovery.recoveries == 0
    return raised.value


def test_sync_batch_norm_counts_as_collectives_of_the_models_own():
    """DDP takes a ``SyncBatchNorm`` only on an accelerator; the recovery asks the same function for it as for a
    flagged module (below)."""
    with_sync = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SyncBatchNorm(8))
    assert ddp_replay.collectives_obstacle(with_sync) == (
        "the model's module '1' (SyncBatchNorm) runs collectives of its own (SyncBatchNorm all-reduces its batch "
        "statistics in forward and their gradients in backward), which the other ranks may wait in and which a rank "
        "that failed cannot complete: it completes DDP's gradient all-reduces only."
    )
    assert ddp_replay.collectives_obstacle(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))) is None


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("synchronized", [True, False], ids=["synchronized", "no_sync"])
def test_a_module_flagged_with_replay_obstacle_is_not_replayed(synchronized):
    """Also inside ``no_sync``: a replay on this rank alone would run the module's collectives without its peers."""
    error = fail_in_forward(TensorParallelStandIn(8, 8), synchronized)
    assert not_recovered_reason(error) == (
        "the model's module '1' (TensorParallelStandIn) runs collectives of its own (it all-reduces its output across "
        "the tensor-parallel group), which the other ranks may wait in and which a rank that failed cannot complete: "
        "it completes DDP's gradient all-reduces only."
    )


def _train_with_find_unused(fail: bool) -> tuple[DistributedDataParallel, int]:
    """Two steps of a DDP model finding unused parameters whose loss is computed from its output (``model(x)``'s
    tensor itself is dropped, as a label-smoothed loss or ``model(x) / n`` drop it); with ``fail``, the backward of the
    first step runs out of memory once."""
    torch.manual_seed(1)
    middle = torch.nn.Linear(8, 8)
    model, optimizer, recovery = _recovering(middle, find_unused_parameters=True)
    middle.register_full_backward_pre_hook(_out_of_memory_once(int(fail), "backward"))
    batches = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    for batch in batches:
        with recovery.window():
            recovery.run(_forward_backward, model, batch)
        optimizer.step()
        optimizer.zero_grad()
    return model, recovery.recoveries


@pytest.mark.usefixtures("one_rank_group")
def test_a_backward_error_finding_unused_parameters_is_replayed_when_only_the_loss_holds_the_graph():
    """The gradients a rank still owes are found from the forward's graph, which the loss keeps; the recovery followed
    the output tensors themselves, gone once a loss is computed from them, and refused the replay ("the forward's
    outputs were gone"): the Trainer with ``label_smoothing_factor`` ended the job at its first error."""
    clean, clean_recoveries = _train_with_find_unused(fail=False)
    replayed, recoveries = _train_with_find_unused(fail=True)
    assert (clean_recoveries, recoveries) == (0, 1)
    for param, expected in zip(replayed.parameters(), clean.parameters()):
        assert torch.equal(param, expected)
