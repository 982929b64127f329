"""A training loop of its own under DDP (no Trainer) whose steps run through ``hf_paged.OOMRecovery``.

Launched with ``torchrun --standalone --nproc-per-node 2 tests/scripts/ddp_loop_replay.py --output-dir DIR``, on the
CPU (gloo). The tests' tiny Llama trains 4 steps of 2 micro-batches (the first inside ``no_sync``) with
PagedAdamW8bit; ``--fail-rank R`` raises ``torch.OutOfMemoryError`` once, in the backward of step 3's last
micro-batch (a gradient hook on the first decoder layer's MLP output). Each rank writes ``rank<R>.json``: a SHA-256 of
its parameters' and optimizer state's bytes, its losses and the recoveries it counted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

import hf_paged
from hf_paged.process_exit import end_distributed_run

from trainer_utils import tiny_llama

STEPS, MICRO_BATCHES, BATCH = 4, 2, 2


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of the bytes of the parameters and of the optimizer's state."""
    found = hashlib.sha256()
    tensors = [param.detach() for param in model.parameters()]
    state = optimizer.state_dict()["state"]
    tensors += [state[index][key] for index in sorted(state) for key in sorted(state[index])]
    for tensor in tensors:
        found.update(torch.as_tensor(tensor).reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return found.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--fail-rank", type=int, default=-1, help="the rank that runs out of memory once (-1: none)")
    options = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(tiny_llama(num_hidden_layers=2), bucket_cap_mb=0.02)
    optimizer = hf_paged.PagedAdamW8bit(model.parameters(), lr=1e-2, block_size=64, min_8bit_size=256)
    recovery = hf_paged.OOMRecovery(optimizer, model=model)
    generator = torch.Generator().manual_seed(1 + rank)
    data = torch.randint(0, 128, (STEPS, MICRO_BATCHES, BATCH, 16), generator=generator)
    left = {"errors": 1 if rank == options.fail_rank else 0, "step": 0}

    def fail_once(grad: torch.Tensor) -> None:
        if left["errors"] and left["step"] == 3 and model.require_backward_grad_sync:
            left["errors"] -= 1
            raise torch.OutOfMemoryError("injected in backward")

    def hook_output(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(fail_once)

    model.module.model.layers[0].mlp.register_forward_hook(hook_output)

    def forward_backward(micro_batch: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=micro_batch, labels=micro_batch).loss / MICRO_BATCHES
        loss.backward()
        return loss.detach()

    losses = []
    for step, micro_batches in enumerate(data, start=1):
        left["step"] = step
        with recovery.window(step):
            with model.no_sync():
                first = recovery.run(forward_backward, micro_batches[0])
            last = recovery.run(forward_backward, micro_batches[1])
        optimizer.step()
        optimizer.zero_grad()
        losses.append((first + last).item())
    recovery.close()
    result = {"digest": digest(model, optimizer), "losses": losses, "oom_recoveries": recovery.recoveries}
    with open(os.path.join(options.output_dir, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
    end_distributed_run()
