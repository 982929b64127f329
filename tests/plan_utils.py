"""Helpers of the planner's tests: the truth of a real run's peaks from the profiler's allocator events."""

from __future__ import annotations

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from hf_paged.optim import PagedOptimizer
from hf_paged.planner import FORWARD_BACKWARD, OPTIMIZER_STEP, allocations_inside, default_loss

TOLERANCE = 0.0025
"""Largest relative difference allowed between a planned and a measured peak (the README's 0.25%)."""

SMALL_LLAMA = [
    "model.tiny.hidden_size=128",
    "model.tiny.intermediate_size=344",
    "model.tiny.num_hidden_layers=2",
    "model.tiny.num_attention_heads=4",
    "model.tiny.num_key_value_heads=2",
    "tokenizer.max_length=128",
    "training.per_device_train_batch_size=2",
    "lora.r=8",
]
"""A small Llama and batch: peaks of a few MiB, dominated by activations as in real fine-tunes."""


def fill_process_tables() -> None:
    """bitsandbytes keeps tables for the process from its first quantization on (the dynamic map, the NF4 codes
    and their bounds: 1,276 bytes); filled before a truth is taken, as any later run in the process finds them."""
    try:
        from bitsandbytes.functional import quantize_4bit
    except ImportError:
        return
    quantize_4bit(torch.ones(64), blocksize=64, quant_type="nf4", compress_statistics=True)


def measured_peaks(build, batch, optimizer, steps: int = 2, loss=default_loss) -> list[tuple[str, int, int]]:
    """(phase, step, peak bytes of live tensors) of a real run of ``steps`` training steps on the CPU, from the
    allocation events of ``torch.profiler``; everything is allocated inside the profile, so live bytes start at 0, and
    frees of blocks allocated before it (which the profiler reports where an earlier profile saw them allocated:
    garbage of an earlier test collected during this run) are left out."""
    fill_process_tables()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        model = build()
        built_optimizer = optimizer(model)
        for step in range(1, steps + 1):
            with record_function(f"plan-test:{FORWARD_BACKWARD}:{step}"):
                inputs = batch()
                value = loss(model, inputs)
                value.backward()
                del value, inputs
            with record_function(f"plan-test:{OPTIMIZER_STEP}:{step}"):
                built_optimizer.step()
                built_optimizer.zero_grad(set_to_none=True)
    return window_peaks(profiler)


def measured_setup_peaks(setup, steps: int = 2) -> list[tuple[str, int, int]]:
    """:func:`measured_peaks` of the model, batches and optimizer of ``hf-paged train``'s ``setup`` on the CPU, each
    batch held as the Trainer holds it (its step's, and one ahead in accelerate's data loader), as
    :func:`hf_paged.cli.plan.plan_setup` plans it; a setup of one micro-batch per step."""
    from hf_paged.cli.plan import architecture, build_model, build_optimizer, make_batch, trainer_batches

    assert setup.accumulation == 1, "measured_peaks runs one micro-batch per step"
    vocab_size = architecture(setup.config).vocab_size
    torch.manual_seed(0)
    return measured_peaks(
        lambda: build_model(setup),
        trainer_batches(lambda: make_batch(setup, vocab_size), fetched=1, used=1, ahead=1),
        lambda model: build_optimizer(setup, model),
        steps=steps,
    )


def window_peaks(profiler: profile) -> list[tuple[str, int, int]]:
    """(phase, step, peak bytes of live tensors) of each ``plan-test:PHASE:STEP`` window a finished ``profiler`` (with
    ``profile_memory=True``) recorded, in order: the live bytes of every allocation the profile saw before the window
    and inside it, without frees of blocks allocated before the profile."""
    allocations, windows = [], []
    pending = list(profiler.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        if event.typed[0] == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.typed[1].ptr, event.typed[1].alloc_size))
        elif event.name.startswith("plan-test:"):
            _, phase, step = event.name.split(":")
            windows.append((event.start_time_ns, event.end_time_ns, phase, int(step)))
        pending.extend(event.children)
    allocations = [(when, size) for when, _, size in allocations_inside(sorted(allocations))]
    peaks = []
    for start, end, phase, step in sorted(windows):
        live = sum(size for when, size in allocations if when < start)
        peak = live
        for when, size in allocations:
            if start <= when <= end:
                live += size
                peak = max(peak, live)
        peaks.append((phase, step, peak))
    return peaks


def check_plan(planned, measured, tolerance: float = TOLERANCE) -> list[str]:
    """The phases whose planned peak is off by more than ``tolerance`` (with the figures), for the assertion."""
    assert [(item.phase, item.step) for item in planned.phases] == [(phase, step) for phase, step, _ in measured]
    failures = []
    for item, (_, _, truth) in zip(planned.phases, measured):
        ratio = item.peak_bytes / truth
        print(f"{item.phase} step {item.step}: planned {item.peak_bytes}, measured {truth}, ratio {ratio:.4f}")
        if abs(ratio - 1) > tolerance:
            failures.append(f"{item.phase} step {item.step}: planned {item.peak_bytes} measured {truth}")
    return failures


def check_bfloat16_mlp() -> None:
    """Plan and train for real a bfloat16 MLP whose backward peaks in a matrix product; assert they agree."""
    from torch import nn

    from hf_paged.planner import plan

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(torch.bfloat16)

    def batch() -> torch.Tensor:
        return torch.randn(64, 256, dtype=torch.bfloat16)

    def loss(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return model(inputs).float().pow(2).mean()

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), foreach=False)

    planned = plan(build, batch, optimizer, loss=loss)
    assert not check_plan(planned, measured_peaks(build, batch, optimizer, loss=loss))


def held_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a real optimizer's state: the storages of ``optimizer.state`` and of every page's buffers (one
    block per page, shared by its buffers' views)."""
    tensors = [
        value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)
    ]
    if isinstance(optimizer, PagedOptimizer):
        tensors += [buffer for page in optimizer._store.pages for buffer in (page.device or page.host)]
    storages = {id(tensor.untyped_storage()): tensor.untyped_storage().nbytes() for tensor in tensors}
    return sum(storages.values())
