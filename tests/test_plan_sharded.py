"""The planner's per-rank peaks of a sharded step against real runs: DDP, FSDP2 and DeepSpeed ZeRO-2 and ZeRO-3 through
the Trainer, 2 and 4 gloo processes on the CPU (issue 39).

Each case plans a small Llama as ``hf-paged plan --gpus N --strategy S`` plans it (a fake process group of N ranks
in this process, rank 0's peaks) and launches ``tests/scripts/sharded_peaks.py`` with ``torchrun`` for N processes,
which trains the same setup for two steps with ``transformers.Trainer`` and takes each rank's peak of each phase
from an allocator that counts every CPU allocation of the process (``tests/device_memory.py``). Every rank's
measured peak must be within 2% of the plan, and the run must show that the engine really took effect (accelerate
drops FSDP on the CPU without a word unless the script enables it).

Under DeepSpeed, accelerate's ``backward`` runs the engine's step too: the script ends forward and backward where the
engine's step begins. The ZeRO cases keep DeepSpeed's defaults but for a reduce bucket of 100,000 elements; the tiny
Llama's parameters are all below DeepSpeed's persistence threshold (1e5 elements), so ZeRO-3 gathers each once per
step in the first step and keeps them whole from its end on, as the plan models.

The default run keeps one launch (FSDP2 on 2 ranks in float32 with the paged 8-bit optimizer under a budget, about
20 s on an idle 2-core machine: bfloat16 matrix products are slow on CPUs without bfloat16 instructions) and the
in-process tests of DDP and FSDP2; the other launches are marked slow.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_paged.cli import main
from hf_paged.cli.config import load_config
from hf_paged.cli.plan import fewest_gpus, format_fewest_gpus, plan_setup, setup_from_config
from hf_paged.planner import FORWARD_BACKWARD, OPTIMIZER_STEP, plan

import device_memory
from plan_utils import SMALL_LLAMA

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "sharded_peaks.py"

TOLERANCE = 0.02
"""Largest relative difference between a planned and a measured per-rank peak (issue 39)."""

PAGED_8BIT = [
    "training.optim=hf_paged_adamw_8bit",
    "training.optim_args=page_size=64KiB,min_8bit_size=1024,device_budget=128KiB",
]
ADAMW = ["training.optim=adamw_torch", "training.optim_args=null"]
BFLOAT16 = ["model.dtype=bfloat16", "lora.compute_dtype=bfloat16"]
NO_CHECKPOINTING = ["lora.gradient_checkpointing=false"]
BF16_TRAINING = ["training.bf16=true", "training.use_cpu=true"]
"""The Trainer in bf16, which DeepSpeed's ``bf16: auto`` follows (``use_cpu`` as the launched ranks set it, so that the
plan's ``TrainingArguments`` accept bf16 on a machine without a GPU)."""
SMALL_BUCKET = "training.deepspeed={zero_optimization: {reduce_bucket_size: 100000}}"
"""DeepSpeed's reduce bucket of 100,000 elements (its default, 5e8, would outweigh everything else of a small Llama)."""
GATHERED = (
    "training.deepspeed={zero_optimization: {reduce_bucket_size: 100000, stage3_param_persistence_threshold: 1000, "
    "stage3_max_reuse_distance: 0, stage3_prefetch_bucket_size: 0}}"
)
"""ZeRO-3 gathers the small Llama's matrices for each use and releases them after it (none persists, none is kept for
its reuse, none is prefetched)."""
PREFETCHED = (
    "training.deepspeed={zero_optimization: {reduce_bucket_size: 100000, stage3_param_persistence_threshold: 1000, "
    "stage3_max_reuse_distance: 0}}"
)
"""As :data:`GATHERED`, with DeepSpeed's prefetch: from the second forward on, the first module gathers all the others'
matrices ahead."""

