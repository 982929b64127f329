"""Helpers of the planner's tests: the truth of a real run's peaks from the profiler's allocator events."""

from __future__ import annotations

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from hf_paged.planner import FORWARD_BACKWARD, OPTIMIZER_STEP, default_loss

TOLERANCE = 0.02
"""Largest relative difference allowed between a planned and a measured peak."""


def measured_peaks(build, batch, optimizer, steps: int = 2) -> list[tuple[str, int, int]]:
    """(phase, step, peak bytes of live tensors) of a real run of ``steps`` training steps on the CPU, from the
    allocation events of ``torch.profiler``; everything is allocated inside the profile, so live bytes start at 0."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        model = build()
        built_optimizer = optimizer(model)
        for step in range(1, steps + 1):
            with record_function(f"plan-test:{FORWARD_BACKWARD}:{step}"):
                inputs = batch()
                loss = default_loss(model, inputs)
                loss.backward()
                del loss, inputs
            with record_function(f"plan-test:{OPTIMIZER_STEP}:{step}"):
                built_optimizer.step()
                built_optimizer.zero_grad(set_to_none=True)
    allocations, windows = [], []
    pending = list(profiler.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        if event.typed[0] == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.typed[1].alloc_size))
        elif event.name.startswith("plan-test:"):
            _, phase, step = event.name.split(":")
            windows.append((event.start_time_ns, event.end_time_ns, phase, int(step)))
        pending.extend(event.children)
    allocations.sort()
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


def check_plan(planned, measured) -> list[str]:
    """The phases whose planned peak is off by more than the tolerance (with the figures), for the assertion."""
    assert [(item.phase, item.step) for item in planned.phases] == [(phase, step) for phase, step, _ in measured]
    failures = []
    for item, (_, _, truth) in zip(planned.phases, measured):
        ratio = item.peak_bytes / truth
        print(f"{item.phase} step {item.step}: planned {item.peak_bytes}, measured {truth}, ratio {ratio:.4f}")
        if abs(ratio - 1) > TOLERANCE:
            failures.append(f"{item.phase} step {item.step}: planned {item.peak_bytes} measured {truth}")
    return failures
