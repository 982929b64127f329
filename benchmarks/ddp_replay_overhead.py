"""Per-step cost of the checks that let every DDP rank replay a step one rank's out-of-memory error interrupted.

    python benchmarks/ddp_replay_overhead.py                 # 2 processes (gloo on the CPU), the tests' tiny Llama
    python benchmarks/ddp_replay_overhead.py --steps 400 --layers 2

Two processes train the tiny Llama of the tests under DDP with PagedAdamW8bit, two micro-batches per step (the first
inside ``no_sync``), on two copies of the model stepped in turn, so that load on the machine hits both alike:

- ``one-process recovery``: ``OOMRecovery`` given the inner module, as before replays across ranks existed (it records
  each micro-batch's arguments and generator states);
- ``replay on every rank``: ``OOMRecovery`` given the DDP model, which adds the new checks: DDP's ``_pre_forward`` and
  ``_post_forward`` wrapped to note when each ends, the reducer's record of handed-over gradients taken before the
  synchronized micro-batch, and one read of the job's store after it.

A plain step without recovery is timed in the same rotation, as the reference. The job's store is served by this
launching process, as ``torchrun``'s agent serves it. The table (rank 0's; each step from a barrier) gives the median
step of each in wall time and in the process's CPU time, which other processes' load on the machine does not inflate,
and the median of the paired differences between the two recovery variants (each step of one against the step of the
other next to it, which cancels slow drifts in the machine's load) as a fraction of the plain step. The checks' own
work is also timed alone: the store read, and the rest (a forward and backward under DDP in a one-process group, with
and without them); and the store read as the steps paid it (wall time: on a busy machine the store's process must be
scheduled to answer).
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

import hf_paged
from hf_paged.ddp_replay import DDPReplay
from hf_paged.replay_requests import ReplayRequests

VARIANTS = ("plain step", "one-process recovery", "replay on every rank")
STEP_READS: list[float] = []
"""Seconds of each store read in the steps (``ReplayRequests.read`` is timed while the steps run)."""


def timed_read(read):
    """``ReplayRequests.read`` that appends its wall time to :data:`STEP_READS`."""

    def timed(self, window: int, attempt: int):
        started = time.perf_counter()
        found = read(self, window, attempt)
        STEP_READS.append(time.perf_counter() - started)
        return found

    return timed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="measured steps of each variant (after 3 warm-up)")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of the tiny Llama")
    parser.add_argument("--batch", type=int, default=2, help="examples per micro-batch")
    parser.add_argument("--sequence", type=int, default=16, help="tokens per example")
    parser.add_argument("--quick", action="store_true", help="20 steps each, for a smoke test")
    return parser.parse_args()


def tiny_llama(layers: int) -> LlamaForCausalLM:
    """The tests' tiny Llama (tests/trainer_utils.py): vocabulary 128, hidden size 64, two heads."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    models, optimizers, recoveries = {}, {}, {}
    base = tiny_llama(args.layers)
    for variant in VARIANTS:
        model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True)
        optimizer = hf_paged.PagedAdamW8bit(model.parameters(), lr=1e-3)
        models[variant], optimizers[variant] = model, optimizer
        if variant == "one-process recovery":
            recoveries[variant] = hf_paged.OOMRecovery(optimizer, model=model.module)
        elif variant == "replay on every rank":
            recoveries[variant] = hf_paged.OOMRecovery(optimizer, model=model)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 128, (2, args.batch, args.sequence), generator=generator) for _ in range(8)]

    def step(variant: str, ids: torch.Tensor) -> tuple[float, float]:
        model, optimizer, recovery = models[variant], optimizers[variant], recoveries.get(variant)

        def forward_backward(micro_batch: torch.Tensor) -> None:
            (model(input_ids=micro_batch, labels=micro_batch).loss / 2).backward()

        dist.barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        if recovery is None:
            with model.no_sync():
                forward_backward(ids[0])
            forward_backward(ids[1])
        else:
            with recovery.window():
                with model.no_sync():
                    recovery.run(forward_backward, ids[0])
                recovery.run(forward_backward, ids[1])
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - started, time.process_time() - cpu_started

    steps = 20 if args.quick else args.steps
    ReplayRequests.read = timed_read(ReplayRequests.read)
    times: dict[str, list[tuple[float, float]]] = {variant: [] for variant in VARIANTS}
    for repetition in range(steps + 3):
        order = VARIANTS if repetition % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            elapsed = step(variant, batches[repetition % len(batches)])
            if repetition >= 3:
                times[variant].append(elapsed)
    step_read = statistics.median(STEP_READS)
    store_read = time_store_read(rank)
    alone = dist.new_group([0])  # every rank takes part in creating a group
    hooks = time_hooks(base, batches[0][1], alone) if rank == 0 else 0.0
    if rank == 0:
        report(times, store_read, hooks, step_read, args, steps, world)
    for recovery in recoveries.values():
        recovery.close()
    dist.barrier()
    dist.destroy_process_group()