CASES = {
    "fsdp2-2-full-float32-paged": ("fsdp2", 2, "full", [*PAGED_8BIT, *NO_CHECKPOINTING]),
    "fsdp2-2-full-bfloat16-paged": ("fsdp2", 2, "full", [*BFLOAT16, *PAGED_8BIT, *NO_CHECKPOINTING]),
    "ddp-2-full-float32": ("ddp", 2, "full", [*ADAMW, *NO_CHECKPOINTING]),
    "ddp-4-full-bfloat16": ("ddp", 4, "full", [*BFLOAT16, *ADAMW, *NO_CHECKPOINTING]),
    "ddp-2-lora-checkpointing": ("ddp", 2, "lora", ADAMW),
    "ddp-2-full-float32-paged": ("ddp", 2, "full", [*PAGED_8BIT, *NO_CHECKPOINTING]),
    "fsdp2-2-full-float32": ("fsdp2", 2, "full", [*ADAMW, *NO_CHECKPOINTING]),
    "fsdp2-4-full-float32": ("fsdp2", 4, "full", [*ADAMW, *NO_CHECKPOINTING]),
    "fsdp2-4-full-bfloat16-paged": ("fsdp2", 4, "full", [*BFLOAT16, *PAGED_8BIT, *NO_CHECKPOINTING]),
    "fsdp2-2-lora-checkpointing": ("fsdp2", 2, "lora", ADAMW),
    "fsdp2_offload-2-full-bfloat16": ("fsdp2_offload", 2, "full", [*BFLOAT16, *ADAMW, *NO_CHECKPOINTING]),
    "fsdp2_offload-4-full-float32-paged": ("fsdp2_offload", 4, "full", [*PAGED_8BIT, *NO_CHECKPOINTING]),
    "fsdp2_offload-2-lora-bfloat16": ("fsdp2_offload", 2, "lora", [*BFLOAT16, *ADAMW]),
    "zero2-2-full-float32": ("zero2", 2, "full", [*ADAMW, *NO_CHECKPOINTING, SMALL_BUCKET]),
    "zero2-2-full-float32-paged": ("zero2", 2, "full", [*PAGED_8BIT, *NO_CHECKPOINTING, SMALL_BUCKET]),
    "zero3-2-full-float32": ("zero3", 2, "full", [*ADAMW, *NO_CHECKPOINTING, SMALL_BUCKET]),
    "zero3-2-full-float32-paged": ("zero3", 2, "full", [*PAGED_8BIT, *NO_CHECKPOINTING, SMALL_BUCKET]),
    "zero3-2-full-float32-paged-gathered": ("zero3", 2, "full", [*PAGED_8BIT, *NO_CHECKPOINTING, GATHERED]),
    "zero3-2-full-float32-paged-prefetched": ("zero3", 2, "full", [*PAGED_8BIT, *NO_CHECKPOINTING, PREFETCHED]),
    "zero3-2-full-float32-checkpointing-gathered": ("zero3", 2, "full", [*ADAMW, GATHERED]),
    "zero3-2-lora-checkpointing": ("zero3", 2, "lora", [*ADAMW, SMALL_BUCKET]),
    "zero2-2-lora-checkpointing": ("zero2", 2, "lora", [*ADAMW, SMALL_BUCKET]),
    "zero3_offload_optimizer-2-full-float32": (
        "zero3_offload_optimizer",
        2,
        "full",
        [*ADAMW, *NO_CHECKPOINTING, SMALL_BUCKET],
    ),
    "zero3_offload-2-full-float32": ("zero3_offload", 2, "full", [*ADAMW, *NO_CHECKPOINTING, SMALL_BUCKET]),
    "zero2_offload-2-full-float32-paged": ("zero2_offload", 2, "full", [*PAGED_8BIT, *NO_CHECKPOINTING, SMALL_BUCKET]),
    "zero2-2-full-bfloat16": ("zero2", 2, "full", [*BFLOAT16, *BF16_TRAINING, *ADAMW, *NO_CHECKPOINTING, SMALL_BUCKET]),
    "zero3-2-full-bfloat16-paged-gathered": (
        "zero3",
        2,
        "full",
        [*BFLOAT16, *BF16_TRAINING, *PAGED_8BIT, *NO_CHECKPOINTING, GATHERED],
    ),
    # QLoRA, whose step peak is the smallest (0.57 MB under FSDP2 with bfloat16 storage), shows most what the Trainer
    # holds beside the model: the step's batch (batch_samples, 3 x 2 x 128 int64 = 6,144 bytes) until the next step's
    # is fetched, and the next one that accelerate's DataLoaderShard fetched ahead (6,144 more), which the plan holds
    # as the Trainer does (hf_paged.cli.plan.trainer_batches); before, it freed each batch after its backward and
    # planned these steps 0.978-0.990 of the measured peaks. The script's data loader has a step more than it trains,
    # so that the last step holds one ahead too, as in a longer run.
    "ddp-2-qlora-checkpointing": ("ddp", 2, "qlora", ADAMW),
    "ddp-2-qlora-bfloat16-paged": ("ddp", 2, "qlora", [*BFLOAT16, *PAGED_8BIT]),
    "fsdp2-2-qlora-checkpointing": ("fsdp2", 2, "qlora", ADAMW),
    "fsdp2_offload-2-qlora-checkpointing": ("fsdp2_offload", 2, "qlora", ADAMW),
    # The 4-bit weights stored in bfloat16, which accelerate's FSDP2 shards (see CASE_TOLERANCE).
    "fsdp2-2-qlora-bfloat16-storage": ("fsdp2", 2, "qlora", [*ADAMW, "lora.quant_storage=bfloat16"]),
    "fsdp2-4-qlora-bfloat16-storage-paged": ("fsdp2", 4, "qlora", [*PAGED_8BIT, "lora.quant_storage=bfloat16"]),
    # DeepSpeed's ZeRO-3 partitions the 4-bit weights of either storage, and holds each whole from its forward to the
    # end of the step (see test_zero3_partitions_qlora_4bit_weights_and_holds_them_whole_through_the_step).
    "zero3-2-qlora-checkpointing-gathered": ("zero3", 2, "qlora", [*ADAMW, GATHERED]),
    "zero3-2-qlora-bfloat16-storage-gathered": ("zero3", 2, "qlora", [*ADAMW, GATHERED, "lora.quant_storage=bfloat16"]),
    # ZeRO-3 on one GPU, as --fewest-gpus plans it (DeepSpeed partitions for one rank too)
    "zero3-1-qlora-checkpointing-gathered": ("zero3", 1, "qlora", [*ADAMW, GATHERED]),
    "zero3-1-full-float32-paged-gathered": ("zero3", 1, "full", [*PAGED_8BIT, *NO_CHECKPOINTING, GATHERED]),
}
DEFAULT_RUN = ("fsdp2-2-full-float32-paged",)

CASE_TOLERANCE = {
    "zero3-2-full-float32-paged": 0.08,
    "zero3-2-full-float32-paged-prefetched": 0.08,
    "zero3-2-lora-checkpointing": 0.12,
    "zero3_offload_optimizer-2-full-float32": 0.08,
    "zero3_offload-2-full-float32": 0.08,
}
"""Cases that miss :data:`TOLERANCE`, by what they measured. Gloo's all-gather allocates a copy of its output while
the collective is in flight (measured: 2 MB for 2 MB of output, as a list or into one tensor); ZeRO-3 gathers many
parameters at once, asynchronously, at the end of each step (the persistent ones) and in a prefetch, so that on the
CPU it holds up to about the gathered parameters again: the steps of ``zero3-2-full-float32-paged`` (where that gather
is the step's peak: with ``adamw_torch`` the peak is the client's update, and within 0.1%) are 6.9% above the plan,
the second forward and backward of ``...-prefetched`` 7.4%. NCCL's all-gather writes into its output, so on GPUs
these are not allocated; the plan leaves them out. Every other phase of these cases is within 0.3%. The step of
``zero3-2-lora-checkpointing`` is such a gather too (LoRA's step updates little; all 49 parameters persist): planned
0.908-0.923 of the measured peak in three runs, about 374 KB of gloo's copies in flight (a 44,032-element weight on the
main thread, two smaller ones on gloo's threads, as a profile of the run showed; how many depends on how far gloo's
threads got); its forward and backward within 0.1%. So are the steps of ``zero3_offload_optimizer-2-full-float32`` and
``zero3_offload-2-full-float32`` (with ``adamw_torch``, whose update on the small Llama is smaller than that gather):
planned 0.950-0.953 of the measured peak, about 360-380 KB of gloo's copies; their forward and backward within 1.3%.
"""


