"""The ways a training step is spread over N ranks that the planner traces, and how each wraps a model.

A :class:`Strategy` names what each rank holds: DDP keeps the whole model, its gradients and optimizer state on every
rank; FSDP2 (``fully_shard``, full shard) keeps 1/N of each and gathers a group's parameters while it runs, with CPU
offload keeping the shards, their gradients and the optimizer step in host memory. :func:`default_wrap` wraps a
model for either as a training loop would. DeepSpeed ZeRO-2 keeps the whole weights on every rank and 1/N of the
gradients and optimizer state (with its fp32 master weights); ZeRO-3 keeps 1/N of each and gathers a module's
parameters while it runs; with optimizer offload, the fp32 partitions, the optimizer state and its step are in host
memory, with parameter offload (ZeRO-3) the parameter partitions too. DeepSpeed cannot run on fake tensors: its
partitioning is modelled (:mod:`hf_paged.zero_model`), the model's forward and backward and the optimizer's step are
traced.

Only torch is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from .zero_model import ZeroSettings


@dataclass(frozen=True)
class Strategy:
    """How a step is spread over the ranks (see :data:`STRATEGIES`)."""

    name: str
    engine: str
    """``ddp``, ``fsdp2`` or ``zero`` (DeepSpeed ZeRO, modelled)."""
    summary: str
    """What each rank holds, in a few words."""
    offload_optimizer: bool = False
    """Optimizer state and its step in host memory."""
    offload_parameters: bool = False
    """Parameters (and for FSDP2 their gradients) rest in host memory between uses."""
    zero_stage: int | None = None
    """2 or 3 for DeepSpeed ZeRO."""
    zero: ZeroSettings = field(default_factory=ZeroSettings)
    """DeepSpeed's bucket sizes and persistence threshold (its defaults unless replaced), for ZeRO."""

    @property
    def budget_applies(self) -> bool:
        """Whether a paged optimizer's state is on the device, so that its ``device_budget`` limits it."""
        return not self.offload_optimizer


STRATEGIES: dict[str, Strategy] = {
    strategy.name: strategy
    for strategy in (
        Strategy("ddp", "ddp", "every rank holds the whole model, gradients and optimizer state"),
        Strategy(
            "fsdp2", "fsdp2", "FSDP2 full shard: 1/N of weights, gradients and state; a group gathered as it runs"
        ),
        Strategy(
            "fsdp2_offload",
            "fsdp2",
            "FSDP2 full shard with CPU offload: shards, gradients and the optimizer step in host memory",
            offload_optimizer=True,
            offload_parameters=True,
        ),
        Strategy(
            "zero2", "zero", "ZeRO-2: whole weights; 1/N of gradients, fp32 master weights and state", zero_stage=2
        ),
        Strategy(
            "zero2_offload",
            "zero",
            "ZeRO-2 with optimizer offload: fp32 master weights, gradient partitions and the step in host memory",
            offload_optimizer=True,
            zero_stage=2,
        ),
        Strategy(
            "zero3", "zero", "ZeRO-3: 1/N of weights, gradients and state; a module gathered as it runs", zero_stage=3
        ),
        Strategy(
            "zero3_offload_optimizer",
            "zero",
            "ZeRO-3 with optimizer offload: fp32 master weights, gradient partitions and the step in host memory",
            offload_optimizer=True,
            zero_stage=3,
        ),
        Strategy(
            "zero3_offload",
            "zero",
            "ZeRO-3 with optimizer and parameter offload: only gathered parameters on the device",
            offload_optimizer=True,
            offload_parameters=True,
            zero_stage=3,
        ),
    )
}
"""Every strategy the planner traces, by name."""


def strategy_named(name: str | Strategy) -> Strategy:
    """The strategy ``name`` (one of :data:`STRATEGIES`), or ``name`` itself if it is one."""
    if isinstance(name, Strategy):
        return name
    if name not in STRATEGIES:
        base = name.split("_offload")[0] if isinstance(name, str) else None
        if base in STRATEGIES:
            offloading = ", ".join(other for other in STRATEGIES if STRATEGIES[other].offload_optimizer)
            raise ValueError(
                f"strategy: {base} has no {name[len(base) + 1 :]!r}; the strategies with offload are {offloading}"
            )
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {name!r}")
    return STRATEGIES[name]


Wrap = Callable[[nn.Module], nn.Module]
"""Wraps a built model for a strategy, inside the planner's fake world of N ranks; returns what forward runs on."""


def fsdp2_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` takes besides the root, innermost first: those whose class a Hugging Face model
    names in ``_no_split_modules`` (its decoder layers), else the items of every ``nn.ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    units = [module for module in model.modules() if module is not model and type(module).__name__ in names]
    if not units:
        units = [item for module in model.modules() if isinstance(module, nn.ModuleList) for item in module]
    return units


def shard_fsdp2(
    model: nn.Module, offload: bool, units: Callable[[nn.Module], list[nn.Module]] = fsdp2_units
) -> nn.Module:
    """``fully_shard`` each of ``units(model)``, then the root, over every rank of the default process group; with
    ``offload``, FSDP2's ``CPUOffloadPolicy`` (unpinned: pinning needs an accelerator, and takes no more bytes)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    for unit in units(model):
        fully_shard(unit, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return model


def wrap_ddp(model: nn.Module, bucket_cap_mb: float | None = None, find_unused_parameters: bool = False) -> nn.Module:
    """``DistributedDataParallel`` over every rank of the default process group, on the CPU or the current device,
    with its defaults (25 MiB buckets, the first 1 MiB; gradients apart from the buckets)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters)


def default_wrap(strategy: Strategy) -> Wrap | None:
    """How :func:`hf_paged.planner.plan` wraps a model for ``strategy`` unless told otherwise (``None`` for ZeRO,
    which is modelled, not wrapped)."""
    if strategy.engine == "zero":
        return None
    if strategy.engine == "ddp":
        return wrap_ddp
    return lambda model: shard_fsdp2(model, offload=strategy.offload_parameters)
