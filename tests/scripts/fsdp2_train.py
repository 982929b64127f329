"""FSDP2 (fully_shard) with paged optimizers, two ranks (torchrun, gloo on CPU).

For each optimizer: trains ``--save-at`` steps, saves model and optimizer with
``torch.distributed.checkpoint``, trains on to ``--steps`` (the uninterrupted run), then loads the
checkpoint into a fresh sharded model and optimizer (another budget) and trains the same further steps
(the resumed run). The last layer, ``Linear(64, 5)``, is sharded unevenly (3 and 2 rows). Rank 0 writes
to ``--output`` (a ``torch.save`` file), per optimizer: the resumed run's full parameters, its paging
statistics, and the mismatches each rank found between the loaded and the saved state and between the
resumed and the uninterrupted run.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import hf_paged
from hf_paged.process_exit import end_distributed_run

EIGHT_BIT = {"block_size": 64, "min_8bit_size": 160}
"""8-bit settings under which the uneven ``Linear(64, 5)`` weight (320 elements; 192 and 128 per rank) is
8-bit on both ranks, its blocks of 64 falling on the same elements sharded and unsharded."""
FOUR_BIT = {"block_size": 64, "min_4bit_size": 160}
"""The same for 4-bit state."""

OPTIMIZERS = {
    "PagedAdamW": (hf_paged.PagedAdamW, {}),
    "PagedLion": (hf_paged.PagedLion, {}),
    "PagedAdamW8bit": (hf_paged.PagedAdamW8bit, EIGHT_BIT),
    "PagedLion8bit": (hf_paged.PagedLion8bit, EIGHT_BIT),
    "PagedAdamW4bit": (hf_paged.PagedAdamW4bit, FOUR_BIT),
    "PagedAdEMAMix8bit": (hf_paged.PagedAdEMAMix8bit, EIGHT_BIT),
}


def make_optimizer(name: str, params, budget: int | None = None) -> hf_paged.PagedOptimizer:
    cls, settings = OPTIMIZERS[name]
    return cls(params, lr=1e-2, weight_decay=0.1, page_size=512, device_budget=budget, **settings)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 5))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=generator), torch.randn(8, 5, generator=generator)) for _ in range(steps)]


def sharded(optimizer_name: str, budget: int | None):
    model = build_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, make_optimizer(optimizer_name, model.parameters(), budget)


def train(model, optimizer, data, rank: int, world: int) -> None:
    for inputs, targets in data:
        rows = slice(rank * len(inputs) // world, (rank + 1) * len(inputs) // world)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows]).backward()
        optimizer.step()


def local_state(optimizer_state: dict) -> dict[str, torch.Tensor]:
    """This rank's tensors of a ``get_state_dict`` optimizer state, by ``parameter/key``, as copies."""
    return {
        f"{fqn}/{key}": (value.to_local() if hasattr(value, "to_local") else value).clone()
        for fqn, entry in optimizer_state["state"].items()
        for key, value in entry.items()
    }


def page_buffers(optimizer: hf_paged.PagedOptimizer) -> list:
    """This rank's pages as stored (codes and scales of 8-bit state), to check that a load is bitwise."""
    return [optimizer._store.read(page) for page in optimizer._store.pages]


def mismatches(expected: dict, actual: dict, what: str) -> list[str]:
    """The keys of two dicts of tensors (or of tuples of tensors) that are missing or not bitwise equal."""
    found = [f"{what}: {key} missing or extra" for key in sorted(set(expected) ^ set(actual), key=str)]
    for key in sorted(set(expected) & set(actual), key=str):
        left, right = expected[key], actual[key]
        if isinstance(left, torch.Tensor):
            left, right = (left,), (right,)
        if left is None or right is None:
            equal = left is right
        else:
            equal = len(left) == len(right) and all(
                a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(left, right)
            )
        if not equal:
            found.append(f"{what}: {key}")
    return found


def run(optimizer_name: str, data, save_at: int, checkpoint: str, rank: int, world: int) -> dict:
    model, optimizer = sharded(optimizer_name, budget=None)
    train(model, optimizer, data[:save_at], rank, world)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    saved_state, saved_pages = local_state(optimizer_state), dict(enumerate(page_buffers(optimizer)))
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint)
    train(model, optimizer, data[save_at:], rank, world)
    _, uninterrupted = get_state_dict(model, optimizer)
    uninterrupted_params = {name: param.to_local().clone() for name, param in model.named_parameters()}

    model, optimizer = sharded(optimizer_name, budget=512)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    found = mismatches(saved_state, local_state(get_state_dict(model, optimizer)[1]), "loaded state")
    found += mismatches(saved_pages, dict(enumerate(page_buffers(optimizer))), "loaded page")
    train(model, optimizer, data[save_at:], rank, world)
    found += mismatches(local_state(uninterrupted), local_state(get_state_dict(model, optimizer)[1]), "resumed state")
    params = {name: param.to_local() for name, param in model.named_parameters()}
    found += mismatches(uninterrupted_params, params, "resumed parameter")

    state = optimizer.state_dict()["state"]
    state_like_params = all(
        state[index][name].placements == param.placements and state[index][name].shape == param.shape
        for index, param in enumerate(model.parameters())
        for name in optimizer.state_names
    )
    every_rank: list = [None] * world
    dist.all_gather_object(every_rank, found)
    return {
        "params": {name: param.full_tensor() for name, param in model.named_parameters()},
        "paging": optimizer.paging_stats(),
        "state_like_params": state_like_params,
        "mismatches": [f"rank {r}: {line}" for r, lines in enumerate(every_rank) for line in lines],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizers", nargs="+", choices=sorted(OPTIMIZERS), required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--checkpoint", required=True, help="a folder: one checkpoint per optimizer in it")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(args.steps)
    results = {
        name: run(name, data, args.save_at, os.path.join(args.checkpoint, name), rank, world)
        for name in args.optimizers
    }
    if rank == 0:
        torch.save(results, args.output)
    end_distributed_run()  # ends the process: see hf_paged/process_exit.py


if __name__ == "__main__":
    main()
