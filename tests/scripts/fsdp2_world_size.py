"""A Trainer checkpoint under accelerate's FSDP2 (DCP, sharded) resumed on another number of ranks.

Two launches (``torchrun --standalone --nproc_per_node N|M``, gloo on the CPU, FSDP2 set up as in
``fsdp2_trainer.py``), one optimizer name each (``--optim``):

1. ``save`` on ``N`` ranks: the Trainer trains :data:`SAVE_AT` steps and saves ``checkpoint-3`` (sharded: DCP).
   Rank 0 writes ``saved.pt`` in ``--folder``: the full model weights and the full optimizer state dict
   (``get_optimizer_state_dict(..., full_state_dict=True)``: states by parameter name; a paged optimizer's 8-bit
   and 4-bit states decoded to fp32).
2. ``resume`` on ``M`` ranks: a fresh Trainer resumes from ``checkpoint-3`` (DCP reshards it to ``M`` ranks) and
   trains to :data:`SAVE_AT` + :data:`RESUMED` steps. When training begins (after the load), each rank checks
   every parameter's shard: the weights equal the saved ones, the step is the saved step, and each state equals
   the saved state's rows of this shard, as the optimizer's codec encodes them on this shard (the saved values
   themselves for fp32 state, bitwise; 8-bit and 4-bit state encoded and decoded again). Rank 0 then runs the
   control: the same optimizer (``Trainer.create_optimizer``) on the full model in this process, without FSDP,
   loaded with ``load_state_dict`` from the saved weights and state and trained on the same global batches.

The learning rate is constant and gradients are not clipped (the control needs no scheduler or clipping of its
own); every step's global batch is the whole dataset (``BATCH`` sequences per rank), so the ranks' batches of a
step together are the control's batch for any number of ranks. ``resume`` writes ``--output`` (``torch.save``,
loadable with ``weights_only=True``): each rank's largest difference per check (0.0 where equal) and whether
its parameters were FSDP2 shards on an ``M``-rank mesh, and the losses of the resumed run and of the control.

Example::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/scripts/fsdp2_world_size.py save \\
        --optim hf_paged_adamw_8bit --folder /tmp/fsdp2
    python -m torch.distributed.run --standalone --nproc_per_node 1 tests/scripts/fsdp2_world_size.py resume \\
        --optim hf_paged_adamw_8bit --folder /tmp/fsdp2 --output /tmp/fsdp2/resumed.pt
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from deepspeed_state_tools import largest_difference, requantized
from fsdp2_trainer import (
    BATCH,
    FSDP2_ENVIRONMENT,
    OPTIM_ARGS,
    enable_fsdp_on_cpu,
    learning_rate,
    logged_losses,
    sharded_llama,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor, Shard
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_paged.codecs import Float32Codec
from hf_paged.optim import PagedOptimizer
from hf_paged.process_exit import end_distributed_run

from trainer_utils import token_dataset

SAVE_AT = 3
RESUMED = 3
KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "lion": ("exp_avg",)}
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def trainer_for(optim: str, folder: str, steps: int) -> Trainer:
    """A Trainer of ``fsdp2_trainer.py``'s model and optimizer settings that saves a checkpoint at step
    :data:`SAVE_AT` only."""
    args = TrainingArguments(
        output_dir=folder,
        optim=optim,
        optim_args=OPTIM_ARGS.get(optim),
        learning_rate=learning_rate(optim),
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.1,
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        save_strategy="steps" if steps == SAVE_AT else "no",
        save_steps=SAVE_AT,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    return Trainer(model=sharded_llama(), args=args, train_dataset=token_dataset(BATCH * dist.get_world_size()))


def save(options: argparse.Namespace) -> None:
    trainer = trainer_for(options.optim, options.folder, SAVE_AT)
    trainer.train()
    optimizer = trainer.optimizer.optimizer
    saved = {
        "model": get_model_state_dict(trainer.model, options=FULL),
        "optimizer": get_optimizer_state_dict(trainer.model, optimizer, options=FULL),
        "losses": logged_losses(trainer),
    }
    if dist.get_rank() == 0:
        torch.save(saved, os.path.join(options.folder, "saved.pt"))


def state_keys(optimizer) -> tuple[str, ...]:
    return tuple(optimizer.state_names) if isinstance(optimizer, PagedOptimizer) else KEYS["adamw"]


def loaded_state(optimizer, param: DTensor, key: str) -> torch.Tensor:
    """This rank's shard of state ``key`` of ``param`` as fp32 values (decoded for a paged optimizer)."""
    if isinstance(optimizer, PagedOptimizer):
        return optimizer.get_state_tensor(param, key)
    return optimizer.state[param][key].to_local()


