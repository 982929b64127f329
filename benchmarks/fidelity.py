"""How close 8-bit and 4-bit AdamW and AdEMAMix train to their fp32 versions: hf-paged's, torchao's and
bitsandbytes', on three tasks, each at three learning rates with and without weight decay.

Tasks, each seeded and offline, one thread:

- ``mlp teacher``: the task of ``tests/test_4bit.py``, an MLP 128-512-512-16 fitted to a fixed random linear
  teacher, steps of 256 samples; its loss is the mean training loss of the last 20 steps.
- ``tiny LM``: a Llama model built from a config (hidden 128, 2 layers, 4 heads, MLP 256, vocabulary 256)
  trained from its seeded initialization on the shipped instruction dataset (``hf_paged/data/instructions.jsonl``)
  as bytes, batches of 8 windows of 64 bytes; its loss is the eval loss on the held-out tenth of the records (every
  tenth record).
- ``tiny LoRA``: that model first trained by fp32 AdamW (lr 1e-3) on the instructions of the training records alone
  (no responses; once per run, as many steps as the task), then frozen, with peft LoRA adapters of rank 32 on every
  projection fine-tuned on whole records; its loss is the eval loss. Each adapter matrix has 4096 elements or more,
  the least that torchao's optimizers keep in low bits (its threshold is fixed), so every library quantizes all of
  them (hf-paged's 4-bit optimizers the ``B`` matrices, whose rows of 32 are shorter than a block, in 8 bits).

Each task runs at its own learning rate (:data:`TASK_LEARNING_RATES`, 1e-3) times each of :data:`LR_FACTORS` (0.3, 1
and 3: 10x from the lowest to the highest), each with each weight decay of :data:`WEIGHT_DECAYS` (0 and 0.1,
decoupled, every optimizer the same): a cell. Prints a markdown table: per cell and optimizer the final loss, its gap
to its fp32 reference's in percent (``|loss - loss_fp32| / loss_fp32``; the AdamW optimizers' reference is
``torch.optim.AdamW``, the AdEMAMix ones' bitsandbytes' reference AdEMAMix, ``_ReferenceAdEMAMix``, with its
defaults), and the relative deviation of the trained weights from its reference's (``|w - w_fp32| / |w_fp32|`` over
the trained parameters flattened), as means over the seed sets with the gap's range; then each optimizer's mean and
largest gap and deviation over the cells, and where each of :data:`RIVALS` is closer; then, per cell, whether
PagedAdamW4bit (its default setting, and ``normalization="rank1"``) is closer to fp32 AdamW than torchao's
``AdamW4bit`` on the means. Optimizers that cannot run here are listed with the reason. torchao's optimizers run their
update eagerly (its ``torch.compile`` would only change the speed).

    PYTHONPATH=. python benchmarks/fidelity.py                  # 200 steps, 18 cells, 3 seed sets: hours on one core
    PYTHONPATH=. python benchmarks/fidelity.py --only 4bit      # the 4-bit comparison: about 25 min of one core
    PYTHONPATH=. python benchmarks/fidelity.py --only 8bit      # the 8-bit AdamWs (ademamix: the AdEMAMixes)
    PYTHONPATH=. python benchmarks/fidelity.py --quick          # 20 steps, one cell per task, one seed set: a minute
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

import hf_paged

Optimizer = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter], float, float], torch.optim.Optimizer]
"""An optimizer of the comparison built on parameters with a learning rate and a weight decay."""

INSTRUCTIONS = Path(hf_paged.__file__).resolve().parent / "data" / "instructions.jsonl"
WINDOW = 64
"""Bytes per training and eval sequence of the language-model tasks."""
LM_BATCH = 8
"""Sequences per step of the language-model tasks."""
LR_FACTORS = (0.3, 1.0, 3.0)
"""Each task runs at its own learning rate times each of these: 10x from the lowest to the highest."""
WEIGHT_DECAYS = (0.0, 0.1)
"""Each task runs with each of these weight decays (decoupled), for every optimizer."""
ADAMW_REFERENCE = "torch AdamW (fp32)"
ADEMAMIX_REFERENCE = "bitsandbytes reference AdEMAMix (fp32)"
OURS_4BIT = "hf-paged PagedAdamW4bit"
OURS_RANK1 = "hf-paged PagedAdamW4bit (rank-1)"
OURS_4BIT_VARIANTS = (OURS_4BIT, OURS_RANK1)
THEIRS_4BIT = "torchao AdamW4bit"
GROUPS = {
    "4bit": (ADAMW_REFERENCE, *OURS_4BIT_VARIANTS, THEIRS_4BIT),
    "8bit": (ADAMW_REFERENCE, "hf-paged PagedAdamW8bit", "torchao AdamW8bit", "bitsandbytes AdamW8bit"),
    "ademamix": (
        ADEMAMIX_REFERENCE,
        "hf-paged PagedAdEMAMix",
        "hf-paged PagedAdEMAMix8bit",
        "hf-paged PagedAdEMAMix4bit",
        "bitsandbytes AdEMAMix8bit",
    ),
}
"""Named subsets of the optimizers for ``--only``."""
RIVALS = (
    ("hf-paged PagedAdamW8bit", "torchao AdamW8bit"),
    ("hf-paged PagedAdamW8bit", "bitsandbytes AdamW8bit"),
    ("hf-paged PagedAdEMAMix8bit", "bitsandbytes AdEMAMix8bit"),
)
"""Pairs of optimizers of the same state size whose cells :func:`grid_summary` counts: where the first is closer to
their fp32 reference than the second."""
SEED_STRIDE = 100
"""Seed set ``k`` adds ``k * SEED_STRIDE`` to every seed of a task (initialization, teacher, data order); set 0 has the
seeds the benchmark always had."""
LOSS_GAP_TARGET = 5.0
"""Issue 29's target: the most percent PagedAdamW4bit's final loss may lie from fp32 AdamW's."""


