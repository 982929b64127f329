"""QLoRA in one call: a causal LM with frozen 4-bit base weights and trainable LoRA adapters.

:func:`prepare_qlora` loads a model in 4 bits (or quantizes a loaded one in place), prepares it for k-bit
training with peft and attaches LoRA adapters; the result goes straight into ``transformers.Trainer`` or
TRL's ``SFTTrainer``, e.g. with ``optim="hf_paged_adamw_8bit"``. :func:`qlora_report` counts what it made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Collection, Iterator
from numbers import Real
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel
from transformers.pytorch_utils import Conv1D
from transformers.quantizers import AutoHfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module

logger = logging.getLogger(__name__)

QUANT_TYPES = ("nf4", "fp4")
"""The 4-bit data types of bitsandbytes: NormalFloat4 (QLoRA's) and a 4-bit float."""

COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
"""Names accepted for ``compute_dtype`` besides ``"auto"`` (the dtypes themselves are accepted too)."""

QUANT_STORAGES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}
"""Names accepted for ``quant_storage``, the dtype the packed 4-bit codes are stored in (the dtypes are accepted
too): the ones ``BitsAndBytesConfig(bnb_4bit_quant_storage=...)`` takes."""

_PLACEMENT_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant activation (gradient) checkpointing of ``model``'s layers, through the API the installed
    transformers has: ``activation_checkpointing_enable`` (transformers 5), else ``gradient_checkpointing_enable``."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


@contextlib.contextmanager
def quiet_peft_checkpointing_check() -> Iterator[None]:
    """Keep out transformers' deprecation warning for ``is_gradient_checkpointing``, which peft reads when it wraps
    a model: the call is peft's to update, not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def _bitsandbytes() -> Any:
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError("4-bit QLoRA weights need bitsandbytes: pip install bitsandbytes") from error
    return bitsandbytes


def _check_hyperparameters(
    r: Any, lora_alpha: Any, lora_dropout: Any, quant_type: Any, double_quant: Any, gradient_checkpointing: Any
) -> None:
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"r (the LoRA rank) must be a positive int, got {r!r}")
    if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, Real) or not lora_alpha > 0:
        raise ValueError(f"lora_alpha must be a positive number, got {lora_alpha!r}")
    if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, Real) or not 0 <= lora_dropout < 1:
        raise ValueError(f"lora_dropout must be a probability in [0, 1), got {lora_dropout!r}")
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type must be one of {', '.join(map(repr, QUANT_TYPES))}, got {quant_type!r}")
    for name, value in (("double_quant", double_quant), ("gradient_checkpointing", gradient_checkpointing)):
        if value is not True and value is not False:
            raise ValueError(f"{name} must be True or False, got {value!r}")


def _parse_compute_dtype(compute_dtype: Any) -> torch.dtype | None:
    """The requested compute dtype, or ``None`` for ``"auto"``."""
    if compute_dtype == "auto":
        return None
    return _named_dtype(compute_dtype, COMPUTE_DTYPES, "compute_dtype", also=("auto",))


def _parse_quant_storage(quant_storage: Any) -> torch.dtype:
    """The requested storage dtype of the packed 4-bit codes."""
    return _named_dtype(quant_storage, QUANT_STORAGES, "quant_storage")


def _named_dtype(value: Any, names: dict[str, torch.dtype], argument: str, also: tuple[str, ...] = ()) -> torch.dtype:
    """``value``, one of the dtypes of ``names`` or its name; anything else is a ValueError naming ``argument`` and
    the names allowed (``also``: those the caller takes besides)."""
    if isinstance(value, torch.dtype) and value in names.values():
        return value
    if isinstance(value, str) and value in names:
        return names[value]
    allowed = ", ".join(map(repr, (*also, *names)))
    raise ValueError(f"{argument} must be one of {allowed} or the torch dtype of one, got {value!r}")


def _auto_compute_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on a CUDA device that supports it, else float32."""
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def _load_device(device_map: Any) -> torch.device:
    """Where ``from_pretrained(..., device_map=device_map)`` puts a 4-bit model (its default: CUDA if present)."""
    if device_map is None or isinstance(device_map, dict) or device_map in _PLACEMENT_STRATEGIES:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device_map)