OUT_OF_MEMORY = "hf-paged test device: out of memory"


def launch(
    strategy: str, world_size: int, method: str, overrides: list[str], folder: Path, *options: str
) -> list[dict] | None:
    """Every rank's result of ``sharded_peaks.py`` under ``torchrun`` with ``world_size`` processes (``options``: more
    of its arguments); ``None`` when a rank ran out of the pseudo-device's memory (``--cap``)."""
    device_memory.build()  # once, before the ranks load it
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size),
        str(SCRIPT), "--strategy", strategy, "--method", method, "--output", str(folder), *options,
        *(item for override in overrides for item in ("--set", override)),
    ]  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    folder.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        command, check=False, cwd=REPO, capture_output=True, text=True, env=environment, timeout=600
    )
    if result.returncode != 0 and OUT_OF_MEMORY in result.stderr:
        return None
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def check_engine(strategy: str, world_size: int, facts: dict) -> None:
    """The engine really took effect on this rank."""
    assert (facts["world_size"], facts["backend"]) == (world_size, "gloo"), facts
    if strategy.startswith("zero"):
        stage = 3 if strategy.startswith("zero3") else 2
        assert facts["distributed_type"] == "DistributedType.DEEPSPEED", facts
        assert facts["zero"][:3] == [stage, "offload" in strategy, strategy == "zero3_offload"], facts
    elif strategy == "ddp":
        assert facts["ddp"] and facts["distributed_type"] == "DistributedType.MULTI_CPU", facts
        assert facts["sharded_params"] == 0, facts
    else:
        assert facts["distributed_type"] == "DistributedType.FSDP" and not facts["ddp"], facts
        # accelerate leaves QLoRA's 4-bit weights (frozen, of an integer storage) out of fully_shard: whole on each rank
        assert facts["fsdp_modules"] >= 3 and facts["sharded_params"] == facts["params"] - facts["params4bit"], facts
        assert facts["offload"] == [strategy == "fsdp2_offload"], facts


def _case(name: str):
    marks = () if name in DEFAULT_RUN else (pytest.mark.slow,)
    return pytest.param(name, id=name, marks=marks)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("case", [_case(name) for name in CASES])
def test_each_rank_peaks_as_planned(case: str, tmp_path: Path) -> None:
    strategy, world_size, method, overrides = CASES[case]
    setup = setup_from_config(load_config(None, [*SMALL_LLAMA, *overrides]), method)
    planned = plan_setup(setup.with_changes(world_size=world_size, strategy=strategy), "cpu")
    assert (planned.world_size, planned.strategy) == (world_size, strategy)
    ranks = launch(strategy, world_size, method, [*SMALL_LLAMA, *overrides], tmp_path)
    assert ranks is not None
    failures = []
    for rank, result in enumerate(ranks):
        check_engine(strategy, world_size, result["facts"])
        measured = [tuple(item) for item in result["peaks"]]
        assert [(phase, step) for phase, step, _ in measured] == [(item.phase, item.step) for item in planned.phases]
        for item, (_, _, truth) in zip(planned.phases, measured):
            ratio = item.peak_bytes / truth
            print(
                f"rank {rank} {item.phase} step {item.step}: planned {item.peak_bytes}, measured {truth}, {ratio:.4f}"
            )
            if abs(ratio - 1) > CASE_TOLERANCE.get(case, TOLERANCE):
                failures.append(
                    f"rank {rank} {item.phase} step {item.step}: planned {item.peak_bytes}, measured {truth}"
                )
    assert not failures, failures


class _SquaredMean(torch.nn.Module):
    def __init__(self, layers: int = 4, width: int = 256) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            inputs = torch.relu(layer(inputs))
        return inputs.pow(2).mean()


def _plain_plan(**sharding):
    return plan(
        _SquaredMean,
        lambda: torch.randn(32, 256),
        lambda model: torch.optim.AdamW(model.parameters(), foreach=False),
        loss=lambda model, inputs: model(inputs),
        **sharding,
    )


def test_fsdp2_shards_weights_gradients_and_state_and_gathers_a_layer_at_a_time() -> None:
    """Each rank of 4 holds a quarter of the weights, gradients and Adam state; forward and backward gather one
    layer's weights at a time (two with the prefetch of the next), in buffers named communication."""
    single = _plain_plan()
    sharded = _plain_plan(strategy="fsdp2", world_size=4)
    layer = (256 * 256 + 256) * 4
    whole, quarter = single.peak(OPTIMIZER_STEP).by_kind, sharded.peak(OPTIMIZER_STEP).by_kind
    assert whole["trainable_weights"] == 4 * layer
    assert quarter["trainable_weights"] == quarter["gradients"] == layer
    assert quarter["optimizer_state"] <= whole["optimizer_state"] / 4 + 64
    gathered = sharded.peak(FORWARD_BACKWARD).by_kind
    assert gathered["communication"] > 0
    assert layer < gathered["trainable_weights"] <= layer + 2 * layer  # the shards and at most two gathered layers
    assert not torch.distributed.is_initialized()  # the fake world is gone


def test_ddp_keeps_a_bucket_for_every_gradient() -> None:
    """DDP's buckets hold a copy of every gradient beside the gradients themselves (gradient_as_bucket_view off)."""
    single = _plain_plan()
    ddp = _plain_plan(strategy="ddp", world_size=8)
    for phase in (FORWARD_BACKWARD, OPTIMIZER_STEP):
        gradients = single.peak(OPTIMIZER_STEP).by_kind["gradients"]
        assert ddp.peak(phase).by_kind["communication"] == gradients
        assert ddp.peak(phase).peak_bytes == single.peak(phase).peak_bytes + gradients


