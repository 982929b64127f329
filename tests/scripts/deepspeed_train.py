"""DeepSpeed ZeRO through ``transformers.Trainer`` on CPU, for several setups and optimizers in one process.

The DeepSpeed config has no ``"optimizer"`` section, so the optimizer the Trainer builds for ``optim`` is
DeepSpeed's client optimizer. For each setup (a ZeRO stage, ZeRO-Offload or not, bf16 or not; see :data:`SETUPS`)
and each configuration (an optimizer and its ``optim_args``; see :data:`CONFIGS`), a Trainer trains a tiny
causal LM ``--steps`` steps on one fixed batch, saving a checkpoint after step ``--save-at`` only (the
uninterrupted run); a second Trainer then resumes from that checkpoint and trains to ``--steps`` (the resumed
run).

Rank 0 writes ``--output`` (a ``torch.save`` file, loadable with ``weights_only=True``): per setup and
configuration, for both runs the logged losses and gradient norms, the full fp32 weights (one flat tensor) and,
for a paged client, the first moments as DeepSpeed's ``safe_get_full_optimizer_state`` reads them,
what DeepSpeed reports (engine, ZeRO stage, offload, bf16, the optimizer chain), the shapes of the tensors in the
client optimizer's ``param_groups`` when training begins and at each of its steps, and its paging statistics;
the files of the checkpoint; and the error that stopped the configuration, if any (the others still run).

Run alone, the script sets the single-process distributed environment that DeepSpeed needs (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); run it with ``torchrun`` for several
processes. Unless ``--shm-op`` is given, DeepSpeed's shared-memory communication op is marked unavailable, so
that DeepSpeed does not JIT-compile it (from about a minute to over three on two busy cores, once per machine,
then cached in ``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``): only DeepSpeed's inference
all-reduce uses it; training's collectives go through torch.distributed (gloo) either way.

Example: ``python tests/scripts/deepspeed_train.py --setups zero2 --folder /tmp/zero2 --output /tmp/zero2.pt``
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import time
import traceback
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import hf_paged  # noqa: F401  (registers the hf_paged_* optimizer names)
from hf_paged.optim import PagedOptimizer
from hf_paged.process_exit import end_distributed_run

from trainer_utils import tiny_llama, token_dataset, trainer_deepspeed_config

PAGES = "page_size=16KiB"
"""Pages of 16 KiB: the tiny model's state spans tens of pages."""
BUDGET = "device_budget=32KiB"
"""Two pages of state on the device at a time."""
EIGHT_BIT = "block_size=64,min_8bit_size=256"
FOUR_BIT = "block_size=64,min_4bit_size=256"

CONFIGS: dict[str, tuple[str, str | None, float]] = {
    "adamw_torch": ("adamw_torch", None, 1e-2),
    "adamw_32bit": ("hf_paged_adamw_32bit", PAGES, 1e-2),
    "adamw_32bit_budget": ("hf_paged_adamw_32bit", f"{PAGES},{BUDGET}", 1e-2),
    "adamw_8bit": ("hf_paged_adamw_8bit", f"{PAGES},{EIGHT_BIT}", 1e-2),
    "adamw_8bit_budget": ("hf_paged_adamw_8bit", f"{PAGES},{BUDGET},{EIGHT_BIT}", 1e-2),
    "adamw_4bit": ("hf_paged_adamw_4bit", f"{PAGES},{FOUR_BIT}", 1e-2),
    "lion_32bit": ("hf_paged_lion_32bit", PAGES, 1e-3),
    "lion_8bit": ("hf_paged_lion_8bit", f"{PAGES},{EIGHT_BIT}", 1e-3),
    "ademamix_8bit": ("hf_paged_ademamix_8bit", f"{PAGES},{EIGHT_BIT}", 1e-2),
}
"""Configuration name: (the Trainer's ``optim``, its ``optim_args``, the learning rate)."""

BATCH = 4
"""Sequences per process and step; each process's share of the dataset is one batch, the same at every step."""


