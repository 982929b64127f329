"""The planner on architectures besides Llama, each built tiny from a config (no download), against the truth.

Causal language models are planned as ``hf-paged plan`` plans them (a directory with only ``config.json``) and
trained for two steps for real, as ``hf-paged train`` would build them, under ``torch.profiler``: each phase's
planned peak must be within 0.25% of the peak of live bytes the CPU allocator reported. Each architecture runs at
least once, each method (full, LoRA, QLoRA) and each weight dtype (float32, bfloat16) several times.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_paged.cli.config import load_config
from hf_paged.cli.plan import plan_setup, setup_from_config
from hf_paged.planner import OPTIMIZER_STEP, plan

from plan_utils import check_plan, measured_peaks, measured_setup_peaks

SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
"""Sizes every tiny causal language model shares."""

ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2}

TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
"""Special tokens inside the tiny vocabulary."""

CONFIGS = {
    "gpt2": lambda transformers: transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=128, **TOKENS
    ),
    "qwen2": lambda transformers: transformers.Qwen2Config(**SMALL, **ATTENTION, **TOKENS),
    "mistral": lambda transformers: transformers.MistralConfig(**SMALL, **ATTENTION, **TOKENS, sliding_window=32),
    "gemma": lambda transformers: transformers.GemmaConfig(**SMALL, **ATTENTION, **TOKENS, head_dim=16),
    "phi3": lambda transformers: transformers.Phi3Config(**SMALL, **ATTENTION, **TOKENS),
    "mixtral": lambda transformers: transformers.MixtralConfig(
        **SMALL, **ATTENTION, **TOKENS, num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen2_moe": lambda transformers: transformers.Qwen2MoeConfig(
        **SMALL,
        **ATTENTION,
        **TOKENS,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    ),
}

MIXTURES_OF_EXPERTS = ("mixtral", "qwen2_moe")
"""Routed with transformers' default experts implementation, grouped_mm: float32 experts too."""

CASES = [
    ("gpt2", "full", "float32"),
    # checkpointing off: bfloat16 matrix products run beside all the activations (the planner measures the scratch
    # their CPU kernels hold)
    ("gpt2", "lora", "bfloat16", "lora.gradient_checkpointing=false"),
    ("gpt2", "qlora", "float32"),  # Conv1D's weights are stored (in, out): quantized transposed
    ("qwen2", "lora", "float32"),
    ("qwen2", "qlora", "bfloat16"),
    ("mistral", "full", "bfloat16"),
    ("mistral", "qlora", "float32"),
    ("gemma", "lora", "bfloat16"),
    ("phi3", "full", "float32"),
    ("phi3", "qlora", "bfloat16"),
    ("mixtral", "full", "float32"),
    ("mixtral", "lora", "bfloat16"),
    ("qwen2_moe", "qlora", "float32"),
    ("qwen2_moe", "full", "bfloat16"),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A directory with only ``config.json`` per architecture."""
    import transformers

    directories = {}
    for name, make in CONFIGS.items():
        directory = tmp_path_factory.mktemp(name)
        make(transformers).save_pretrained(directory)
        directories[name] = str(directory)
    return directories


@pytest.mark.parametrize("case", CASES, ids=["-".join(case[:3]) for case in CASES])
def test_plan_matches_the_measured_peak(model_dirs: dict[str, str], case: tuple[str, ...]) -> None:
    name, method, dtype, *extra = case
    overrides = [
        f"model.name={model_dirs[name]}",
        f"model.dtype={dtype}",
        f"lora.compute_dtype={dtype}",
        "lora.r=4",
        "tokenizer.max_length=64",
        "training.per_device_train_batch_size=2",
        "training.optim=adamw_torch",
        "training.optim_args=null",
        *extra,
    ]
    if name in MIXTURES_OF_EXPERTS and method in ("lora", "qlora"):
        # peft's LoRA of the experts' 3D weights has no dropout; from peft 0.22 QLoRA adapts them too
        overrides.append("lora.lora_dropout=0")
    setup = setup_from_config(load_config(None, overrides), method)
    planned = plan_setup(setup)
    trained = {param_dtype for _, param_dtype in planned.trainable_shapes}
    assert trained == {getattr(torch, dtype) if method == "full" else torch.float32}  # peft's adapters: float32
    assert not check_plan(planned, measured_setup_peaks(setup))


BERT = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


@pytest.mark.parametrize("method", ["full-float32", "lora-bfloat16"])
def test_plan_of_bert_matches_the_measured_peak(method: str) -> None:
    """An encoder: masked language modelling trained in full, sequence classification with LoRA (peft copies the
    classification head for ``modules_to_save``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    config = BertConfig(**BERT, num_attention_heads=4, num_labels=3, pad_token_id=0)
    lora = method.startswith("lora")
    dtype = torch.bfloat16 if method.endswith("bfloat16") else torch.float32

    def build() -> nn.Module:
        if not lora:
            return BertForMaskedLM(config).to(dtype)
        model = BertForSequenceClassification(config).to(dtype)
        return get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"]))

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 256, (2, 64))
        labels = torch.randint(0, 3, (2,)) if lora else ids
        mask = torch.ones_like(ids)
        mask[-1, -1] = 0  # padded, as make_batch does: transformers builds the attention mask, also from fake tensors
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], foreach=False)

    planned = plan(build, batch, optimizer)
    step = planned.peak(OPTIMIZER_STEP).by_kind
    assert step["gradients"] == step["trainable_weights"] > 0
    torch.manual_seed(0)
    assert not check_plan(planned, measured_peaks(build, batch, optimizer))


def test_mixture_of_experts_planned_for_any_routing() -> None:
    """transformers' grouped_mm experts run every token's chosen experts in one call, so memory does not depend on
    the routing: the plan matches a run whose routers send every token to the same two experts (the worst
    imbalance) as well as the random routing of the other cases."""
    import transformers

    config = CONFIGS["mixtral"](transformers)
    routed: list[torch.Tensor] = []

    def same_two_experts(module: nn.Module, args: tuple, output: tuple) -> tuple:
        logits, weights, indices = output
        indices = torch.zeros_like(indices)
        indices[:, 1] = 1
        routed.append(indices)
        return logits, weights, indices

    def build() -> nn.Module:
        model = transformers.MixtralForCausalLM(config)
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(same_two_experts)
        return model

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 256, (2, 64))
        return {"input_ids": ids, "labels": ids}

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), foreach=False)

    planned = plan(build, batch, optimizer)
    routed.clear()
    measured = measured_peaks(build, batch, optimizer)
    assert len(routed) == 2 * config.num_hidden_layers
    assert all(set(indices.unique().tolist()) == {0, 1} for indices in routed)
    assert not check_plan(planned, measured)