def codec_of(optimizer, param: DTensor, key: str):
    """The codec that ``optimizer`` stores state ``key`` of ``param`` with (``None``: fp32 or not paged)."""
    if not isinstance(optimizer, PagedOptimizer):
        return None
    codec = optimizer._formats[optimizer._layout[param].kind].codecs[optimizer.state_names.index(key)]
    return None if isinstance(codec, Float32Codec) else codec


class CheckLoadedState(TrainerCallback):
    """When training begins (after the checkpoint is loaded): every check of this rank's shards."""

    def __init__(self, saved: dict) -> None:
        self.saved = saved
        self.found: dict = {}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        optimizer = optimizer.optimizer
        differences: dict[str, float] = {}

        def note(check: str, difference: float) -> None:
            differences[check] = max(differences.get(check, 0.0), difference)

        rank, world_size = dist.get_rank(), dist.get_world_size()
        saved_states = self.saved["optimizer"]["state"]
        names = dict(model.named_parameters())
        sharded = all(
            isinstance(param, DTensor) and param.placements == (Shard(0),) and param.device_mesh.size() == world_size
            for param in names.values()
        )
        for name, param in names.items():
            rows = self.saved["model"][name].chunk(world_size, dim=0)[rank]
            note("weights", largest_difference(param.to_local(), rows))
            note("step", abs(float(optimizer.state[param]["step"]) - float(saved_states[name]["step"])))
            for key in state_keys(optimizer):
                expected = saved_states[name][key].chunk(world_size, dim=0)[rank].reshape(-1).float()
                codec = codec_of(optimizer, param, key)
                if codec is not None:
                    expected = requantized(codec, expected)
                note("state", largest_difference(loaded_state(optimizer, param, key), expected))
        self.found = {"differences": differences, "sharded": sharded}


def control_losses(trainer: Trainer, saved: dict) -> list[float]:
    """The same optimizer on the full model in this process, loaded from the saved weights and state, trained on
    the global batches of the steps after the checkpoint (one process: the whole dataset)."""
    model = sharded_llama()
    model.load_state_dict(saved["model"])
    trainer.optimizer = None  # create_optimizer builds one only where the Trainer has none
    optimizer = trainer.create_optimizer(model)
    name_of = {id(param): name for name, param in model.named_parameters()}
    order = [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]
    groups = optimizer.state_dict()["param_groups"]
    state = {index: saved["optimizer"]["state"][name] for index, name in enumerate(order)}
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    ids = torch.stack([sample["input_ids"] for sample in token_dataset(BATCH * dist.get_world_size())])
    losses = []
    for _ in range(RESUMED):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def resume(options: argparse.Namespace) -> None:
    saved = torch.load(os.path.join(options.folder, "saved.pt"), weights_only=True)
    trainer = trainer_for(options.optim, os.path.join(options.folder, "resumed"), SAVE_AT + RESUMED)
    check = CheckLoadedState(saved)
    trainer.add_callback(check)
    trainer.train(resume_from_checkpoint=os.path.join(options.folder, f"checkpoint-{SAVE_AT}"))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, check.found)
    losses = logged_losses(trainer)
    if dist.get_rank() == 0:
        result = {
            "ranks": gathered,
            "losses": [losses[step] for step in sorted(losses) if step > SAVE_AT],
            "control": control_losses(trainer, saved),
            "saved_losses": [saved["losses"][step] for step in sorted(saved["losses"])],
        }
        torch.save(result, options.output)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["save", "resume"])
    parser.add_argument("--optim", required=True, help="a TrainingArguments.optim name")
    parser.add_argument("--folder", required=True, help="where the checkpoint and saved.pt are")
    parser.add_argument("--output", help="where resume writes what it found")
    options = parser.parse_args()
    if options.phase == "resume" and not options.output:
        parser.error("resume needs --output")
    for key, value in FSDP2_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    enable_fsdp_on_cpu()
    dist.init_process_group("gloo", timeout=timedelta(minutes=2))
    (save if options.phase == "save" else resume)(options)
    end_distributed_run()  # ends the process: see hf_paged/process_exit.py


if __name__ == "__main__":
    main()