def test_cpu_offload_for_an_accelerator_keeps_shards_gradients_and_the_step_in_host_memory() -> None:
    """Planned for CUDA, FSDP2's CPU offload leaves on the device only what a group gathers while it runs (and the
    copies of its shards it gathers from): no shard, sharded gradient or optimizer state, and the optimizer step
    allocates nothing there; without offload the shards, their gradients and the state are the device's."""
    on_device = _plain_plan(strategy="fsdp2", world_size=4, device="cuda")
    offloaded = _plain_plan(strategy="fsdp2_offload", world_size=4, device="cuda")
    workspace = 32 * 2**20
    step = offloaded.peak(OPTIMIZER_STEP).by_kind
    assert step["trainable_weights"] == step["gradients"] == step["optimizer_state"] == 0
    assert offloaded.optimizer_step_peak == workspace
    kept = on_device.peak(OPTIMIZER_STEP).by_kind
    assert kept["trainable_weights"] > 0 and kept["gradients"] > 0 and kept["optimizer_state"] > 0
    layer = (256 * 256 + 256) * 4
    gathered = offloaded.peak(FORWARD_BACKWARD).by_kind
    assert 0 < gathered["trainable_weights"] <= 2 * layer + 2 * 512
    assert offloaded.forward_backward_peak < on_device.forward_backward_peak


