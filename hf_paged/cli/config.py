"""The ``hf-paged train`` configuration: its schema as dataclasses, YAML files and ``--set`` overrides.

The dataclasses' defaults are the embedded default run (``configs/default.yaml`` writes them out). A YAML
file or an override changes only the keys it names: ``--set lora.r=8`` or ``--set training.max_steps=20``
(the value is read as YAML, so ``8`` is an integer, ``null`` is ``None`` and ``[q_proj, v_proj]`` a list).
``training`` holds ``transformers.TrainingArguments`` keys and is checked against its fields. An unknown key
at any depth, a value of the wrong type or out of its range, a size that is not one, or a number that is not finite
(``.inf``, ``.nan``) anywhere raises :class:`ConfigError` naming the key and where it came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ..sizes import parse_size

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
"""Dtype names a config accepts; ``auto`` lets the checkpoint or the hardware decide."""


class ConfigError(ValueError):
    """A configuration key that does not exist, or a value it does not accept."""


def _bounded(
    default: Any, low: float, high: float | None = None, *, closed: bool = False, above_low: bool = False
) -> Any:
    """A field whose number must lie in ``[low, high)`` (``[low, high]`` if ``closed``, ``(low, ...`` if
    ``above_low``; ``high=None``: no bound)."""
    return field(default=default, metadata={"bounds": (low, high, closed, above_low)})


def _size(default: int | str | None) -> Any:
    """A field holding a size of at least one byte: an integer of bytes or a string such as ``"24GiB"``."""
    return field(default=default, metadata={"size": True})


@dataclass
class TinyModelConfig:
    """The embedded Llama-architecture model built when ``model.name`` is ``tiny`` (random weights, no download)."""

    hidden_size: int = _bounded(128, 1)
    intermediate_size: int = _bounded(256, 1)
    num_hidden_layers: int = _bounded(2, 1)
    num_attention_heads: int = _bounded(4, 1)
    num_key_value_heads: int = _bounded(4, 1)
    max_position_embeddings: int = _bounded(256, 1)
    initializer_range: float = _bounded(0.1, 0)
    """Standard deviation of the random weights; about ``hidden_size ** -0.5`` lets the frozen output head
    reach confident predictions (transformers' 0.02 keeps every logit small)."""
    seed: int = 0
    """Seed of the random initial weights."""


@dataclass
class ModelConfig:
    name: str = "tiny"
    """``tiny`` (the embedded model), a Hugging Face Hub name or a local directory."""
    dtype: Dtype = "auto"
    """Dtype of the weights that stay unquantized; ``auto``: the checkpoint's (float32 for ``tiny``)."""
    trust_remote_code: bool = False
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class TokenizerConfig:
    name: str | None = None
    """``byte`` (the embedded byte-level tokenizer), a Hub name or a local directory; ``None``: ``byte`` for
    the tiny model, else the model's own tokenizer."""
    max_length: int = _bounded(128, 1)
    """Longest training example in tokens; longer ones are cut."""


@dataclass
class DataConfig:
    path: str | None = None
    """A local ``.json``/``.jsonl``/``.csv``/``.txt`` file, a ``datasets`` name or directory; ``None``: the
    shipped instructions."""
    name: str | None = None
    """The ``datasets`` configuration name, if the dataset has several."""
    split: str = "train"
    instruction_field: str = "instruction"
    response_field: str = "response"
    text_field: str | None = None
    """Train on this field as plain text (no prompt template); ``.txt`` files use ``text``."""
    max_samples: int | None = _bounded(None, 1)
    """Use only the first this many examples."""


@dataclass
class PromptConfig:
    template: str = "### Instruction:\n{instruction}\n\n### Response:\n{response}"
    """How an example becomes text; ``{instruction}`` and ``{response}`` are filled in, EOS is appended."""
    train_on_prompt: bool = False
    """Also compute the loss on the text before ``{response}`` (else only on the response and EOS)."""


@dataclass
class LoraConfig:
    quantize: bool = True
    """QLoRA: 4-bit base weights with :func:`hf_paged.qlora.prepare_qlora`; ``False``: LoRA on full weights."""
    r: int = _bounded(16, 1)
    lora_alpha: float = _bounded(32, 0)
    lora_dropout: float = _bounded(0.05, 0, 1)
    target_modules: str | list[str] = "all-linear"
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Dtype = "auto"
    quant_storage: Literal["uint8", "int8", "bfloat16", "float16", "float32", "float64"] = "uint8"
    """Dtype the packed 4-bit codes are stored in; ``bfloat16`` (the weights' dtype) lets FSDP2 and ZeRO-3 shard them."""
    gradient_checkpointing: bool = True
    """Non-reentrant gradient checkpointing of the decoder layers."""


@dataclass
class MemoryConfig:
    """Arguments of :class:`hf_paged.callbacks.MemorySpikeCallback`, and whether to attach it."""

    enabled: bool = True
    window: int = _bounded(20, 1)
    """Recent steps whose peaks form the spike baseline."""
    warmup: int = _bounded(5, 1)
    """Steps measured before spikes are judged."""
    spike_margin: float = _bounded(0.1, 0)
    """Fraction above the baseline a peak must rise to count as a spike."""
    device_capacity: int | str | None = _size(None)
    """Memory the device offers, in bytes or as ``"24GiB"``; ``None``: the device's total memory."""
    safety_margin: float | None = _bounded(None, 0, 1)
    """Fraction of the capacity an automatic device budget keeps free; ``None``: the optimizer's (0.1)."""
    warn_fraction: float = _bounded(0.9, 0, 1, closed=True, above_low=True)
    """Warn once when the forward/backward peak reaches this fraction of the capacity."""
    plot: bool = True
    """Also draw ``memory_timeline.png`` (needs matplotlib)."""
    oom_retries: int = _bounded(2, 0)
    """Recoveries from an out-of-memory error allowed per training step; 0 turns recovery off."""
    simulate_spike_at: int | None = _bounded(None, 1)
    """Raise one simulated out-of-memory error in the forward of this optimizer step (from 1), to watch a
    recovery; ``None``: never."""


DEFAULT_TRAINING: dict[str, Any] = {
    "output_dir": "hf-paged-output",
    "max_steps": 160,
    "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 1,
    "learning_rate": 6e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 10,
    "weight_decay": 0.0,
    "optim": "hf_paged_adamw_8bit",
    "optim_args": "device_budget=32KiB,page_size=16KiB,min_8bit_size=1024",
    "logging_steps": 10,
    "logging_first_step": True,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
}
"""``TrainingArguments`` of the embedded default run; a config's ``training`` keys update these."""


@dataclass
class Config:
    """Everything ``hf-paged train`` runs from."""

    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    training: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_TRAINING))
    """Any ``transformers.TrainingArguments`` keys."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)


def default_config() -> Config:
    """The embedded default configuration."""
    return Config()


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The default updated by the YAML file at ``path`` (if given), then by each ``key=value`` override."""
    config = default_config()
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ConfigError(f"cannot read config file {str(path)!r}: {error.strerror}") from None
        try:
            mapping = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"{path} is not valid YAML: {error}") from None
        if mapping is None:
            mapping = {}
        if not isinstance(mapping, dict):
            raise ConfigError(f"{path} must hold a mapping of sections, got {type(mapping).__name__}")
        update(config, mapping, source=str(path))
    for override in overrides:
        apply_override(config, override)
    check_config(config)
    return config