def prepare_process() -> None:
    """Set what DeepSpeed's gloo fallback needs for one process (unless a launcher has), one CPU thread (on a
    tiny model more threads only contend: a 64x64 matmul took 20 ms with two on two cores) and eager kernels."""
    os.environ.setdefault("HF_PAGED_COMPILE", "0")
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    if "RANK" not in os.environ:
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def skip_shm_op_build() -> None:
    """Make DeepSpeed's communication backend skip its shared-memory op (and so its JIT build)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class Setup(NamedTuple):
    """How DeepSpeed runs: the ZeRO stage (``None``: the DeepSpeed config that ``accelerate launch`` hands the
    Trainer, from its ``--config_file``), the optimizer offloaded to the CPU or not, bf16 mixed precision or not,
    and ZeRO-3's ``sub_group_size`` (elements; ``None``: DeepSpeed's default)."""

    stage: int | None
    offload: bool = False
    bf16: bool = False
    sub_group_size: int | None = None


SETUPS: dict[str, Setup] = {
    "zero1": Setup(1),
    "zero2": Setup(2),
    "zero3": Setup(3),
    "zero1_bf16": Setup(1, bf16=True),
    "zero2_offload": Setup(2, offload=True),
    "zero3_offload": Setup(3, offload=True),
    "zero3_sub_groups": Setup(3, sub_group_size=20_000),  # the tiny Llama's 57,792 parameters in 3 uneven sub-groups
    "accelerate": Setup(None, bf16=True),  # configs/accelerate/*.yaml set bf16; the Trainer must agree
}


def deepspeed_config(setup: Setup) -> dict:
    """A ZeRO config without an optimizer section; ``auto`` values are filled in from the Trainer's arguments."""
    zero = {"stage": setup.stage}
    if setup.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if setup.sub_group_size is not None:
        zero["sub_group_size"] = setup.sub_group_size
    config = trainer_deepspeed_config(zero)
    if setup.bf16:
        config["data_types"] = {"grad_accum_dtype": "fp32"}  # under ZeRO-1: DeepSpeed's BF16_Optimizer
    return config


def shapes(param_groups: list[dict]) -> list[list[list[int]]]:
    """The shape of each tensor in each group."""
    return [[list(param.shape) for param in group["params"]] for group in param_groups]


class SaveOnce(TrainerCallback):
    """Save a checkpoint after step ``step`` only (not also at the end of training, as the Trainer would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_save = state.global_step == self.step
        return control


class WatchClient(TrainerCallback):
    """Fill ``record`` as training goes: what DeepSpeed set up when training begins, the shapes in the client
    optimizer's param groups at each of its steps, and each logged loss and gradient norm."""

    def __init__(self, record: dict) -> None:
        self.record = record
        self.trainer: Trainer | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped
        client = engine.optimizer.optimizer
        self.record.update(
            engine=type(engine).__name__,
            deepspeed_is_engine=self.trainer.deepspeed is engine,
            zero_stage=int(engine.zero_optimization_stage()),
            offload=bool(engine.zero_cpu_offload()),
            bf16=bool(engine.bfloat16_enabled()),
            optimizers=[type(self.trainer.optimizer).__name__, type(engine.optimizer).__name__, type(client).__name__],
            groups_between_steps=shapes(client.param_groups),
            groups_at_steps=[],
        )
        step = client.step

        def watched_step(*args, **kwargs):
            self.record["groups_at_steps"].append(shapes(client.param_groups))
            return step(*args, **kwargs)

        client.step = watched_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.record["steps"].append(state.global_step)
            self.record["losses"].append(float(logs["loss"]))
            self.record["grad_norms"].append(float(logs["grad_norm"]))


def full_weights(engine) -> torch.Tensor:
    """The engine's fp32 master weights, gathered from every rank's partition, as one flat tensor."""
    from deepspeed.utils import safe_get_full_fp32_param

    return torch.cat([safe_get_full_fp32_param(param).reshape(-1).clone() for param in engine.module.parameters()])