def test_fsdp2_keeps_qlora_4bit_weights_whole_and_shards_the_rest() -> None:
    """accelerate leaves frozen 4-bit weights of an integer storage out of ``fully_shard`` (it finds bitsandbytes'
    ``Params4bit`` by class name), so each rank of FSDP2 keeps QLoRA's 4-bit weights and their quantization state
    whole and shards the rest. The planner's 4-bit shells are plain parameters of fake tensors: before they were left
    out as accelerate leaves out the real ones, planning QLoRA under FSDP2 failed on the nested offset's value that
    bitsandbytes reads for the state dict accelerate takes, and then FSDP2 sharded the shells."""
    setup = setup_from_config(
        load_config(None, [*SMALL_LLAMA, "model.tiny.num_hidden_layers=1", "tokenizer.max_length=16", *ADAMW]), "qlora"
    )
    whole = plan_setup(setup, "cpu").peak(OPTIMIZER_STEP).by_kind
    half = plan_setup(setup.with_changes(world_size=2, strategy="fsdp2"), "cpu").peak(OPTIMIZER_STEP).by_kind
    packed = (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 344) // 2  # q, o; k, v; gate, up, down at 4 bits
    assert half["quantization_state"] == whole["quantization_state"] > 0
    assert half["trainable_weights"] * 2 == whole["trainable_weights"]  # LoRA's adapters, sharded
    assert 0 <= half["frozen_weights"] - (packed + (whole["frozen_weights"] - packed) // 2) < 1024, (half, whole)


def _qlora_step_kinds(strategy: str, overrides: list[str]) -> dict[str, tuple[dict, dict]]:
    """For each 4-bit storage, the kinds at the step's peak of a one-layer QLoRA on one device and on a rank of 2."""
    lines = [*SMALL_LLAMA, "model.tiny.num_hidden_layers=1", "tokenizer.max_length=16", *ADAMW, *BFLOAT16, *overrides]
    stored = {}
    for storage in ("uint8", "bfloat16"):
        setup = setup_from_config(load_config(None, [*lines, f"lora.quant_storage={storage}"]), "qlora")
        whole = plan_setup(setup, "cpu").peak(OPTIMIZER_STEP).by_kind
        half = plan_setup(setup.with_changes(world_size=2, strategy=strategy), "cpu").peak(OPTIMIZER_STEP).by_kind
        assert half["quantization_state"] == whole["quantization_state"] > 0
        stored[storage] = (whole, half)
    assert stored["bfloat16"][0] == stored["uint8"][0]  # one device: the same bytes, only their dtype differs
    return stored


PACKED = (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 344) // 2
"""The one-layer small Llama's packed 4-bit weights (bytes): q, o; k, v; gate, up, down at 4 bits."""


def test_qlora_4bit_weights_stored_in_bfloat16_are_sharded() -> None:
    """With ``lora.quant_storage=bfloat16`` the packed 4-bit weights are floating-point parameters, which FSDP2 (through
    accelerate) shards: at the step a rank of 2 holds half of every frozen weight, the packed ones included (within a
    row of padding per tensor), and the whole quantization state, which is no parameter. Before, the plan built uint8
    shells whatever the key said; then peft's k-bit preparation cast the bfloat16 shells to float32 (it spares
    bitsandbytes' ``Params4bit`` by class name), and FSDP2's gathered weight lacked the quantization state."""
    stored = _qlora_step_kinds("fsdp2", [])
    whole, half = stored["bfloat16"]
    assert 0 <= half["frozen_weights"] - whole["frozen_weights"] // 2 < 1024, (half, whole)
    assert stored["uint8"][1]["frozen_weights"] - half["frozen_weights"] == PACKED // 2


def test_zero3_partitions_qlora_4bit_weights_and_holds_them_whole_through_the_step() -> None:
    """DeepSpeed's ZeRO-3 partitions QLoRA's 4-bit weights whatever their storage (uint8 ones too: each rank's
    ``ds_tensor`` holds half), and releases a gathered one as every parameter, by making ``param.data`` an empty tensor.
    bitsandbytes' ``MatMul4Bit`` keeps a view of the gathered weight in ``ctx.tensors`` (a plain attribute, not a saved
    tensor, so backward does not free it), and under DeepSpeed the graph lives through the engine's step, which runs
    inside accelerate's backward while the Trainer holds the loss: at the step a rank holds its half of every frozen
    weight and the whole packed weights again, with either storage (measured in ``zero3-2-qlora-*`` of :data:`CASES`:
    14 uint8 tensors of 181,248 bytes in all, each ``(N, 1)``, held by ``MatMul4BitBackward``). Before, the plan kept
    uint8 weights whole and unpartitioned and freed bfloat16 ones in place, which frees the view too: the step planned
    0.943 (uint8) and 0.889 (bfloat16) of the measured peak."""
    stored = _qlora_step_kinds(
        "zero3", ["training.deepspeed={zero_optimization: {stage3_param_persistence_threshold: 0}}"]
    )
    assert stored["uint8"][1] == stored["bfloat16"][1]
    whole, half = stored["uint8"]
    assert 0 <= half["frozen_weights"] - (whole["frozen_weights"] // 2 + PACKED) < 1024, (half, whole)


def test_bad_sharding_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="strategy must be one of ddp, fsdp2, fsdp2_offload"):
        _plain_plan(strategy="fsdp3", world_size=2)
    with pytest.raises(ValueError, match="world_size > 1 and wrap need a strategy"):
        _plain_plan(world_size=2)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        _plain_plan(strategy="ddp", world_size=0)


def test_a_process_with_a_process_group_is_refused(tmp_path: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already has a default process group"):
            _plain_plan(strategy="fsdp2", world_size=2)
    finally:
        dist.destroy_process_group()


PARAMETER_HEAVY_LLAMA = [
    "model.tiny.hidden_size=256",
    "model.tiny.intermediate_size=688",
    "model.tiny.num_hidden_layers=4",
    "model.tiny.num_attention_heads=4",
    "model.tiny.num_key_value_heads=2",
    "tokenizer.max_length=32",
    "training.per_device_train_batch_size=1",
    "lora.gradient_checkpointing=false",
    "training.optim=hf_paged_adamw_32bit",
    "training.optim_args=page_size=64KiB",
]
"""A Llama of 3 million parameters trained on short sequences: its weights, gradients and fp32 Adam state (12, 12 and
24 MB) outweigh its activations, so that where the state rests decides how many GPUs it needs."""

CAP = 36_000_000
"""The pseudo-device's memory in the fewest-GPUs check (bytes)."""


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_the_fewest_gpus_are_the_fewest_processes_that_train_under_a_memory_cap(tmp_path: Path) -> None:
    """``--fewest-gpus`` for FSDP2 on GPUs of 36 MB, planned for the CPU as a pseudo-device (host memory apart), is
    3 without paging and 2 with paging; real runs through the Trainer with the counting allocator capped at 36 MB, a
    paged optimizer's host pages apart, agree: without paging (no budget, and no recovery of an out-of-memory error
    in the step by paging) 2 processes run out of memory and 3 train; with paging (the planned budget) two processes
    train. The cap leaves 5.2 MB above the plan of 3 ranks (30.8 MB), room for gloo's reduce-scatter copy (one decoder
    layer's gradients, 2.9 MB) where its worker frees it late, which tests/scripts/sharded_peaks.py waits for under
    FSDP2 (README.md, Planning memory). One GPU is planned wrapped in FSDP2, as ``accelerate launch`` starts one
    process of an FSDP config on accelerators (through torchrun); on the CPU it starts one unwrapped, so no run here
    checks that count. (One process without FSDP2 is the DDP row's count.)"""
    setup = setup_from_config(load_config(None, PARAMETER_HEAVY_LLAMA), "full")
    (count,) = fewest_gpus(setup, "cpu", CAP, ["fsdp2"], limit=4, host_memory_apart=True)
    print(format_fewest_gpus(setup, "cpu", CAP, [count]))
    assert (count.gpus, count.paged_gpus) == (3, 2), (count.gpus, count.paged_gpus)
    assert count.budget is not None and count.budget >= 64 * 1024

    def trains(world_size: int, budget: int | None, name: str) -> bool:
        return _trains_under_cap("fsdp2", world_size, budget, tmp_path / name)

    assert trains(2, count.budget, "paged-2")
    assert [trains(world_size, None, f"unpaged-{world_size}") for world_size in (2, 3)] == [False, True]


def _trains_under_cap(
    strategy: str, world_size: int, budget: int | None, folder: Path, overrides: tuple[str, ...] = (), cap: int = CAP
) -> bool:
    """Whether ``PARAMETER_HEAVY_LLAMA`` trains on ``world_size`` processes of ``strategy`` with the counting allocator
    capped at ``cap`` (a paged optimizer's host pages apart): with the paged optimizer's ``budget``, or without
    paging (no budget, and no recovery of an out-of-memory error in the step by paging). On the CPU accelerate leaves
    one process of DDP or FSDP2 unwrapped (checked for DDP; not called for FSDP2's one process), and DeepSpeed's ZeRO
    applies on one process too (``overrides``: more config keys; ``cap``: the pseudo-device's bytes)."""
    optim_args = "page_size=64KiB" if budget is None else f"page_size=64KiB,device_budget={budget}"
    overrides = [*PARAMETER_HEAVY_LLAMA, *overrides, f"training.optim_args={optim_args}"]
    options = ["--cap", str(cap), "--host-apart", *(["--no-step-recovery"] if budget is None else [])]
    ranks = launch(strategy, world_size, "full", overrides, folder, *options)
    peaks = "out of memory" if ranks is None else [max(peak for *_, peak in rank["peaks"]) for rank in ranks]
    print(f"{strategy} on {world_size} process(es), budget {budget}: peaks {peaks} (cap {cap})")
    if ranks is not None and world_size == 1 and strategy == "ddp":
        assert not ranks[0]["facts"]["ddp"], ranks[0]["facts"]
    elif ranks is not None:
        check_engine(strategy, world_size, ranks[0]["facts"])
    return ranks is not None


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_for_ddp_paging_is_what_brings_the_count_to_one(tmp_path: Path) -> None:
    """DDP keeps the whole weights, gradients and optimizer state on every rank, and from two ranks on a bucket for
    every gradient as well: a rank's peak never falls with the count, so DDP's fewest GPUs is one or none, and only
    paging can lower it (from none to one). On GPUs of 36 MB (the model and cap of the FSDP2 check above)
    ``--fewest-gpus`` for DDP is none without paging (two GPUs answer for every count) and one with paging; real runs
    through the Trainer with the counting allocator capped at 36 MB agree: without paging one and two processes run
    out of memory, with the planned budget one process trains, and two processes with that budget run out of memory
    (the buckets), as their plan says. (The planned budget is the largest that fits: the one process measured a peak
    of 35.95 MB, 54 KB under the cap.)"""
    setup = setup_from_config(load_config(None, PARAMETER_HEAVY_LLAMA), "full")
    (count,) = fewest_gpus(setup, "cpu", CAP, ["ddp"], limit=4, host_memory_apart=True)
    print(format_fewest_gpus(setup, "cpu", CAP, [count]))
    assert (count.gpus, count.paged_gpus) == (None, 1), (count.gpus, count.paged_gpus)
    assert count.budget is not None and count.budget >= 64 * 1024
    budgeted = setup.with_changes(
        world_size=2, strategy="ddp", training={"optim_args": f"page_size=64KiB,device_budget={count.budget}"}
    )
    two = plan_setup(budgeted, "cpu", True)
    print(f"ddp on 2 GPUs with the budget: peak {two.peak_bytes} bytes, cap {CAP}")
    assert not two.fits(CAP)
    runs = {
        name: _trains_under_cap("ddp", world_size, budget, tmp_path / name)
        for name, world_size, budget in (
            ("paged-1", 1, count.budget),
            ("unpaged-1", 1, None),
            ("unpaged-2", 2, None),
            ("paged-2", 2, count.budget),
        )
    }
    assert runs == {"paged-1": True, "unpaged-1": False, "unpaged-2": False, "paged-2": False}, runs


def _cli(capsys, *arguments: str) -> tuple[int, str, str]:
    status = main(["plan", "--device", "cpu", *arguments])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.slow  # the report traces six other optimizers' state too: about 40 s of CPU
def test_the_command_plans_one_rank_by_kind(capsys) -> None:
    """``hf-paged plan --gpus 2 --strategy ddp`` plans one rank: the description says so and DDP's gradient buckets
    are a row of their own."""
    overrides = [item for override in [*SMALL_LLAMA, *ADAMW, *NO_CHECKPOINTING] for item in ("--set", override)]
    status, out, _ = _cli(capsys, *overrides, "--method", "full", "--gpus", "2", "--strategy", "ddp")
    assert status == 0, out
    assert "ddp on 2 GPUs (one rank's memory)" in out
    assert "communication buffers" in out


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("--gpus", "2"), "--gpus 2 needs a --strategy (one of ddp, fsdp2, fsdp2_offload, zero2"),
        (("--gpus", "0", "--strategy", "ddp"), "--gpus must be an integer >= 1, got 0"),
        (("--gpus", "2", "--strategy", "zero4"), "--strategy must be one of ddp, fsdp2, fsdp2_offload, zero2"),
        (("--gpus", "2", "--strategy", "ddp_offload"), "--strategy: ddp has no 'offload'; the strategies with offload"),
        (("--fewest-gpus",), "--fewest-gpus needs --device-memory"),
        (("--fewest-gpus", "--device-memory", "1GiB", "--gpus", "2"), "--fewest-gpus finds the count itself"),
        (("--fewest-gpus", "--device-memory", "1GiB", "--strategy", "zero4"), "--strategy must be one of ddp"),
    ],
)
def test_bad_command_arguments_are_named(capsys, arguments: tuple[str, ...], message: str) -> None:
    status, _, err = _cli(capsys, *arguments)
    assert status == 2 and message in err, err


