"""The ``hf-paged`` command: ``hf-paged train [CONFIG.yaml] [--set key=value ...]``, ``hf-paged plan`` and
``hf-paged env``.

``train`` fine-tunes with LoRA or QLoRA, a paged optimizer and the memory callback (with no config: the
embedded tiny model on the shipped instructions, about a minute on a CPU) and prints a summary; ``plan``
predicts the memory of the same config without weights and says whether it fits; ``env``
prints the versions, devices and optimizer names. Importing ``hf_paged`` does not import this package.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from typing import Any

from . import quiet
from .config import Config, ConfigError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-paged", description="Fine-tuning with hf-paged optimizers.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train",
        help="fine-tune with LoRA/QLoRA, a paged optimizer and the memory callback",
        description="Fine-tune from CONFIG.yaml (default: the embedded tiny QLoRA run) and print a summary.",
    )
    train.add_argument("config", nargs="?", help="YAML config; its keys update the embedded default")
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one dotted key, the value read as YAML (repeatable), e.g. --set training.max_steps=20",
    )
    train.add_argument("--output-dir", help="where the adapter, timeline and summary go (training.output_dir)")
    train.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    train.add_argument(
        "--plan",
        action="store_true",
        help=(
            "first print the memory plan of the run (as hf-paged plan does): one rank's, on the device it trains on, "
            "for the launch's processes and the strategy its config or launcher asks for (DDP, FSDP2, ZeRO)"
        ),
    )
    plan = commands.add_parser(
        "plan",
        help="predict the peak memory of each training phase from the model's config.json, and the verdict",
        description=(
            "Trace two training steps of CONFIG.yaml (default: the embedded tiny QLoRA run) under fake tensors, "
            "without weights, and print memory by kind, the forward+backward and optimizer-step peaks and whether "
            "they fit; exit status 1 when they do not."
        ),
    )
    plan.add_argument("config", nargs="?", help="YAML config of hf-paged train; its keys update the embedded default")
    plan.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one dotted key, the value read as YAML (repeatable), e.g. --set tokenizer.max_length=2048",
    )
    plan.add_argument(
        "--device-memory", metavar="SIZE", help="memory the device offers, e.g. 24GiB (default: the GPU's)"
    )
    plan.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="device to plan for (default cuda)")
    plan.add_argument(
        "--method",
        choices=("full", "lora", "qlora"),
        help="what is trained (default: qlora if lora.quantize, else lora)",
    )
    plan.add_argument(
        "--gpus",
        type=int,
        default=1,
        metavar="N",
        help="plan one rank of N GPUs (with --strategy); the peaks are one rank's (default 1)",
    )
    plan.add_argument(
        "--strategy",
        metavar="NAME",
        help="how the step is spread over the GPUs: ddp, fsdp2 (full shard), fsdp2_offload (with CPU offload), zero2, "
        "zero2_offload, zero3, zero3_offload_optimizer or zero3_offload (DeepSpeed ZeRO, optimizer and parameter offload)",
    )
    plan.add_argument(
        "--fewest-gpus",
        action="store_true",
        help="for each strategy (or --strategy), the fewest GPUs of --device-memory on which every rank fits, "
        "without and with paging",
    )
    commands.add_parser("env", help="print versions, devices and their memory, and the optimizer names")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hf-paged`` command line; return the exit status (0 success, 1 a plan that does not fit, 2 bad
    arguments or config)."""
    args = _parser().parse_args(argv)
    quiet.install()
    try:
        if args.command == "env":
            from .env import report

            print(report())
            return 0
        from .sources import import_bitsandbytes_offline

        import_bitsandbytes_offline()
        if args.command == "plan":
            return _plan(args)
        return _train(args)
    except ConfigError as error:
        from .train import is_first_on_machine

        if is_first_on_machine():  # every process of a launch reads the same config: one says what is wrong
            print(f"hf-paged: error: {error}", file=sys.stderr)
        return 2


