"""``hf-paged train``: a LoRA or QLoRA fine-tune from a :class:`~hf_paged.cli.config.Config`, with the memory callback.

:func:`run` builds the tokenizer, the tokenized data, the model with its adapters and the
``TrainingArguments``, trains with the Trainer (and its progress bar), saves the adapter, the trainer
state, the resolved config and ``summary.json`` into the output directory, and returns the summary.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from .. import register
from ..sizes import format_size
from . import quiet
from .config import Config, ConfigError, DataConfig, check_tiny_model, default_config, to_dict
from .config import LoraConfig as LoraSettings
from .tokenizer import byte_tokenizer

if TYPE_CHECKING:
    from ..planner import MemoryPlan

logger = logging.getLogger(__name__)

SHIPPED_DATA = Path(__file__).resolve().parent.parent / "data" / "instructions.jsonl"
"""The instruction/response pairs trained on by default (written by ``scripts/make_instructions.py``)."""

IGNORE_INDEX = -100
"""Label of the tokens that carry no loss (prompt and padding)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}


_RANK_VARIABLES = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
_LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")
_WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def _launch_value(names: tuple[str, ...], default: int) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def launched_processes() -> int:
    """How many processes the launcher started (``accelerate launch``, ``torchrun``, MPI); 1 without one."""
    return _launch_value(_WORLD_SIZE_VARIABLES, 1)


def is_main_process() -> bool:
    """Whether this process is the launch's first (rank 0), the one that prints for all; true without a launcher."""
    return _launch_value(_RANK_VARIABLES, 0) == 0


def is_first_on_machine() -> bool:
    """Whether this process is the first of its machine (local rank 0); true without a launcher."""
    return _launch_value(_LOCAL_RANK_VARIABLES, 0) == 0


def _progress(message: str) -> None:
    if is_main_process():
        print(f"hf-paged: {message}", flush=True)


def build_tokenizer(config: Config) -> Any:
    """The configured tokenizer, with a padding token (the EOS token if it has none)."""
    name = config.tokenizer.name
    if name is None:
        name = "byte" if config.model.name == "tiny" else config.model.name
    if name == "byte":
        tokenizer = byte_tokenizer(model_max_length=config.tokenizer.max_length)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=config.model.trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"tokenizer.name: {name!r} has neither a padding nor an EOS token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_records(data: DataConfig) -> Any:
    """The configured examples as a ``datasets.Dataset`` (a local file, a local dataset or a ``datasets`` name)."""
    from datasets import load_dataset
    from datasets.data_files import EmptyDatasetError
    from datasets.exceptions import DatasetGenerationError

    path = Path(data.path) if data.path is not None else SHIPPED_DATA
    if path.is_file():
        builder = _LOCAL_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ConfigError(
                f"data.path: {str(path)!r} has suffix {path.suffix!r}; local files must be one of "
                f"{', '.join(sorted(_LOCAL_BUILDERS))}"
            )
        arguments: tuple[Any, ...] = (builder,)
        options: dict[str, Any] = {"data_files": {"train": str(path)}}
    elif path.suffix.lower() in _LOCAL_BUILDERS:
        raise ConfigError(f"data.path: no such file: {str(path)!r}")
    else:
        arguments, options = (str(data.path), data.name), {}
    try:
        records = load_dataset(*arguments, split=data.split, **options)
    except ValueError as error:
        key = "data.split" if "split" in str(error).lower() else "data.path"
        raise ConfigError(f"{key}: cannot load {str(path)!r} (split {data.split!r}): {error}") from None
    except (OSError, StopIteration, DatasetGenerationError, EmptyDatasetError) as error:
        reason = str(error) or "it holds no records"
        raise ConfigError(f"data.path: cannot load {str(path)!r}: {type(error).__name__}: {reason}") from None
    if data.max_samples is not None:
        records = records.select(range(min(data.max_samples, len(records))))
    return records


def _text_field(data: DataConfig) -> str | None:
    if data.text_field is None and data.path is not None and Path(data.path).suffix.lower() == ".txt":
        return "text"
    return data.text_field