def test_fewest_gpus_of_a_config_no_strategy_can_plan_is_a_bad_argument(capsys) -> None:
    """Exit status 1 says that no strategy fits; a config that none can plan (here: targets that match no module)
    is exit status 2, as without --fewest-gpus, with the reason."""
    overrides = ("--set", "model.tiny.num_hidden_layers=1", "--set", "lora.target_modules=[bogus_proj]")
    status, out, _ = _cli(capsys, *overrides, "--fewest-gpus", "--device-memory", "1GiB", "--strategy", "ddp")
    assert status == 2, out
    assert "ddp: lora.target_modules: 'bogus_proj' matches no module" in out


def test_one_gpu_of_ddp_is_planned_unwrapped() -> None:
    """accelerate wraps DDP only for several processes, so ``--gpus 1 --strategy ddp`` plans (and names) one process
    without a strategy, not a rank of DDP with gradient buckets. (FSDP2 wraps one process that ``accelerate launch``
    starts.)"""
    overrides = [*SMALL_LLAMA, "model.tiny.num_hidden_layers=1", *ADAMW, *NO_CHECKPOINTING]
    setup = setup_from_config(load_config(None, overrides), "full")
    alone = plan_setup(setup)
    one_rank = setup.with_changes(world_size=1, strategy="ddp")
    wrapped = plan_setup(one_rank)
    assert [phase.peak_bytes for phase in wrapped.phases] == [phase.peak_bytes for phase in alone.phases]
    assert one_rank.describe() == setup.describe()


def test_one_gpu_of_fsdp2_is_planned_wrapped() -> None:
    """``accelerate launch`` wraps one process of an FSDP config on accelerators (it starts torchrun), so
    ``--fewest-gpus`` plans FSDP2's count of one as a rank of FSDP2, as ``--gpus 1 --strategy fsdp2`` plans it, not as
    one process without a strategy (the DDP row's count)."""
    overrides = [*SMALL_LLAMA, "model.tiny.num_hidden_layers=1", *ADAMW, *NO_CHECKPOINTING]
    setup = setup_from_config(load_config(None, overrides), "full")
    wrapped = plan_setup(setup.with_changes(world_size=1, strategy="fsdp2"))
    assert wrapped.peak_bytes != plan_setup(setup).peak_bytes
    (count,) = fewest_gpus(setup, "cpu", 2 * wrapped.peak_bytes, ["fsdp2"], limit=2)
    assert count.gpus == 1 and (count.plan.world_size, count.plan.strategy) == (1, "fsdp2")
    assert [phase.peak_bytes for phase in count.plan.phases] == [phase.peak_bytes for phase in wrapped.phases]


class _Peak:
    """What the search reads of a plan: whether it fits."""

    def __init__(self, peak_bytes: int) -> None:
        self.peak_bytes = peak_bytes

    def fits(self, capacity: int) -> bool:
        return self.peak_bytes <= capacity


