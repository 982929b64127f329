"""prepare_qlora: 4-bit base weights as transformers loads them, LoRA adapters as peft makes them, Trainer steps."""

from __future__ import annotations

import logging
import math
import sys

import bitsandbytes as bnb
import pytest
import torch
from peft import PeftModel
from transformers import (
    AutoModelForCausalLM,
    BitsAndBytesConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaModel,
    Trainer,
)

import hf_paged
from hf_paged.qlora import prepare_qlora, qlora_report

from trainer_utils import tiny_llama, token_dataset, training_args

pytestmark = pytest.mark.filterwarnings("ignore:`(gradient|is_gradient)_checkpointing.*` is deprecated:FutureWarning")

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=1, n_head=2))


def layers4bit(model) -> dict[str, bnb.nn.Linear4bit]:
    return {name: module for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)}


def base_state(model: PeftModel) -> dict[str, torch.Tensor]:
    """The base model's weights and 4-bit quantization state, as bitsandbytes serializes them."""
    return {name: tensor.clone() for name, tensor in model.state_dict().items() if "lora_" not in name}


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2-conv1d"])
def test_quantizing_in_place_matches_loading_with_a_bitsandbytes_config(tmp_path, build):
    build().save_pretrained(tmp_path)
    loaded = prepare_qlora(str(tmp_path))
    in_place = prepare_qlora(build())
    assert isinstance(in_place, PeftModel) and isinstance(loaded, PeftModel)
    assert layers4bit(in_place).keys() == layers4bit(loaded).keys() and layers4bit(in_place)
    assert not any("lm_head" in name for name in layers4bit(in_place))
    expected, actual = base_state(loaded), base_state(in_place)
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
    for model in (in_place, loaded):
        assert model.is_loaded_in_4bit and model.base_model.model.hf_quantizer.is_trainable
    assert in_place.config.quantization_config.to_dict() == loaded.config.quantization_config.to_dict()
    inputs = torch.arange(16)[None]
    with torch.no_grad():
        assert torch.equal(in_place.eval()(inputs).logits, loaded.eval()(inputs).logits)


