"""A tiny causal LM and dataset for Trainer tests, built from a config (no download)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments


def tiny_llama(seed: int = 0, **config_overrides) -> LlamaForCausalLM:
    """A one-layer Llama with a vocabulary of 128 (``config_overrides`` change its ``LlamaConfig``)."""
    torch.manual_seed(seed)
    settings = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        **config_overrides,
    }
    return LlamaForCausalLM(LlamaConfig(**settings))


def token_dataset(samples: int = 16, length: int = 16, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Sequences with a learnable pattern (each token is the previous plus one, modulo the vocabulary)."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 128, (samples, 1), generator=generator)
    ids = (starts + torch.arange(length)) % 128
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def training_args(output_dir, **overrides) -> TrainingArguments:
    settings = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-3,
        "max_steps": 4,
        "use_cpu": True,
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": 0,
        "weight_decay": 0.1,
        **overrides,
    }
    return TrainingArguments(**settings)


def trainer_deepspeed_config(zero: dict) -> dict:
    """A DeepSpeed config for the Trainer with the ``zero_optimization`` section ``zero`` and no optimizer section (the
    Trainer's optimizer is DeepSpeed's client); its ``auto`` values are filled in from the Trainer's arguments."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
    }