LOCAL_PATH_KEYS = ("model.name", "tokenizer.name", "data.path")
"""Keys that may name a local path, where a leading ``~`` is the user's home directory."""

POSITIVE_TRAINING_COUNTS = ("per_device_train_batch_size", "gradient_accumulation_steps")
"""``training`` keys that must be integers >= 1 (the Trainer fails on 0 only once the model and data are built)."""


def check_config(config: Config) -> None:
    """Raise ConfigError for values that are allowed one by one but not together, or that the run would reject only
    after building the model and data."""
    check_training_counts(config.training)
    check_tiny_model(config.model.tiny)
    memory = config.memory
    if memory.warmup > memory.window:
        raise ConfigError(
            f"memory.warmup must be at most memory.window ({memory.window}): spikes are judged once warmup steps are "
            f"in the window, got {memory.warmup}"
        )
    if memory.simulate_spike_at is not None and (not memory.enabled or memory.oom_retries < 1):
        raise ConfigError(
            "memory.simulate_spike_at needs the memory callback's recovery, which it is there to show "
            f"(memory.enabled=true and memory.oom_retries >= 1), got memory.enabled={memory.enabled}, "
            f"memory.oom_retries={memory.oom_retries}"
        )
    eval_strategy = config.training.get("eval_strategy", "no")
    if getattr(eval_strategy, "value", eval_strategy) not in (None, "no"):
        raise ConfigError(
            f"training.eval_strategy must be 'no', got {eval_strategy!r}: hf-paged train has no evaluation data (the "
            "Trainer would refuse it once the model is built)"
        )