def time_store_read(rank: int) -> float:
    """Median seconds of one read of the replay requests of an attempt that has none (what each step pays)."""
    requests = ReplayRequests()
    durations = []
    for attempt in range(200):
        started = time.perf_counter()
        requests.read(10**9 + rank, attempt)
        durations.append(time.perf_counter() - started)
    return statistics.median(durations)


def time_hooks(base: torch.nn.Module, ids: torch.Tensor, group: dist.ProcessGroup) -> float:
    """Median seconds the per-micro-batch checks add to one forward and backward of the model under DDP in a
    one-process ``group`` (the wrapped forward steps and the reducer's record taken before it)."""
    plain = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=group)
    hooked = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=group)
    replay = DDPReplay(hooked)

    def once(model: torch.nn.Module) -> float:
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad()
        return time.perf_counter() - started

    differences = []
    for _ in range(200):
        without = once(plain)
        started = time.perf_counter()
        replay.begin_micro_batch(synchronizes=True)
        differences.append(time.perf_counter() - started + once(hooked) - without)
    replay.close()
    return max(0.0, statistics.median(differences))


def report(
    times: dict[str, list[tuple[float, float]]],
    store_read: float,
    hooks: float,
    step_read: float,
    args,
    steps: int,
    world: int,
):
    """Print the table: per variant and per clock (0: wall, 1: CPU), the median step and its ratio to the plain step."""

    def median(variant: str, clock: int) -> float:
        return statistics.median(sample[clock] for sample in times[variant])

    def paired(clock: int) -> float:
        pairs = zip(times["replay on every rank"], times["one-process recovery"])
        return statistics.median(mine[clock] - theirs[clock] for mine, theirs in pairs)

    print(
        f"{world} processes (gloo on the CPU), tiny Llama of {args.layers} layer(s), 2 micro-batches of "
        f"{args.batch}x{args.sequence} tokens per step, PagedAdamW8bit, {steps} steps each (medians), load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(f"| {'variant':<45} | {'wall time':>10} | {'ratio':>8} | {'CPU time':>10} | {'ratio':>8} |")
    print(f"|{'-' * 47}|{'-' * 12}|{'-' * 10}|{'-' * 12}|{'-' * 10}|")
    rows = [(variant, median(variant, 0), median(variant, 1)) for variant in VARIANTS]
    rows.append(("new checks: paired difference", paired(0), paired(1)))
    rows.append(("new checks timed alone: store read + the rest", store_read + hooks, None))
    rows.append(("the store read as the steps paid it", step_read, None))
    plain = rows[0][1:]
    for name, wall, cpu in rows:
        cells = []
        for clock, seconds in enumerate((wall, cpu)):
            if seconds is None:
                cells += ["-", "-"]
                continue
            cells.append(f"{seconds * 1e3:.2f} ms" if abs(seconds) >= 1e-3 else f"{seconds * 1e6:.0f} us")
            cells.append(f"{seconds / plain[clock] * 100:.2f}%")
        print(f"| {name:<45} | {cells[0]:>10} | {cells[1]:>8} | {cells[2]:>10} | {cells[3]:>8} |")
    sys.stdout.flush()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)  # served here, as by torchrun
    mp.spawn(run_rank, args=(2, port, args), nprocs=2, join=True)
    del store


if __name__ == "__main__":
    main()
