"""DDP through the Trainer on CPU processes that form two (or more) nodes, with ``MemorySpikeCallback`` (issue 28).

Launched once per node, as on separate machines; on one machine the nodes are launchers started together::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr 127.0.0.1 --master-port PORT \\
        -m hf_paged.run tests/scripts/multinode_ddp.py --optim adamw_torch hf_paged_adamw_8bit --output-dir DIR
    torchrun --nnodes 2 --node-rank 1 ... (the same)

(or ``accelerate launch --config_file configs/accelerate/ddp.yaml --num_machines 2 --machine_rank 0|1
--main_process_ip 127.0.0.1 --main_process_port PORT --num_processes TOTAL``). For each ``--optim`` name: a run of
``--steps`` steps that saves a checkpoint every ``--save-at`` steps (the uninterrupted run), then a fresh model and
Trainer that resume from the checkpoint of step ``--save-at`` in the same output directory and train to ``--steps``
(the resumed run). With ``--save-on-each-node`` each node writes into its own directory ``DIR/node<N>`` (``N``:
the launcher's node rank, ``GROUP_RANK``), as machines without shared storage would, and resumes from it.

Rank 0 writes ``results.pt`` in ``DIR``: per name, every rank's runs (the ranks as the Trainer and the launcher
number them, logged losses, the full log history, the memory callback's rows and summary, the final weights as one flat
tensor, the error of a run that failed) and the files of each node's checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

import hf_paged  # noqa: F401  (registers the hf_paged_* names, as ``-m hf_paged.run`` does)
from hf_paged.callbacks import MemorySpikeCallback
from hf_paged.process_exit import end_distributed_run

from trainer_utils import tiny_llama, token_dataset

BATCH = 2

OPTIM_ARGS = {
    "hf_paged_adamw_32bit": "page_size=16KiB,device_budget=48KiB",
    "hf_paged_adamw_8bit": "page_size=16KiB,device_budget=48KiB,block_size=64,min_8bit_size=256",
    "hf_paged_adamw_4bit": "page_size=16KiB,device_budget=48KiB,block_size=64,min_4bit_size=256",
}
"""Pages under a budget smaller than the state, so that every step pages."""


def node_rank() -> int:
    """This process's node, as the launcher numbers it."""
    return int(os.environ["GROUP_RANK"])


def listing(folder: str) -> dict[str, list[str]]:
    """Every subfolder of ``folder`` (relative, ``.`` for itself) with its files."""
    return {os.path.relpath(root, folder): sorted(files) for root, _, files in sorted(os.walk(folder))}


def train(optim: str, output_dir: str, options: argparse.Namespace, resume_from: str | None = None) -> dict:
    """One Trainer run of a fresh model; what this rank saw, and the error if it failed."""
    args = TrainingArguments(
        output_dir=output_dir,
        optim=optim,
        optim_args=OPTIM_ARGS.get(optim),
        learning_rate=1e-3,
        weight_decay=0.1,
        max_steps=options.steps,
        per_device_train_batch_size=BATCH,
        save_strategy="steps",
        save_steps=options.save_at,
        save_on_each_node=options.save_on_each_node,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        ddp_timeout=120,
    )
    callback = MemorySpikeCallback(plot=False)
    samples = 2 * BATCH * options.steps * args.world_size
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset(samples), callbacks=[callback])
    run: dict = {
        "error": None,
        "process_index": args.process_index,
        "local_process_index": args.local_process_index,
        "node_rank": node_rank(),
        "is_world_process_zero": trainer.is_world_process_zero(),
        "should_save": args.should_save,
    }
    try:
        trainer.train(resume_from_checkpoint=resume_from)
        run["weights"] = torch.cat([param.detach().reshape(-1) for param in trainer.model.parameters()]).clone()
    except Exception:  # noqa: BLE001  (reported to the test, which fails on it)
        run["error"] = traceback.format_exc(limit=-8)
    run["losses"] = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    run["log_history"] = trainer.state.log_history
    run["rows"] = callback.rows
    run["summary"] = callback.summary()
    return run


def run_optimizer(optim: str, options: argparse.Namespace) -> dict:
    """The uninterrupted and the resumed run of ``optim``: every rank's results, gathered."""
    root = os.path.join(options.output_dir, f"node{node_rank()}") if options.save_on_each_node else options.output_dir
    folder = os.path.join(root, optim)
    uninterrupted = train(optim, folder, options)
    checkpoint = os.path.join(folder, f"checkpoint-{options.save_at}")
    files = listing(checkpoint) if os.path.isdir(checkpoint) else None
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, uninterrupted["error"])
    resumed = {"error": "not run: the uninterrupted run failed", "losses": {}}
    if not any(errors):
        resumed = train(optim, folder, options, resume_from=checkpoint)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"uninterrupted": uninterrupted, "resumed": resumed, "checkpoint": files})
    return {"ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optim", nargs="+", required=True, help="TrainingArguments.optim names")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--save-on-each-node", action="store_true", help="a directory per node, each node saving")
    parser.add_argument("--output-dir", required=True)
    options = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(minutes=2))  # the Trainer would wait 30 minutes
    results = {optim: run_optimizer(optim, options) for optim in options.optim}
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(options.output_dir, "results.pt"))
    end_distributed_run()  # ends the process: see hf_paged/process_exit.py


if __name__ == "__main__":
    main()