def _check_columns(columns: list[str], wanted: dict[str, str]) -> None:
    for key, column in wanted.items():
        if column not in columns:
            hint = "" if key == "data.text_field" else "; set data.text_field to train on plain text"
            raise ConfigError(f"{key}: the data has no column {column!r} (its columns: {', '.join(columns)}){hint}")


def tokenize(records: Any, config: Config, tokenizer: Any) -> Any:
    """``input_ids`` and ``labels`` of every example, at most ``tokenizer.max_length`` tokens; the prompt's
    labels are ``-100`` unless ``prompt.train_on_prompt``. Examples left without a labelled token are dropped."""
    data, prompt, max_length = config.data, config.prompt, config.tokenizer.max_length
    text_field = _text_field(data)
    if text_field is not None:
        _check_columns(records.column_names, {"data.text_field": text_field})
    else:
        _check_columns(
            records.column_names,
            {"data.instruction_field": data.instruction_field, "data.response_field": data.response_field},
        )
    before, after = prompt.template.split("{response}", 1)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def field(example: dict[str, Any], index: int, key: str, column: str) -> str:
        value = example[column]
        if value is None:  # a record without the column, an empty CSV cell: datasets gives None
            raise ConfigError(
                f"{key}: example {index} of the data has no {column!r} (missing or null); fill it in or drop the "
                "example"
            )
        return str(value)

    def encode(example: dict[str, Any], index: int) -> dict[str, list[int]]:
        if text_field is not None:
            ids = tokenizer(field(example, index, "data.text_field", text_field))["input_ids"] + eos
            labels = list(ids)
        else:
            instruction = field(example, index, "data.instruction_field", data.instruction_field)
            response = field(example, index, "data.response_field", data.response_field)
            head = tokenizer(before.replace("{instruction}", instruction))["input_ids"]
            tail = tokenizer(response + after, add_special_tokens=False)["input_ids"] + eos
            ids = head + tail
            labels = (list(head) if prompt.train_on_prompt else [IGNORE_INDEX] * len(head)) + tail
        return {"input_ids": ids[:max_length], "labels": labels[:max_length]}

    tokenized = records.map(encode, with_indices=True, remove_columns=records.column_names, desc="tokenizing")
    kept = tokenized.filter(
        lambda example: any(label != IGNORE_INDEX for label in example["labels"]),
        desc="keeping examples with a labelled token",
    )
    if len(kept) < len(tokenized) and is_main_process():
        logger.warning(
            "hf-paged: dropped %d of %d examples whose response lies beyond tokenizer.max_length=%d",
            len(tokenized) - len(kept),
            len(tokenized),
            max_length,
        )
    if len(kept) == 0:
        raise ConfigError("data: no example is left to train on (is tokenizer.max_length too short?)")
    return kept


def training_data(config: Config, tokenizer: Any, args: Any) -> Any:
    """The tokenized training examples. Under several processes the first process of each machine loads and
    tokenizes them while the others wait, then the others read the ``datasets`` cache it wrote: the work is done
    once per machine, and its progress bars are the first process's."""
    with args.main_process_first(desc="loading and tokenizing the data"):
        return tokenize(load_records(config.data), config, tokenizer)


def build_model(config: Config, tokenizer: Any, device: torch.device) -> Any:
    """The base model with LoRA adapters (4-bit base weights when ``lora.quantize``), on ``device``. Targets that
    match no module of the model are a :class:`ConfigError` naming ``lora.target_modules``; adapters peft refuses
    (those of a mixture of experts' 3D weights with ``lora_dropout``: one naming ``lora.lora_dropout``) or a model that
    4-bit preparation refuses (one without a linear layer to quantize, one that is not a causal LM) are one naming
    ``lora`` (:func:`setup_error`).
    An error loading a model for LoRA is raised as it is."""
    from ..qlora import TargetModulesError

    base = _base_model(config, tokenizer, device)
    try:
        return _with_adapters(config, base, device)
    except TargetModulesError as error:
        raise ConfigError(f"lora.{error}") from None
    except ConfigError:
        raise
    except ValueError as error:
        raise setup_error("qlora" if config.lora.quantize else "lora", config.model.name, error) from None


