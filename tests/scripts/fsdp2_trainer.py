"""The Trainer under accelerate's FSDP2 on the CPU, two processes: the path of the README's multi-GPU command.

Launched as the README launches a training script, with the repository's FSDP2 config (mixed precision off on
the CPU, a free port)::

    accelerate launch --config_file configs/accelerate/fsdp2.yaml --mixed_precision no --main_process_port 0 \\
        -m hf_paged.run tests/scripts/fsdp2_trainer.py --optim adamw_torch hf_paged_adamw_32bit --output-dir DIR

(``torchrun --standalone --nproc_per_node 2 tests/scripts/fsdp2_trainer.py ...`` works too: the variables
``accelerate launch`` sets for that config are filled in when missing.) The Trainer then builds its optimizer
on the full parameters, accelerate shards the model with ``fully_shard`` and puts the sharded DTensor
parameters into the optimizer's param groups (``fsdp2_switch_optimizer_parameters``).

accelerate turns FSDP on only for accelerator devices: on the CPU, ``AcceleratorState`` keeps the distributed
type ``MULTI_CPU`` and drops the FSDP plugin without a word (the branch of ``AcceleratorState.__init__`` that
sets ``DistributedType.FSDP`` lists only GPU-like types), so the run would be plain DDP. :func:`enable_fsdp_on_cpu`
makes that branch apply to ``MULTI_CPU`` too, and nothing else changes but one thing: launched with
``--fsdp_offload_params true`` (FSDP2's ``CPUOffloadPolicy``: sharded parameters, gradients and the optimizer
step on the host), the policy does not pin host memory, which needs an accelerator.

For each ``--optim`` name: a run of ``--steps`` steps that saves a checkpoint at ``--save-at`` (the
uninterrupted run), then a fresh model and Trainer that resume from that checkpoint and train to ``--steps``
(the resumed run). Rank 0 writes ``results.pt`` in ``--output-dir``: per name, both runs' logged losses, what
shows that FSDP2 was in effect, every rank's optimizer pages (and those of the same optimizer built on the
full model), every rank's final local shards of both runs, the files of the checkpoint (rank 0's, and the one each
rank resumed from), and the error of a run that failed. With ``--save-on-each-node`` (for launches of several nodes) each node saves into
``--output-dir/node<N>`` (``N``: the launcher's node rank), as machines without shared storage would, and before
resuming copies the checkpoint's DCP files between the nodes (the checkpoint listing is from before the copy).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor, Shard
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

import hf_paged  # noqa: F401  (registers the hf_paged_* names, as ``-m hf_paged.run`` does)
from hf_paged.process_exit import end_distributed_run

from trainer_utils import tiny_llama, token_dataset

FSDP2_ENVIRONMENT = {
    "ACCELERATE_USE_FSDP": "true",
    "ACCELERATE_MIXED_PRECISION": "no",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
}
"""What ``accelerate launch --config_file configs/accelerate/fsdp2.yaml --mixed_precision no`` sets for FSDP."""

BATCH = 4

OPTIM_ARGS = {
    "hf_paged_adamw_32bit": "page_size=1KiB,device_budget=8KiB",
    "hf_paged_lion_32bit": "page_size=1KiB,device_budget=8KiB",
    "hf_paged_adamw_8bit": "page_size=1KiB,device_budget=8KiB,block_size=64,min_8bit_size=512",
    "hf_paged_lion_8bit": "page_size=1KiB,device_budget=8KiB,block_size=64,min_8bit_size=512",
    "hf_paged_adamw_4bit": "page_size=1KiB,device_budget=8KiB,block_size=64,min_4bit_size=512",
    "hf_paged_ademamix_8bit": "page_size=1KiB,device_budget=8KiB,block_size=64,min_8bit_size=512",
}
"""Small pages under a budget smaller than the state, so that every step pages; the 512-element matrices
(256 elements per rank) and everything larger have 8-bit or 4-bit state."""


def learning_rate(optim: str) -> float:
    """Lion takes a smaller learning rate than AdamW."""
    return 3e-3 if "lion" in optim else 1e-2


def enable_fsdp_on_cpu() -> None:
    """Let accelerate's FSDP plugin take effect on the CPU (``MULTI_CPU``), as it does on GPUs (idempotent).

    ``AcceleratorState.__init__`` sets ``DistributedType.FSDP`` and keeps the plugin only when the distributed
    type is one of the accelerator types (accelerate/state.py, the branch that tests ``ACCELERATE_USE_FSDP``);
    this applies the same assignments, mixed precision included, when it is ``MULTI_CPU``.
    """
    original = AcceleratorState.__init__
    if getattr(original, "fsdp_on_cpu", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            if self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            if isinstance(plugin.cpu_offload, CPUOffloadPolicy):  # pinning host memory needs an accelerator
                plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
            self.fsdp_plugin = plugin
            self.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    __init__.fsdp_on_cpu = True
    AcceleratorState.__init__ = __init__


def sharded_llama() -> LlamaForCausalLM:
    """Two decoder layers (each its own FSDP unit) with every dimension even, so that both ranks get equal shards."""
    return tiny_llama(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=1)


def training_args(optim: str, output_dir: str, steps: int, save_at: int, on_each_node: bool) -> TrainingArguments:
    return TrainingArguments(
        output_dir=output_dir,
        optim=optim,
        optim_args=OPTIM_ARGS.get(optim),
        learning_rate=learning_rate(optim),
        weight_decay=0.1,
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        save_strategy="steps",
        save_steps=save_at,
        save_on_each_node=on_each_node,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )


def logged_losses(trainer: Trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def pages(optimizer) -> int | None:
    """The optimizer's page count, ``None`` for optimizers that are not paged."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    return optimizer.paging_stats()["pages_total"] if hasattr(optimizer, "paging_stats") else None