def check_training_counts(training: Mapping[str, Any]) -> None:
    """Raise ConfigError for a batch size or an accumulation that is not an integer >= 1."""
    for key in POSITIVE_TRAINING_COUNTS:
        value = training.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"training.{key} must be an integer >= 1, got {value!r}")


def check_tiny_model(tiny: TinyModelConfig) -> None:
    """Raise ConfigError for a tiny model whose attention cannot be built: ``hidden_size`` a multiple of
    ``num_attention_heads``, that a multiple of ``num_key_value_heads``, and an even size per head (rotary
    embeddings rotate pairs of elements)."""
    heads, kv_heads = tiny.num_attention_heads, tiny.num_key_value_heads
    if tiny.hidden_size % heads or heads % kv_heads or tiny.hidden_size // heads % 2:
        raise ConfigError(
            "model.tiny: hidden_size must be a multiple of num_attention_heads with an even quotient (the size of a "
            "head), and num_attention_heads a multiple of num_key_value_heads, got "
            f"{tiny.hidden_size}, {heads}, {kv_heads}"
        )


def apply_override(config: Config, override: str) -> None:
    """Apply one ``dotted.key=value`` override to ``config`` (the value is read as YAML)."""
    key, separator, text = override.partition("=")
    parts = key.strip().split(".")
    if not separator or not all(parts):
        raise ConfigError(f"--set expects dotted.key=value (e.g. lora.r=8), got {override!r}")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"the value of --set {override!r} is not valid YAML: {error}") from None
    for part in reversed(parts):
        value = {part: value}
    update(config, value, source=f"--set {override}")


def update(config: Config, mapping: Mapping[str, Any], source: str = "config") -> None:
    """Update ``config`` in place from nested ``mapping``; ``source`` names where it came from, for errors."""
    _update_dataclass(config, mapping, "", source)


def to_dict(config: Config) -> dict[str, Any]:
    """``config`` as plain nested dicts (what a YAML file holding it would load as)."""
    return dataclasses.asdict(config)


def _update_dataclass(instance: Any, mapping: Mapping[str, Any], prefix: str, source: str) -> None:
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'the config'} in {source} must be a mapping, got {mapping!r}")
    fields = {item.name: item for item in dataclasses.fields(instance)}
    hints = typing.get_type_hints(type(instance))
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(_unknown(name, key, list(fields), prefix, source))
        current = getattr(instance, key)
        if dataclasses.is_dataclass(current):
            _update_dataclass(current, value, f"{name}.", source)
        elif key == "training" and prefix == "":
            _update_training(current, value, source)
        else:
            value = _convert(value, hints[key], name, source)
            if name in LOCAL_PATH_KEYS and isinstance(value, str) and value.startswith("~"):
                value = os.path.expanduser(value)
            _check_bounds(value, fields[key], name, source)
            _check_size(value, fields[key], name, source)
            if name == "prompt.template":
                _check_template(value, source)
            if name == "lora.target_modules" and (value in ("", []) or (isinstance(value, list) and "" in value)):
                raise ConfigError(
                    f"lora.target_modules in {source} must be 'all-linear', a regular expression or a non-empty list "
                    f"of module names, got {value!r}"
                )
            setattr(instance, key, value)


def _update_training(training: dict[str, Any], mapping: Any, source: str) -> None:
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"training in {source} must be a mapping of TrainingArguments keys, got {mapping!r}")
    known = _training_fields()
    for key, value in mapping.items():
        name = f"training.{key}"
        if key not in known:
            raise ConfigError(_unknown(name, key, list(known), "training.", source, "transformers.TrainingArguments"))
        if isinstance(value, Mapping) and isinstance(training.get(key), dict):
            _check_finite(value, name, source)
            training[key] = {**training[key], **value}
        else:
            training[key] = _convert(value, known[key], name, source)


@functools.cache
def _training_fields() -> dict[str, Any]:
    """``TrainingArguments``' constructor fields and their types."""
    from transformers import TrainingArguments

    hints = typing.get_type_hints(TrainingArguments)
    return {item.name: hints.get(item.name, Any) for item in dataclasses.fields(TrainingArguments) if item.init}


def _unknown(name: str, key: Any, valid: list[str], prefix: str, source: str, owner: str | None = None) -> str:
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    where = f"unknown key {name!r} in {source}"
    if close:
        return f"{where}; did you mean {prefix + close[0]!r}?"
    if owner is not None:
        return f"{where}; it is not a field of {owner}"
    return f"{where}; valid keys: {', '.join(prefix + item for item in valid)}"