def full_first_moments(engine) -> torch.Tensor | str:
    """Every parameter's ``exp_avg`` as ``deepspeed.utils.safe_get_full_optimizer_state`` reads it (8-bit and 4-bit
    state decoded), as one flat tensor; or the error DeepSpeed raised (with bf16 parameters under ZeRO-1)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    try:
        moments = [safe_get_full_optimizer_state(param, "exp_avg") for param in engine.module.parameters()]
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return torch.cat([moment.reshape(-1).clone() for moment in moments])


def train(record: dict, name: str, folder: str, setup: str, options: argparse.Namespace, resume: bool) -> None:
    """One run of configuration ``name`` into ``record``: from scratch, or resumed from the uninterrupted run's
    checkpoint (``record`` keeps what was logged before an error)."""
    optim, optim_args, learning_rate = CONFIGS[name]
    steps, save_at = options.steps, options.save_at
    record.update(steps=[], losses=[], grad_norms=[])
    watch = WatchClient(record)
    args = TrainingArguments(
        output_dir=os.path.join(folder, "resumed" if resume else "full"),
        deepspeed=None if SETUPS[setup].stage is None else deepspeed_config(SETUPS[setup]),
        bf16=SETUPS[setup].bf16,
        optim=optim,
        optim_args=optim_args,
        learning_rate=learning_rate,
        weight_decay=0.1,
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no" if resume else "steps",
        save_steps=save_at,
        save_on_each_node=options.save_on_each_node,
        seed=0,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        ddp_timeout=120,
    )
    callbacks = [watch] if resume else [watch, SaveOnce(save_at)]
    data = token_dataset(samples=BATCH * args.world_size, length=16)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=data, callbacks=callbacks)
    watch.trainer = trainer
    trainer.train(resume_from_checkpoint=os.path.join(folder, "full", f"checkpoint-{save_at}") if resume else None)
    client = trainer.model_wrapped.optimizer.optimizer
    record["weights"] = full_weights(trainer.model_wrapped)
    if isinstance(client, PagedOptimizer):  # torch's AdamW: DeepSpeed's own tool raises on some ranks after a resume
        record["first_moments"] = full_first_moments(trainer.model_wrapped)
    record["paging"] = client.paging_stats() if hasattr(client, "paging_stats") else None


def checkpoint_files(folder: str) -> list[str]:
    """The files under ``folder``, relative to it."""
    return sorted(
        os.path.relpath(os.path.join(root, file), folder) for root, _, files in os.walk(folder) for file in files
    )


def copy_latest_from_node_zero(checkpoint: str) -> None:
    """Write node 0's ``latest`` file of ``checkpoint`` (the tag of its DeepSpeed checkpoint) into the other nodes'
    copies, as a user copies it between machines: with ``save_on_each_node`` (DeepSpeed's node-local storage) each
    node writes its own partitions and model states, but DeepSpeed writes ``latest`` on global rank 0 alone, and
    without it the other nodes' resume fails."""
    import torch.distributed as dist

    tag = [None]
    if dist.get_rank() == 0:
        with open(os.path.join(checkpoint, "latest")) as file:
            tag[0] = file.read()
    dist.broadcast_object_list(tag, src=0)
    if int(os.environ["LOCAL_RANK"]) == 0 and not os.path.exists(os.path.join(checkpoint, "latest")):
        with open(os.path.join(checkpoint, "latest"), "w") as file:
            file.write(tag[0])
    dist.barrier()


def run_config(name: str, folder: str, setup: str, options: argparse.Namespace) -> dict:
    """The uninterrupted and the resumed run of ``name``, and what stopped them, if anything did."""
    result: dict = {"optim": CONFIGS[name][0], "optim_args": CONFIGS[name][1], "full": {}, "error": None}
    start = time.perf_counter()
    try:
        train(result["full"], name, folder, setup, options, resume=False)
        checkpoint = os.path.join(folder, "full", f"checkpoint-{options.save_at}")
        result["checkpoint_files"] = checkpoint_files(checkpoint)
        if options.save_on_each_node:
            copy_latest_from_node_zero(checkpoint)
        result["resumed"] = {}
        train(result["resumed"], name, folder, setup, options, resume=True)
    except Exception as error:  # noqa: BLE001  (recorded, so that the other configurations still run)
        traceback.print_exc()
        frame = traceback.extract_tb(error.__traceback__)[-1]
        message = "".join(traceback.format_exception_only(type(error), error)).strip()
        result["error"] = f"{message} (at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"
    result["seconds"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    own_config = [name for name, setup in SETUPS.items() if setup.stage is not None]
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=own_config, help="default: %(default)s")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--folder", required=True, help="where the Trainers write their checkpoints")
    parser.add_argument("--output", required=True)
    parser.add_argument("--shm-op", action="store_true", help="let DeepSpeed build its shared-memory comm op")
    parser.add_argument(
        "--save-on-each-node",
        action="store_true",
        help="each node saves into FOLDER/node<N> (N: its node rank); node 0's 'latest' file is copied to the others",
    )
    options = parser.parse_args()
    if options.save_on_each_node:
        options.folder = os.path.join(options.folder, f"node{os.environ['GROUP_RANK']}")

    prepare_process()
    if not options.shm_op:
        skip_shm_op_build()
    gc.freeze()  # accelerate and ZeRO-3 run gc.collect() per engine (0.5 s each): leave the imports out of it
    results = {
        setup: {
            name: run_config(name, os.path.join(options.folder, setup, name), setup, options)
            for name in options.configs
        }
        for setup in options.setups
    }
    from deepspeed.comm import comm

    if int(os.environ["RANK"]) == 0:
        summary = {
            "world_size": int(os.environ["WORLD_SIZE"]),
            "shm_op": comm.cdb.shm_comm_op is not None,
            "steps": options.steps,
            "save_at": options.save_at,
            "results": results,
        }
        torch.save(summary, options.output)


if __name__ == "__main__":
    main()
    end_distributed_run()  # ends the process: see hf_paged/process_exit.py