def unsharded_pages(trainer: Trainer) -> int | None:
    """The pages of the optimizer ``trainer`` builds, on an unsharded model of its own, after one step."""
    model = sharded_llama()
    optimizer = trainer.create_optimizer(model)
    trainer.optimizer = None  # train() builds the optimizer it uses
    for param in model.parameters():  # a step, in case the pages are laid out at the first one
        param.grad = torch.zeros_like(param)
    optimizer.step()
    return pages(optimizer)


def fsdp_facts(trainer: Trainer) -> dict:
    """What shows that accelerate's FSDP2 sharded the model the optimizer updates."""
    model, optimizer = trainer.model, trainer.optimizer
    params = list(model.parameters())
    grouped = [param for group in optimizer.param_groups for param in group["params"]]
    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "is_fsdp2": trainer.accelerator.is_fsdp2,
        "fsdp_version": trainer.accelerator.state.fsdp_plugin.fsdp_version,
        "trainer_is_fsdp_enabled": trainer.is_fsdp_enabled,
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "fsdp_modules": sum(isinstance(module, FSDPModule) for module in model.modules()),
        "params_are_sharded_dtensors": all(
            isinstance(param, DTensor) and param.placements == (Shard(0),)
            and param.device_mesh.size() == dist.get_world_size()
            for param in params
        ),
        "optimizer_holds_the_sharded_params": {id(param) for param in grouped} == {id(param) for param in params},
        "local_elements": sum((param.to_local() if isinstance(param, DTensor) else param).numel() for param in params),
        "params_offloaded_to_cpu": [
            fsdp_param.offload_to_cpu
            for module in model.modules()
            if isinstance(module, FSDPModule)
            for group in module._get_fsdp_state()._fsdp_param_groups
            for fsdp_param in group.fsdp_params
        ],
        "full_elements": sum(param.numel() for param in params),
    }


def listing(folder: str) -> dict[str, list[str]]:
    """Every subfolder of ``folder`` (relative, ``.`` for itself) with its files."""
    return {os.path.relpath(root, folder): sorted(files) for root, _, files in sorted(os.walk(folder))}


def train(
    optim: str, output_dir: str, steps: int, save_at: int, on_each_node: bool, resume_from: str | None = None
) -> dict:
    """One Trainer run of a fresh model; what this rank saw, and the error if it failed."""
    args = training_args(optim, output_dir, steps, save_at, on_each_node)
    trainer = Trainer(model=sharded_llama(), args=args, train_dataset=token_dataset(2 * BATCH * steps))
    run: dict = {"error": None, "unsharded_pages": unsharded_pages(trainer)}
    try:
        trainer.train(resume_from_checkpoint=resume_from)
        run["weights"] = {name: param.to_local().detach().clone() for name, param in trainer.model.named_parameters()}
    except Exception:  # noqa: BLE001  (reported to the test, which fails on it)
        run["error"] = traceback.format_exc(limit=-8)
    run["losses"] = logged_losses(trainer)
    if trainer.optimizer is not None:  # also after a failed step or save: what the optimizer was given
        run["pages"] = pages(trainer.optimizer)
        run["fsdp"] = fsdp_facts(trainer)
    return run


