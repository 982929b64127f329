"""A DeepSpeed ZeRO checkpoint resumed on another number of ranks through a universal checkpoint.

Three steps, each its own process (the test runs them; ``N`` and ``M`` ranks, ``torchrun`` with gloo on the CPU):

1. ``save`` on ``N`` ranks: a small MLP (``deepspeed_state_tools.model``) with a client optimizer of
   :data:`deepspeed_state_tools.CLIENTS` trains :data:`SAVE_AT` steps on :data:`GLOBAL_BATCH` samples split
   evenly over the ranks, and the engine saves a checkpoint (tag ``global_step3``). Rank 0 writes ``saved.pt``:
   every parameter's full fp32 weights and full ``exp_avg`` and ``exp_avg_sq`` as DeepSpeed's
   ``safe_get_full_fp32_param`` and ``safe_get_full_optimizer_state`` read them, the step and the losses.
2. ``python -m deepspeed.checkpoint.ds_to_universal --input_folder .../global_step3 --output_folder
   .../global_step3_universal`` (run by the test).
3. ``resume`` on ``M`` ranks: a fresh engine with ``"checkpoint": {"load_universal": true}`` loads the universal
   checkpoint. Each rank checks every parameter: the full fp32 weights equal the saved ones, the step is the saved
   step, and the full moments the tools read, and the client's own state of this rank's new partition, equal the
   saved moments as the client's codec encodes them on the new partition (the saved values themselves for fp32
   state, bitwise; for 8-bit and 4-bit state, the partition of saved values encoded and decoded again: blocks
   span parameters). Then the engine trains :data:`RESUMED` more steps. Rank 0 also runs the control: the same
   client on the full model in this one process, without DeepSpeed, loaded with ``load_state_dict`` from the saved
   weights, moments and step, trained on the same global batches.

``resume`` writes ``--output`` (``torch.save``, loadable with ``weights_only=True``): the largest difference of
each check per rank (0.0 where equal), the keys left in the client's ``optimizer.state``, and the losses of the
resumed run and of the control.

Example (from the repository root)::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/scripts/deepspeed_world_size.py save \\
        --stage 2 --config adamw_8bit --folder /tmp/ckpt
    python -m deepspeed.checkpoint.ds_to_universal --input_folder /tmp/ckpt/global_step3 \\
        --output_folder /tmp/ckpt/global_step3_universal
    python -m torch.distributed.run --standalone --nproc_per_node 1 tests/scripts/deepspeed_world_size.py resume \\
        --stage 2 --config adamw_8bit --folder /tmp/ckpt --output /tmp/resumed.pt
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from deepspeed_state_tools import CLIENTS, KEYS, largest_difference, model, requantized
from deepspeed_train import prepare_process, skip_shm_op_build

import hf_paged  # noqa: F401  (enables DeepSpeed's tools and checkpoints for paged clients once DeepSpeed loads)
from hf_paged.codecs import Float32Codec
from hf_paged.optim import PagedOptimizer
from hf_paged.process_exit import end_distributed_run

SAVE_AT = 3
"""Steps before the checkpoint."""
RESUMED = 3
"""Steps after it."""
GLOBAL_BATCH = 4
"""Samples per step over all ranks (one and two ranks split them evenly)."""
TAG = f"global_step{SAVE_AT}"


def batches(steps: int, rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the global batch of each step (the same global batches for any number of ranks)."""
    generator = torch.Generator().manual_seed(0)
    share = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    steps_data = []
    for _ in range(steps):
        inputs, targets = (
            torch.randn(GLOBAL_BATCH, 16, generator=generator),
            torch.randn(GLOBAL_BATCH, 8, generator=generator),
        )
        steps_data.append((inputs[share], targets[share]))
    return steps_data


def engine_for(stage: int, name: str, world_size: int, universal: bool):
    import deepspeed

    net = model()
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    if universal:
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=net, optimizer=CLIENTS[name](net.parameters()), config=config)
    return engine