def test_loading_passes_load_kwargs_to_from_pretrained(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    model = prepare_qlora(tmp_path, device_map="cpu", dtype=torch.bfloat16)
    assert model.base_model.model.model.embed_tokens.weight.device.type == "cpu"
    assert layers4bit(model)[
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer"
    ].weight.quant_state.dtype == (torch.bfloat16)


@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", True), ("fp4", False)])
def test_linear_layers_are_4bit_with_the_requested_quantization(quant_type, double_quant):
    reference = tiny_llama()
    model = prepare_qlora(tiny_llama(), quant_type=quant_type, double_quant=double_quant)
    layers = layers4bit(model)
    assert sorted(name.split(".")[-2] for name in layers) == sorted(LINEAR_NAMES)
    for name, layer in layers.items():
        weight = layer.weight
        assert isinstance(weight, bnb.nn.Params4bit) and weight.bnb_quantized and not weight.requires_grad
        state = weight.quant_state
        assert state.quant_type == quant_type and state.blocksize == 64 and state.nested is double_quant
        if double_quant:
            assert state.absmax.dtype == torch.uint8 and state.state2.absmax.dtype == torch.float32
        else:
            assert state.absmax.dtype == torch.float32 and state.state2 is None
        original = reference.get_submodule(name.removeprefix("base_model.model.").removesuffix(".base_layer")).weight
        restored = bnb.functional.dequantize_4bit(weight.data, state)
        assert restored.shape == original.shape
        # 16 levels per block of 64: the round trip keeps the weights to within a few percent.
        assert ((restored - original).norm() / original.norm()).item() < 0.15
    assert type(model.base_model.model.lm_head) is torch.nn.Linear


def test_trainable_params_are_exactly_the_lora_params():
    model = prepare_qlora(tiny_llama(), r=8)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable == {name for name, _ in model.named_parameters() if ".lora_A." in name or ".lora_B." in name}
    assert len(trainable) == 2 * len(LINEAR_NAMES)
    report = model.hf_paged_qlora_report
    assert (report["trainable_params"], report["total_params"]) == model.get_nb_trainable_parameters()
    shapes = [layer.weight.quant_state.shape for layer in layers4bit(model).values()]
    assert report["trainable_params"] == sum(8 * (rows + columns) for rows, columns in shapes)
    assert report["total_params"] == tiny_llama().num_parameters() + report["trainable_params"]
    assert report["quantized_modules"] == len(LINEAR_NAMES)


@pytest.mark.parametrize("double_quant", [True, False])
def test_quantized_bytes_count_bitsandbytes_tensors(double_quant):
    model = prepare_qlora(tiny_llama(), double_quant=double_quant)
    expected = 0
    for layer in layers4bit(model).values():
        serialized = layer.state_dict()
        state = layer.weight.quant_state
        elements = state.shape.numel()
        blocks = math.ceil(elements / 64)
        # Two 4-bit codes per byte, one absmax per block of 64 and a 16-entry code book ...
        formula = elements // 2 + 16 * 4
        if double_quant:
            # ... the absmax in 8 bits with an fp32 absmax per 256 blocks, a 256-entry code book and an offset.
            formula += blocks + 4 * math.ceil(blocks / 256) + 256 * 4 + 4
        else:
            formula += 4 * blocks
        tensors = [serialized["weight"], serialized["weight.absmax"], serialized["weight.quant_map"]]
        if double_quant:
            tensors += [serialized["weight.nested_absmax"], serialized["weight.nested_quant_map"], state.offset]
        assert sum(tensor.nbytes for tensor in tensors) == formula
        expected += formula
    assert qlora_report(model)["quantized_bytes"] == model.hf_paged_qlora_report["quantized_bytes"] == expected


def test_gradient_checkpointing_is_on_and_non_reentrant():
    model = prepare_qlora(tiny_llama())
    layer = model.base_model.model.model.layers[0]
    assert layer.gradient_checkpointing and layer._gradient_checkpointing_func.keywords == {"use_reentrant": False}
    inputs = torch.arange(16)[None]
    model.train()
    model(input_ids=inputs, labels=inputs).loss.backward()
    # Reentrant checkpointing would leave the adapters inside the layers without gradients (inputs need no grad).
    assert all(param.grad is not None for param in model.parameters() if param.requires_grad)
    plain = prepare_qlora(tiny_llama(), gradient_checkpointing=False)
    assert not plain.base_model.model.model.layers[0].gradient_checkpointing


def fit(tmp_path, optim: str) -> tuple[PeftModel, Trainer]:
    model = prepare_qlora(tiny_llama(), r=8, lora_dropout=0.0)
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path / optim, optim=optim, max_steps=12, learning_rate=1e-2, weight_decay=0.0),
        train_dataset=token_dataset(),
    )
    return model, trainer


def test_trainer_steps_train_only_the_adapters(tmp_path):
    model, trainer = fit(tmp_path, "hf_paged_adamw_8bit")
    before = base_state(model)
    adapters = {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, hf_paged.PagedAdamW8bit)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.3
    after = base_state(model)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert not torch.equal(param.detach(), adapters[name]), name
    # The adapters are smaller than min_8bit_size: their state is fp32 and the steps are torch's AdamW steps.
    reference, reference_trainer = fit(tmp_path, "adamw_torch")
    reference_trainer.train()
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        if param.requires_grad:
            assert ((param - expected).norm() / expected.norm()).item() < 1e-5, name


def test_a_quantized_model_is_used_as_it_is(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False)
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config)
    weights = {name: layer.weight for name, layer in layers4bit(quantized).items()}
    model = prepare_qlora(quantized, quant_type="nf4")
    for name, layer in layers4bit(model).items():
        assert layer.weight is weights[name.removeprefix("base_model.model.").removesuffix(".base_layer")]
        assert layer.weight.quant_state.quant_type == "fp4"


