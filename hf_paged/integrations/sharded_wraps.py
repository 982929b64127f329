"""How ``transformers.Trainer`` (through accelerate) wraps a model for DDP and FSDP2, for the planner to trace.

The planner (:func:`hf_paged.planner.plan` with a ``strategy``) calls the :data:`~hf_paged.sharding.Wrap` these
return inside its fake world of N ranks:

* DDP takes the keyword arguments the Trainer hands accelerate (``find_unused_parameters``, ``bucket_cap_mb``,
  ``broadcast_buffers``, ``static_graph``: ``Trainer._build_accelerator_args``), with accelerate's defaults otherwise;
* FSDP2 is accelerate's own ``fsdp2_prepare_model``, the function ``Accelerator.prepare`` runs, given the plugin
  ``accelerate launch`` builds from ``configs/accelerate/fsdp2.yaml`` (transformer-based wrap of the classes in
  ``_no_split_modules``, then the input embedding, the final norm and output head as one group kept gathered after
  forward, then the root; full shard; sharded state dicts) and, for ``fsdp2_offload``, FSDP2's ``CPUOffloadPolicy``
  (unpinned: pinning needs an accelerator and takes no more bytes). It runs on a stand-in of the ``Accelerator`` that
  holds only what the function reads (no process group of its own, no global state).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..sharding import Strategy, Wrap


@dataclass
class _AcceleratorStandIn:
    """What accelerate's ``fsdp2_prepare_model`` reads of an ``Accelerator``."""

    state: Any
    mixed_precision: str = "no"
    is_main_process: bool = True
    torch_device_mesh: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass
class _PluginHolder:
    fsdp_plugin: Any


def _fsdp2_plugin(offload: bool) -> Any:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
        cpu_ram_efficient_loading=False,
        state_dict_type="SHARDED_STATE_DICT",
    )
    if offload:
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    return plugin


def accelerate_fsdp2(offload: bool) -> Wrap:
    """accelerate's FSDP2 preparation of a model, as ``Accelerator.prepare`` runs it (see the module's docstring)."""

    def wrap(model: nn.Module) -> nn.Module:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        plugin = _fsdp2_plugin(offload)
        shells = _params4bit_shells(model)
        if shells:
            plugin.ignored_modules = [_IgnoredParameters(shells)]
        return fsdp2_prepare_model(_AcceleratorStandIn(_PluginHolder(plugin)), model)

    return wrap


def _params4bit_shells(model: nn.Module) -> list[nn.Parameter]:
    """The planner's stand-ins for bitsandbytes' ``Params4bit`` (plain parameters of fake packed weights, marked
    ``bnb_quantized``: ``hf_paged.cli.plan``) that accelerate would leave unsharded: it leaves out of ``fully_shard``
    every frozen ``Params4bit`` of an integer storage, which it finds by class name (a fake tensor's is
    ``FakeTensor``), so that each rank keeps its 4-bit weights whole."""
    return [
        param
        for param in model.parameters()
        if getattr(param, "bnb_quantized", False)
        and type(param).__name__ != "Params4bit"
        and not (param.requires_grad or param.is_floating_point() or param.is_complex())
    ]


class _IgnoredParameters:
    """What accelerate reads of an ignored module (``FullyShardedDataParallelPlugin.ignored_modules``) for exactly
    these parameters: moving it to the device (they are there) and its parameters."""

    def __init__(self, parameters: list[nn.Parameter]) -> None:
        self._parameters = parameters

    def to(self, device: Any) -> _IgnoredParameters:
        return self

    def parameters(self) -> list[nn.Parameter]:
        return list(self._parameters)


def trainer_ddp(training_args: Any) -> Wrap:
    """``DistributedDataParallel`` as the Trainer has accelerate build it from ``training_args``."""

    def wrap(model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel
        from transformers import PreTrainedModel

        options: dict[str, Any] = {"find_unused_parameters": True}
        if training_args.ddp_find_unused_parameters is not None:
            options["find_unused_parameters"] = training_args.ddp_find_unused_parameters
        elif isinstance(model, PreTrainedModel):
            checkpointing = getattr(model, "is_activation_checkpointing", False)
            options["find_unused_parameters"] = not (
                checkpointing or getattr(training_args, "activation_checkpointing", False)
            )
        for name in ("bucket_cap_mb", "broadcast_buffers", "static_graph"):
            value = getattr(training_args, f"ddp_{name}", None)
            if value is not None:
                options[name] = value
        return DistributedDataParallel(model, **options)

    return wrap


def trainer_wrap(strategy: Strategy, training_args: Any) -> Wrap | None:
    """How the Trainer wraps a model for ``strategy`` (DDP or FSDP2); ``None`` for DeepSpeed ZeRO, which the planner
    models instead (:mod:`hf_paged.zero_model`)."""
    if strategy.engine == "zero":
        return None
    if strategy.engine == "ddp":
        return trainer_ddp(training_args)
    return accelerate_fsdp2(strategy.offload_parameters)
