"""A Trainer run of several processes in which one rank fails: an out-of-memory error injected on that rank only.

Launched with ``torchrun`` (one node, or two ``--nnodes 2 --node-rank 0|1`` launchers), on the CPU (gloo)::

    torchrun --standalone --nproc-per-node 2 tests/scripts/rank_failure.py --engine ddp --output-dir DIR \\
        --fail-rank 1 --fail-step 3 --fail-in backward

``--engine`` picks DDP, FSDP2 (accelerate's, through the Trainer) or DeepSpeed ZeRO-3. The model is the tests' tiny
Llama of ``--layers`` decoder layers (DDP all-reduces its gradients in buckets of ``--bucket-cap-mb``, several, and finds unused parameters as the
Trainer decides, or not with ``--find-unused false``), the optimizer ``hf_paged_adamw_8bit``
under a budget (its pages stream at every step) and ``MemorySpikeCallback`` (which turns on hf-paged's handling of
errors, ``--oom-retries`` recoveries per step). ``--save-strategy`` is the Trainer's (``epoch``: an epoch of
``--save-steps`` steps; ``best``: the lowest evaluation loss), ``--eval-steps`` evaluates every so many steps. On rank
``--fail-rank`` (and on the ranks of ``--also-fail RANK WHERE``) at optimizer step ``--fail-step`` (from 1),
``--fail-in`` picks where an error is raised, ``--fail-times`` times each, in the first attempt of a job only
(``TORCHELASTIC_RESTART_COUNT`` 0):

- ``forward``: ``torch.OutOfMemoryError`` (``RuntimeError`` with ``--fail-error runtime``) in a forward pre-hook of the
  first decoder layer's MLP, in micro-batch ``--fail-micro-batch`` of the step (from 0; a replay of the whole step
  counts from 0 again);
- ``backward``: the same error in a gradient hook on that MLP's output, in the backward of that micro-batch (the
  gradients of the layers above it are all-reduced by then);
- ``optimizer``: ``torch.OutOfMemoryError`` in the optimizer's first page allocations of the step;
- ``evaluation``: ``torch.OutOfMemoryError`` in the forward of the evaluation after the step;
- ``save``: ``OSError`` (no space left on device) in the checkpoint written after the step, once the model's weights
  are written (the optimizer's ``state_dict``: the rank that writes it);
- ``none``: nowhere.

``--run-ahead`` turns off the collectives a DDP step starts with (the count of label tokens across ranks,
``average_tokens_across_devices``, and DDP's broadcast of buffers), as a model without buffers whose loss counts no
tokens has none: a rank then goes on into the next step while another still writes a checkpoint.

``--interrupt-save STEP SECONDS`` makes rank 0's checkpoint of step ``STEP`` wait ``SECONDS`` once the model's weights
are written (a save that takes long; ``SECONDS`` -1: the process kills itself there with SIGKILL), in the first
attempt only.

``--resume-from auto`` resumes with ``resume_from_checkpoint=True`` (the last checkpoint in ``--output-dir``) when
torchrun restarted the job, and the process group's keys then go under a prefix per attempt
(:func:`init_process_group_per_attempt`); ``--resume-from last`` resumes with ``True`` at once.

With ``--linger S`` the failing rank catches the error and keeps its process (and its connections) for ``S``
seconds before raising it again: its peers then wait in the collective it never joins, as they would on NCCL
after it ended.

Each rank that finishes writes ``rank<R>.json`` in ``--output-dir`` (its logged losses, the sum and norm of its
parameters, a SHA-256 of its parameters' and its optimizer state's bytes, the recoveries counted, the steps and ranks
the memory callback's summary marks, the checkpoint it resumed from, and under DDP how many collectives each injected
backward error came after and each clean backward ran); the failing rank writes ``failure.json`` (the time it raised,
the note on its error) before it raises.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import hf_paged  # noqa: F401  (registers the hf_paged_* optimizer names)
from callbacks import MemorySpikeCallback
from hf_paged.process_exit import end_distributed_run
from hf_paged.recovery import paged_optimizer_of

from trainer_utils import tiny_llama, token_dataset

BATCH = 2
OPTIM_ARGS = "page_size=4KiB,device_budget=16KiB,block_size=64,min_8bit_size=256"


class Injector(TrainerCallback):
    """Raises an error on chosen ranks at one optimizer step (in forward, backward, the optimizer step, the evaluation
    or the checkpoint after it), and makes rank 0's checkpoint of one step wait or kill its process."""

    def __init__(self, model: torch.nn.Module, options: argparse.Namespace, rank: int) -> None:
        self.options = options
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        places = {options.fail_rank: options.fail_in, **{int(r): [where] for r, where in options.also_fail or []}}
        self.armed = rank in places and first_attempt
        self.interrupts = rank == 0 and first_attempt and options.interrupt_save is not None
        self.left = {where: options.fail_times for where in places.get(rank, [])}
        self.error = torch.OutOfMemoryError if options.fail_error == "oom" else RuntimeError
        self.forwards = self.backwards = 0
        self.step = 0
        self.collectives_before_error: list[int] = []
        self.collectives_per_backward: list[int] = []
        self._collectives_at_forward_end = 0
        layer = model.model.layers[0]
        layer.mlp.register_forward_pre_hook(self._forward_begins)
        layer.mlp.register_forward_hook(self._forward)
        model.register_forward_hook(self._model_forward_ends)

    def _forward_begins(self, module, args):
        if not torch.is_grad_enabled():
            return
        calls, self.forwards = self.forwards, self.forwards + 1
        if self._now("forward") and calls % self.options.grad_accum == self.options.fail_micro_batch:
            self.left["forward"] -= 1
            raise self.error("injected in forward")

    def _forward(self, module, args, output):
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(self._backward)
        elif not torch.is_grad_enabled() and self._now("evaluation"):
            self.left["evaluation"] -= 1
            raise torch.OutOfMemoryError("injected in evaluation")

    def _model_forward_ends(self, module, args, output):
        self._collectives_at_forward_end = collectives_so_far()

    def _saving(self, optimizer):
        """An optimizer ``state_dict`` pre-hook: the checkpoint's model weights are written, the rest is not."""
        if self._now("save"):
            self.left["save"] -= 1
            raise OSError(28, "injected: No space left on device")
        if self.interrupts and self.step == self.options.interrupt_save[0]:
            self.interrupts = False
            if self.options.interrupt_save[1] < 0:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(self.options.interrupt_save[1])

    def _backward(self, grad):
        calls, self.backwards = self.backwards, self.backwards + 1
        if self._now("backward") and calls % self.options.grad_accum == self.options.fail_micro_batch:
            self.left["backward"] -= 1
            self.collectives_before_error.append(collectives_so_far() - self._collectives_at_forward_end)
            raise self.error("injected in backward")

    def _now(self, where: str) -> bool:
        return self.armed and self.step == self.options.fail_step and self.left.get(where, 0) > 0

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        paged_optimizer_of(optimizer).register_state_dict_pre_hook(self._saving)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step, self.forwards, self.backwards = state.global_step + 1, 0, 0

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.collectives_per_backward.append(collectives_so_far() - self._collectives_at_forward_end)
        if not self._now("optimizer"):
            return
        (store,) = paged_optimizer_of(optimizer)._store.stores.values()
        allocate = store.backend.empty_device

        def failing(specs):
            self.left["optimizer"] -= 1
            if self.left["optimizer"] == 0:
                store.backend.empty_device = allocate
            raise torch.OutOfMemoryError("injected in the optimizer step")

        store.backend.empty_device = failing