def _is_quantized(model: nn.Module) -> bool:
    return (
        getattr(model, "hf_quantizer", None) is not None
        or getattr(model, "is_loaded_in_4bit", False)
        or getattr(model, "is_loaded_in_8bit", False)
    )


def _check_causal_lm(model: PreTrainedModel) -> None:
    """Raise TypeError, before anything changes ``model``, where it is not a causal LM: peft's causal LM adapters call
    its ``prepare_inputs_for_generation``, which a base model (no output head) or a classifier lacks."""
    if not callable(getattr(model, "prepare_inputs_for_generation", None)):
        raise TypeError(
            f"model_or_path: {type(model).__name__} is not a causal language model (it has no "
            "prepare_inputs_for_generation): prepare_qlora takes a causal LM, such as one loaded with "
            "AutoModelForCausalLM"
        )


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, (nn.Linear, Conv1D))]


class TargetModulesError(ValueError):
    """``target_modules`` names no module of the model, or is not a target specification."""


def check_target_modules(model: nn.Module, target_modules: Any) -> None:
    """Each requested target matches a module name of ``model`` the way peft matches it; else
    :class:`TargetModulesError` names the targets and the model's linear modules."""
    if isinstance(target_modules, str) and target_modules.lower() == "all-linear":
        return
    if isinstance(target_modules, str):
        targets = [target_modules]
        configs = [LoraConfig(target_modules=target_modules)]
    elif isinstance(target_modules, Collection) and target_modules and all(isinstance(t, str) for t in target_modules):
        targets = sorted(target_modules)
        configs = [LoraConfig(target_modules=[target]) for target in targets]
    else:
        raise TargetModulesError(
            "target_modules must be 'all-linear', a regular expression or a non-empty list of module names, "
            f"got {target_modules!r}"
        )
    names = [name for name, _ in model.named_modules() if name]
    for target, config in zip(targets, configs):
        if not any(check_target_module_exists(config, name) for name in names):
            available = sorted({name.rsplit(".", 1)[-1] for name in _linear_names(model)})
            raise TargetModulesError(
                f"target_modules: {target!r} matches no module of {type(model).__name__}; "
                f"its linear modules are named {', '.join(available[:12]) or '(none)'}"
            )


def _bnb_config(
    quant_type: str, double_quant: bool, compute_dtype: torch.dtype, quant_storage: torch.dtype
) -> BitsAndBytesConfig:
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=quant_storage,
    )


def _linear4bit(module: nn.Module, config: BitsAndBytesConfig, bnb: Any) -> nn.Module:
    """A ``bnb.nn.Linear4bit`` holding ``module``'s weight quantized on the weight's device, and its bias."""
    # Conv1D (GPT-2) stores its weight as (in, out): transposed to nn.Linear's (out, in), as transformers does.
    weight = module.weight.data.T if isinstance(module, Conv1D) else module.weight.data
    out_features, in_features = weight.shape
    with torch.device("meta"):
        layer = bnb.nn.Linear4bit(
            in_features,
            out_features,
            bias=module.bias is not None,
            compute_dtype=config.bnb_4bit_compute_dtype,
            compress_statistics=config.bnb_4bit_use_double_quant,
            quant_type=config.bnb_4bit_quant_type,
            quant_storage=config.bnb_4bit_quant_storage,
        )
    # Params4bit quantizes when it is moved to a device.
    layer.weight = bnb.nn.Params4bit(
        weight,
        requires_grad=False,
        compress_statistics=config.bnb_4bit_use_double_quant,
        quant_type=config.bnb_4bit_quant_type,
        quant_storage=config.bnb_4bit_quant_storage,
        module=layer,
    ).to(weight.device)
    layer.bias = module.bias
    layer.requires_grad_(False)
    return layer


