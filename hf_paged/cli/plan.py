"""``hf-paged plan``: the memory of a ``hf-paged train`` config, predicted without weights and without training.

:class:`TrainingSetup` says what is trained (a :class:`~hf_paged.cli.config.Config`, the method: full fine-tune,
LoRA or QLoRA, and the kind of gradient checkpointing); :func:`build_model`, :func:`make_batch` and
:func:`build_optimizer` build it as ``hf-paged train`` would, from the model's ``config.json`` only. With
``shapes_only`` the 4-bit layers of QLoRA are shells whose fake storage has the size bitsandbytes' quantization
gives (their codes cannot be computed from fake weights). :func:`plan_setup` traces it with
:func:`hf_paged.planner.plan`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..planner import MemoryPlan, OptimizerPlanningError, PlanningError, plan
from ..sharding import Strategy
from .config import Config, ConfigError, check_training_counts
from .train import IGNORE_INDEX, add_lora_adapters, setup_error

METHODS = ("full", "lora", "qlora")
"""Full fine-tune (every weight trained), LoRA adapters on full-precision weights, QLoRA (4-bit weights)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

QUANT_BLOCK = 64
"""Weights per absmax of bitsandbytes' 4-bit quantization."""

NESTED_QUANT_BLOCK = 256
"""Absmax values per fp32 scale of double quantization."""


@dataclass(frozen=True)
class TrainingSetup:
    """What a plan traces: a train config, the method and the kind of gradient checkpointing."""

    config: Config
    method: str
    """One of :data:`METHODS`."""
    gradient_checkpointing: bool
    reentrant: bool = False
    """Reentrant checkpointing (``torch.utils.checkpoint`` with ``use_reentrant=True``); full and LoRA only."""
    world_size: int = 1
    """GPUs the step is spread over (with a ``strategy``); a plan gives one rank's memory."""
    strategy: str | None = None
    """One of :data:`hf_paged.sharding.STRATEGIES`, ``None`` for one device."""

    def __post_init__(self) -> None:
        from ..sharding import STRATEGIES

        if self.method not in METHODS:
            raise ConfigError(f"method must be one of {', '.join(map(repr, METHODS))}, got {self.method!r}")
        if self.reentrant and self.method == "qlora":
            raise ConfigError("reentrant checkpointing is not available with QLoRA (prepare_qlora uses non-reentrant)")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError(f"--gpus must be an integer >= 1, got {self.world_size!r}")
        if self.strategy is not None and self.strategy not in STRATEGIES:
            from ..sharding import strategy_named

            try:
                strategy_named(self.strategy)
            except ValueError as error:
                raise ConfigError(f"--{error}") from None
        if self.world_size > 1 and self.strategy is None:
            raise ConfigError(f"--gpus {self.world_size} needs a --strategy (one of {', '.join(STRATEGIES)})")
        check_training_counts(self.config.training)

    @property
    def batch_size(self) -> int:
        return int(self.config.training.get("per_device_train_batch_size", 8))

    @property
    def sequence_length(self) -> int:
        """Tokens per example: ``tokenizer.max_length``, the longest a batch is padded to."""
        return self.config.tokenizer.max_length

    @property
    def accumulation(self) -> int:
        return int(self.config.training.get("gradient_accumulation_steps", 1))

    @property
    def wrapping_strategy(self) -> str | None:
        """The strategy the Trainer's accelerate wraps each rank in: ``strategy``, but none for one process of DDP
        (accelerate wraps DDP only for several processes)."""
        if self.strategy is None or (self.world_size == 1 and _strategy_engine(self.strategy) == "ddp"):
            return None
        return self.strategy

    @property
    def optimizer_name(self) -> str:
        optim = self.config.training.get("optim", "adamw_torch")
        return str(getattr(optim, "value", optim))

    def describe(self) -> str:
        checkpointing = "off"
        if self.gradient_checkpointing:
            checkpointing = "reentrant" if self.reentrant else "on"
        sharded = ""
        if self.wrapping_strategy is not None:
            sharded = f", {self.strategy} on {self.world_size} GPUs (one rank's memory)"
        storage = f" (4-bit weights stored as {self.config.lora.quant_storage})" if self.method == "qlora" else ""
        return (
            f"{self.method}{storage}, batch {self.batch_size} x {self.sequence_length} tokens"
            f"{f' (x{self.accumulation} accumulation)' if self.accumulation > 1 else ''}, "
            f"checkpointing {checkpointing}, {self.optimizer_name}{sharded}"
        )

    def with_changes(
        self, training: dict[str, Any] | None = None, tokens: int | None = None, **fields: Any
    ) -> TrainingSetup:
        """A copy with ``training`` keys and the sequence length changed, and any field replaced."""
        config = copy.deepcopy(self.config)
        if training:
            config.training.update(training)
        if tokens is not None:
            config.tokenizer.max_length = tokens
        return dataclasses.replace(self, config=config, **fields)


def setup_from_config(config: Config, method: str | None = None) -> TrainingSetup:
    """The setup ``hf-paged train`` runs from ``config``: QLoRA if ``lora.quantize`` else LoRA (``method``
    overrides), checkpointing from ``lora.gradient_checkpointing`` or ``training.activation_checkpointing`` (or its
    deprecated name ``gradient_checkpointing``)."""
    if method is None:
        method = "qlora" if config.lora.quantize else "lora"
    reentrant = False
    checkpointing = config.lora.gradient_checkpointing
    if _checkpointing_setting(config.training):
        checkpointing = True
        kwargs = _checkpointing_setting(config.training, "_kwargs") or {}
        reentrant = bool(kwargs.get("use_reentrant", False)) and method != "qlora"
    return TrainingSetup(config=config, method=method, gradient_checkpointing=checkpointing, reentrant=reentrant)


def _checkpointing_setting(training: dict[str, Any], suffix: str = "") -> Any:
    """``training.activation_checkpointing`` (with ``suffix``: ``activation_checkpointing_kwargs``), or where it is
    unset its deprecated name ``gradient_checkpointing``, as ``TrainingArguments`` resolves the two."""
    value = training.get(f"activation_checkpointing{suffix}")
    return value if value is not None else training.get(f"gradient_checkpointing{suffix}")


def weight_dtype(setup: TrainingSetup) -> torch.dtype:
    """The dtype of the weights left unquantized: ``model.dtype``, or for ``auto`` the checkpoint's (float32 for
    the embedded tiny model)."""
    name = setup.config.model.dtype
    if name != "auto":
        return _DTYPES[name]
    if setup.config.model.name == "tiny":
        return torch.float32
    model_config = architecture(setup.config)
    dtype = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype, torch.float32)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def architecture(config: Config) -> Any:
    """The model's transformers config: the embedded tiny Llama's, else ``config.json`` read by ``AutoConfig``."""
    if config.model.name == "tiny":
        from .tokenizer import byte_tokenizer
        from .train import tiny_model

        with torch.device("meta"):
            return tiny_model(config, byte_tokenizer(model_max_length=config.tokenizer.max_length)).config
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(config.model.name, trust_remote_code=config.model.trust_remote_code)
    except (OSError, ValueError) as error:
        raise ConfigError(f"model.name: cannot read the config.json of {config.model.name!r}: {error}") from None


def compute_dtype(setup: TrainingSetup, device: str) -> torch.dtype:
    """The 4-bit layers' compute dtype: ``lora.compute_dtype``; ``auto`` is bfloat16 on CUDA, float32 elsewhere."""
    name = setup.config.lora.compute_dtype
    if name != "auto":
        return _DTYPES[name]
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _enable_checkpointing(model: Any, reentrant: bool) -> None:
    options = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    model.enable_input_require_grads()