def share_sharded_checkpoint(checkpoint: str) -> None:
    """Copy the DCP folders of ``checkpoint`` (the model's and the optimizer's) between the nodes' copies of it, as a
    user copies them between machines: each node's directory holds its own ranks' shards, but DCP writes the
    ``.metadata`` file on node 0 alone (its coordinator, global rank 0) and each replicated tensor once, in one
    rank's file, and a rank loads from both."""
    files = {}
    if int(os.environ["LOCAL_RANK"]) == 0:
        for folder in os.listdir(checkpoint):
            if os.path.isdir(os.path.join(checkpoint, folder)):
                for name in os.listdir(os.path.join(checkpoint, folder)):
                    with open(os.path.join(checkpoint, folder, name), "rb") as file:
                        files[os.path.join(folder, name)] = file.read()
    nodes: list = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, files)
    if int(os.environ["LOCAL_RANK"]) == 0:
        for node_files in nodes:
            for path, data in node_files.items():
                if not os.path.exists(os.path.join(checkpoint, path)):
                    with open(os.path.join(checkpoint, path), "wb") as file:
                        file.write(data)
    dist.barrier()


def run_optimizer(optim: str, output_dir: str, steps: int, save_at: int, on_each_node: bool = False) -> dict:
    """The uninterrupted and the resumed run of ``optim``: every rank's results, gathered (``on_each_node``: each
    node saves into ``output_dir/node<N>``, ``N`` the launcher's node rank, and resumes from there once the nodes'
    DCP files are copied between them)."""
    if on_each_node:
        output_dir = os.path.join(output_dir, f"node{os.environ['GROUP_RANK']}")
    folder = os.path.join(output_dir, optim)
    uninterrupted = train(optim, os.path.join(folder, "uninterrupted"), steps, save_at, on_each_node)
    checkpoint = os.path.join(folder, "uninterrupted", f"checkpoint-{save_at}")
    files = listing(checkpoint) if os.path.isdir(checkpoint) else None
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, uninterrupted["error"])
    resumed = {"error": "not run: the uninterrupted run failed", "losses": {}}
    if not any(ranks):
        if on_each_node:
            share_sharded_checkpoint(checkpoint)
        resumed = train(optim, os.path.join(folder, "resumed"), steps, save_at, on_each_node, resume_from=checkpoint)
    dist.all_gather_object(ranks, {"uninterrupted": uninterrupted, "resumed": resumed})
    checkpoints: list = [None] * dist.get_world_size()
    dist.all_gather_object(checkpoints, files)
    return {"ranks": ranks, "checkpoint": files, "checkpoints": checkpoints}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optim", nargs="+", required=True, help="TrainingArguments.optim names")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--save-on-each-node", action="store_true", help="a directory per node, each node saving")
    args = parser.parse_args()
    for key, value in FSDP2_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    enable_fsdp_on_cpu()
    # accelerate would create this group (gloo, from the torchrun variables) with a 30-minute timeout; a
    # run that fails on one rank only then ends in minutes rather than hanging.
    dist.init_process_group("gloo", timeout=timedelta(minutes=2))
    results = {
        optim: run_optimizer(optim, args.output_dir, args.steps, args.save_at, args.save_on_each_node)
        for optim in args.optim
    }
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(args.output_dir, "results.pt"))
        for optim, result in results.items():
            first = result["ranks"][0]
            print(
                f"{optim}: losses {list(first['uninterrupted']['losses'].values())}, "
                f"resumed {list(first['resumed']['losses'].values())}, "
                f"errors {[run[kind]['error'] is not None for run in result['ranks'] for kind in run]}",
                flush=True,
            )
    end_distributed_run()  # ends the process: see hf_paged/process_exit.py


if __name__ == "__main__":
    main()