def _quantize_in_place(model: PreTrainedModel, config: BitsAndBytesConfig, bnb: Any) -> None:
    """Replace the linear layers that ``from_pretrained(quantization_config=config)`` would quantize.

    Like transformers, this keeps the output head (``lm_head``), tied weights, the last module and the
    model's ``_keep_in_fp32_modules`` in full precision, and marks the model as transformers marks a
    model it loaded in 4 bits (``hf_quantizer``, ``config.quantization_config``, ``is_loaded_in_4bit``).
    """
    quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
    quantizer.validate_environment()
    skip = quantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    layers = [
        name
        for name, module in model.named_modules()
        if type(module) in (nn.Linear, Conv1D) and should_convert_module(name, skip)
    ]
    if not layers:
        raise ValueError(
            f"model_or_path: {type(model).__name__} has no linear layers to quantize "
            f"(kept in full precision: {', '.join(sorted(skip)) or 'none'})"
        )
    for name in layers:
        model.set_submodule(name, _linear4bit(model.get_submodule(name), config, bnb))
    model.is_quantized = True
    model.quantization_method = config.quant_method
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)


def _param_count(param: torch.Tensor, bnb: Any) -> int:
    """Elements of a parameter; a 4-bit weight counts the elements of the matrix it stands for."""
    if isinstance(param, bnb.nn.Params4bit) and param.quant_state is not None:
        return param.quant_state.shape.numel()
    return param.numel()


def _quantized_bytes(weight: Any) -> int:
    """Bytes of a 4-bit weight: packed codes, absmax and code book (and with double quantization the
    8-bit absmax's own fp32 absmax, code book and offset)."""
    state = weight.quant_state
    tensors = [weight.data, state.absmax, state.code]
    if state.nested:
        tensors += [state.state2.absmax, state.state2.code, state.offset]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def qlora_report(model: nn.Module) -> dict[str, int]:
    """Parameter and 4-bit weight counts of a (QLoRA) model.

    Returns ``trainable_params`` and ``total_params`` (elements; a 4-bit weight counts as the matrix it
    stands for), ``quantized_bytes`` (bytes held by the 4-bit weights with their quantization state) and
    ``quantized_modules`` (number of ``bitsandbytes.nn.Linear4bit`` layers).
    """
    bnb = _bitsandbytes()
    params = list(model.parameters())
    layers = [module for module in model.modules() if isinstance(module, bnb.nn.Linear4bit)]
    return {
        "trainable_params": sum(_param_count(p, bnb) for p in params if p.requires_grad),
        "total_params": sum(_param_count(p, bnb) for p in params),
        "quantized_bytes": sum(
            _quantized_bytes(layer.weight) for layer in layers if layer.weight.quant_state is not None
        ),
        "quantized_modules": len(layers),
    }


def _describe(report: dict[str, int]) -> str:
    share = 100 * report["trainable_params"] / max(report["total_params"], 1)
    return (
        f"QLoRA: {report['trainable_params']:,} trainable of {report['total_params']:,} parameters ({share:.2f}%); "
        f"{report['quantized_modules']} 4-bit linear layers in {report['quantized_bytes'] / 2**20:.2f} MiB"
    )


