"""The per-rank memory peaks of a real sharded fine-tune through the Trainer on the CPU, for the planner's tests.

Launched with ``torchrun --standalone --nproc_per_node N`` (gloo): each rank builds the model ``hf-paged train``
builds from the hf-paged config (``--set`` keys, ``--method``) and trains ``--steps`` steps with
``transformers.Trainer``, under ``torch.profiler`` with ``profile_memory=True`` from before the model exists. Each
step's forward and backward (``on_step_begin`` to ``on_pre_optimizer_step``: the gradient clipping included) and its
optimizer step (``on_pre_optimizer_step`` to ``on_step_end``: the learning-rate schedule and ``zero_grad`` included)
is a profiler window; the peak of live bytes in each window is that rank's truth (``tests/plan_utils.window_peaks``).
Every batch is :func:`hf_paged.cli.plan.make_batch`'s, the batch the planner traces.

``--strategy``: ``ddp`` (accelerate wraps the model in ``DistributedDataParallel``; with one process it wraps
nothing), ``fsdp2`` or ``fsdp2_offload`` (accelerate's FSDP2, enabled on the CPU as ``tests/scripts/fsdp2_trainer.py``
enables it, with ``--fsdp_offload_params true``'s ``CPUOffloadPolicy`` for the latter), or a ZeRO strategy of
:data:`ZERO_CONFIGS` (the Trainer's DeepSpeed integration with a config of :func:`zero_config`; accelerate's
``backward`` runs the engine's step, so forward and backward end where the engine's step begins). Each rank writes
``rank<R>.json`` into ``--output``: its peaks and what shows that the engine was in effect (the wrapper, the world size
and backend, the sharded parameters, the offload flags).

``--cap BYTES`` makes the counting allocator a GPU of that much memory: an allocation past it raises
``torch.OutOfMemoryError``, and a rank that meets one writes ``{"out_of_memory": message}`` and exits with status 3
(torchrun then ends the other ranks). ``--host-apart``: a paged optimizer's host pages are host memory, not the
pseudo-device's (its page store's backend allocates them inside ``device_memory.host_memory``), as on a GPU.
``--no-step-recovery``: a paged optimizer's step does not recover an out-of-memory error by paging state out to host
memory (``PagedOptimizer.oom_retries = 0``), so that a run without a device budget keeps all its state on the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from hf_paged import device as device_module
from hf_paged.cli.config import load_config
from hf_paged.cli.plan import architecture, build_model, deepspeed_config, make_batch, setup_from_config
from hf_paged.cli.train import training_arguments
from hf_paged.planner import FORWARD_BACKWARD, OPTIMIZER_STEP
from hf_paged.process_exit import end_distributed_run

import device_memory
from plan_utils import fill_process_tables
from trainer_utils import trainer_deepspeed_config


class PhasePeaks(TrainerCallback):
    """Each step's forward and backward peak and optimizer-step peak, from the pseudo-device's allocator."""

    def __init__(self) -> None:
        self.peaks: list[tuple[str, int, int]] = []
        self.engine_steps = False
        self.trainer: Trainer | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        """Under DeepSpeed, accelerate's ``backward`` runs the engine's step too: forward and backward end there."""
        engine = self.trainer.model_wrapped
        if not hasattr(engine, "zero_optimization_stage"):
            return
        self.engine_steps = True
        step = engine.step

        def step_after_backward(*step_args, **step_kwargs):
            self.peaks.append((FORWARD_BACKWARD, state.global_step + 1, device_memory.peak()))
            device_memory.reset_peak()
            return step(*step_args, **step_kwargs)

        engine.step = step_after_backward

    def on_step_begin(self, args, state, control, **kwargs):
        device_memory.reset_peak()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.engine_steps:
            return
        self.peaks.append((FORWARD_BACKWARD, state.global_step + 1, device_memory.peak()))
        device_memory.reset_peak()

    def on_step_end(self, args, state, control, **kwargs):
        self.peaks.append((OPTIMIZER_STEP, state.global_step, device_memory.peak()))


def engine_facts(trainer: Trainer, strategy: str) -> dict:
    """What shows that the engine really wrapped the model the Trainer trained."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    model = trainer.model_wrapped
    params = list(trainer.model.parameters())
    facts = {
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "distributed_type": str(trainer.accelerator.distributed_type),
        "ddp": isinstance(model, DistributedDataParallel),
        "fsdp_modules": sum(isinstance(module, FSDPModule) for module in trainer.model.modules()),
        "sharded_params": sum(isinstance(param, DTensor) for param in params),
        "params": len(params),
        "params4bit": sum(type(param).__name__ == "Params4bit" for param in params),
    }
    if strategy in ZERO_CONFIGS:
        engine = trainer.model_wrapped
        facts["zero"] = [
            int(engine.zero_optimization_stage()),
            bool(engine.zero_cpu_offload()),
            engine.zero_offload_param() is not None,
            type(engine.optimizer).__name__,
            type(engine.optimizer.optimizer).__name__,
        ]
    if strategy.startswith("fsdp2"):
        facts["offload"] = sorted(
            {
                fsdp_param.offload_to_cpu
                for module in trainer.model.modules()
                if isinstance(module, FSDPModule)
                for group in module._get_fsdp_state()._fsdp_param_groups
                for fsdp_param in group.fsdp_params
            }
        )
    return facts


ZERO_CONFIGS = {
    "zero2": (2, False, False),
    "zero2_offload": (2, True, False),
    "zero3": (3, False, False),
    "zero3_offload_optimizer": (3, True, False),
    "zero3_offload": (3, True, True),
}
"""ZeRO strategy: (stage, optimizer offloaded to the CPU, parameters offloaded to the CPU)."""