def train(engine, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Train one step per batch; the loss of each step over the global batch (the mean of the ranks' means)."""
    losses = []
    for inputs, targets in data:
        loss = torch.nn.functional.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / torch.distributed.get_world_size())
    return losses


def full_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's full fp32 weights and moments, by name, as DeepSpeed's tools read them."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    state = {}
    for name, param in engine.module.named_parameters():
        state[name] = {"fp32": safe_get_full_fp32_param(param).detach().clone()}
        for key in KEYS:
            state[name][key] = safe_get_full_optimizer_state(param, key).detach().clone()
    return state


def client_step(engine) -> float:
    """The step count of the client's first partition."""
    client = engine.optimizer.optimizer
    return float(next(entry["step"] for entry in client.state.values() if "step" in entry))


def save(options: argparse.Namespace, rank: int, world_size: int) -> None:
    engine = engine_for(options.stage, options.config, world_size, universal=False)
    losses = train(engine, batches(SAVE_AT, rank, world_size))
    engine.save_checkpoint(options.folder, tag=TAG)
    saved = {"state": full_state(engine), "step": client_step(engine), "losses": losses, "world_size": world_size}
    if rank == 0:
        torch.save(saved, os.path.join(options.folder, "saved.pt"))


def partition_layout(engine, rank: int) -> tuple[torch.Tensor, list[tuple[str, int, int, int]]]:
    """This rank's flat fp32 partition of the client's (only) param group, and where each parameter's piece is:
    (name, offset in the partition, elements, offset in the flat parameter)."""
    zero = engine.optimizer
    names = {param: name for name, param in engine.module.named_parameters()}
    pieces = []
    if engine.zero_optimization_stage() == 3:
        partition = zero.fp32_partitioned_groups_flat[0]
        for param in zero.fp16_groups[0]:
            _, offset, elements = zero.grad_position[zero.get_param_id(param)]
            pieces.append((names[param], offset, elements, rank * param.ds_tensor.ds_numel))
        return partition, pieces
    partition = zero.single_partition_of_fp32_groups[0]
    for param in zero.bit16_groups[0]:
        mapping = param._hp_mapping
        if mapping is not None:
            hp, lp = mapping.get_hp_fragment_address(), mapping.lp_fragment_address
            pieces.append((names[param], hp.start, hp.numel, lp.start))
    return partition, pieces


def expected_partition(saved: dict, pieces: list[tuple[str, int, int, int]], numel: int, key: str) -> torch.Tensor:
    """This rank's new partition of saved state ``key`` as fp32 values (zeros in its padding)."""
    values = torch.zeros(numel)
    for name, offset, elements, start in pieces:
        flat = saved[name][key].reshape(-1)
        present = max(0, min(elements, flat.numel() - start))
        values[offset : offset + present] = flat[start : start + present]
    return values


def codec_of(client, partition: torch.Tensor, key: str):
    """The codec that ``client`` stores state ``key`` of ``partition`` with (``None``: fp32 or not paged)."""
    if not isinstance(client, PagedOptimizer):
        return None
    kind = client._layout[partition].kind
    codec = client._formats[kind].codecs[client.state_names.index(key)]
    return None if isinstance(codec, Float32Codec) else codec


def resume(options: argparse.Namespace, rank: int, world_size: int) -> None:
    saved = torch.load(os.path.join(options.folder, "saved.pt"), weights_only=True)
    engine = engine_for(options.stage, options.config, world_size, universal=True)
    engine.load_checkpoint(options.folder, tag=f"{TAG}_universal", load_lr_scheduler_states=False)
    client = engine.optimizer.optimizer
    differences: dict[str, float] = {}

    def note(check: str, difference: float) -> None:
        differences[check] = max(differences.get(check, 0.0), difference)

    partition, pieces = partition_layout(engine, rank)
    loaded = full_state(engine)
    note("step", abs(client_step(engine) - saved["step"]))
    for name, state in loaded.items():
        note("fp32", largest_difference(state["fp32"], saved["state"][name]["fp32"]))
    for key in KEYS:
        expected = expected_partition(saved["state"], pieces, partition.numel(), key)
        codec = codec_of(client, partition, key)
        if codec is not None:
            expected = requantized(codec, expected)
        if isinstance(client, PagedOptimizer):
            note("client_partition", largest_difference(client.get_state_tensor(partition, key), expected))
        else:
            note("client_partition", largest_difference(client.state[partition][key], expected))
        for name, offset, elements, start in pieces:
            full = loaded[name][key].reshape(-1)
            present = max(0, min(elements, full.numel() - start))
            note("full", largest_difference(full[start : start + present], expected[offset : offset + present]))
    state_keys = sorted({str(key) for entry in client.state.values() for key in entry})
    losses = train(engine, batches(SAVE_AT + RESUMED, rank, world_size)[SAVE_AT:])
    gathered: list = [None] * world_size
    torch.distributed.all_gather_object(gathered, {"differences": differences, "state_keys": state_keys})
    if rank == 0:
        control = control_losses(options.config, saved)
        result = {"ranks": gathered, "losses": losses, "control": control, "saved_losses": saved["losses"]}
        torch.save(result, options.output)
    torch.distributed.barrier()


def control_losses(name: str, saved: dict) -> list[float]:
    """The control: the client on the full model in this process, loaded from the saved weights and state, trained
    on the global batches after the checkpoint."""
    net = model()
    with torch.no_grad():
        for param_name, param in net.named_parameters():
            param.copy_(saved["state"][param_name]["fp32"].view(param.shape))
    optimizer = CLIENTS[name](net.parameters())
    state = {
        index: {"step": torch.tensor(saved["step"]), **{key: saved["state"][param_name][key].clone() for key in KEYS}}
        for index, (param_name, _) in enumerate(net.named_parameters())
    }
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    losses = []
    for inputs, targets in batches(SAVE_AT + RESUMED, 0, 1)[SAVE_AT:]:
        loss = torch.nn.functional.mse_loss(net(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["save", "resume"])
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], required=True)
    parser.add_argument("--config", choices=list(CLIENTS), required=True)
    parser.add_argument("--folder", required=True, help="the checkpoint folder")
    parser.add_argument("--output", help="where resume writes what it found")
    options = parser.parse_args()
    if options.phase == "resume" and not options.output:
        parser.error("resume needs --output")
    prepare_process()
    skip_shm_op_build()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    (save if options.phase == "save" else resume)(options, rank, world_size)
    end_distributed_run()  # ends the process: see hf_paged/process_exit.py


if __name__ == "__main__":
    main()