def _train(args: argparse.Namespace) -> int:
    """``hf-paged train``; launched as several processes, only the first (rank 0) prints the plan, config and
    summary, and each process ends once it has trained (see :func:`~hf_paged.process_exit.end_distributed_run`)."""
    from ..process_exit import end_distributed_run
    from .config import load_config, to_dict, update
    from .sources import check_sources, hub_offline, is_local
    from .train import is_main_process

    config = load_config(args.config, args.overrides)
    if args.output_dir is not None:
        update(config, {"training": {"output_dir": args.output_dir}}, source="--output-dir")
    if args.plan or not args.print_config:
        check_sources(config)
    with hub_offline() if is_local(config) else contextlib.nullcontext():
        planned = _plan_training(config) if args.plan else None
        if args.print_config:
            import yaml

            if is_main_process():
                print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
            return 0
        from .train import format_summary, run

        summary = run(config, plan=planned)
    if is_main_process():
        print(format_summary(summary), flush=True)
    end_distributed_run()  # a process of a launch ends here, without the interpreter's finalization
    return 0


def _plan_training(config: Config) -> Any:
    """``hf-paged train --plan``: the plan of one rank of this launch (its number of processes, and the strategy its
    configuration and launcher ask for) on the device the Trainer trains on, printed by rank 0; ``None``, with a line
    that says why, where there is none."""
    from .plan import format_report, launch_setup, report, report_apart, setup_from_config
    from .train import is_main_process, launched_processes, training_device

    device = training_device(config)
    why = f"plans are for cpu and cuda, not {device}"
    if device in ("cpu", "cuda"):
        processes, setup = launched_processes(), setup_from_config(config)
        try:
            setup = launch_setup(setup, processes, device)
        except ConfigError as error:  # a strategy the planner does not model
            why = str(error)
        else:
            plan_of = report if processes == 1 else report_apart
            outcome = plan_of(setup, device, _capacity(config, None, device))
            if is_main_process():
                print(format_report(outcome), flush=True)
            return outcome.plan
    if is_main_process():
        print(f"hf-paged train --plan: {why}; training without one", flush=True)
    return None


def _plan(args: argparse.Namespace) -> int:
    from ..sizes import parse_size
    from .config import load_config
    from .plan import format_report, report, setup_from_config
    from .sources import check_sources, hub_offline, is_local

    capacity = None
    if args.device_memory is not None:
        try:
            capacity = parse_size(args.device_memory, "--device-memory")
        except (TypeError, ValueError) as error:
            raise ConfigError(str(error)) from None
        if capacity < 1:
            raise ConfigError(f"--device-memory must be at least 1 byte, got {args.device_memory!r}")
    config = load_config(args.config, args.overrides)
    check_sources(config)
    setup = setup_from_config(config, args.method)
    capacity = _capacity(config, capacity, args.device)
    with hub_offline() if is_local(config) else contextlib.nullcontext():
        if args.fewest_gpus:
            return _fewest_gpus(args, setup, capacity)
        setup = setup.with_changes(world_size=args.gpus, strategy=args.strategy)
        outcome = report(setup, args.device, capacity)
    print(format_report(outcome), flush=True)
    return 1 if outcome.fits is False else 0


def _fewest_gpus(args: argparse.Namespace, setup: Any, capacity: int | None) -> int:
    """``hf-paged plan --fewest-gpus``: exit status 1 when no strategy fits at any count, 2 when none can be planned
    (a config error, said per strategy)."""
    import time

    from .plan import fewest_gpus, format_fewest_gpus

    if capacity is None:
        raise ConfigError("--fewest-gpus needs --device-memory (or memory.device_capacity, or a local GPU)")
    if args.gpus != 1:
        raise ConfigError("--fewest-gpus finds the count itself: leave --gpus out")
    setup.with_changes(strategy=args.strategy)  # checks --strategy
    started = time.perf_counter()
    counts = fewest_gpus(setup, args.device, capacity, None if args.strategy is None else [args.strategy])
    print(format_fewest_gpus(setup, args.device, capacity, counts), flush=True)
    print(f"planned in {time.perf_counter() - started:.1f} s", flush=True)
    if all(count.error is not None for count in counts):
        return 2
    return 0 if any(count.gpus is not None or count.paged_gpus is not None for count in counts) else 1


def _capacity(config: Config, given: int | None, device: str) -> int | None:
    """Bytes the device offers: ``given``, else ``memory.device_capacity``, else the local GPU's; ``None`` if unknown."""
    from ..sizes import parse_size

    if given is not None:
        return given
    if config.memory.device_capacity is not None:
        try:
            return parse_size(config.memory.device_capacity, "memory.device_capacity")
        except (TypeError, ValueError) as error:
            raise ConfigError(str(error)) from None
    if device == "cuda" and torch_cuda_available():
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    return None


def torch_cuda_available() -> bool:
    """Whether PyTorch sees a CUDA device."""
    import torch

    return torch.cuda.is_available()