def test_compute_dtype():
    def compute_dtypes(model) -> set[torch.dtype]:
        return {layer.compute_dtype for layer in layers4bit(model).values()}

    auto = prepare_qlora(tiny_llama())
    assert (
        compute_dtypes(auto) == {torch.float32}
        and auto.config.quantization_config.bnb_4bit_compute_dtype == torch.float32
    )
    assert compute_dtypes(prepare_qlora(tiny_llama(), compute_dtype="bfloat16")) == {torch.bfloat16}
    assert compute_dtypes(prepare_qlora(tiny_llama(), compute_dtype=torch.float16)) == {torch.float16}


@pytest.mark.parametrize("storage", ["bfloat16", torch.float16, "float32"])
def test_quant_storage_holds_the_same_packed_codes_in_another_dtype(tmp_path, storage):
    """Stored in a floating-point dtype (what FSDP and ZeRO-3 shard), the 4-bit weights are that dtype's
    ``Params4bit`` over the same bytes as uint8 storage, counted alike, and the model computes the same logits (in
    training mode: in eval mode bitsandbytes repacks the codes for its CPU kernel at the first forward)."""
    dtype = getattr(torch, storage) if isinstance(storage, str) else storage
    tiny_llama().save_pretrained(tmp_path)
    reference = prepare_qlora(tiny_llama(), lora_dropout=0.0)
    packed = {name: layer.weight.data.clone() for name, layer in layers4bit(reference).items()}
    inputs = torch.arange(16)[None]
    with torch.no_grad():
        expected = reference.train()(inputs).logits
    loaded = prepare_qlora(tmp_path, quant_storage=storage, lora_dropout=0.0)
    for model in (prepare_qlora(tiny_llama(), quant_storage=storage, lora_dropout=0.0), loaded):
        assert model.config.quantization_config.bnb_4bit_quant_storage == dtype
        layers = layers4bit(model)
        assert layers.keys() == packed.keys()
        for name, layer in layers.items():
            weight = layer.weight
            assert isinstance(weight, bnb.nn.Params4bit) and weight.dtype == dtype and weight.quant_storage == dtype
            assert weight.is_floating_point() and not weight.requires_grad
            assert weight.numel() * dtype.itemsize == packed[name].numel()
            assert torch.equal(weight.data.view(torch.uint8).flatten(), packed[name].flatten()), name
        assert model.hf_paged_qlora_report == reference.hf_paged_qlora_report
        with torch.no_grad():
            assert torch.equal(model.train()(inputs).logits, expected)