@pytest.mark.parametrize(
    ("capacity", "expected", "plans"),
    [(100, 1, 1), (60, 2, 2), (47, 3, 4), (40, 4, 4), (33, 7, 5), (30, 8, 5), (29, None, 4)],
)
def test_the_search_finds_the_fewest_count_with_few_plans(capacity: int, expected: int | None, plans: int) -> None:
    """A rank holding 20 bytes plus 80 shared out fits ``capacity`` from the count ``expected`` on. Counts 1, 2 and
    4 are planned as the plain search plans them; then the line ``a + b/n`` through 2 and 4 predicts the count, and
    the count below confirms it (7 and 6), or the limit (8) is planned at once where the line says none fits; the
    plain search (doubling, then bisection) takes 6 plans for 7 and 8. None fits past the limit, whose plan says by
    how much."""
    from hf_paged.cli.plan import _fewest

    tried: list[int] = []

    def plan_at(count: int) -> _Peak:
        tried.append(count)
        return _Peak(20 + -(-80 // count))

    found, planned = _fewest(plan_at, capacity, 8)
    assert found == expected, tried
    assert planned.peak_bytes == 20 + -(-80 // (8 if expected is None else expected))
    assert len(tried) == len(set(tried)) == plans, tried


def _doubling_then_bisection(plan_at, capacity: int, limit: int):
    """The search before predictions (``_fewest`` until issue 39's 70B table): counts double until one fits, then
    the gap is bisected; the reference for the answers."""
    failing, count = 0, 1
    while True:
        planned = plan_at(count)
        if planned.fits(capacity):
            break
        if count >= limit:
            return None, planned
        failing, count = count, min(2 * count, limit)
    fitting, fitting_plan = count, planned
    while fitting - failing > 1:
        middle = (failing + fitting) // 2
        planned = plan_at(middle)
        if planned.fits(capacity):
            fitting, fitting_plan = middle, planned
        else:
            failing = middle
    return fitting, fitting_plan


def _searched(search, peak, capacity: int, limit: int) -> tuple[int | None, int, list[int]]:
    tried: list[int] = []

    def plan_at(count: int) -> _Peak:
        tried.append(count)
        return _Peak(peak(count))

    found, planned = search(plan_at, capacity, limit)
    return found, planned.peak_bytes, tried


def _sharded(whole: int, shared: int, one: int | None = None):
    """``whole + shared/n`` bytes rounded up, and ``one`` at one GPU (planned without a strategy) where given."""
    return lambda count: one if count == 1 and one is not None else whole + -(-shared // count)


GIB = 2**30
LINES = {
    "20 + 80/n": _sharded(20, 80),
    "1000 + 1e6/n": _sharded(1000, 10**6),
    # the 70B shape's full fine-tune under FSDP2: about 8 GiB whole and 380 GiB shared, one GPU unsharded
    "70B fsdp2": _sharded(8 * GIB + 12345, 380 * GIB + 678, one=402 * GIB),
    "70B fsdp2, one GPU low": _sharded(8 * GIB, 380 * GIB, one=300 * GIB),
}
OTHER_SHAPES = {
    "flat": lambda count: 500,
    "steps of 1": lambda count: 1000 - 100 * count,
    "steps of 3": lambda count: 1000 - 100 * (count // 3),
    "steps of 7": lambda count: 1000 - 100 * (count // 7),
    "floor 1000/n": lambda count: 1000 // count,
    "7/n rounded up": _sharded(0, 7),  # rounding moves the line
    "1/sqrt(n)": lambda count: 100 + int(1000 / count**0.5),
    "log2(n)": lambda count: 1000 - int(200 * math.log2(count)),
    "a plateau, then a + b/n": lambda count: 900 if count < 6 else 100 + 4000 // count,
}


def _capacities(peak, limit: int) -> list[int]:
    """Every capacity that changes an answer: each count's peak, a byte below and a byte above it."""
    return sorted({peak(count) + step for count in range(1, limit + 1) for step in (-1, 0, 1)})


@pytest.mark.parametrize("limit", [1, 2, 3, 8, 13, 64])
@pytest.mark.parametrize("shape", list(LINES) + list(OTHER_SHAPES))
def test_the_search_gives_the_answers_of_doubling_and_bisection(shape: str, limit: int) -> None:
    """For every capacity that changes the answer, on peaks of the form ``a + b/n`` and on others that only
    shrink with the count (steps, plateaus, ``1/sqrt(n)``, ``log2(n)``): the same count and plan as the plain search
    (:func:`_doubling_then_bisection`), no count planned twice, and, on the others, at most twice its plans plus 2
    (each prediction that is off costs at most a count and its confirmation before the plain search's next)."""
    from hf_paged.cli.plan import _fewest

    peak = {**LINES, **OTHER_SHAPES}[shape]
    for capacity in _capacities(peak, limit):
        found, planned, tried = _searched(_fewest, peak, capacity, limit)
        plain_found, plain_planned, plain_tried = _searched(_doubling_then_bisection, peak, capacity, limit)
        assert (found, planned) == (plain_found, plain_planned), (capacity, tried, plain_tried)
        assert len(tried) == len(set(tried)) <= 2 * len(plain_tried) + 2, (capacity, tried, plain_tried)


@pytest.mark.parametrize("shape", list(LINES))
def test_where_the_peak_is_a_plus_b_over_n_the_search_takes_at_most_five_plans(shape: str) -> None:
    """Where a rank's peak is ``a + b/n`` (one GPU may be off the line), any answer up to 64 GPUs, or none, takes at
    most five plans (1, 2, 4, the predicted count and the count below it), where doubling and bisection take up to
    12; seven where the capacity is a count's peak to the byte, as rounding can put the line's prediction one count
    high there (the plain search's step, then a prediction between the counts known, settle it)."""
    from hf_paged.cli.plan import _fewest

    peak, limit = LINES[shape], 64
    peaks = {peak(count) for count in range(1, limit + 1)}
    total = plain_total = 0
    for capacity in _capacities(peak, limit):
        found, _, tried = _searched(_fewest, peak, capacity, limit)
        _, _, plain_tried = _searched(_doubling_then_bisection, peak, capacity, limit)
        assert len(tried) <= (7 if capacity in peaks else 5), (capacity, found, tried)
        total, plain_total = total + len(tried), plain_total + len(plain_tried)
    assert total < plain_total * 3 / 4, (total, plain_total)


@pytest.mark.slow  # three plans of the embedded QLoRA run: about 35 s of CPU
def test_a_strategy_that_cannot_be_planned_is_a_row_of_its_own(monkeypatch) -> None:
    """The embedded QLoRA run with bitsandbytes' own ``QuantState`` for the planner's 4-bit shells: accelerate's FSDP2
    preparation takes the model's state dict, for which bitsandbytes reads the nested offset's value (which a fake
    tensor does not have), so the row of FSDP2 with CPU offload says it cannot be planned and why, and the others
    still get their counts. (The shells' own ``QuantState`` serializes without that value, so that QLoRA plans under
    FSDP2: ``test_fsdp2_keeps_qlora_4bit_weights_whole_and_shards_the_rest``.)"""
    from bitsandbytes.functional import QuantState

    import hf_paged.cli.plan as plan_module

    monkeypatch.setattr(plan_module, "_shell_quant_state_class", lambda: QuantState)
    setup = setup_from_config(load_config(None, []))
    counts = fewest_gpus(setup, "cpu", 2**30, ["ddp", "fsdp2_offload"], limit=2)
    assert [(count.strategy, count.gpus, count.error is None) for count in counts] == [
        ("ddp", 1, True),
        ("fsdp2_offload", None, False),
    ]
    text = format_fewest_gpus(setup, "cpu", 2**30, counts)
    assert "fsdp2_offload            cannot plan" in text
    assert "fsdp2_offload: model.name: 'tiny': cannot plan the step" in text


ZERO2_CAP = 35_000_000
"""The pseudo-device's memory in the fewest-GPUs check of ZeRO-2 (bytes): 4% below the plan of 3 ranks without paging
and 4.6% above that of 4, so that neither is decided by the plan's error."""


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_for_zero2_paging_halves_the_fewest_processes_that_train_under_a_memory_cap(tmp_path: Path) -> None:
    """ZeRO-2 partitions the gradients and the optimizer state but keeps the whole weights on every rank. On GPUs of
    35 MB (with DeepSpeed's reduce bucket of 100,000 elements) ``--fewest-gpus`` for ZeRO-2 is 4 without paging and
    2 with paging; real runs through the Trainer with the counting allocator capped at 35 MB agree: without paging
    1, 2 and 3 processes run out of memory and 4 train; with paging (a budget of one page, the budget the search
    tries; the largest that fits, which the table shows, leaves the plan no room for its error) 1 process runs out
    of memory and 2 train. Measured peaks of the runs that trained: 2 paged ranks 30.41 MB each (planned 30.68), 4
    unpaged ranks 33.38 MB each (planned 33.38)."""
    setup = setup_from_config(load_config(None, [*PARAMETER_HEAVY_LLAMA, SMALL_BUCKET]), "full")
    (count,) = fewest_gpus(setup, "cpu", ZERO2_CAP, ["zero2"], limit=4, host_memory_apart=True)
    print(format_fewest_gpus(setup, "cpu", ZERO2_CAP, [count]))
    assert (count.gpus, count.paged_gpus) == (4, 2), (count.gpus, count.paged_gpus)
    page = 64 * 1024
    assert count.budget is not None and count.budget >= page

    def trains(world_size: int, budget: int | None, name: str) -> bool:
        return _trains_under_cap("zero2", world_size, budget, tmp_path / name, (SMALL_BUCKET,), ZERO2_CAP)

    assert [trains(world_size, page, f"paged-{world_size}") for world_size in (1, 2)] == [False, True]
    unpaged = [trains(world_size, None, f"unpaged-{world_size}") for world_size in (1, 2, 3, 4)]
    assert unpaged == [False, False, False, True], unpaged


@pytest.mark.parametrize("storage", ["uint8", "bfloat16"])
def test_the_plan_header_names_the_4bit_storage(storage: str) -> None:
    """A QLoRA plan's header names the storage of its 4-bit weights, on which the sharded plans depend (FSDP2 shards
    floating-point storage only); the other methods have none to name."""
    config = load_config(None, [*SMALL_LLAMA, f"lora.quant_storage={storage}"])
    assert f"qlora (4-bit weights stored as {storage}), batch 2" in setup_from_config(config, "qlora").describe()
    assert "4-bit" not in setup_from_config(config, "lora").describe()


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_for_zero3_paging_lowers_the_fewest_processes_that_train_under_a_memory_cap(tmp_path: Path) -> None:
    """ZeRO-3 partitions the weights too, and on one process gathers them as views of their partitions. On GPUs of 36
    MB (DeepSpeed gathering each matrix for its use: :data:`GATHERED`) ``--fewest-gpus`` for ZeRO-3 is 3 without paging
    and 2 with paging; real runs through the Trainer with the counting allocator capped at 36 MB agree: without paging 1
    and 2 processes run out of memory and 3 train; with paging (a budget of one page, the budget the search tries) 1
    process runs out of memory and 2 train. Measured peaks of the runs that trained: 2 paged ranks 24.74 MB each, 3
    unpaged ranks 26.81 MB each."""
    setup = setup_from_config(load_config(None, [*PARAMETER_HEAVY_LLAMA, GATHERED]), "full")
    (count,) = fewest_gpus(setup, "cpu", CAP, ["zero3"], limit=4, host_memory_apart=True)
    print(format_fewest_gpus(setup, "cpu", CAP, [count]))
    assert (count.gpus, count.paged_gpus) == (3, 2), (count.gpus, count.paged_gpus)
    page = 64 * 1024

    def trains(world_size: int, budget: int | None, name: str) -> bool:
        return _trains_under_cap("zero3", world_size, budget, tmp_path / name, (GATHERED,))

    assert [trains(world_size, page, f"paged-{world_size}") for world_size in (1, 2)] == [False, True]
    unpaged = [trains(world_size, None, f"unpaged-{world_size}") for world_size in (1, 2, 3)]
    assert unpaged == [False, False, True], unpaged
