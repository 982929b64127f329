"""The planner's DeepSpeed ZeRO strategies (issue 39) against DeepSpeed's own estimators, and their bad input.

DeepSpeed's ``estimate_zero2_model_states_mem_needs`` and ``estimate_zero3_model_states_mem_needs`` (what the
``..._all_live`` estimators print for a model) count one GPU's model states of a 16-bit model trained with fp32 Adam:
ZeRO-2 ``2P + 18P/N`` bytes for P parameters on N GPUs (16-bit weights; 16-bit and fp32 gradient partitions, fp32
master partition, two fp32 moments), ``2P`` with the optimizer offloaded; ZeRO-3 ``4L + 18P/N`` (L: the largest
layer's parameters, gathered with its gradient), ``4L + 2P/N`` with the optimizer offloaded, ``4L`` with the
parameters too. The plan's model states at its optimizer-step peak (weights, gradients, optimizer state) are the same
for ZeRO-2. For ZeRO-3 they differ by what the two count differently: the plan holds DeepSpeed's 16-bit gradient
partition beside its 16-bit parameter partition (``stage3.py`` allocates both; the estimator counts one 16-bit
partition), and no gathered layer at the step (DeepSpeed releases every parameter before it); so the plan is the
estimator's figure less ``4L``, plus ``2P/N`` without offload. ZeRO-2's estimate counts its 16-bit gradient partition
beside the fp32 one, which DeepSpeed frees once it has flattened the last param group's gradients from it, before that
group's step: with the one group here the plan's step peak is the estimate less ``2P/N`` (``stage_1_and_2.py``'s
``step``; the real runs agree). With ZeRO-2's optimizer offload the plan holds one more buffer on the device, as
DeepSpeed does: the staging of offloaded gradients, the largest parameter's size. The real runs are in
``tests/test_plan_sharded.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from hf_paged.cli.config import ConfigError, load_config
from hf_paged.cli.plan import TrainingSetup, build_model, build_optimizer, plan_setup, setup_from_config, zero_settings
from hf_paged.planner import OPTIMIZER_STEP, plan
from hf_paged.sharding import Strategy
from hf_paged.zero_model import ALIGNMENT, REDUCE_BUCKET_SIZE, ZeroSettings, zero2_gradient_partitions

WIDTH, LAYERS, GPUS = 512, 4, 4
"""An MLP whose weights (262,144 elements each) are above DeepSpeed's persistence threshold, on 4 GPUs."""


def _mlp() -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))).to(torch.bfloat16)


def _plan(strategy: str | Strategy, device: str = "cpu"):
    return plan(
        _mlp,
        lambda: torch.randn(8, WIDTH, dtype=torch.bfloat16),
        lambda model: torch.optim.AdamW(model.parameters(), foreach=False),
        loss=lambda model, inputs: model(inputs).float().pow(2).mean(),
        strategy=strategy,
        world_size=GPUS,
        device=device,
    )


def _model_states(planned) -> int:
    """Weights, gradients and optimizer state at the optimizer step's peak (bytes)."""
    kinds = planned.peak(OPTIMIZER_STEP).by_kind
    return kinds["trainable_weights"] + kinds["gradients"] + kinds["optimizer_state"]


PARAMS = LAYERS * (WIDTH * WIDTH + WIDTH)
LARGEST = WIDTH * WIDTH + WIDTH

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


@needs_deepspeed
@pytest.mark.parametrize(("strategy", "device", "offload"), [("zero2", "cpu", False), ("zero2_offload", "cuda", True)])
def test_zero2_model_states_are_deepspeeds_estimate(strategy: str, device: str, offload: bool) -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, estimate = estimate_zero2_model_states_mem_needs(PARAMS, num_gpus_per_node=GPUS, cpu_offload=offload)
    staging = 2 * WIDTH * WIDTH if offload else 0  # bf16, the largest parameter
    freed = 0 if offload else 2 * PARAMS // GPUS  # the 16-bit gradient partition, freed before the group's step
    planned = _model_states(_plan(strategy, device))
    print(f"{strategy}: planned {planned}, DeepSpeed's estimate {estimate} (+{staging} of offload staging, -{freed})")
    assert abs(planned / (estimate + staging - freed) - 1) < 0.005