def build_model(setup: TrainingSetup, device: str = "cpu", shapes_only: bool = False) -> nn.Module:
    """The model ``hf-paged train`` would train, with random weights, on the CPU; ``shapes_only``: 4-bit layers
    are shells of the right size (for fake tensors, which bitsandbytes cannot quantize). Targets that match no
    module of the model are a :class:`ConfigError` naming ``lora.target_modules``, as in ``hf-paged train``; adapters
    peft refuses (those of a mixture of experts' 3D weights with ``lora_dropout``: ``lora.lora_dropout``) or a model
    without a linear layer to quantize are one naming ``lora``."""
    from ..qlora import TargetModulesError

    config = setup.config
    dtype = weight_dtype(setup)
    if config.model.name == "tiny":
        from .tokenizer import byte_tokenizer
        from .train import tiny_model

        model = tiny_model(config, byte_tokenizer(model_max_length=config.tokenizer.max_length)).to(dtype)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(
            architecture(config), dtype=dtype, trust_remote_code=config.model.trust_remote_code
        )
    if setup.gradient_checkpointing:
        model.config.use_cache = False  # as the Trainer's forward would find it; else transformers says it turns it off
    try:
        return _with_adapters(setup, model, device, shapes_only)
    except TargetModulesError as error:
        raise ConfigError(f"lora.{error}") from None
    except ConfigError:
        raise
    except ValueError as error:
        raise setup_error(setup.method, config.model.name, error) from None


def _with_adapters(setup: TrainingSetup, model: nn.Module, device: str, shapes_only: bool) -> nn.Module:
    """``model`` as ``setup.method`` trains it: 4-bit weights and LoRA, LoRA, or itself, checkpointed as set."""
    from ..qlora import prepare_qlora

    lora = setup.config.lora
    if setup.method == "qlora":
        with _shell_quantization() if shapes_only else contextlib.nullcontext():
            return prepare_qlora(
                model,
                r=lora.r,
                lora_alpha=lora.lora_alpha,
                lora_dropout=lora.lora_dropout,
                target_modules=lora.target_modules,
                quant_type=lora.quant_type,
                double_quant=lora.double_quant,
                compute_dtype=compute_dtype(setup, device),
                quant_storage=lora.quant_storage,
                gradient_checkpointing=setup.gradient_checkpointing,
            )
    if setup.gradient_checkpointing:
        _enable_checkpointing(model, setup.reentrant)
    if setup.method == "full":
        return model
    return add_lora_adapters(model, lora)


@functools.cache
def _shell_quant_state_class() -> type:
    """bitsandbytes' ``QuantState``, but ``as_dict`` (the 4-bit layer's state dict, which accelerate's FSDP2
    preparation takes) writes 0.0 for the nested offset instead of reading the fake offset's value, which it does not
    have (the value does not change the state dict's tensors)."""
    from bitsandbytes.functional import QuantState

    class ShellQuantState(QuantState):
        def as_dict(self, packed: bool = False) -> dict[str, Any]:
            offset = self.offset
            if offset is not None:
                self.offset = _ZeroOffset()
            try:
                return super().as_dict(packed)
            finally:
                self.offset = offset

    return ShellQuantState


class _ZeroOffset:
    """What ``QuantState.as_dict`` reads of the nested offset: its value."""

    def item(self) -> float:
        return 0.0


def _linear4bit_shell(module: nn.Module, config: Any, bnb: Any) -> nn.Module:
    """A ``bnb.nn.Linear4bit`` for ``module`` whose packed weight and quantization state are fake tensors of the
    sizes bitsandbytes' quantization gives: 0.5 byte per weight, an absmax per 64 weights (fp32, or 8-bit with
    an fp32 scale per 256 of them and a 256-entry code book under double quantization), a 16-entry code book."""
    from bitsandbytes.functional import QuantState
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from transformers.pytorch_utils import Conv1D

    _ShellQuantState = _shell_quant_state_class()
    # Conv1D (GPT-2) stores its weight as (in, out): quantized as nn.Linear's (out, in), as prepare_qlora does
    shape = module.weight.shape[::-1] if isinstance(module, Conv1D) else module.weight.shape
    out_features, in_features = shape
    double_quant = config.bnb_4bit_use_double_quant
    with unset_fake_temporarily(), torch.device("meta"):  # its meta Params4bit is replaced below
        layer = bnb.nn.Linear4bit(
            in_features,
            out_features,
            bias=module.bias is not None,
            compute_dtype=config.bnb_4bit_compute_dtype,
            compress_statistics=double_quant,
            quant_type=config.bnb_4bit_quant_type,
            quant_storage=config.bnb_4bit_quant_storage,
        )
    weights = out_features * in_features
    blocks = math.ceil(weights / QUANT_BLOCK)
    nested = None
    offset = None
    if double_quant:
        absmax = torch.empty(blocks, dtype=torch.uint8)
        nested = QuantState(
            absmax=torch.empty(math.ceil(blocks / NESTED_QUANT_BLOCK), dtype=torch.float32),
            code=torch.empty(256, dtype=torch.float32),
            blocksize=NESTED_QUANT_BLOCK,
            dtype=torch.float32,
        )
        offset = torch.empty((), dtype=torch.float32)
    else:
        absmax = torch.empty(blocks, dtype=torch.float32)
    state = _ShellQuantState(
        absmax=absmax,
        shape=shape,
        code=torch.empty(16, dtype=torch.float32),
        blocksize=QUANT_BLOCK,
        quant_type=config.bnb_4bit_quant_type,
        dtype=module.weight.dtype,
        offset=offset,
        state2=nested,
    )
    storage = config.bnb_4bit_quant_storage
    packed = torch.empty((math.ceil(weights / 2 / storage.itemsize), 1), dtype=storage)
    # Params4bit cannot wrap a fake tensor: a plain parameter carries the attributes bitsandbytes and peft read.
    weight = nn.Parameter(packed, requires_grad=False)
    weight.quant_state = state
    weight.blocksize = QUANT_BLOCK
    weight.compress_statistics = double_quant
    weight.quant_type = config.bnb_4bit_quant_type
    weight.quant_storage = storage
    weight.bnb_quantized = True
    weight.module = layer
    layer.weight = weight
    layer.quant_state = state
    layer.bias = module.bias
    layer.requires_grad_(False)
    attributes = {name: getattr(weight, name) for name in _SHELL_ATTRIBUTES}
    layer.register_forward_pre_hook(functools.partial(_restore_shell_attributes, attributes=attributes))
    return layer


_SHELL_ATTRIBUTES = ("quant_state", "blocksize", "compress_statistics", "quant_type", "quant_storage", "bnb_quantized")
"""What bitsandbytes and peft read of a 4-bit weight besides its tensor."""


def _restore_shell_attributes(layer: nn.Module, args: Any, attributes: dict[str, Any]) -> None:
    """Before a shell's forward: a weight FSDP2 replaced by its gathered parameter (a floating-point storage is
    sharded) gets the shell's attributes, which bitsandbytes would restore by wrapping it in a ``Params4bit``, which
    a fake tensor cannot be."""
    weight = layer.weight
    if getattr(weight, "quant_state", None) is None:
        for name, value in attributes.items():
            setattr(weight, name, value)
        weight.module = layer


