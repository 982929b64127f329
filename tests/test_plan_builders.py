"""Model builders the planner calls under fake tensors: dtype conversions, tied weights and deep copies.

Each plan is checked against the peaks of the same builder run for real (the profiler's allocator events)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_paged.planner import OPTIMIZER_STEP, plan

from plan_utils import check_plan, measured_peaks

VOCAB, HIDDEN = 512, 256


class _TiedLanguageModel(nn.Module):
    """An embedding and an output head that share one weight, a buffer, and a float32 loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.hidden = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embedding.weight
        self.register_buffer("offset", torch.zeros(HIDDEN))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.hidden(self.embedding(tokens) + self.offset))
        logits = self.head(hidden).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


CONVERSIONS = {
    "to-bfloat16": (lambda model: model.to(torch.bfloat16), torch.bfloat16),
    "to-dtype-keyword": (lambda model: model.to(dtype=torch.float16), torch.float16),
    "half": (lambda model: model.half(), torch.float16),
    "bfloat16": (lambda model: model.bfloat16(), torch.bfloat16),
    "float-after-bfloat16": (lambda model: model.bfloat16().float(), torch.float32),
    "double": (lambda model: model.double(), torch.float64),
}


@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_dtype_conversions_in_a_builder_are_planned(conversion: str) -> None:
    convert, dtype = CONVERSIONS[conversion]
    built: list[nn.Module] = []

    def build() -> nn.Module:
        model = convert(_TiedLanguageModel())
        built.append(model)
        return model

    def batch() -> torch.Tensor:
        return torch.randint(0, VOCAB, (4, 64))

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), foreach=False)

    planned = plan(build, batch, optimizer)
    fake = built[0]
    assert all(param.dtype == dtype for param in fake.parameters()) and fake.offset.dtype == dtype
    assert fake.head.weight is fake.embedding.weight  # the tie survives the conversion
    assert all(isinstance(param, nn.Parameter) for param in fake.parameters())
    assert planned.total_params == VOCAB * HIDDEN + HIDDEN * HIDDEN + HIDDEN
    weights = planned.total_params * dtype.itemsize
    assert planned.peak(OPTIMIZER_STEP).by_kind["trainable_weights"] == weights
    assert not check_plan(planned, measured_peaks(build, batch, optimizer))


def test_a_builder_that_deep_copies_modules() -> None:
    """peft copies the classification head for ``modules_to_save`` (LoRA with ``task_type="SEQ_CLS"``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_labels=3,
        pad_token_id=0,
    )

    def build() -> nn.Module:
        model = LlamaForSequenceClassification(config)
        return get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"]))

    def batch() -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(1, 256, (2, 32)), "labels": torch.randint(0, 3, (2,))}

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([param for param in model.parameters() if param.requires_grad])

    planned = plan(build, batch, optimizer)
    head = 64 * 3  # the trainable copy of the score head beside the LoRA matrices
    lora = 2 * 2 * (64 * 4 + 4 * 64)
    assert planned.trainable_params == head + lora
    torch.manual_seed(0)
    assert not check_plan(planned, measured_peaks(build, batch, optimizer))