def setup_error(method: str, model_name: str, error: ValueError) -> ConfigError:
    """The :class:`ConfigError` for ``error``, raised by peft or the quantization while ``method`` (``full``, ``lora``
    or ``qlora``) set up ``model_name``: it names ``model.name`` for a full fine-tune, ``lora.lora_dropout`` where
    peft refuses dropout (the adapters of weights it targets as parameters, such as a mixture of experts' 3D expert
    weights, which LoRA, and QLoRA from peft 0.22, adapt), else ``lora``."""
    if method == "full":
        return ConfigError(f"model.name: full of {model_name!r} cannot be set up: {error}")
    if "lora_dropout" in str(error):
        return ConfigError(
            f"lora.lora_dropout: {method} of {model_name!r} cannot be set up with dropout: peft adapts some of its "
            f"weights as parameters (a mixture of experts' 3D expert weights), whose inputs it cannot drop out "
            f"({error}); set lora.lora_dropout=0"
        )
    return ConfigError(f"lora: {method} of {model_name!r} cannot be set up: {error}")


def _base_model(config: Config, tokenizer: Any, device: torch.device) -> Any | None:
    """The model before adapters: the tiny one on ``device``, or one loaded from the Hub for LoRA; ``None`` for a
    QLoRA of a Hub model, which :func:`~hf_paged.qlora.prepare_qlora` loads quantized."""
    model_config = config.model
    dtype = _DTYPES.get(model_config.dtype, "auto")
    if model_config.name == "tiny":
        model = tiny_model(config, tokenizer).to(device)
        return model if dtype == "auto" else model.to(dtype)
    if config.lora.quantize:
        return None
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            model_config.name, dtype=dtype, trust_remote_code=model_config.trust_remote_code
        )
    except ValueError as error:  # such as a model that is not a causal LM
        reason = str(error).splitlines()[0]  # transformers' first line; the next lists every causal LM class
        raise ConfigError(f"model.name: {model_config.name!r} cannot be loaded as a causal LM: {reason}") from None


def _with_adapters(config: Config, base: Any | None, device: torch.device) -> Any:
    """``base`` (see :func:`_base_model`) with 4-bit weights when ``lora.quantize``, and LoRA adapters."""
    from ..qlora import enable_activation_checkpointing, prepare_qlora

    model_config, lora = config.model, config.lora
    if lora.quantize:
        qlora = {
            "r": lora.r,
            "lora_alpha": lora.lora_alpha,
            "lora_dropout": lora.lora_dropout,
            "target_modules": lora.target_modules,
            "quant_type": lora.quant_type,
            "double_quant": lora.double_quant,
            "compute_dtype": lora.compute_dtype,
            "quant_storage": lora.quant_storage,
            "gradient_checkpointing": lora.gradient_checkpointing,
        }
        if base is not None:
            return prepare_qlora(base, **qlora)
        return prepare_qlora(
            model_config.name,
            dtype=_DTYPES.get(model_config.dtype, "auto"),
            device_map=str(device),
            trust_remote_code=model_config.trust_remote_code,
            **qlora,
        )
    if lora.gradient_checkpointing:
        enable_activation_checkpointing(base)
        base.enable_input_require_grads()
    return add_lora_adapters(base, lora)


def add_lora_adapters(model: Any, lora: LoraSettings) -> Any:
    """``model`` wrapped by peft with the LoRA adapters ``lora`` (``config.lora``) describes, for causal LM."""
    from peft import LoraConfig, get_peft_model

    from ..qlora import check_target_modules, quiet_peft_checkpointing_check

    check_target_modules(model, lora.target_modules)

    adapters = LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    with quiet_peft_checkpointing_check():
        return get_peft_model(model, adapters)


