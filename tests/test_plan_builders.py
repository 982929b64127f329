"""Model builders the planner calls under fake tensors: dtype conversions, tied weights and deep copies.

Each plan is checked against the peaks of the same builder run for real (the profiler's allocator events)."""

from __future__ import annotations

from typing import Any

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


def _tiny_mixtral_config(experts_implementation: str) -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_implementation=experts_implementation,
    )


def _tiny_mixtral(experts_implementation: str) -> nn.Module:
    from transformers import MixtralForCausalLM

    return MixtralForCausalLM(_tiny_mixtral_config(experts_implementation))


def _token_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, 16))
    return {"input_ids": ids, "labels": ids}


def test_data_dependent_routing_is_refused_with_the_operator_and_what_to_do() -> None:
    """A mixture of experts that loops over the experts its tokens chose (transformers' eager experts) has shapes
    that depend on the routing; the refusal names the operator and the implementation to plan instead."""
    from hf_paged.planner import PlanningError

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters())

    with pytest.raises(PlanningError, match=r"aten\.nonzero\.default.*experts_implementation='grouped_mm'"):
        plan(lambda: _tiny_mixtral("eager"), _token_batch, optimizer)
    for implementation in ("grouped_mm", "batched_mm"):
        assert (
            plan(
                lambda implementation=implementation: _tiny_mixtral(implementation), _token_batch, optimizer, steps=1
            ).forward_backward_peak
            > 0
        )


def test_a_value_read_in_forward_is_refused_with_the_operator() -> None:
    from hf_paged.planner import PlanningError

    class ReadsAValue(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            output = self.linear(inputs)
            return output.mean() if output.sum().item() > 0 else output.pow(2).mean()

    with pytest.raises(PlanningError, match=r"the value that aten\._local_scalar_dense\.default returns"):
        plan(ReadsAValue, lambda: torch.randn(4, 8), lambda model: torch.optim.SGD(model.parameters()))


def test_an_optimizer_that_reads_a_value_is_refused_as_the_optimizer() -> None:
    """What an optimizer reads of values, in its construction or in its step, is the optimizer's: the refusal says so
    and names the class whose step it is, not a model's routing."""
    from hf_paged.planner import OptimizerPlanningError

    class ReadsAValueInItsStep(torch.optim.SGD):
        def step(self, closure: Any = None) -> None:
            if self.param_groups[0]["params"][0].grad.sum().item() > 0:
                super().step()

    def reads_a_value_when_built(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=torch.ones(1).sum().item())

    batch = lambda: torch.randn(4, 8)
    with pytest.raises(OptimizerPlanningError, match="^cannot plan the optimizer: building it reads the values"):
        plan(lambda: nn.Linear(8, 8), batch, reads_a_value_when_built, loss=lambda model, inputs: model(inputs).sum())
    stepping = f"the step of {__name__}.{ReadsAValueInItsStep.__qualname__}"
    with pytest.raises(OptimizerPlanningError, match=f"^cannot plan the optimizer: {stepping} reads the values"):
        optimizer = lambda model: ReadsAValueInItsStep(model.parameters())
        plan(lambda: nn.Linear(8, 8), batch, optimizer, loss=lambda model, inputs: model(inputs).sum())


def test_cli_refuses_a_model_it_cannot_plan(tmp_path, monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``hf-paged plan`` of a model whose routing decides shapes (built here as transformers would build remote code
    with an eager experts loop) stops with exit status 2 and the planner's reason, not a traceback."""
    from transformers import AutoModelForCausalLM

    from hf_paged.cli import main

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", lambda config, **kwargs: _tiny_mixtral("eager"))
    _tiny_mixtral_config("grouped_mm").save_pretrained(tmp_path)
    overrides = [f"model.name={tmp_path}", "tokenizer.max_length=16", "training.optim=adamw_torch"]
    arguments = [item for override in overrides for item in ("--set", override)]
    assert main(["plan", "--device", "cpu", "--method", "full", *arguments]) == 2
    error = capsys.readouterr().err
    assert f"model.name: '{tmp_path}'" in error and "aten.nonzero.default" in error and "grouped_mm" in error


class _CheckpointedLayers(nn.Module):
    """Small layers under non-reentrant activation checkpointing, which saves the CPU generator's state (5 KiB)
    for each call: here a large part of the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(8))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            inputs = checkpoint(lambda tensor, layer=layer: torch.relu(layer(tensor)), inputs, use_reentrant=False)
        return inputs.pow(2).mean()


def test_checkpointing_counts_the_generator_states_it_saves() -> None:
    def batch() -> torch.Tensor:
        return torch.randn(16, 32)

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1)

    planned = plan(_CheckpointedLayers, batch, optimizer)
    assert not check_plan(planned, measured_peaks(_CheckpointedLayers, batch, optimizer))