def zero_config(strategy: str, settings: dict) -> dict:
    """The DeepSpeed config of a ZeRO strategy, without an optimizer section (the Trainer's optimizer is DeepSpeed's
    client), with the ``zero_optimization`` ``settings`` of the hf-paged config's ``training.deepspeed`` and
    DeepSpeed's defaults for everything else, as ``configs/accelerate/zero*.yaml`` build it."""
    stage, offload_optimizer, offload_parameters = ZERO_CONFIGS[strategy]
    zero: dict = {**settings, "stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    return trainer_deepspeed_config(zero)


class _HostApartBackend(device_module.SyncBackend):
    """The CPU page store's backend, whose host pages are host memory beside the pseudo-device."""

    def empty_host(self, specs):
        with device_memory.host_memory():
            return super().empty_host(specs)


GLOO_COPY_WAIT_SECONDS = 2.0
"""How long a collective waits, at most, for gloo's worker to free the copy it made (see :func:`free_gloo_copies`)."""


def free_gloo_copies() -> None:
    """FSDP2's reduce-scatters and all-gathers return once gloo's worker thread has freed what it made for them.

    Gloo's reduce-scatter copies its input on its worker thread and frees the copy when the collective's work ends,
    sometimes after FSDP2 has gone on to gather the next layer (``tests/test_gloo_copies.py``; README.md, Planning
    memory): a rank's forward and backward then measures one layer's gradients more, on any rank and step from run to
    run. NCCL writes into its output and keeps no such copy, and the plan has none: waiting here until the live bytes
    are back to those before the call measures what the plan models, the same in every run."""

    def waiting(collective):
        def call(*args, **kwargs):
            if kwargs.get("async_op", False):
                return collective(*args, **kwargs)
            before = device_memory.live()
            result = collective(*args, **kwargs)
            deadline = time.monotonic() + GLOO_COPY_WAIT_SECONDS
            while device_memory.live() > before and time.monotonic() < deadline:
                time.sleep(0.0005)
            return result

        return call

    for name in ("reduce_scatter_single", "all_gather_single"):  # FSDP2's, with async_op=False
        if hasattr(dist, name):
            setattr(dist, name, waiting(getattr(dist, name)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("ddp", "fsdp2", "fsdp2_offload", *ZERO_CONFIGS), required=True)
    parser.add_argument("--method", choices=("full", "lora", "qlora"), required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--output", required=True)
    parser.add_argument("--cap", type=int, help="bytes of the pseudo-device: past them, torch.OutOfMemoryError")
    parser.add_argument("--host-apart", action="store_true", help="a paged optimizer's host pages are not counted")
    parser.add_argument(
        "--no-step-recovery",
        action="store_true",
        help="a paged optimizer does not recover an out-of-memory error in its step by paging state out",
    )
    args = parser.parse_args()
    if args.no_step_recovery:
        from hf_paged.optim import PagedOptimizer

        PagedOptimizer.oom_retries = 0
    if args.host_apart:
        device_module._backend_factory = _HostApartBackend
    if args.strategy.startswith("fsdp2"):
        from fsdp2_trainer import FSDP2_ENVIRONMENT, enable_fsdp_on_cpu

        os.environ.update(FSDP2_ENVIRONMENT, FSDP_OFFLOAD_PARAMS=str(args.strategy == "fsdp2_offload").lower())
        enable_fsdp_on_cpu()
    if args.strategy in ZERO_CONFIGS:
        os.environ.setdefault("HF_PAGED_COMPILE", "0")
        import deepspeed.ops

        # no JIT build of its shared-memory op (as tests/scripts/deepspeed_train.py)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    dist.init_process_group("gloo", timeout=timedelta(minutes=2))
    setup = setup_from_config(load_config(None, args.overrides), args.method)
    vocab_size = architecture(setup.config).vocab_size
    training = training_arguments(setup.with_changes(training={"deepspeed": None}).config)
    overrides = {
        "output_dir": os.path.join(args.output, "trainer"),
        "max_steps": args.steps,
        "save_strategy": "no",
        "report_to": [],
        "logging_steps": 1,
        "disable_tqdm": True,
        "remove_unused_columns": False,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    if args.strategy in ZERO_CONFIGS:
        overrides["deepspeed"] = zero_config(args.strategy, deepspeed_config(setup).get("zero_optimization", {}))
    training = dataclasses.replace(training, **overrides)
    # a step more than it trains, so that the data loader holds the next batch at every step, as in a longer run
    examples_per_step = setup.batch_size * setup.accumulation * dist.get_world_size()
    examples = [{"index": index} for index in range((args.steps + 1) * examples_per_step)]
    fill_process_tables()
    phases = PhasePeaks()
    result_file = os.path.join(args.output, f"rank{dist.get_rank()}.json")
    device_memory.install(args.cap)
    if args.strategy.startswith("fsdp2"):
        free_gloo_copies()
    try:
        model = build_model(setup)
        trainer = Trainer(
            model=model,
            args=training,
            train_dataset=examples,
            data_collator=lambda features: make_batch(setup, vocab_size),
            callbacks=[phases],
        )
        phases.trainer = trainer
        trainer.train()
    except torch.OutOfMemoryError as error:
        with open(result_file, "w") as file:
            json.dump({"out_of_memory": str(error)}, file)
        sys.stderr.write(f"rank {dist.get_rank()}: {error}\n")
        sys.stderr.flush()
        os._exit(3)  # the other ranks wait in a collective: torchrun ends them
    result = {"peaks": phases.peaks, "facts": engine_facts(trainer, args.strategy)}
    with open(result_file, "w") as file:
        json.dump(result, file)
    dist.barrier()
    end_distributed_run()


if __name__ == "__main__":
    main()