def tiny_model(config: Config, tokenizer: Any) -> Any:
    """The embedded Llama-architecture model, random weights from ``model.tiny.seed``, sized to the tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = config.model.tiny
    check_tiny_model(tiny)
    architecture = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        initializer_range=tiny.initializer_range,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        return LlamaForCausalLM(architecture)


def training_arguments(config: Config) -> Any:
    """``TrainingArguments`` from ``config.training`` (the hf-paged optimizer names are registered first).

    Launched as several processes on a machine without an accelerator, the processes train with DDP on the
    CPU (gloo): ``use_cpu`` is set, without which each process would train alone on all the data.
    ``ddp_find_unused_parameters`` is ``False`` unless set: the adapters are all used at every step (a LoRA of
    experts that a step may not route to needs ``true``)."""
    register()
    from transformers import TrainingArguments

    settings = dict(config.training)
    accelerator = _accelerator_available()
    if "dataloader_pin_memory" not in settings:
        settings["dataloader_pin_memory"] = accelerator  # pinned batches need an accelerator
    # every trained parameter is a LoRA adapter of a module each forward pass runs: DDP need not search the graph
    settings.setdefault("ddp_find_unused_parameters", False)
    if not accelerator and launched_processes() > 1:
        settings["use_cpu"] = True  # accelerate makes a CPU process group of the launch only when told use_cpu
    try:
        return TrainingArguments(**settings)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"training: TrainingArguments rejects these settings: {error}") from None


def training_device(config: Config) -> str:
    """The type of the device the Trainer of ``config`` trains on (``TrainingArguments.device``'s), found without
    making the arguments (which start a launch's process group): the CPU with ``training.use_cpu`` or without an
    accelerator, else the accelerator."""
    if config.training.get("use_cpu") or not _accelerator_available():
        return "cpu"
    accelerator = getattr(torch, "accelerator", None)
    return accelerator.current_accelerator().type if accelerator is not None else "cuda"


def resume_checkpoint(path: str | None) -> str | None:
    """``training.resume_from_checkpoint``, the checkpoint folder (``checkpoint-N``, written by a run with
    ``save_strategy`` steps or epoch) that ``Trainer.train`` resumes from, checked before anything loads: transformers
    leaves this field to the script, and ``hf-paged train`` is that script."""
    if path is None:
        return None
    folder = Path(path)
    if not (folder / "trainer_state.json").is_file():
        found = "a folder without trainer_state.json" if folder.is_dir() else "no such folder"
        raise ConfigError(
            f"training.resume_from_checkpoint: {path!r} is {found}; give a checkpoint-N folder that a run saved"
        )
    return str(folder)


def _accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)  # torch 2.6 and later
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def memory_callback(config: Config, plan: MemoryPlan | None = None) -> Any | None:
    """The :class:`~hf_paged.callbacks.MemorySpikeCallback` of ``config.memory``, ``None`` if disabled; with the
    ``plan`` of the run, which it compares with the measured peaks and hands to an automatic budget."""
    if not config.memory.enabled:
        return None
    from hf_paged.callbacks import MemorySpikeCallback

    arguments = {
        key: value for key, value in vars(config.memory).items() if key not in ("enabled", "simulate_spike_at")
    }
    return MemorySpikeCallback(**arguments, plan=plan)


def _paging(trainer: Any) -> dict[str, Any]:
    """The optimizer's pages and what moved in the run (bytes, seconds); ``None`` values if it is not paged."""
    from ..recovery import paged_optimizer_of

    keys = ("pages_total", "page_size", "device_budget", "bytes_to_device", "bytes_to_host", "page_ins", "page_outs")
    try:
        stats = paged_optimizer_of(trainer.optimizer).paging_stats()
    except TypeError:
        return {key: None for key in (*keys, "stall_seconds")}
    return {**{key: stats[key] for key in keys}, "stall_seconds": stats["stall_seconds"]}


def _parameter_counts(model: Any) -> tuple[int, int]:
    report = getattr(model, "hf_paged_qlora_report", None)
    if report is not None:
        return report["trainable_params"], report["total_params"]
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def run(config: Config | None = None, plan: MemoryPlan | None = None) -> dict[str, Any]:
    """Fine-tune as ``config`` says (``None``: the embedded default) and return the summary.

    ``plan`` (``hf-paged train --plan``), the memory plan of this run for its device, goes to the memory callback,
    which compares the first steps' peaks with it and hands it to an automatic device budget (``device_budget=auto``:
    the budget then starts from the planned forward/backward peak); without the callback it is not used.

    Launched as several processes, every process trains and returns the summary; the first (rank 0) writes it and
    the other files, and only it prints progress.

    The summary holds the number of processes that trained together, the first and final logged loss, the steps,
    the training and total wall time (seconds), the memory callback's peaks per phase and optimizer device bytes
    (bytes) and spike count, the optimizer's pages and what moved each way (bytes, page-ins and page-outs, stall
    seconds), the out-of-memory recoveries and their steps, and the paths of the output directory, the adapter, the
    memory timeline and its plot (``None`` when not written). It is also written to ``summary.json`` in the output
    directory.
    """
    started = time.perf_counter()
    config = default_config() if config is None else config
    from transformers import DataCollatorForSeq2Seq, Trainer, set_seed

    args = training_arguments(config)
    checkpoint = resume_checkpoint(args.resume_from_checkpoint)
    set_seed(args.seed)  # before the adapters are initialised, so that a seed gives the same run
    if not is_main_process():
        from datasets import disable_progress_bars

        disable_progress_bars()  # rank 0 shows the loading and tokenizing, once for the launch
    output_dir = Path(args.output_dir)
    _progress(f"tokenizer and data ({config.data.path or 'shipped instructions'})")
    tokenizer = build_tokenizer(config)
    dataset = training_data(config, tokenizer, args)
    method = "QLoRA (4-bit base weights)" if config.lora.quantize else "LoRA"
    device = device_name(args.device, args.world_size)
    _progress(f"model {config.model.name!r} with {method} on {device}")
    model = build_model(config, tokenizer, args.device)
    trainable, total = _parameter_counts(model)
    for note in quiet.notes():
        _progress(note)
    _progress(f"{len(dataset)} examples, {trainable:,} trainable of {total:,} parameters; training")
    callback = memory_callback(config, plan)
    callbacks = [callback] if callback is not None else []
    if config.memory.simulate_spike_at is not None:
        from hf_paged.callbacks import SimulatedSpikeCallback

        callbacks.append(SimulatedSpikeCallback(config.memory.simulate_spike_at))
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX),
        processing_class=tokenizer,
        callbacks=callbacks or None,
    )
    if checkpoint is not None:
        _progress(f"resuming from {checkpoint}")
    result = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model()
    trainer.save_state()
    if trainer.is_world_process_zero():
        (output_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False), encoding="utf-8")
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    memory = callback.summary() if callback is not None else {}
    adapter = output_dir / "adapter_model.safetensors"
    summary = {
        "model": config.model.name,
        "method": method,
        "device": device,
        "processes": args.world_size,
        "optimizer": str(getattr(args.optim, "value", args.optim)),
        "trainable_params": trainable,
        "total_params": total,
        "examples": len(dataset),
        "steps": trainer.state.global_step,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "train_loss": result.training_loss,
        "train_seconds": result.metrics.get("train_runtime"),
        "total_seconds": time.perf_counter() - started,
        "forward_backward_peak_bytes": memory.get("forward_backward_peak_bytes"),
        "optimizer_step_peak_bytes": memory.get("optimizer_step_peak_bytes"),
        "optimizer_device_bytes": memory.get("optimizer_device_bytes"),
        "spikes": memory.get("spikes"),
        **_paging(trainer),
        "oom_recoveries": memory.get("oom_recoveries"),
        "oom_recovery_steps": memory.get("oom_recovery_steps"),
        "output_dir": str(output_dir),
        "adapter_path": str(adapter) if adapter.is_file() else None,
        "timeline_path": memory.get("timeline_path"),
        "plot_path": memory.get("plot_path"),
    }
    if trainer.is_world_process_zero():
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def device_name(device: torch.device, processes: int) -> str:
    """Where training runs, as the summary says it: the device's type for the CPU or for several processes (each
    has its own index), else the device (``cuda:0``)."""
    return device.type if device.type == "cpu" or processes > 1 else str(device)