def prepare_qlora(
    model_or_path: str | os.PathLike | PreTrainedModel,
    *,
    r: int = 16,
    lora_alpha: float = 32,
    lora_dropout: float = 0.05,
    target_modules: str | Collection[str] = "all-linear",
    quant_type: str = "nf4",
    double_quant: bool = True,
    compute_dtype: str | torch.dtype = "auto",
    quant_storage: str | torch.dtype = torch.uint8,
    gradient_checkpointing: bool = True,
    **load_kwargs: Any,
) -> PeftModel:
    """A causal LM with frozen 4-bit base weights and LoRA adapters, ready for the Trainer.

    ``model_or_path`` is a hub name or local path, loaded with ``AutoModelForCausalLM.from_pretrained``
    in 4 bits (``load_kwargs`` go to it), or a loaded ``PreTrainedModel``. A model not yet quantized is
    quantized in place, on the device its weights are on, with the same layer choice as loading: every
    ``nn.Linear`` (and GPT-2's ``Conv1D``) except the output head and tied weights becomes a
    ``bitsandbytes.nn.Linear4bit``. A quantized model is used as it is.

    ``quant_type`` is ``"nf4"`` or ``"fp4"``; ``double_quant`` also quantizes the absmax scales (QLoRA's
    double quantization). ``compute_dtype`` is the dtype of the 4-bit matmuls: ``"auto"`` (bfloat16 on a
    CUDA device that supports it, float32 elsewhere), ``"bfloat16"``, ``"float16"``, ``"float32"`` or
    the torch dtype. ``quant_storage`` is the dtype the packed codes are stored in (two codes a byte, viewed as
    that dtype): ``torch.uint8`` by default; a floating-point one (``"bfloat16"``, the weights' dtype) lets
    FSDP and DeepSpeed ZeRO-3 shard the 4-bit weights with the other parameters of their dtype, where they
    would keep uint8 ones whole. Then peft's ``prepare_model_for_kbit_training`` runs (with non-reentrant gradient
    checkpointing when ``gradient_checkpointing``; ``False`` leaves a model's own checkpointing as it is, as peft and
    the Trainer do) and LoRA adapters of rank ``r`` are attached to
    ``target_modules`` (``"all-linear"``, a regular expression or module names, matched as peft does).

    The :func:`qlora_report` of the result is logged (logger ``hf_paged.qlora``, INFO) and kept as the
    attribute ``hf_paged_qlora_report`` of the returned peft model.
    """
    _check_hyperparameters(r, lora_alpha, lora_dropout, quant_type, double_quant, gradient_checkpointing)
    requested_dtype = _parse_compute_dtype(compute_dtype)
    storage = _parse_quant_storage(quant_storage)
    if "quantization_config" in load_kwargs:
        raise TypeError(
            "prepare_qlora builds the quantization_config itself: pass quant_type, double_quant, "
            "compute_dtype and quant_storage instead"
        )
    bnb = _bitsandbytes()
    if isinstance(model_or_path, (str, os.PathLike)):
        device = _load_device(load_kwargs.get("device_map"))
        config = _bnb_config(quant_type, double_quant, requested_dtype or _auto_compute_dtype(device), storage)
        model = AutoModelForCausalLM.from_pretrained(model_or_path, quantization_config=config, **load_kwargs)
        check_target_modules(model, target_modules)
    elif isinstance(model_or_path, PreTrainedModel):
        model = model_or_path
        if load_kwargs:
            raise TypeError(
                f"prepare_qlora got {', '.join(load_kwargs)}, which it passes to from_pretrained only when it loads "
                "model_or_path from a hub name or a path; with a loaded model they would do nothing"
            )
        _check_causal_lm(model)
        check_target_modules(model, target_modules)
        if not _is_quantized(model):
            device = next(model.parameters()).device
            config = _bnb_config(quant_type, double_quant, requested_dtype or _auto_compute_dtype(device), storage)
            _quantize_in_place(model, config, bnb)
    else:
        raise TypeError(
            "model_or_path must be a hub name or local path (str or os.PathLike) or a transformers "
            f"PreTrainedModel, got {type(model_or_path).__name__}"
        )
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)  # what peft would enable, through transformers' current API
    lora = LoraConfig(
        r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=target_modules, task_type="CAUSAL_LM"
    )
    with quiet_peft_checkpointing_check():
        peft_model = get_peft_model(model, lora)
    report = qlora_report(peft_model)
    logger.info(_describe(report))
    peft_model.hf_paged_qlora_report = report
    return peft_model
