"""FSDP2 (fully_shard) with a paged optimizer, two ranks (torchrun, gloo on CPU).

Trains ``--steps`` steps, saving model and optimizer with ``torch.distributed.checkpoint`` after
``--save-at`` steps, then loads them into a fresh sharded model and optimizer (another budget) and
continues. Rank 0 writes the full parameters to ``--output`` (a ``torch.save`` file).
"""

import argparse

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import hf_paged

OPTIMIZERS = {
    "PagedAdamW": hf_paged.PagedAdamW,
    "PagedAdamW4bit": hf_paged.PagedAdamW4bit,
    "PagedLion": hf_paged.PagedLion,
}
LAYOUT = {"PagedAdamW4bit": {"block_size": 16, "min_4bit_size": 512}}
"""Layout arguments that give the first layer's weight (1024 elements, 512 a rank) quantized state."""


def make_optimizer(optimizer_name: str, params, **paging):
    return OPTIMIZERS[optimizer_name](params, lr=1e-2, weight_decay=0.1, **LAYOUT.get(optimizer_name, {}), **paging)


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
    optimizer = make_optimizer(optimizer_name, model.parameters(), page_size=1024, device_budget=budget)
    return model, optimizer


def train(model, optimizer, data, rank: int, world: int) -> None:
    for inputs, targets in data:
        rows = slice(rank * len(inputs) // world, (rank + 1) * len(inputs) // world)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows]).backward()
        optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(args.steps)
    model, optimizer = sharded(args.optimizer, budget=None)
    train(model, optimizer, data[: args.save_at], rank, world)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=args.checkpoint)

    model, optimizer = sharded(args.optimizer, budget=1024)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=args.checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    train(model, optimizer, data[args.save_at :], rank, world)
    full = {name: param.full_tensor() for name, param in model.named_parameters()}
    state = optimizer.state_dict()["state"]
    state_like_params = all(
        state[index]["exp_avg"].placements == param.placements and state[index]["exp_avg"].shape == param.shape
        for index, param in enumerate(model.parameters())
        if "exp_avg" in state[index]
    )
    if rank == 0:
        torch.save(
            {"params": full, "paging": optimizer.paging_stats(), "state_like_params": state_like_params}, args.output
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
