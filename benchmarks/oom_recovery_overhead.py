"""Overhead of out-of-memory recovery when no error occurs (hf_paged.OOMRecovery, as the Trainer uses it).

    python benchmarks/oom_recovery_overhead.py                      # CPU, small Llama, 4 micro-batches per step
    python benchmarks/oom_recovery_overhead.py --device cuda --hidden 1024 --layers 8 --steps 30

Steps with and without recovery alternate on one model, so load on the machine hits both alike; the table
gives the median step time of each and the median of the paired differences (each protected step against the
unprotected step next to it), which cancels slow drifts in the machine's load. The bookkeeping alone (recording each micro-batch's
arguments and generator states, starting the window) is also timed around a function that does nothing,
which measures the added cost without the noise of whole steps. On the CPU steps are timed in this process's
CPU time (``time.process_time``), which other processes' load on the machine does not inflate; on an
accelerator in wall time, synchronized.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_paged


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sequence", type=int, default=64, help="tokens per example")
    parser.add_argument("--batch", type=int, default=2, help="examples per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=40, help="measured steps of each variant (after 2 warm-up)")
    parser.add_argument("--budget", default="auto", help="device_budget of the optimizer (auto, a size, none)")
    return parser.parse_args()


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.sequence,
        attention_dropout=0.1,
    )
    model = LlamaForCausalLM(config).to(device).train()
    budget = None if args.budget == "none" else args.budget
    optimizer = hf_paged.PagedAdamW8bit(model.parameters(), lr=1e-4, device_budget=budget, page_size="1MiB")
    recovery = hf_paged.OOMRecovery(optimizer, retries=2)
    ids = torch.randint(0, config.vocab_size, (args.micro_batches, args.batch, args.sequence), device=device)

    def forward_backward(micro_batch: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=micro_batch, labels=micro_batch).loss / args.micro_batches
        loss.backward()
        return loss.detach()

    clock = time.process_time if device.type == "cpu" else time.perf_counter

    def step(protected: bool) -> float:
        synchronize(device)
        started = clock()
        if protected:
            with recovery.window():
                for micro_batch in ids:
                    recovery.run(forward_backward, micro_batch)
        else:
            for micro_batch in ids:
                forward_backward(micro_batch)
        optimizer.step()
        optimizer.zero_grad()
        synchronize(device)
        return clock() - started

    times: dict[bool, list[float]] = {False: [], True: []}
    for repetition in range(args.steps + 2):
        for protected in (repetition % 2 == 0, repetition % 2 == 1):
            elapsed = step(protected)
            if repetition >= 2:
                times[protected].append(elapsed)

    def nothing(micro_batch: torch.Tensor) -> None:
        return None

    bookkeeping = []
    for _ in range(200):
        started = time.perf_counter()
        with recovery.window():
            for micro_batch in ids:
                recovery.run(nothing, micro_batch)
        bookkeeping.append(time.perf_counter() - started)

    direct, protected = statistics.median(times[False]), statistics.median(times[True])
    paired = statistics.median((mine - theirs) / theirs for mine, theirs in zip(times[True], times[False]))
    cost = statistics.median(bookkeeping)
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"device {device}, Llama {parameters / 1e6:.1f}M parameters, {args.micro_batches} micro-batches of "
        f"{args.batch}x{args.sequence} tokens per step, PagedAdamW8bit device_budget={args.budget}, "
        f"{args.steps} steps each (medians; {'CPU' if device.type == 'cpu' else 'wall'} time)"
    )
    rows = [
        ("without recovery", f"{direct * 1e3:.1f} ms", "-"),
        ("OOMRecovery(retries=2)", f"{protected * 1e3:.1f} ms", f"{paired * 100:+.2f}%"),
        ("bookkeeping alone", f"{cost * 1e6:.0f} us", f"{cost / direct * 100:+.3f}%"),
    ]
    print(f"| {'variant':<24} | {'step time':>10} | {'overhead':>9} |")
    print(f"|{'-' * 26}|{'-' * 12}|{'-' * 11}|")
    for name, value, overhead in rows:
        print(f"| {name:<24} | {value:>10} | {overhead:>9} |")


if __name__ == "__main__":
    main()