@needs_deepspeed
@pytest.mark.parametrize(
    ("strategy", "device", "offload", "offload_params"),
    [
        ("zero3", "cpu", False, False),
        ("zero3_offload_optimizer", "cuda", True, False),
        ("zero3_offload", "cuda", True, True),
    ],
)
def test_zero3_model_states_are_deepspeeds_estimate_but_for_what_they_count_differently(
    strategy: str, device: str, offload: bool, offload_params: bool
) -> None:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    _, estimate, largest_layer = estimate_zero3_model_states_mem_needs(
        PARAMS, LARGEST, num_gpus_per_node=GPUS, cpu_offload=offload, cpu_offload_params=offload_params
    )
    expected = estimate - largest_layer + (0 if offload else 2 * PARAMS // GPUS)
    planned = _model_states(_plan(strategy, device))
    print(f"{strategy}: planned {planned}, DeepSpeed's estimate {estimate} ({largest_layer} of a gathered layer)")
    assert abs(planned - expected) <= max(0.005 * expected, 4096)


def test_the_reduce_bucket_is_a_communication_buffer_of_deepspeeds_default_size() -> None:
    """ZeRO-2's reduce bucket lives through backward only; ZeRO-3's from the engine's start; at the step each rank
    holds the whole 16-bit weights and its fp32 master partition under ZeRO-2, its partition of both under ZeRO-3."""
    zero2, zero3 = _plan("zero2"), _plan("zero3")
    bucket = REDUCE_BUCKET_SIZE * 2  # bf16
    assert zero2.peak("forward_backward").by_kind["communication"] == bucket
    assert zero2.peak(OPTIMIZER_STEP).by_kind["communication"] == 0
    assert zero3.peak(OPTIMIZER_STEP).by_kind["communication"] == bucket
    whole = PARAMS * 2
    partitions = 6 * PARAMS // GPUS  # 2 bytes of bf16, 4 of fp32 master
    assert (
        whole + 4 * PARAMS // GPUS
        <= zero2.peak(OPTIMIZER_STEP).by_kind["trainable_weights"]
        <= whole + 4 * PARAMS // GPUS + 64
    )
    assert partitions <= zero3.peak(OPTIMIZER_STEP).by_kind["trainable_weights"] <= partitions + 64


def _gathered_in_second_backward(**settings: int) -> int:
    """Elements of the MLP's weights gathered whole at the second forward and backward's peak under ZeRO-3 on 4 GPUs,
    with ``settings`` (its partitions and fp32 master partitions aside)."""
    import dataclasses

    from hf_paged.sharding import STRATEGIES

    strategy = dataclasses.replace(STRATEGIES["zero3"], zero=ZeroSettings(param_persistence_threshold=0, **settings))
    planned = _plan(strategy)
    second = next(item for item in planned.phases if item.phase == "forward_backward" and item.step == 2)
    return (second.by_kind["trainable_weights"] - 6 * PARAMS // GPUS) // 2


def test_zero3_gathers_ahead_and_keeps_what_is_reused_soon_as_deepspeed() -> None:
    """At the start of the second backward the last layer is gathered; a layer stays gathered from its forward when the
    layers after it, in forward and backward, hold fewer than ``max_reuse_distance`` elements (the last two for twice a
    layer and one more; all for DeepSpeed's default, 1e9); each module gathers the next ones ahead, up to
    ``prefetch_bucket_size`` elements at a time and ``max_live_parameters`` in all."""
    layer = WIDTH * WIDTH + WIDTH
    alone = _gathered_in_second_backward(max_reuse_distance=0, prefetch_bucket_size=0)
    kept = _gathered_in_second_backward(max_reuse_distance=2 * layer + 1, prefetch_bucket_size=0)
    ahead = _gathered_in_second_backward(
        max_reuse_distance=0, prefetch_bucket_size=layer, max_live_parameters=2 * layer
    )
    defaults = _gathered_in_second_backward()
    assert (alone, kept, ahead, defaults) == (layer, 2 * layer, 2 * layer, LAYERS * layer), (
        alone,
        kept,
        ahead,
        defaults,
    )


def test_zero3_steps_sub_groups_one_at_a_time_and_a_paged_client_takes_them_in_turn() -> None:
    """Sub-groups of about one layer each: the step flattens one sub-group's fp32 gradient at a time, not the whole
    partition's; a paged client steps the sub-groups' masters in turn at one position, as DeepSpeed lists them (it
    refused the second before, as a real run did: tests/test_deepspeed.py), and saves the same."""
    import dataclasses

    import hf_paged
    from hf_paged.sharding import STRATEGIES

    layer = WIDTH * WIDTH + WIDTH
    one_layer = dataclasses.replace(STRATEGIES["zero3"], zero=ZeroSettings(sub_group_size=layer // GPUS + 1))
    whole, split = _plan("zero3"), _plan(one_layer)
    saved = 4 * (PARAMS - 2 * layer) // GPUS
    assert whole.optimizer_step_peak - split.optimizer_step_peak >= saved

    def paged(strategy):
        return plan(
            _mlp,
            lambda: torch.randn(8, WIDTH, dtype=torch.bfloat16),
            lambda model: hf_paged.PagedAdamW8bit(model.parameters(), compiled=False),
            loss=lambda model, inputs: model(inputs).float().pow(2).mean(),
            strategy=strategy,
            world_size=GPUS,
        )

    paged_whole, paged_split = paged(STRATEGIES["zero3"]), paged(one_layer)
    assert paged_whole.optimizer_step_peak - paged_split.optimizer_step_peak >= saved


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ddp_offload", "strategy: ddp has no 'offload'; the strategies with offload are fsdp2_offload, zero2_offload"),
        ("zero4", "strategy must be one of ddp, fsdp2, fsdp2_offload, zero2, zero2_offload, zero3"),
    ],
)
def test_bad_strategies_are_named(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _plan(name)


def test_zero_is_modelled_not_wrapped() -> None:
    with pytest.raises(ValueError, match="wrap: strategy zero2 is DeepSpeed ZeRO, which is modelled, not wrapped"):
        plan(_mlp, lambda: torch.randn(8, WIDTH), torch.optim.AdamW, strategy="zero2", world_size=2, wrap=lambda m: m)


@needs_deepspeed
def test_the_defaults_are_deepspeeds() -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    defaults = DeepSpeedZeroConfig()
    assert ZeroSettings() == ZeroSettings(
        reduce_bucket_size=defaults.reduce_bucket_size, param_persistence_threshold=defaults.param_persistence_threshold
    )


def test_bad_zero_settings_are_named() -> None:
    with pytest.raises(ValueError, match="reduce_bucket_size must be an integer >= 0"):
        ZeroSettings(reduce_bucket_size=-1)


def _setup(deepspeed: object) -> TrainingSetup:
    return setup_from_config(load_config(None, ["model.tiny.hidden_size=64"]), "full").with_changes(
        training={"deepspeed": deepspeed}
    )


def test_zero_settings_come_from_the_deepspeed_config() -> None:
    """DeepSpeed's defaults where the config leaves a key out; ``auto`` as the Trainer fills it from the hidden size."""
    assert zero_settings(_setup(None)) == ZeroSettings()
    settings = zero_settings(
        _setup({"zero_optimization": {"reduce_bucket_size": "auto", "stage3_param_persistence_threshold": 1e3}})
    )
    assert settings == ZeroSettings(reduce_bucket_size=64 * 64, param_persistence_threshold=1000)
    linear = zero_settings(_setup({"zero_optimization": {"memory_efficient_linear": False}}))
    assert linear == ZeroSettings(memory_efficient_linear=False)
    with pytest.raises(ConfigError, match="zero_optimization.memory_efficient_linear must be true or false, got 'no'"):
        zero_settings(_setup({"zero_optimization": {"memory_efficient_linear": "no"}}))
    with pytest.raises(ConfigError, match="zero_optimization.reduce_bucket_size must be a number or 'auto'"):
        zero_settings(_setup({"zero_optimization": {"reduce_bucket_size": "big"}}))
    with pytest.raises(ConfigError, match="training.deepspeed: cannot read a DeepSpeed config"):
        zero_settings(_setup("/nonexistent/ds.json"))
    for key in ("sub_group_size", "stage3_max_live_parameters", "stage3_max_reuse_distance"):
        # the Trainer fills 'auto' in only from the hidden size of the keys above; DeepSpeed's config drops it
        assert zero_settings(_setup({"zero_optimization": {key: "auto"}})) == ZeroSettings(), key


def _frozen_after_trained() -> nn.Module:
    """A trained linear layer, then two frozen ones (as LoRA's base layers), in float32."""
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(3)))
    for layer in model[1:]:
        layer.requires_grad_(False)
    return model


def _frozen_plan(strategy: str, input_requires_grad: bool = False, memory_efficient_linear: bool = True):
    import dataclasses

    from hf_paged.sharding import STRATEGIES

    zero = ZeroSettings(reduce_bucket_size=WIDTH, memory_efficient_linear=memory_efficient_linear)
    return plan(
        _frozen_after_trained,
        lambda: torch.randn(8, WIDTH, requires_grad=input_requires_grad),
        lambda model: torch.optim.AdamW(model.parameters(), foreach=False),
        loss=lambda model, inputs: model(inputs).pow(2).mean(),
        strategy=dataclasses.replace(STRATEGIES[strategy], zero=zero),
        world_size=2,
    )


def test_zero3_saves_the_input_of_every_linear_layer_as_deepspeeds_linear_does() -> None:
    """ZeRO-3 puts DeepSpeed's ``LinearFunctionForZeroStage3`` in place of ``torch.nn.functional.linear``
    (``memory_efficient_linear``, on by default): it saves each layer's input for backward even where the weight is
    frozen, which torch's linear does not. Forward and backward hold the two frozen layers' inputs (8 x 512 float32,
    16 KiB each) more; torch's linear is back after the plan."""
    original = torch.nn.functional.linear
    saving = _frozen_plan("zero3").peak("forward_backward").by_kind["activations"]
    torch_linear = _frozen_plan("zero3", memory_efficient_linear=False).peak("forward_backward").by_kind["activations"]
    assert saving - torch_linear == 2 * 8 * WIDTH * 4
    assert torch.nn.functional.linear is original


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_the_loss_and_inputs_live_through_deepspeeds_step(strategy: str) -> None:
    """DeepSpeed's engine steps inside accelerate's backward, while the Trainer's training step holds the loss and the
    inputs; the loss's graph keeps its leaves with their gradients: an input that requires a gradient (as peft makes
    the embeddings' output for checkpointing) keeps its gradient (8 x 512 float32, 16 KiB) through the step."""
    leaf = _frozen_plan(strategy, input_requires_grad=True).optimizer_step_peak
    assert leaf - _frozen_plan(strategy).optimizer_step_peak == 8 * WIDTH * 4


def test_zero3_optimizer_offload_keeps_an_fp32_gradient_for_each_master_partition() -> None:
    """With optimizer offload, DeepSpeed's ZeRO-3 gives each fp32 master partition an fp32 gradient of its own for the
    whole run (``initialize_optimizer_states``), which its step takes in place of flattening one from the gradient
    partition: planned for the CPU (host memory is the device's), every forward and backward holds ``4P/N`` bytes more
    than without offload, and the step the same."""
    on_device, offloaded = _plan("zero3"), _plan("zero3_offload_optimizer")
    for kept, moved in zip(on_device.phases, offloaded.phases):
        more = 4 * PARAMS // GPUS if kept.phase == "forward_backward" else 0
        assert moved.peak_bytes - kept.peak_bytes == more, (kept.phase, kept.step)


def test_zero3_on_one_rank_gathers_each_parameter_as_a_view_of_its_partition() -> None:
    """On one rank a ZeRO-3 partition is the whole parameter, and DeepSpeed gathers it as a view of it
    (``NoGatherHandle``): forward and backward hold each weight once as its 16-bit partition, beside its fp32 master
    partition (``2P + 4P``), where on 4 ranks they hold a quarter of those plus the layers gathered whole (real runs of
    one process agree: tests/test_plan_sharded.py's ``zero3-1-...`` cases)."""
    one = plan(
        _mlp,
        lambda: torch.randn(8, WIDTH, dtype=torch.bfloat16),
        lambda model: torch.optim.AdamW(model.parameters(), foreach=False),
        loss=lambda model, inputs: model(inputs).float().pow(2).mean(),
        strategy="zero3",
        world_size=1,
    )
    assert one.peak("forward_backward").by_kind["trainable_weights"] == 6 * PARAMS
    sharded = _plan("zero3").peak("forward_backward").by_kind["trainable_weights"]
    assert 6 * PARAMS // GPUS + 2 * LARGEST <= sharded


def _partition(numels: list[int], world_size: int) -> int:
    """Elements of a rank's part of a ZeRO-2 flat buffer of parameters of ``numels`` elements, padded to a multiple of
    ``ALIGNMENT * world_size`` as DeepSpeed pads it."""
    alignment = ALIGNMENT * world_size
    return -(-sum(numels) // alignment) * alignment // world_size


def _deepspeed_gradient_partitions(numels: list[int], partition: int, world_size: int) -> list[int]:
    """Each rank's ZeRO-2 gradient partition of one group, by DeepSpeed's own ``get_partition_info``."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    tensors = [torch.empty(numel, device="meta") for numel in numels]
    return [
        sum(t.numel() for t in DeepSpeedZeroOptimizer.get_partition_info(None, tensors, partition, rank)[0])
        for rank in range(world_size)
    ]


@needs_deepspeed
@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_zero2_gradient_partitions_are_deepspeeds_on_every_rank(world_size: int) -> None:
    generator = torch.Generator().manual_seed(world_size)
    for _ in range(20):
        numels = torch.randint(0, 5000, (int(torch.randint(1, 12, (1,), generator=generator)),), generator=generator)
        numels = numels.tolist()
        partition = _partition(numels, world_size)
        expected = _deepspeed_gradient_partitions(numels, partition, world_size)
        assert zero2_gradient_partitions(numels, partition, world_size) == expected


@needs_deepspeed
def test_zero2_plans_the_largest_rank_s_gradient_partition(tmp_path) -> None:
    """A tied embedding of 2.0M elements first in the decay group, on 2 GPUs: it crosses into rank 1's part, whose
    gradient partition (every parameter with an element in its part, whole) is 1.8x rank 0's. The step holds the
    largest rank's partition beside the fp32 gradient flattened for the group it steps (before: rank 0's)."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=4,
        tie_word_embeddings=True,
        dtype="float32",
    ).save_pretrained(tmp_path)
    overrides = [
        f"model.name={tmp_path}",
        "tokenizer.name=byte",
        "tokenizer.max_length=32",
        "training.per_device_train_batch_size=1",
        "training.optim=adamw_torch",
        "training.optim_args=null",
    ]
    setup = setup_from_config(load_config(None, overrides), "full").with_changes(world_size=2, strategy="zero2")
    groups = [group["params"] for group in build_optimizer(setup, build_model(setup)).param_groups]
    per_rank, partitions = [0, 0], []
    for group in groups:
        numels = [param.numel() for param in group]
        partitions.append(_partition(numels, 2))
        for rank, elements in enumerate(_deepspeed_gradient_partitions(numels, partitions[-1], 2)):
            per_rank[rank] += elements
    assert per_rank[1] > 1.5 * per_rank[0]
    planned = plan_setup(setup, "cpu").peak(OPTIMIZER_STEP).by_kind["gradients"]
    assert planned == 4 * (per_rank[1] + max(partitions))