def _check_template(template: str, source: str) -> None:
    for placeholder in ("{instruction}", "{response}"):
        if placeholder not in template:
            raise ConfigError(f"prompt.template in {source} must contain {placeholder}, got {template!r}")
    if template.index("{instruction}") > template.index("{response}"):
        raise ConfigError(f"prompt.template in {source} must put {{instruction}} before {{response}}")


def _check_bounds(value: Any, item: dataclasses.Field, name: str, source: str) -> None:
    bounds = item.metadata.get("bounds")
    if bounds is None or value is None:
        return
    low, high, closed, above_low = bounds
    below = value <= low if above_low else value < low
    above = high is not None and (value > high if closed else value >= high)
    if below or above:
        if high is None:
            allowed = f"{'>' if above_low else '>='} {low}"
        else:
            allowed = f"in {'(' if above_low else '['}{low}, {high}{']' if closed else ')'}"
        raise ConfigError(f"{name} in {source} must be {allowed}, got {value!r}")


def _check_size(value: Any, item: dataclasses.Field, name: str, source: str) -> None:
    if not item.metadata.get("size") or value is None:
        return
    try:
        size = parse_size(value, name)
    except (TypeError, ValueError):
        size = 0
    if size < 1:
        raise ConfigError(
            f"{name} in {source} must be a size of at least 1 byte: a number of bytes or a number with one of the "
            f"units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (for example '24GiB'), got {value!r}"
        )


def _check_finite(value: Any, name: str, source: str) -> None:
    """Raise ConfigError if ``value`` is, or holds at any depth, a float that is infinite or NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} in {source} must be a finite number, got {value!r}")
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        _check_finite(item, name, source)


def _convert(value: Any, annotation: Any, name: str, source: str) -> Any:
    accepted, converted = _accept(value, annotation)
    if not accepted:
        raise ConfigError(f"{name} in {source} must be {_describe(annotation)}, got {value!r} ({type(value).__name__})")
    _check_finite(converted, name, source)
    return converted


_YAML_BOOLEAN_WORDS = {False: ("no", "off", "false"), True: ("yes", "on", "true")}
"""Words that YAML 1.1 (``yaml.safe_load``) reads as booleans, which a choice among words may mean."""


def _choice(value: Any, allowed: Sequence[Any]) -> tuple[bool, Any]:
    """Whether ``value`` is one of ``allowed``, and the value to store: a boolean that YAML read from a word
    ``allowed`` has (``save_strategy: no``) is that word."""
    if not isinstance(value, bool):
        return value in allowed, value
    if any(value is choice for choice in allowed):
        return True, value
    word = next((word for word in _YAML_BOOLEAN_WORDS[value] if word in allowed), None)
    return (False, value) if word is None else (True, word)


def _accept(value: Any, annotation: Any) -> tuple[bool, Any]:
    """Whether ``value`` fits ``annotation``, and the value to store (numbers written as strings are parsed)."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        for member in typing.get_args(annotation):
            accepted, converted = _accept(value, member)
            if accepted:
                return True, converted
        return False, value
    if annotation is type(None):
        return value is None, value
    if origin is Literal:
        return _choice(value, typing.get_args(annotation))
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, value
        if isinstance(value, str):
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if annotation is str:
        return isinstance(value, str), value
    if origin is list or annotation is list:
        if not isinstance(value, list):
            return False, value
        (member,) = typing.get_args(annotation) or (Any,)
        items = [_accept(item, member) for item in value]
        return all(accepted for accepted, _ in items), [converted for _, converted in items]
    if origin is dict or annotation is dict:
        return isinstance(value, dict), value
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return (
            (True, value) if isinstance(value, annotation) else _choice(value, [member.value for member in annotation])
        )
    if isinstance(annotation, type):
        return isinstance(value, annotation), value
    return True, value


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(member) for member in typing.get_args(annotation))
    if origin is Literal:
        return "one of " + ", ".join(repr(item) for item in typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(repr(member.value) for member in annotation)
    if origin is list or annotation is list:
        (member,) = typing.get_args(annotation) or (Any,)
        return f"a list of ({_describe(member)})"
    names = {
        type(None): "null",
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        dict: "a mapping",
        Any: "any value",
    }
    if annotation in names:
        return names[annotation]
    if origin is dict:
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))