def _size(value: int | None, suffix: str = "") -> str:
    return "not measured" if value is None else format_size(value) + suffix


def _loss_change(first: float, final: float) -> str:
    """How the logged loss changed, as a ratio: ``", 2.5x lower"``, ``", 1.2x higher"``; empty where no ratio says
    it (equal losses, a loss at or below zero)."""
    if first <= 0 or final <= 0 or f"{first / final:.1f}" == "1.0":
        return ""
    return f", {first / final:.1f}x lower" if final < first else f", {final / first:.1f}x higher"


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as the lines ``hf-paged train`` prints."""
    first, final = summary["first_loss"], summary["final_loss"]
    if first is None:
        loss = "not logged (no logging step was reached)"
    else:
        loss = f"{first:.4f} -> {final:.4f} (first -> final logged{_loss_change(first, final)})"
    rows = [
        ("model", f"{summary['model']} with {summary['method']} on {summary['device']}{_processes(summary)}"),
        ("parameters", f"{summary['trainable_params']:,} trainable of {summary['total_params']:,}"),
        ("steps", f"{summary['steps']} on {summary['examples']} examples"),
        ("time", f"{summary['train_seconds']:.1f} s training, {summary['total_seconds']:.1f} s in all"),
        ("loss", loss),
        (
            "peak memory",
            (
                f"forward+backward {_size(summary['forward_backward_peak_bytes'])}, "
                f"optimizer step {_size(summary['optimizer_step_peak_bytes'])}"
            ),
        ),
        ("optimizer", summary["optimizer"]),
        ("optimizer state", _size(summary["optimizer_device_bytes"], " on the device")),
        ("paging", _paging_line(summary)),
        ("moved", _moved_line(summary)),
        ("memory spikes", "not measured" if summary["spikes"] is None else str(summary["spikes"])),
        ("oom recoveries", _recoveries_line(summary)),
        ("adapter", summary["adapter_path"] or "not written"),
        ("memory timeline", summary["timeline_path"] or "not written"),
        ("memory plot", summary["plot_path"] or "not written"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(["hf-paged train summary"] + [f"  {name:<{width}}  {value}" for name, value in rows])


def _processes(summary: dict[str, Any]) -> str:
    processes = summary["processes"]
    return f", {processes} processes (data parallel)" if processes > 1 else ""


def _paging_line(summary: dict[str, Any]) -> str:
    if summary["pages_total"] is None:
        return "not paged (the optimizer is not an hf-paged one)"
    budget = summary["device_budget"]
    budget = "no device budget" if budget is None else f"device budget {format_size(budget)}"
    return f"{summary['pages_total']} pages of {format_size(summary['page_size'])}, {budget}"


def _moved_line(summary: dict[str, Any]) -> str:
    if summary["pages_total"] is None:
        return "nothing (not paged)"
    return (
        f"{format_size(summary['bytes_to_device'])} to the device in {summary['page_ins']:,} page-ins, "
        f"{format_size(summary['bytes_to_host'])} to the host in {summary['page_outs']:,} page-outs, "
        f"{summary['stall_seconds']:.3f} s stalled"
    )


def _recoveries_line(summary: dict[str, Any]) -> str:
    count = summary["oom_recoveries"]
    if count is None:
        return "not watched (memory.enabled is false)"
    if not count:
        return "0"
    steps = ", ".join(str(step) for step in summary["oom_recovery_steps"])
    return f"{count} (step{'s' if len(summary['oom_recovery_steps']) > 1 else ''} {steps}): state moved to the host, step replayed"