def student(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed * SEED_STRIDE)
    return torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 16)
    )


def teacher_batches(steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A regression task: targets from a fixed random linear teacher."""
    generator = torch.Generator().manual_seed(1 + seed * SEED_STRIDE)
    teacher = torch.randn(128, 16, generator=generator) / math.sqrt(128)
    return [(inputs, inputs @ teacher) for inputs in (torch.randn(256, 128, generator=generator) for _ in range(steps))]


def fit(make_optimizer: Optimizer, steps: int, seed: int = 0) -> tuple[torch.nn.Module, float, float]:
    """Train the student of seed set ``seed``; return it with its first and final (mean of the last 20 steps)
    loss."""
    model = student(seed)
    optimizer = make_optimizer(model.parameters())
    losses = []
    for inputs, targets in teacher_batches(steps, seed):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    last = losses[-20:]
    return model, losses[0], sum(last) / len(last)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([param.detach().reshape(-1) for param in model.parameters()])


def trained(model: torch.nn.Module) -> torch.Tensor:
    """The parameters that require gradients, flattened into one fp32 vector."""
    return torch.cat([param.detach().float().reshape(-1) for param in model.parameters() if param.requires_grad])


def mlp_teacher(make_optimizer: Optimizer, steps: int, seed: int) -> tuple[torch.Tensor, float]:
    """The MLP teacher task: the trained weights and the mean training loss of the last 20 steps."""
    model, _, loss = fit(make_optimizer, steps, seed)
    return trained(model), loss


def records() -> list[dict[str, str]]:
    """The shipped instruction dataset, one dict per record."""
    lines = INSTRUCTIONS.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def random_windows(stream: torch.Tensor, steps: int, seed: int) -> list[torch.Tensor]:
    """``steps`` batches of ``LM_BATCH`` windows of a byte stream, drawn at seeded random offsets."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        starts = torch.randint(0, stream.numel() - WINDOW, (LM_BATCH,), generator=generator)
        batches.append(torch.stack([stream[start : start + WINDOW] for start in starts.tolist()]))
    return batches


def byte_windows(steps: int, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The instruction dataset as bytes: ``steps`` training batches of windows drawn at seeded random offsets from
    nine records in ten, and the held-out tenth cut into whole windows, shape ``(windows, WINDOW)``."""
    texts = [f"{record['instruction']}\n{record['response']}\n\n".encode() for record in records()]
    train_bytes = torch.tensor(list(b"".join(text for index, text in enumerate(texts) if index % 10 != 9)))
    held_out = torch.tensor(list(b"".join(text for index, text in enumerate(texts) if index % 10 == 9)))
    usable = held_out.numel() // WINDOW * WINDOW
    return random_windows(train_bytes, steps, seed=2 + seed * SEED_STRIDE), held_out[:usable].reshape(-1, WINDOW)


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """A seeded Llama model of about 0.39M parameters over a byte vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=WINDOW,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(3 + seed * SEED_STRIDE)
    return LlamaForCausalLM(config)


def train_lm(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> float:
    """Train a causal LM on ``steps`` byte batches; return its eval loss on the held-out windows."""
    batches, held_out = byte_windows(steps, seed)
    model.train()
    for batch in batches:
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        return model(input_ids=held_out, labels=held_out).loss.item()


def tiny_lm(make_optimizer: Optimizer, steps: int, seed: int) -> tuple[torch.Tensor, float]:
    """The tiny LM task: all weights trained; the trained weights and the eval loss."""
    model = tiny_llama(seed)
    loss = train_lm(model, make_optimizer(model.parameters()), steps, seed)
    return trained(model), loss


@functools.cache
def instruction_pretrained_weights(steps: int, seed: int) -> dict[str, torch.Tensor]:
    """The LoRA task's base: the tiny Llama trained by fp32 AdamW (lr 1e-3) for ``steps`` steps on the
    instructions of the training records alone, without their responses."""
    text = b"".join(f"{record['instruction']}\n".encode() for index, record in enumerate(records()) if index % 10 != 9)
    model = tiny_llama(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for batch in random_windows(torch.tensor(list(text)), steps, seed=5 + seed * SEED_STRIDE):
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def tiny_lora(make_optimizer: Optimizer, steps: int, seed: int) -> tuple[torch.Tensor, float]:
    """The tiny LoRA task: rank-32 adapters on every projection of the instruction-pretrained base, fine-tuned on
    whole records; the trained adapters and the eval loss."""
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(seed)
    base.load_state_dict(instruction_pretrained_weights(steps, seed))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(4 + seed * SEED_STRIDE)
    model = get_peft_model(base, LoraConfig(r=32, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
    params = [param for param in model.parameters() if param.requires_grad]
    loss = train_lm(model, make_optimizer(params), steps, seed)
    return trained(model), loss


TASKS: dict[str, Callable[[Optimizer, int, int], tuple[torch.Tensor, float]]] = {
    "mlp teacher": mlp_teacher,
    "tiny LM": tiny_lm,
    "tiny LoRA": tiny_lora,
}
TASK_LEARNING_RATES = dict.fromkeys(TASKS, 1e-3)
"""Each task's own learning rate, the middle of the three it runs at."""


def bitsandbytes_optimizer(name: str) -> Callable[..., torch.optim.Optimizer] | str:
    """bitsandbytes' optimizer ``name`` (``AdamW8bit``, ``AdEMAMix8bit``), or why it cannot run here (not installed,
    or no CPU support in this version)."""
    try:
        import bitsandbytes
    except ImportError as error:
        return f"skipped: bitsandbytes not importable ({error})"
    probe = torch.nn.Parameter(torch.zeros(4096))
    probe.grad = torch.ones(4096)
    try:
        getattr(bitsandbytes.optim, name)([probe]).step()
    except Exception as error:  # noqa: BLE001 (any failure of its CPU path is the reason reported)
        return f"skipped: {name} {bitsandbytes.__version__} fails on the CPU ({type(error).__name__}: {error})"
    return getattr(bitsandbytes.optim, name)


def with_weight_decay(build: Callable[..., torch.optim.Optimizer] | str) -> OptimizerFactory | str:
    """``build(params, lr=, weight_decay=)`` as an :data:`OptimizerFactory` (a reason it cannot run as it is)."""
    if isinstance(build, str):
        return build
    return lambda params, lr, weight_decay: build(params, lr=lr, weight_decay=weight_decay)


def optimizers() -> dict[str, tuple[str, OptimizerFactory | str]]:
    """The optimizers compared, by the name the table gives them: each with the name of its fp32 reference, and a
    factory or why it is left out. hf-paged's run under a 256 KiB device budget in 64 KiB pages."""
    paging = {"device_budget": "256KiB", "page_size": "64KiB"}
    found: dict[str, tuple[str, OptimizerFactory | str]] = {
        ADAMW_REFERENCE: (ADAMW_REFERENCE, with_weight_decay(torch.optim.AdamW)),
        "hf-paged PagedAdamW8bit": (
            ADAMW_REFERENCE,
            with_weight_decay(functools.partial(hf_paged.PagedAdamW8bit, **paging)),
        ),
        OURS_4BIT: (ADAMW_REFERENCE, with_weight_decay(functools.partial(hf_paged.PagedAdamW4bit, **paging))),
        OURS_RANK1: (
            ADAMW_REFERENCE,
            with_weight_decay(functools.partial(hf_paged.PagedAdamW4bit, normalization="rank1", **paging)),
        ),
    }
    try:
        from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError as error:
        found["torchao AdamW8bit"] = found[THEIRS_4BIT] = (
            ADAMW_REFERENCE,
            f"skipped: torchao not importable ({error})",
        )
    else:
        found["torchao AdamW8bit"] = (ADAMW_REFERENCE, with_weight_decay(AdamW8bit))
        found[THEIRS_4BIT] = (ADAMW_REFERENCE, with_weight_decay(AdamW4bit))
    found["bitsandbytes AdamW8bit"] = (ADAMW_REFERENCE, with_weight_decay(bitsandbytes_optimizer("AdamW8bit")))
    try:
        from bitsandbytes.optim.ademamix import _ReferenceAdEMAMix
    except ImportError as error:
        found[ADEMAMIX_REFERENCE] = (ADEMAMIX_REFERENCE, f"skipped: bitsandbytes not importable ({error})")
    else:
        found[ADEMAMIX_REFERENCE] = (ADEMAMIX_REFERENCE, with_weight_decay(_ReferenceAdEMAMix))
    for name in ("PagedAdEMAMix", "PagedAdEMAMix8bit", "PagedAdEMAMix4bit"):
        factory = functools.partial(getattr(hf_paged, name), **paging)
        found[f"hf-paged {name}"] = (ADEMAMIX_REFERENCE, with_weight_decay(factory))
    found["bitsandbytes AdEMAMix8bit"] = (ADEMAMIX_REFERENCE, with_weight_decay(bitsandbytes_optimizer("AdEMAMix8bit")))
    return found


@dataclass(frozen=True)
class Result:
    """One optimizer's runs of one cell against its fp32 reference's, over the seed sets: means, and the loss gap's
    range."""

    loss: float
    gap_percent: float
    deviation: float
    gap_range: tuple[float, float]


Cell = tuple[str, float, float]
"""A task, its learning rate and its weight decay."""


def cells(lr_factors: Iterable[float], weight_decays: Iterable[float]) -> list[Cell]:
    """Every task at its learning rate times each of ``lr_factors``, with each of ``weight_decays``."""
    return [
        (task, TASK_LEARNING_RATES[task] * factor, weight_decay)
        for task in TASKS
        for factor in lr_factors
        for weight_decay in weight_decays
    ]


def bound(factory: OptimizerFactory, lr: float, weight_decay: float) -> Optimizer:
    """``factory`` with its learning rate and weight decay given."""
    return lambda params: factory(params, lr, weight_decay)


def measure(
    steps: int, seeds: int = 1, grid: Iterable[Cell] | None = None, names: Iterable[str] | None = None
) -> dict[Cell, dict[str, Result | str]]:
    """Every cell of ``grid`` (default: every task at its own learning rate times :data:`LR_FACTORS`, with each of
    :data:`WEIGHT_DECAYS`) run with every optimizer of ``names`` (default: all) on seed sets ``0 .. seeds - 1``: per
    cell, per optimizer, its result against its reference or why it did not run. A reference runs wherever an
    optimizer it is the reference of does."""
    grid = cells(LR_FACTORS, WEIGHT_DECAYS) if grid is None else list(grid)
    compared = optimizers()
    chosen = list(compared) if names is None else [name for name in compared if name in set(names)]
    references = {compared[name][0] for name in chosen}
    chosen = [name for name in compared if name in set(chosen) | references]
    results: dict[Cell, dict[str, Result | str]] = {}
    with mock.patch.object(torch, "compile", lambda function, **options: function):
        for cell in grid:
            task, lr, weight_decay = cell
            runs: dict[str, list[tuple[float, float, float]] | str] = {}
            for seed in range(seeds):
                reference_runs: dict[str, tuple[torch.Tensor, float]] = {}
                for name in chosen:
                    reference, factory = compared[name]
                    if isinstance(compared[reference][1], str):
                        runs[name] = f"skipped: its reference did not run ({compared[reference][1]})"
                        continue
                    if isinstance(factory, str):
                        runs[name] = factory
                        continue
                    weights, loss = TASKS[task](bound(factory, lr, weight_decay), steps, seed)
                    reference_weights, reference_loss = reference_runs.setdefault(reference, (weights, loss))
                    gap = 100 * abs(loss - reference_loss) / reference_loss
                    deviation = ((weights - reference_weights).norm() / reference_weights.norm()).item()
                    runs.setdefault(name, []).append((loss, gap, deviation))
            results[cell] = {name: summary(figures) for name, figures in runs.items()}
    return results


def summary(figures: list[tuple[float, float, float]] | str) -> Result | str:
    """The means of the (loss, gap, deviation) of each seed set, and the range of the gaps."""
    if isinstance(figures, str):
        return figures
    losses, gaps, deviations = zip(*figures)
    return Result(
        statistics.fmean(losses), statistics.fmean(gaps), statistics.fmean(deviations), (min(gaps), max(gaps))
    )


def table(results: dict[Cell, dict[str, Result | str]]) -> str:
    lines = [
        "| task | lr | weight decay | optimizer | final loss | loss gap to fp32 | loss gap range "
        + "| weight deviation from fp32 | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (task, lr, weight_decay), rows in results.items():
        cell = f"| {task} | {lr:.0e} | {weight_decay:g} "
        for name, result in rows.items():
            if isinstance(result, str):
                lines.append(f"{cell}| {name} | — | — | — | — | {result} |")
            else:
                low, high = result.gap_range
                lines.append(
                    f"{cell}| {name} | {result.loss:.4f} | {result.gap_percent:.2f}% | {low:.2f}-{high:.2f}% "
                    f"| {result.deviation:.4f} | |"
                )
    return "\n".join(lines)


def target_checks(results: dict[Cell, dict[str, Result | str]]) -> list[str]:
    """Per cell and PagedAdamW4bit variant (its default, and rank-1): whether it is closer to fp32 AdamW than
    torchao's AdamW4bit in loss gap and in weight deviation (means over the seed sets), and its loss gap within 5%;
    then in how many cells each variant is closer on each measure and on both."""
    lines = []
    wins = {variant: {"loss gap": 0, "weight deviation": 0, "both measures": 0} for variant in OURS_4BIT_VARIANTS}
    for (task, lr, weight_decay), rows in results.items():
        theirs = rows.get(THEIRS_4BIT)
        for variant in OURS_4BIT_VARIANTS:
            ours = rows.get(variant)
            where = f"{task}, lr {lr:.0e}, weight decay {weight_decay:g}, {variant}"
            if not isinstance(ours, Result):
                lines.append(f"- {where}: not run ({ours})")
                continue
            within = "<=" if ours.gap_percent <= LOSS_GAP_TARGET else ">"
            checks = [f"loss gap {ours.gap_percent:.2f}% {within} 5%"]
            if isinstance(theirs, Result):
                closer = ours.gap_percent <= theirs.gap_percent and ours.deviation <= theirs.deviation
                wins[variant]["both measures"] += closer
                for measure_name, mine, its in [
                    ("loss gap", ours.gap_percent, theirs.gap_percent),
                    ("weight deviation", ours.deviation, theirs.deviation),
                ]:
                    wins[variant][measure_name] += mine <= its
                    verdict = "closer than" if mine <= its else "farther than"
                    checks.append(f"{measure_name} {mine:.4g} {verdict} torchao's {its:.4g}")
            else:
                checks.append(f"torchao's AdamW4bit not run ({theirs})")
            lines.append(f"- {where}: " + "; ".join(checks))
    for variant, counts in wins.items():
        for measure_name, count in counts.items():
            lines.append(
                f"- {variant} closer to fp32 AdamW than torchao's AdamW4bit on {measure_name}: {count} of "
                f"{len(results)} cells"
            )
    return lines


def grid_summary(results: dict[Cell, dict[str, Result | str]]) -> list[str]:
    """Per optimizer that is not a reference, over the cells it ran: the mean and the largest of its loss gaps and of
    its weight deviations (each a mean over the seed sets) as a markdown table; then, per pair of :data:`RIVALS`
    that both ran, in how many cells the first is closer to the reference on each measure."""
    ran: dict[str, list[Result]] = {}
    for rows in results.values():
        for name, result in rows.items():
            if name not in (ADAMW_REFERENCE, ADEMAMIX_REFERENCE) and isinstance(result, Result):
                ran.setdefault(name, []).append(result)
    lines = [
        "| optimizer | cells | mean loss gap | largest loss gap | mean weight deviation | largest weight deviation |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, found in ran.items():
        gaps = [result.gap_percent for result in found]
        deviations = [result.deviation for result in found]
        lines.append(
            f"| {name} | {len(found)} | {statistics.fmean(gaps):.2f}% | {max(gaps):.2f}% "
            f"| {statistics.fmean(deviations):.4f} | {max(deviations):.4f} |"
        )
    for ours, theirs in RIVALS:
        pairs = [
            (rows[ours], rows[theirs])
            for rows in results.values()
            if isinstance(rows.get(ours), Result) and isinstance(rows.get(theirs), Result)
        ]
        if pairs:
            gap_wins = sum(mine.gap_percent <= its.gap_percent for mine, its in pairs)
            deviation_wins = sum(mine.deviation <= its.deviation for mine, its in pairs)
            lines.append(
                f"- {ours} closer to its fp32 reference than {theirs}: loss gap in {gap_wins} of {len(pairs)} cells, "
                f"weight deviation in {deviation_wins}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 steps, one seed set, one cell per task: a test's size")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (at least 20; default 200)")
    parser.add_argument(
        "--seeds", type=int, default=None, help="seed sets each cell runs on, figures their means (default 3; quick 1)"
    )
    parser.add_argument(
        "--only", nargs="+", default=None, help=f"optimizer names, or {', '.join(GROUPS)} (their references run too)"
    )
    args = parser.parse_args()
    steps = args.steps if args.steps is not None else 20 if args.quick else 200
    seeds = args.seeds if args.seeds is not None else 1 if args.quick else 3
    if steps < 20:
        parser.error(f"--steps must be at least 20, got {steps}")
    if seeds < 1:
        parser.error(f"--seeds must be at least 1, got {seeds}")
    names = None
    if args.only is not None:
        names = [name for entry in args.only for name in GROUPS.get(entry, (entry,))]
        unknown = sorted(set(names) - set(optimizers()))
        if unknown:
            parser.error(f"--only: no optimizer {unknown}; the names are {sorted(optimizers())} and {sorted(GROUPS)}")
    grid = cells((1.0,), (0.1,)) if args.quick else cells(LR_FACTORS, WEIGHT_DECAYS)
    torch.set_num_threads(1)
    results = measure(steps, seeds, grid, names)
    print(f"{steps} steps per run, one thread, means over {seeds} seed set(s)\n")
    print(table(results))
    print(f"\nEach optimizer over the {len(results)} cell(s), on the means over {seeds} seed set(s):\n")
    print("\n".join(grid_summary(results)))
    if any(variant in rows for rows in results.values() for variant in OURS_4BIT_VARIANTS):
        print(f"\nPagedAdamW4bit against torchao's AdamW4bit, on the means over {seeds} seed set(s):\n")
        print("\n".join(target_checks(results)))


if __name__ == "__main__":
    main()