def collectives_so_far() -> int:
    """Collectives this process has launched in the default group (gloo counts them; 0 without a group)."""
    if not dist.is_initialized():
        return 0
    return dist.group.WORLD._get_backend(torch.device("cpu"))._get_sequence_number_for_group()


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of the bytes of this rank's parameters and of its optimizer's state (DDP: both whole on every rank)."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        local = param.detach().cpu().reshape(-1).contiguous()
        digest.update(name.encode())
        digest.update(local.view(torch.uint8).numpy().tobytes())
    state = paged_optimizer_of(optimizer).state_dict()["state"]
    for index in sorted(state):
        for key in sorted(state[index]):
            value = state[index][key]
            digest.update(f"{index}/{key}".encode())
            if isinstance(value, torch.Tensor):
                digest.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
            else:
                digest.update(repr(value).encode())
    return digest.hexdigest()


def training_args(options: argparse.Namespace) -> TrainingArguments:
    deepspeed = None
    if options.engine == "deepspeed":
        deepspeed = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": 3},
            "zero_force_ds_cpu_optimizer": False,
        }
    return TrainingArguments(
        output_dir=options.output_dir,
        optim="hf_paged_adamw_8bit",
        optim_args=OPTIM_ARGS,
        learning_rate=1e-2,
        weight_decay=0.1,
        max_steps=options.steps,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=options.grad_accum,
        save_strategy=options.save_strategy,
        save_steps=options.save_steps,
        eval_strategy="steps" if options.eval_steps else "no",
        eval_steps=options.eval_steps,
        metric_for_best_model="loss" if options.save_strategy == "best" else None,
        per_device_eval_batch_size=BATCH,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        ddp_timeout=options.pg_timeout,
        ddp_bucket_cap_mb=options.bucket_cap_mb,
        ddp_find_unused_parameters=False if options.find_unused == "false" else None,
        ddp_broadcast_buffers=not options.run_ahead,
        average_tokens_across_devices=not options.run_ahead,
        deepspeed=deepspeed,
    )