def test_report_is_logged_in_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="hf_paged.qlora"):
        model = prepare_qlora(tiny_llama())
    (record,) = [record for record in caplog.records if record.name == "hf_paged.qlora"]
    report = model.hf_paged_qlora_report
    message = record.getMessage()
    assert record.levelno == logging.INFO and "\n" not in message
    assert f"{report['trainable_params']:,} trainable of {report['total_params']:,}" in message
    assert f"{report['quantized_modules']} 4-bit linear layers" in message
    assert report == qlora_report(model)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"r": 0}, "r \\(the LoRA rank\\) must be a positive int, got 0"),
        ({"r": 4.0}, "r \\(the LoRA rank\\) must be a positive int"),
        ({"lora_alpha": 0}, "lora_alpha must be a positive number, got 0"),
        ({"lora_alpha": "32"}, "lora_alpha must be a positive number"),
        ({"lora_dropout": 1.0}, "lora_dropout must be a probability in \\[0, 1\\), got 1.0"),
        ({"lora_dropout": -0.1}, "lora_dropout must be a probability"),
        ({"quant_type": "int4"}, "quant_type must be one of 'nf4', 'fp4', got 'int4'"),
        ({"double_quant": "no"}, "double_quant must be True or False, got 'no'"),
        ({"gradient_checkpointing": "no"}, "gradient_checkpointing must be True or False, got 'no'"),
        ({"compute_dtype": "int8"}, "compute_dtype must be one of 'auto', 'bfloat16', 'float16', 'float32'"),
        ({"compute_dtype": torch.int8}, "compute_dtype must be one of .* got torch.int8"),
        (
            {"quant_storage": "int4"},
            (
                "quant_storage must be one of 'uint8', 'int8', 'bfloat16', 'float16', 'float32', 'float64' or the "
                "torch dtype of one, got 'int4'"
            ),
        ),
        ({"quant_storage": torch.int32}, "quant_storage must be one of .* got torch.int32"),
        ({"quant_storage": None}, "quant_storage must be one of .* got None"),
        ({"target_modules": []}, "target_modules must be 'all-linear', a regular expression or a non-empty list"),
        (
            {"target_modules": ["q_proj", "qkv"]},
            (
                "target_modules: 'qkv' matches no module of LlamaForCausalLM; "
                "its linear modules are named down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"
            ),
        ),
        ({"target_modules": "encoder"}, "target_modules: 'encoder' matches no module of LlamaForCausalLM"),
    ],
)
def test_bad_arguments_are_named_and_leave_the_model_unquantized(kwargs, match):
    model = tiny_llama()
    with pytest.raises(ValueError, match=match):
        prepare_qlora(model, **kwargs)
    assert not layers4bit(model) and not hasattr(model, "hf_quantizer")


def test_a_model_without_linear_layers_is_refused():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=0, num_attention_heads=2))
    with pytest.raises(ValueError, match="model_or_path: LlamaForCausalLM has no linear layers to quantize .*lm_head"):
        prepare_qlora(model)


def test_other_inputs_are_refused(monkeypatch):
    with pytest.raises(TypeError, match="model_or_path must be a hub name or local path .* got Linear"):
        prepare_qlora(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="pass quant_type, double_quant, compute_dtype and quant_storage instead"):
        prepare_qlora(tiny_llama(), quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        prepare_qlora(tiny_llama())


def test_a_model_that_is_not_a_causal_lm_is_refused_before_it_is_quantized():
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    for model in (LlamaModel(config), LlamaForSequenceClassification(config)):
        with pytest.raises(TypeError, match=f"model_or_path: {type(model).__name__} is not a causal language model"):
            prepare_qlora(model)
        assert not layers4bit(model) and not hasattr(model, "hf_quantizer")


def test_loading_arguments_with_a_loaded_model_are_refused():
    model = tiny_llama()
    with pytest.raises(TypeError, match="got modules_to_save, device_map, which it passes to from_pretrained only"):
        prepare_qlora(model, modules_to_save=["lm_head"], device_map="cpu")
    assert not layers4bit(model) and not hasattr(model, "hf_quantizer")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_compute_dtype_on_cuda(tmp_path):
    bf16 = torch.cuda.is_bf16_supported()
    expected = torch.bfloat16 if bf16 else torch.float32
    model = prepare_qlora(tiny_llama().cuda())
    assert {layer.compute_dtype for layer in layers4bit(model).values()} == {expected}
    assert all(layer.weight.device.type == "cuda" for layer in layers4bit(model).values())
    tiny_llama().save_pretrained(tmp_path / "model")
    loaded = prepare_qlora(tmp_path / "model")
    assert {layer.compute_dtype for layer in layers4bit(loaded).values()} == {expected}
    trainer = Trainer(
        model=model,
        args=training_args(
            tmp_path, optim="hf_paged_adamw_8bit", max_steps=12, learning_rate=1e-2, use_cpu=False, bf16=bf16
        ),
        train_dataset=token_dataset(),
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert sum(losses[-3:]) < 0.9 * sum(losses[:3])