def _prepare_keeping_shells(prepare: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """peft's ``prepare_model_for_kbit_training``, but the shells keep their storage dtype: peft casts every 16-bit
    parameter but a ``Params4bit`` (by class name) to float32, which would double a shell stored in bfloat16."""

    def prepare_model(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        shells = {param: param.data for param in model.parameters() if getattr(param, "bnb_quantized", False)}
        prepared = prepare(model, *args, **kwargs)
        for param, data in shells.items():
            param.data = data
        return prepared

    return prepare_model


@contextlib.contextmanager
def _shell_quantization() -> Iterator[None]:
    """:func:`hf_paged.qlora.prepare_qlora` makes 4-bit shells instead of quantizing (see :func:`_linear4bit_shell`)."""
    from .. import qlora

    original = qlora._linear4bit, qlora.prepare_model_for_kbit_training
    qlora._linear4bit = _linear4bit_shell
    qlora.prepare_model_for_kbit_training = _prepare_keeping_shells(original[1])
    try:
        yield
    finally:
        qlora._linear4bit, qlora.prepare_model_for_kbit_training = original


def quantization_state(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """The tensors of the 4-bit layers' quantization state (absmax, code books, offsets), by planner kind."""
    import bitsandbytes as bnb

    tensors: list[torch.Tensor] = []
    for module in model.modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        # The layer's own reference: a weight FSDP2 shards (floating-point storage) is a DTensor without it.
        state = getattr(module.weight, "quant_state", None) or getattr(module, "quant_state", None)
        if state is None:
            continue
        tensors += [state.absmax, state.code]
        if state.nested:
            tensors += [state.offset, state.state2.absmax, state.state2.code]
    return {"quantization_state": tensors}


def make_batch(setup: TrainingSetup, vocab_size: int) -> dict[str, torch.Tensor]:
    """One batch of random tokens: ``input_ids``, ``labels`` and ``attention_mask``, batch x sequence length.

    The last token of the last example is padding, as in the batches the collator pads to their longest
    example: transformers then builds the 4D attention mask (what it also does for fake tensors, whose
    padding it cannot read)."""
    ids = torch.randint(0, vocab_size, (setup.batch_size, setup.sequence_length))
    mask = torch.ones_like(ids)
    mask[-1, -1] = 0
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def trainer_batches(make: Callable[[], Any], fetched: int, used: int, ahead: int) -> Callable[[], Any]:
    """Batches as the Trainer holds them, for :func:`hf_paged.planner.plan`: each step fetches its ``fetched``
    micro-batches at its start and holds them until the next step has fetched its own (the training loop's
    ``batch_samples``), the plan traces the first ``used`` of them, and accelerate's data loader holds ``ahead`` more,
    fetched before it hands one out (on an accelerator they stay in host memory until their step)."""
    loaded: list[Any] = []
    step_batches: list[Any] = []
    handed = 0

    def next_batch() -> Any:
        nonlocal handed
        if handed == used or not step_batches:
            while len(loaded) < fetched + ahead:
                loaded.append(make())
            step_batches[:] = loaded[:fetched]
            del loaded[:fetched]
            handed = 0
        handed += 1
        return step_batches[handed - 1]

    return next_batch


def planning_arguments(setup: TrainingSetup) -> Any:
    """The config's ``TrainingArguments`` as a plan reads them (the optimizer, weight decay, DDP's options): without
    DeepSpeed, which would start a process group, and on a machine without an accelerator with ``use_cpu``, without
    which ``TrainingArguments`` refuse ``bf16`` and ``fp16`` there, though the plan is for the config's machine."""
    from .train import _accelerator_available, training_arguments

    changes: dict[str, Any] = {"deepspeed": None}
    if not _accelerator_available():
        changes["use_cpu"] = True
    return training_arguments(setup.with_changes(training=changes).config)


def build_optimizer(
    setup: TrainingSetup, model: nn.Module, device: str = "cpu", training_args: Any = None
) -> torch.optim.Optimizer:
    """The optimizer ``training.optim`` and ``training.optim_args`` name, over the trainable parameters in the
    Trainer's two param groups (those that take weight decay, then the others: biases and norms), eager (hf-paged
    optimizers with ``compiled=False``); an automatic budget is planned as no limit; on CUDA, ``torch.optim``
    optimizers take their multi-tensor path as they would there. ``training_args``: the config's
    ``TrainingArguments``, if already made."""
    from transformers import Trainer

    from ..budget import AutoBudget
    from ..optim import PagedOptimizer

    args = training_args if training_args is not None else planning_arguments(setup)
    try:
        optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"training.optim: {error}") from None
    kwargs = dict(kwargs)
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, PagedOptimizer):
        kwargs["compiled"] = False
        if kwargs.get("device_budget") == "auto" or isinstance(kwargs.get("device_budget"), AutoBudget):
            kwargs["device_budget"] = None
    elif optimizer_class.__module__.startswith("torch.optim") and torch.device(device).type == "cuda":
        kwargs.setdefault("foreach", True)
    decayed = set(Trainer.get_decay_parameter_names(SimpleNamespace(args=args), model))
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    groups = [
        {"params": [param for name, param in trainable if name in decayed], "weight_decay": args.weight_decay},
        {"params": [param for name, param in trainable if name not in decayed], "weight_decay": 0.0},
    ]
    return optimizer_class(groups, **kwargs)


def plan_setup(setup: TrainingSetup, device: str = "cpu", host_memory_apart: bool = False) -> MemoryPlan:
    """Trace ``setup`` with :func:`hf_paged.planner.plan` for ``device`` (``cpu`` or ``cuda``), on one device or, with
    a ``strategy``, as one rank of ``world_size`` under the Trainer (DDP and FSDP2 wrapped as the Trainer's accelerate
    wraps them; one process is not wrapped in DDP); a model the planner cannot trace is a :class:`ConfigError` naming
    ``model.name``.
    ``host_memory_apart``: see :func:`hf_paged.planner.plan` (a CPU standing in for an accelerator)."""
    if setup.wrapping_strategy != setup.strategy:
        setup = dataclasses.replace(setup, strategy=setup.wrapping_strategy)
    vocab_size = architecture(setup.config).vocab_size
    extra = quantization_state if setup.method == "qlora" else None
    training_args = planning_arguments(setup)  # before a fake world, whose process group it would see
    wrap = None
    strategy = None
    if setup.strategy is not None:
        from ..integrations.sharded_wraps import trainer_wrap
        from ..sharding import strategy_named

        strategy = strategy_named(setup.strategy)
        if strategy.engine == "zero":
            strategy = dataclasses.replace(strategy, zero=zero_settings(setup))
        wrap = trainer_wrap(strategy, training_args)
    traced_accumulation = min(setup.accumulation, 2)
    batches = trainer_batches(
        lambda: make_batch(setup, vocab_size),
        fetched=setup.accumulation,
        used=traced_accumulation,
        ahead=1 if torch.device(device).type == "cpu" else 0,
    )
    try:
        return plan(
            lambda: build_model(setup, device, shapes_only=True),
            batches,
            lambda model: build_optimizer(setup, model, device, training_args),
            device=device,
            accumulation=traced_accumulation,
            extra_state=extra,
            world_size=setup.world_size,
            strategy=strategy,
            wrap=wrap,
            host_memory_apart=host_memory_apart,
        )
    except OptimizerPlanningError as error:
        raise ConfigError(f"training.optim: {setup.optimizer_name!r}: {error}") from None
    except PlanningError as error:
        raise ConfigError(f"model.name: {setup.config.model.name!r}: {error}") from None


def deepspeed_config(setup: TrainingSetup) -> dict[str, Any]:
    """The DeepSpeed config ``training.deepspeed`` gives (a mapping or a JSON file's path), ``{}`` without one."""
    import json

    value = setup.config.training.get("deepspeed")
    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    try:
        with open(value) as file:
            loaded = json.load(file)
    except (OSError, TypeError, ValueError) as error:
        raise ConfigError(f"training.deepspeed: cannot read a DeepSpeed config from {value!r}: {error}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"training.deepspeed: {value!r} holds no JSON object")
    return loaded


_ZERO_KEYS = {
    "reduce_bucket_size": "reduce_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "sub_group_size": "sub_group_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
}
"""``zero_optimization`` keys of a DeepSpeed config and the :class:`~hf_paged.zero_model.ZeroSettings` field of each."""

_AUTO_FROM_HIDDEN_SIZE = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
"""The keys whose ``auto`` the Trainer fills in from the model's hidden size."""


def _accelerate_uses(environ: Mapping[str, str], engine: str) -> bool:
    """Whether accelerate's variables turn ``engine`` (``DEEPSPEED``, ``FSDP``) on, read as accelerate reads them."""
    return environ.get(f"ACCELERATE_USE_{engine}", "false").lower() == "true"


def _zero_strategy(zero: Mapping[str, Any], source: str) -> str:
    """The ZeRO strategy of a DeepSpeed config's ``zero_optimization`` (``source`` names it in errors)."""
    stage = zero.get("stage", 0)
    offloaded = {
        part: str((zero.get(f"offload_{part}") or {}).get("device", "none")).lower() in ("cpu", "nvme")
        for part in ("optimizer", "param")
    }
    if stage == 2 and not offloaded["param"]:
        return "zero2_offload" if offloaded["optimizer"] else "zero2"
    if stage == 3 and offloaded["param"] and offloaded["optimizer"]:
        return "zero3_offload"
    if stage == 3 and not offloaded["param"]:
        return "zero3_offload_optimizer" if offloaded["optimizer"] else "zero3"
    raise ConfigError(
        f"{source}: ZeRO stage {stage!r}{' with parameters but not the optimizer offloaded' if stage == 3 else ''} "
        "is not planned (stage 2, with or without optimizer offload, and stage 3, with no offload, the optimizer's "
        "or both, are)"
    )


def _strategy_engine(name: str) -> str:
    from ..sharding import strategy_named

    return strategy_named(name).engine


def launch_setup(
    setup: TrainingSetup, world_size: int, device: str, environ: Mapping[str, str] | None = None
) -> TrainingSetup:
    """``setup`` for one rank of a launch of ``world_size`` processes training on ``device`` (``hf-paged train --plan``
    under ``accelerate launch`` or ``torchrun``): its strategy is ZeRO where ``training.deepspeed`` or accelerate's
    DeepSpeed variables (``environ``, default the process's) turn DeepSpeed on, FSDP2 (with CPU offload where asked)
    where ``training.fsdp`` or accelerate's FSDP variables turn FSDP on on an accelerator (on the CPU accelerate
    trains such a run with DDP), else DDP. One process is ``setup`` itself but for ZeRO, which DeepSpeed applies to one
    process too."""
    import os

    environ = os.environ if environ is None else environ
    training = setup.config.training
    if training.get("deepspeed") is None and _accelerate_uses(environ, "DEEPSPEED"):
        path = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if path:
            setup = setup.with_changes(training={"deepspeed": path})
        else:
            zero = {
                "stage": int(environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")),
                "offload_optimizer": {"device": environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")},
                "offload_param": {"device": environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")},
            }
            return setup.with_changes(world_size=world_size, strategy=_zero_strategy(zero, "accelerate's DeepSpeed"))
    if setup.config.training.get("deepspeed") is not None:
        zero = deepspeed_config(setup).get("zero_optimization") or {}
        return setup.with_changes(world_size=world_size, strategy=_zero_strategy(zero, "training.deepspeed"))
    if world_size == 1:
        return setup
    options = str(training.get("fsdp") or "").split()  # TrainingArguments' fsdp: "full_shard offload", say
    if device != "cpu" and (options or _accelerate_uses(environ, "FSDP")):
        fsdp_config = _fsdp_config(training) if options else {}
        version = fsdp_config.get("version") if options else environ.get("FSDP_VERSION", "1")
        if str(version or 2) != "2":
            raise ConfigError(f"FSDP version {version} is not planned (FSDP2 is: fsdp_version 2)")
        from accelerate.utils import str_to_bool  # as accelerate's FSDP plugin reads its variables

        def flag(value: Any, source: str) -> bool:
            try:
                return str_to_bool(value.lower(), to_bool=True) if isinstance(value, str) else bool(value)
            except ValueError:
                raise ConfigError(f"{source} must be true or false, got {value!r}") from None

        if options:  # an fsdp_config key wins over the option, as TrainingArguments sets the option's by default
            offload = flag(fsdp_config.get("cpu_offload", "offload" in options), "training.fsdp_config's cpu_offload")
            reshard = flag(
                fsdp_config.get("reshard_after_forward", "shard_grad_op" not in options),
                "training.fsdp_config's reshard_after_forward",
            )
        else:
            offload = flag(environ.get("FSDP_OFFLOAD_PARAMS", "false"), "FSDP_OFFLOAD_PARAMS")
            reshard = flag(environ.get("FSDP_RESHARD_AFTER_FORWARD", True), "FSDP_RESHARD_AFTER_FORWARD")
        if not reshard:
            raise ConfigError(
                "FSDP2 without resharding after forward (shard_grad_op, reshard_after_forward false) is not planned "
                "(full shard is)"
            )
        return setup.with_changes(world_size=world_size, strategy="fsdp2_offload" if offload else "fsdp2")
    return setup.with_changes(world_size=world_size, strategy="ddp")


def _fsdp_config(training: Mapping[str, Any]) -> dict[str, Any]:
    """``training.fsdp_config`` as ``TrainingArguments`` reads it: a mapping or a JSON file's path, each key without
    its ``fsdp_`` prefix."""
    import json

    value = training.get("fsdp_config") or {}
    if isinstance(value, str):
        try:
            with open(value, encoding="utf-8") as file:
                value = json.load(file)
        except (OSError, ValueError) as error:
            raise ConfigError(f"training.fsdp_config: cannot read an FSDP config from {value!r}: {error}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"training.fsdp_config must be a mapping or a JSON file of one, got {value!r}")
    return {key.removeprefix("fsdp_"): item for key, item in value.items()}


def zero_settings(setup: TrainingSetup) -> Any:
    """The :class:`~hf_paged.zero_model.ZeroSettings` of ``training.deepspeed``'s ``zero_optimization``: DeepSpeed's
    defaults for keys it leaves out, and for ``auto`` what the Trainer fills in from the model's hidden size (a
    reduce bucket of hidden_size², a prefetch bucket of 0.9 hidden_size², a persistence threshold of 10
    hidden_size; DeepSpeed's default for another key's ``auto``, which its config drops)."""
    from ..zero_model import ZeroSettings

    zero = deepspeed_config(setup).get("zero_optimization") or {}
    values: dict[str, int] = {}
    for key, field_name in _ZERO_KEYS.items():
        value = zero.get(key)
        if value is None:
            continue
        if value == "auto" and key not in _AUTO_FROM_HIDDEN_SIZE:
            continue  # DeepSpeed's config drops an 'auto' the Trainer does not fill in: its default
        if value == "auto":
            hidden = architecture(setup.config).hidden_size
            value = {"reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden)}
            value = value.get(key, 10 * hidden)
        try:
            values[field_name] = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"training.deepspeed: zero_optimization.{key} must be a number or 'auto', got {value!r}")
    linear = zero.get("memory_efficient_linear", True)
    if not isinstance(linear, bool):
        raise ConfigError(
            f"training.deepspeed: zero_optimization.memory_efficient_linear must be true or false, got {linear!r}"
        )
    try:
        return ZeroSettings(**values, memory_efficient_linear=linear)
    except ValueError as error:
        raise ConfigError(f"training.deepspeed: {error}") from None


COMPARED_OPTIMIZERS = (
    "adamw_torch",
    "adamw_bnb_8bit",
    "hf_paged_adamw_32bit",
    "hf_paged_adamw_8bit",
    "hf_paged_adamw_4bit",
    "hf_paged_lion_32bit",
    "hf_paged_lion_8bit",
)
"""Optimizers whose state the report sets beside the chosen one's."""

COMPARISON_LIMIT = 500_000_000
"""Trainable parameters above which the report leaves the comparison out (each paged optimizer lays out all its pages,
about 50 us per page: 6 s for the 32-bit state of 2**28 parameters in 16 KiB pages)."""

BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes' 8-bit optimizers keep 32-bit state for parameters with fewer elements."""

BNB_BLOCK = 256
"""Elements per absmax of bitsandbytes' blockwise 8-bit state."""


def _bitsandbytes_8bit_state(shapes: list[tuple[tuple[int, ...], torch.dtype]], rounding: int) -> int:
    """Bytes of bitsandbytes' 8-bit AdamW state (its optimizer reads values, so it cannot be traced), each
    allocation rounded up to ``rounding``: two 8-bit codes and two fp32 absmax per 256 elements, or two fp32
    moments below 4096 elements, and a 256-entry fp32 code map per state kind."""

    def allocated(nbytes: int) -> int:
        return math.ceil(nbytes / rounding) * rounding

    total = 2 * allocated(2 * 256 * 4)
    for shape, _ in shapes:
        elements = math.prod(shape)
        if elements >= BNB_MIN_8BIT_SIZE:
            total += 2 * allocated(elements) + 2 * allocated(4 * math.ceil(elements / BNB_BLOCK))
        else:
            total += 2 * allocated(4 * elements)
    return total


def _comparison_optim_args(setup: TrainingSetup, name: str) -> str | None:
    """The chosen ``optim_args`` that the hf-paged optimizer ``name`` takes, without ``device_budget`` (the
    comparison counts all the state); ``None`` for other optimizers."""
    import inspect

    from ..integrations.trainer import optimizer_class_for, split_optim_args

    optimizer_class = optimizer_class_for(name)
    if optimizer_class is None:
        return None
    accepted = inspect.signature(optimizer_class).parameters
    chosen = split_optim_args(setup.config.training.get("optim_args")) if _paged(setup) else {}
    kept = {key: value for key, value in chosen.items() if key in accepted and key != "device_budget"}
    return ",".join(f"{key}={value}" for key, value in kept.items()) or None


def _state_bytes(
    setup: TrainingSetup, shapes: list[tuple[tuple[int, ...], torch.dtype]], device: str, rounding: int
) -> int:
    """Bytes of all the state that the optimizer of ``setup`` keeps for trainable parameters of ``shapes`` once each has
    taken a step, each allocation rounded up to ``rounding``, as a plan's
    :attr:`~hf_paged.planner.MemoryPlan.optimizer_state_bytes` counts it, without tracing a step: on fake tensors, a
    paged optimizer lays out the pages of every tensor (one block each, rank-1 statistics beside them), and each tensor
    adds its step count (a 0-d fp32 tensor); another optimizer steps once on zero gradients."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..optim import PagedOptimizer
    from ..planner import optimizer_state_bytes

    with FakeTensorMode():
        params = nn.ParameterList(nn.Parameter(torch.empty(shape, dtype=dtype)) for shape, dtype in shapes)
        optimizer = build_optimizer(setup, params, device)
        step_counts = 0
        if isinstance(optimizer, PagedOptimizer):
            optimizer.lay_out()
            step_counts = len(params) * math.ceil(torch.float32.itemsize / rounding) * rounding
        else:
            for param in params:
                param.grad = torch.zeros_like(param)
            optimizer.step()
        return optimizer_state_bytes(optimizer, rounding) + step_counts


def optimizer_state_comparison(setup: TrainingSetup, result: MemoryPlan, device: str = "cpu") -> dict[str, int] | None:
    """All the optimizer state of ``result``'s trainable parameters under each of :data:`COMPARED_OPTIMIZERS`, in
    bytes as :attr:`~hf_paged.planner.MemoryPlan.optimizer_state_bytes` counts it (the chosen optimizer's is
    ``result``'s own; the others by :func:`_state_bytes` with the chosen ``optim_args`` they take; bitsandbytes' from
    its layout); ``None`` above :data:`COMPARISON_LIMIT` trainable parameters."""
    if result.trainable_params > COMPARISON_LIMIT:
        return None
    from ..planner import CUDA_ALLOCATION_ROUNDING

    rounding = CUDA_ALLOCATION_ROUNDING if torch.device(device).type == "cuda" else 1
    states = {}
    for name in COMPARED_OPTIMIZERS:
        if name == setup.optimizer_name:
            states[name] = result.optimizer_state_bytes
        elif name == "adamw_bnb_8bit":
            states[name] = _bitsandbytes_8bit_state(result.trainable_shapes, rounding)
        else:
            other = setup.with_changes(training={"optim": name, "optim_args": _comparison_optim_args(setup, name)})
            states[name] = _state_bytes(other, result.trainable_shapes, device, rounding)
    return states


KIND_LABELS = {
    "frozen_weights": "frozen weights",
    "trainable_weights": "trainable weights",
    "quantization_state": "4-bit quantization state",
    "gradients": "gradients",
    "optimizer_state": "optimizer state on device",
    "communication": "communication buffers",
    "activations": "activations",
    "temporaries": "step temporaries",
}


@dataclass
class Alternative:
    """A nearby setup, re-planned."""

    change: str
    plan: MemoryPlan | None
    error: str | None = None
    """Why the setup cannot be planned, where it cannot (``plan`` is then ``None``)."""


@dataclass
class PlanReport:
    """A plan with its verdict for a device's memory, and what fits when the setup does not."""

    setup: TrainingSetup
    device: str
    plan: MemoryPlan
    capacity: int | None
    largest_budget: tuple[int, MemoryPlan] | None = None
    """For a paged optimizer: the largest device budget that fits and its plan."""
    alternatives: list[Alternative] = dataclasses.field(default_factory=list)
    optimizer_states: dict[str, int] | None = None
    """Bytes of optimizer state under each of :data:`COMPARED_OPTIMIZERS` (see :func:`optimizer_state_comparison`)."""
    seconds: float = 0.0
    """Wall time of every plan of the report."""

    @property
    def fits(self) -> bool | None:
        """Whether the setup fits in ``capacity``; ``None`` when no capacity is known."""
        return None if self.capacity is None else self.plan.fits(self.capacity)


def _paged(setup: TrainingSetup) -> bool:
    from ..integrations.trainer import optimizer_class_for

    return optimizer_class_for(setup.optimizer_name) is not None


def _budget_applies(setup: TrainingSetup) -> bool:
    """Whether ``setup`` pages optimizer state kept on the device, so that a ``device_budget`` limits it (not when a
    strategy keeps the state and its step in host memory)."""
    from ..sharding import strategy_named

    return _paged(setup) and (setup.strategy is None or strategy_named(setup.strategy).budget_applies)


def _page_size(setup: TrainingSetup) -> int:
    from ..integrations.trainer import split_optim_args
    from ..optim.base import DEFAULT_PAGE_SIZE
    from ..sizes import parse_size

    page_size = split_optim_args(setup.config.training.get("optim_args")).get("page_size")
    return DEFAULT_PAGE_SIZE if page_size is None else parse_size(page_size, "page_size")


def _with_budget(setup: TrainingSetup, budget: int | None) -> TrainingSetup:
    """``setup`` with ``optim_args``' ``device_budget`` set to ``budget`` bytes (``None``: removed, planned as no
    limit)."""
    from ..integrations.trainer import split_optim_args

    arguments = split_optim_args(setup.config.training.get("optim_args"))
    arguments.pop("device_budget", None)
    if budget is not None:
        arguments["device_budget"] = str(budget)
    optim_args = ",".join(f"{key}={value}" for key, value in arguments.items()) or None
    return setup.with_changes(training={"optim_args": optim_args})


def _largest_budget(
    setup: TrainingSetup, result: MemoryPlan, capacity: int, device: str, host_memory_apart: bool = False
) -> tuple[int, MemoryPlan]:
    """The largest device budget, in whole pages, whose re-planned peak fits ``capacity`` (at most all the state:
    that plan is ``result``); ``(0, result)`` if not even one page fits. Without state, each phase's peak drops by
    the state it held."""
    page_size = _page_size(setup)
    without_state = max(item.peak_bytes - item.by_kind["optimizer_state"] for item in result.phases)
    budget = (capacity - without_state) // page_size * page_size
    if result.paged_state_bytes is not None and budget >= result.paged_state_bytes and result.fits(capacity):
        return result.paged_state_bytes, result
    while budget >= page_size:
        budgeted = plan_setup(_with_budget(setup, budget), device, host_memory_apart)
        if budgeted.fits(capacity):
            return budget, budgeted
        # a smaller budget lowers a peak by at most what it takes away: none above budget - overshoot fits
        overshoot = budgeted.peak_bytes - capacity
        budget = min(budget - page_size, (budget - overshoot) // page_size * page_size)
    return 0, result


Change = Callable[[TrainingSetup], TrainingSetup]


def _checkpointing(setup: TrainingSetup) -> TrainingSetup:
    return setup.with_changes(gradient_checkpointing=True)


def _half_batch(setup: TrainingSetup) -> TrainingSetup:
    batch = setup.batch_size // 2
    accumulation = setup.accumulation * setup.batch_size // batch
    return setup.with_changes(
        training={"per_device_train_batch_size": batch, "gradient_accumulation_steps": accumulation}
    )


def _half_sequences(setup: TrainingSetup) -> TrainingSetup:
    return setup.with_changes(tokens=setup.sequence_length // 2)


def _optimizer(name: str) -> Change:
    def change(setup: TrainingSetup) -> TrainingSetup:
        optim_args = f"page_size={_page_size(setup)}" if _paged(setup) else None
        return setup.with_changes(training={"optim": name, "optim_args": optim_args})

    return change


def _qlora(setup: TrainingSetup) -> TrainingSetup:
    return setup.with_changes(method="qlora", reentrant=False)


def _alternatives(setup: TrainingSetup) -> list[tuple[str, Change]]:
    """The nearest settings that use less memory, one change each."""
    options: list[tuple[str, Change]] = []
    if not setup.gradient_checkpointing:
        options.append(("gradient checkpointing on", _checkpointing))
    if setup.batch_size > 1:
        batch = setup.batch_size // 2
        accumulation = setup.accumulation * setup.batch_size // batch
        options.append((f"batch {batch} with {accumulation} accumulation steps", _half_batch))
    if setup.sequence_length > 1:
        options.append((f"sequences of {setup.sequence_length // 2} tokens", _half_sequences))
    for name in ("hf_paged_adamw_8bit", "hf_paged_adamw_4bit"):
        if setup.optimizer_name != name and not setup.optimizer_name.endswith("4bit"):
            options.append((f"optimizer {name}", _optimizer(name)))
    if setup.method != "qlora":
        options.append(("QLoRA (4-bit base weights)", _qlora))
    return options


def _replanned(label: str, setup: TrainingSetup, device: str) -> Alternative:
    try:
        return Alternative(label, plan_setup(setup, device))
    except ConfigError as error:  # e.g. QLoRA of a model peft or bitsandbytes refuses
        return Alternative(label, None, str(error))


def _replan_alternatives(setup: TrainingSetup, device: str, capacity: int) -> list[Alternative]:
    """Each alternative re-planned (one that cannot be planned says why); when none fits, all of them that can be
    planned at once (with 4-bit state) too."""
    options = _alternatives(setup)
    alternatives = [_replanned(label, change(setup), device) for label, change in options]
    planned = [option for option, alternative in zip(options, alternatives) if alternative.plan is not None]
    fitting = any(alternative.plan.fits(capacity) for alternative in alternatives if alternative.plan is not None)
    if len(planned) > 1 and not fitting:
        combined = setup
        for label, change in planned:
            if label != "optimizer hf_paged_adamw_8bit":
                combined = change(combined)
        labels = [label for label, _ in planned]
        state = " (4-bit state)" if "optimizer hf_paged_adamw_4bit" in labels else ""
        which = "these" if len(planned) == len(options) else "these that can be planned"
        alternatives.append(_replanned(f"all of {which} together{state}", combined, device))
    return alternatives


def report(setup: TrainingSetup, device: str = "cuda", capacity: int | None = None) -> PlanReport:
    """Plan ``setup`` for ``device``; with a ``capacity`` (bytes), also the largest budget of a paged optimizer that
    fits and, when the setup does not fit, its alternatives, each re-planned."""
    import time

    started = time.perf_counter()
    result = plan_setup(setup, device)
    outcome = PlanReport(setup=setup, device=device, plan=result, capacity=capacity)
    outcome.optimizer_states = optimizer_state_comparison(setup, result, device)
    if capacity is not None and _budget_applies(setup) and torch.device(device).type != "cpu":
        outcome.largest_budget = _largest_budget(setup, result, capacity, device)
    if capacity is not None and not result.fits(capacity):
        outcome.alternatives = _replan_alternatives(setup, device, capacity)
    outcome.seconds = time.perf_counter() - started
    return outcome


_LAUNCH_PREFIXES = ("ACCELERATE_", "TORCHELASTIC_", "OMPI_COMM_WORLD_", "MV2_COMM_WORLD_", "PMI_", "MPI_LOCALRANKID")
_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                     "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
"""What a launcher (``torchrun``, ``accelerate launch``, MPI) tells its processes: a plan apart sees none of it."""


def report_apart(setup: TrainingSetup, device: str, capacity: int | None) -> PlanReport:
    """:func:`report` in a Python process of its own that sees no launcher, for a process of a launch: its Trainer
    starts the launch's process group, and a plan of several ranks traces them in a fake one of its own process."""
    import os
    import pickle
    import subprocess
    import sys
    import tempfile

    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in _LAUNCH_VARIABLES and not name.startswith(_LAUNCH_PREFIXES)
    }
    with tempfile.TemporaryDirectory(prefix="hf-paged-plan-") as folder:
        request, answer = os.path.join(folder, "request.pickle"), os.path.join(folder, "report.pickle")
        with open(request, "wb") as file:
            pickle.dump((setup, device, capacity), file)
        code = "import sys; from hf_paged.cli.plan import _report_to_file; _report_to_file(*sys.argv[1:])"
        result = subprocess.run(
            [sys.executable, "-c", code, request, answer], env=environment, capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            lines = result.stderr.strip().splitlines()
            raise ConfigError(f"the plan's own process failed: {lines[-1] if lines else result.returncode}")
        with open(answer, "rb") as file:
            return pickle.load(file)


def _report_to_file(request: str, answer: str) -> None:
    """The process of :func:`report_apart`: the report of the pickled request, pickled."""
    import pickle

    from . import quiet

    quiet.install()
    with open(request, "rb") as file:
        setup, device, capacity = pickle.load(file)
    outcome = report(setup, device, capacity)
    with open(answer, "wb") as file:
        pickle.dump(outcome, file)


GPU_LIMIT = 64
"""The most GPUs :func:`fewest_gpus` tries by default (past a few dozen, FSDP2's padding of small tensors to the
count outgrows what sharding saves of a small model, and each count is a trace)."""


@dataclass
class GpuCount:
    """The fewest GPUs of one strategy on which every rank fits, with the paged optimizer's state all on the device
    (no paging) and with paging (a device budget)."""

    strategy: str
    gpus: int | None
    """Without paging; ``None`` when no count up to :data:`GPU_LIMIT` fits or the step cannot be planned."""
    plan: MemoryPlan | None
    """At ``gpus``, or at the largest count tried when none fits (its peak says what that count lacks); ``None`` when
    the step cannot be planned with this strategy (see :attr:`error`)."""
    paged_gpus: int | None = None
    """With paging; ``None`` when no count fits or paging does not apply (see :attr:`paging`)."""
    budget: int | None = None
    """The largest device budget, in bytes, that fits at ``paged_gpus``."""
    paged_plan: MemoryPlan | None = None
    """At ``paged_gpus`` with ``budget`` (or at the largest count tried)."""
    paging: str | None = None
    """Why paging does not apply, where it does not."""
    error: str | None = None
    """Why the step cannot be planned with this strategy (the planner's error), where it cannot."""


def _fewest(plan_at: Callable[[int], MemoryPlan], capacity: int, limit: int) -> tuple[int | None, MemoryPlan]:
    """The fewest ``n`` in 1..``limit`` whose ``plan_at(n)`` fits ``capacity``, and its plan (``None`` and the plan at
    ``limit`` when none does), where what fits at a count fits at every larger one (a rank's peak does not grow with
    the count).

    A rank's peak is close to ``a + b/n``: what every rank holds whole, and its share of what is sharded. Once two
    counts from 2 up are planned (one GPU, whose rank shards nothing, is off that line), the search predicts
    where the line through the two nearest the answer meets ``capacity`` (:func:`_predicted`) and plans that count;
    one that fits is confirmed by planning the count below it. Where no prediction can be made, or the last one was
    off (its count did not fit, or the count below fitted too), the next count is the plain search's: counts double
    until one fits, then the gap is bisected. Every count planned lies strictly between the largest count known not
    to fit and the smallest known to fit, so the answer is the one the plain search gives. Where the peak is
    ``a + b/n`` it takes at most five plans (1, 2, 4, the predicted count and the one below it; seven where rounding
    puts the prediction one count off), where the plain search takes up to twice log2 of the count."""
    plans: dict[int, MemoryPlan] = {}
    failing, fitting = 0, None  # the largest count planned that does not fit, the smallest that does
    confirming, trusted = False, True
    while fitting is None or fitting - failing > 1:
        if fitting is None and failing == limit:
            return None, plans[limit]
        if confirming:
            guess = fitting - 1
        else:
            guess = _predicted(plans, capacity, failing, fitting) if trusted else None
        guessed = guess is not None
        if guessed:  # between the counts known, beyond ``limit`` at ``limit``
            count = min(max(guess, failing + 1), limit if fitting is None else fitting - 1)
        elif fitting is None:
            count = min(2 * failing or 1, limit)
        else:
            count = (failing + fitting) // 2
        plans[count] = plan_at(count)
        fits = plans[count].fits(capacity)
        if fits:
            fitting = count
        else:
            failing = count
        # a predicted count that fits is confirmed next; one that does not, or a confirmation that fits, was off
        trusted = not guessed or (fits and not confirming)
        confirming = guessed and fits and not confirming
    return fitting, plans[fitting]


def _predicted(plans: dict[int, MemoryPlan], capacity: int, failing: int, fitting: int | None) -> int | float | None:
    """The smallest count from which the line ``a + b/n`` through two planned peaks is at most ``capacity``: through
    the largest count that does not fit and the smallest that does, or, before one fits, the two largest that do not
    (``math.inf`` where the line never comes down to ``capacity``). ``None`` without two such counts from 2 up."""
    if fitting is not None and failing >= 2:
        counts = [failing, fitting]
    else:
        counts = sorted(count for count in plans if 2 <= count <= failing)[-2:]
        if len(counts) < 2:
            return None
    (n1, p1), (n2, p2) = ((count, plans[count].peak_bytes) for count in counts)  # n1 < n2
    b = Fraction(p1 - p2) / (Fraction(1, n1) - Fraction(1, n2))
    a = p1 - b / n1
    if b <= 0 or capacity <= a:
        return math.inf  # the line does not come down to capacity as the count grows
    return math.ceil(b / (capacity - a))


def fewest_gpus(
    setup: TrainingSetup,
    device: str,
    capacity: int,
    strategies: Iterable[str] | None = None,
    limit: int = GPU_LIMIT,
    host_memory_apart: bool = False,
) -> list[GpuCount]:
    """For each of ``strategies`` (default: every one of :data:`hf_paged.sharding.STRATEGIES`), the fewest GPUs of
    ``capacity`` bytes on which every rank of ``setup`` fits: one count with the paged optimizer's state all on the
    device (``device_budget`` removed), one with paging, whose device budget is one page while searching and then
    the largest that fits at the count found. Each count is planned as ``accelerate launch`` runs it
    (:attr:`TrainingSetup.wrapping_strategy`): one process of DDP is not wrapped, one of FSDP2 or ZeRO is. DDP's rank
    holds the same at any count, so two GPUs answer for all. ``host_memory_apart``: see :func:`hf_paged.planner.plan`."""
    from ..sharding import STRATEGIES, strategy_named

    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(f"limit must be an integer >= 1, got {limit!r}")
    names = list(STRATEGIES) if strategies is None else [strategy_named(name).name for name in strategies]
    page_size = _page_size(setup) if _paged(setup) else None
    counts = []
    for name in names:
        strategy = STRATEGIES[name]

        plans: dict[tuple[int, int | None], MemoryPlan] = {}

        def at(count: int, budget: int | None, strategy=strategy, plans=plans) -> MemoryPlan:
            if (count, budget) not in plans:
                changed = _with_budget(setup, budget) if page_size is not None else setup
                changed = changed.with_changes(world_size=count, strategy=strategy.name)
                plans[count, budget] = plan_setup(changed, device, host_memory_apart)
            return plans[count, budget]

        most = min(limit, 2) if strategy.engine == "ddp" else limit
        try:
            counts.append(_count(name, strategy, at, capacity, most, page_size, setup, device, host_memory_apart))
        except ConfigError as error:  # e.g. QLoRA's 4-bit layers under FSDP2 read values
            counts.append(GpuCount(name, None, None, paging="-", error=str(error)))
    return counts


def _count(
    name: str,
    strategy: Strategy,
    at: Callable[[int, int | None], MemoryPlan],
    capacity: int,
    most: int,
    page_size: int | None,
    setup: TrainingSetup,
    device: str,
    host_memory_apart: bool,
) -> GpuCount:
    """One strategy's :class:`GpuCount` (see :func:`fewest_gpus`); ``at(count, budget)`` plans a count."""
    gpus, planned = _fewest(lambda count: at(count, None), capacity, most)
    count = GpuCount(name, gpus, planned)
    if page_size is None:
        count.paging = f"{setup.optimizer_name} is not paged"
    elif not strategy.budget_applies:
        count.paging = "the optimizer state is in host memory"
    else:
        # one page of state on the device lowers every peak: paging needs at most the count without it
        paged_most = most if gpus is None else gpus
        count.paged_gpus, count.paged_plan = _fewest(lambda count: at(count, page_size), capacity, paged_most)
        if count.paged_gpus is not None:
            at_count = _with_budget(setup, None).with_changes(world_size=count.paged_gpus, strategy=name)
            unlimited = planned if count.paged_gpus == gpus else plan_setup(at_count, device, host_memory_apart)
            count.budget, count.paged_plan = _largest_budget(at_count, unlimited, capacity, device, host_memory_apart)
            if not count.budget:  # one page fits, as searched, where the peaks without paging leave less room
                count.budget, count.paged_plan = page_size, at(count.paged_gpus, page_size)
    return count


def format_fewest_gpus(setup: TrainingSetup, device: str, capacity: int, counts: list[GpuCount]) -> str:
    """:func:`fewest_gpus`'s answer as a table: per strategy the count without and with paging, and the budget and
    page size that get there, or what the largest count tried lacks."""
    from ..sizes import format_size

    lines = [
        f"hf-paged plan --fewest-gpus: {setup.config.model.name}, {setup.describe()}, GPUs of {format_size(capacity)}",
        "",
        f"  {'strategy':<16}{'without paging':>20}{'with paging':>20}  device budget per GPU (page size)",
    ]

    def shown(gpus: int | None, planned: MemoryPlan | None) -> str:
        if gpus is not None:
            return str(gpus)
        return "none" if planned is None else f"none (+{format_size(planned.peak_bytes - capacity)})"

    page_size = _page_size(setup) if _paged(setup) else None
    for count in counts:
        if count.error is not None:
            lines.append(f"  {count.strategy:<16}{'cannot plan':>20}{'-':>20}  (see below)")
            continue
        if count.paging is not None:
            paged, budget = "-", f"({count.paging})"
        else:
            paged = shown(count.paged_gpus, count.paged_plan)
            budget = "" if count.budget is None else f"{format_size(count.budget)} ({format_size(page_size)})"
            if (
                count.paged_gpus is not None
                and count.paged_plan is not None
                and count.budget == (count.paged_plan.paged_state_bytes)
            ):
                budget = f"no limit needed ({format_size(page_size)} pages)"
        lines.append(f"  {count.strategy:<16}{shown(count.gpus, count.plan):>20}{paged:>20}  {budget}")
    for count in counts:
        if count.error is not None:
            lines.append(f"{count.strategy}: {count.error}")
    lacking = [count for count in counts if count.plan is not None and count.gpus is None and count.paged_gpus is None]
    for count in lacking:
        at = count.paged_plan or count.plan
        lines.append(
            f"{count.strategy}: no count fits; on {at.world_size} GPU(s) a rank's peak is "
            f"{format_size(at.peak_bytes)}, {format_size(at.peak_bytes - capacity)} more than a GPU has"
        )
    if any(
        count.error is None and (count.gpus is None or (count.paging is None and count.paged_gpus is None))
        for count in counts
    ):
        lines.append(
            "(none (+X): at the largest count tried a rank needs X more; ddp's rank holds the same at any count)"
        )
    return "\n".join(lines)


def format_report(outcome: PlanReport) -> str:
    """The report as a table a person reads in ten seconds, then the verdict."""
    from ..sizes import format_size

    result = outcome.plan
    forward_backward, step = result.peak("forward_backward"), result.peak("optimizer_step")
    lines = [
        f"hf-paged plan: {outcome.setup.config.model.name}, {outcome.setup.describe()}, on {outcome.device}",
        f"  {result.trainable_params:,} trainable of {result.total_params:,} parameters (as stored)",
        "",
        f"  {'memory by kind':<28}{'forward+backward':>18}{'optimizer step':>18}",
        "  (what the device holds at each phase's peak)",
    ]
    for kind, label in KIND_LABELS.items():
        if forward_backward.by_kind[kind] or step.by_kind[kind]:
            lines.append(
                f"  {label:<28}{format_size(forward_backward.by_kind[kind]):>18}{format_size(step.by_kind[kind]):>18}"
            )
    lines.append(f"  {'peak':<28}{format_size(forward_backward.peak_bytes):>18}{format_size(step.peak_bytes):>18}")
    lines += [f"  ({note})" for note in result.notes]
    everything = format_size(result.optimizer_state_bytes)
    if result.paged_state_bytes is not None and result.optimizer_state_bytes > step.by_kind["optimizer_state"]:
        lines.append(
            f"  (optimizer state on device: pages device_budget keeps there or updates, and step counts; all of it: "
            f"{everything})"
        )
    elif (
        result.paged_state_bytes is not None
        and torch.device(outcome.device).type == "cpu"
        and result.optimizer_state_bytes < step.by_kind["optimizer_state"]
    ):
        lines.append(
            f"  (optimizer state on device, the host here: all of it, {everything}, and copies of the pages "
            "device_budget keeps)"
        )
    if outcome.optimizer_states is not None:
        lines.append(
            "  all the optimizer state by optimizer, on the device or in host memory (the chosen optim_args "
            "but device_budget):"
        )
        for name, nbytes in outcome.optimizer_states.items():
            chosen = "  <- chosen" if name == outcome.setup.optimizer_name else ""
            lines.append(f"    {name:<26}{format_size(nbytes):>18}{chosen}")
    lines.append("")
    if outcome.capacity is None:
        lines.append(f"verdict: peak {format_size(result.peak_bytes)}; give --device-memory (e.g. 24GiB) for a verdict")
    else:
        verdict = "fits" if outcome.fits else "does not fit"
        lines.append(
            f"verdict: {verdict} in {format_size(outcome.capacity)} "
            f"(peak {format_size(result.peak_bytes)}, {100 * result.peak_bytes / outcome.capacity:.0f}% of it)"
        )
    if outcome.largest_budget is not None:
        budget, budgeted = outcome.largest_budget
        if budget and budget == result.paged_state_bytes:
            lines.append(
                f"largest device budget that fits: no limit needed (all pages fit: {format_size(budget)}, "
                "step counts aside)"
            )
        elif budget:
            lines.append(
                f"largest device budget that fits: {format_size(budget)} "
                f"(re-planned peak {format_size(budgeted.peak_bytes)}; optim_args device_budget={budget})"
            )
        else:
            without_state = max(item.peak_bytes - item.by_kind["optimizer_state"] for item in result.phases)
            lines.append(
                f"largest device budget that fits: none (without any optimizer state the peak is still "
                f"{format_size(without_state)})"
            )
    if outcome.alternatives:
        lines.append("alternatives (one change each, re-planned):")
        for alternative in outcome.alternatives:
            if alternative.plan is None:
                lines.append(f"  {alternative.change:<44} cannot plan: {alternative.error}")
                continue
            fits = alternative.plan.fits(outcome.capacity) if outcome.capacity is not None else None
            lines.append(
                f"  {alternative.change:<44} peak {format_size(alternative.plan.peak_bytes):>10}  "
                f"{'fits' if fits else 'does not fit'}"
            )
    lines.append(f"planned in {outcome.seconds:.1f} s")
    return "\n".join(lines)