def prepare_engine(options: argparse.Namespace) -> None:
    """What FSDP2 and DeepSpeed need on the CPU (see tests/scripts/fsdp2_trainer.py and deepspeed_train.py)."""
    if options.engine == "fsdp2":
        from fsdp2_trainer import FSDP2_ENVIRONMENT, enable_fsdp_on_cpu

        for key, value in FSDP2_ENVIRONMENT.items():
            os.environ.setdefault(key, value)
        enable_fsdp_on_cpu()
    elif options.engine == "deepspeed":
        from deepspeed_train import skip_shm_op_build

        skip_shm_op_build()


def init_process_group_per_attempt(timeout_s: int) -> None:
    """Create the gloo process group with its keys under a prefix per torchrun attempt.

    torchrun's agent keeps one store for all attempts, and gloo's keys (each rank's address) have the same names in
    each: a restarted rank may read its peer's address of the first attempt and fail to connect ("Gloo
    connectFullMesh failed ... Connection refused", or a wait until the group's timeout): 9 of 14 restarts on a busy
    2-core machine, 3 of 4 of them without hf-paged's watcher; 0 of 3 with this prefix)."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and os.environ["RANK"] == "0",
        timeout=timedelta(seconds=timeout_s),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
    )


def parameters_checksum(model: torch.nn.Module) -> tuple[float, float]:
    local = [getattr(param, "_local_tensor", param) for param in model.parameters()]
    flat = torch.cat([param.detach().double().reshape(-1) for param in local])
    return flat.sum().item(), flat.norm().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["ddp", "fsdp2", "deepspeed"], default="ddp")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--save-strategy", choices=["steps", "epoch", "best"], default="steps")
    parser.add_argument("--eval-steps", type=int, default=None)
    parser.add_argument("--run-ahead", action="store_true", help="no collective at the start of a step")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--also-fail", nargs=2, action="append", metavar=("RANK", "WHERE"), help="another rank's place")
    parser.add_argument("--fail-step", type=int, default=3)
    parser.add_argument(
        "--fail-in",
        nargs="+",
        choices=["forward", "backward", "optimizer", "evaluation", "save", "none"],
        default=["backward"],
    )
    parser.add_argument("--fail-error", choices=["oom", "runtime"], default="oom", help="in forward and backward")
    parser.add_argument("--oom-retries", type=int, default=2)
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of the tiny Llama")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.02, help="DDP's gradient buckets (MiB)")
    parser.add_argument(
        "--find-unused", choices=["default", "false"], default="default", help="DDP's find_unused_parameters"
    )
    parser.add_argument("--fail-micro-batch", type=int, default=0)
    parser.add_argument("--fail-times", type=int, default=1000)
    parser.add_argument("--linger", type=float, default=0.0)
    parser.add_argument("--interrupt-save", nargs=2, type=float, metavar=("STEP", "SECONDS"), default=None)
    parser.add_argument("--pg-timeout", type=int, default=600, help="seconds a collective may wait")
    parser.add_argument(
        "--resume-from", default=None, help="a checkpoint, last (the last one), or auto (the last one, after a restart)"
    )
    options = parser.parse_args()
    os.environ.setdefault("HF_PAGED_COMPILE", "0")
    torch.set_num_threads(1)
    prepare_engine(options)
    rank = int(os.environ["RANK"])
    resume_from = options.resume_from
    if resume_from == "auto":
        resume_from = "last" if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" else None
        init_process_group_per_attempt(options.pg_timeout)
    resumed_from = get_last_checkpoint(options.output_dir) if resume_from == "last" else resume_from
    args = training_args(options)
    model = tiny_llama(num_hidden_layers=options.layers)
    injector = Injector(model, options, rank)
    spikes = MemorySpikeCallback(plot=False, oom_retries=options.oom_retries)
    epoch_steps = options.save_steps if options.save_strategy == "epoch" else options.steps
    data = token_dataset(samples=BATCH * options.grad_accum * args.world_size * epoch_steps)
    evaluation = token_dataset(samples=BATCH * args.world_size, seed=1) if options.eval_steps else None
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=evaluation, callbacks=[injector, spikes])
    try:
        trainer.train(resume_from_checkpoint=True if resume_from == "last" else resume_from)
    except Exception:
        if rank == options.fail_rank:
            with open(os.path.join(options.output_dir, "failure.json"), "w") as file:
                json.dump({"time": time.time(), "rank": rank, "traceback": traceback.format_exc()}, file)
            time.sleep(options.linger)
        raise
    checksum, norm = parameters_checksum(trainer.model)
    summary = spikes.summary()
    result = {
        "rank": rank,
        "losses": {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry},
        "checksum": checksum,
        "norm": norm,
        "digest": state_digest(trainer.model, trainer.optimizer) if options.engine == "ddp" else None,
        "oom_recoveries": spikes.oom_recoveries,
        "oom_recovery_steps": summary["oom_recovery_steps"],
        "oom_ranks": summary["oom_ranks"],
        "resumed_from": resumed_from,
        "collectives_before_error": injector.collectives_before_error,
        "collectives_per_backward": injector.collectives_per_backward,
    }
    with open(os.path.join(options.output_dir, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
    end_distributed_run()  # ends the process: see hf_paged/process_exit.py
