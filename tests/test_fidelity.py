"""``benchmarks/fidelity.py``: its quick run as a user runs it (table shape, the fp32 references, PagedAdamW4bit against
torchao's AdamW4bit, AdEMAMix against bitsandbytes' reference, upper bounds on our figures), its grid of learning
rates and weight decays, its data split and its report of an optimizer that cannot run; README.md's table of the 4-bit
comparison on the whole grid (its cells and verdicts; in the slow run, measured again)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from test_benchmarks import markdown_tables, run_benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fidelity

TASKS = ["mlp teacher", "tiny LM", "tiny LoRA"]
OPTIMIZERS = [
    "torch AdamW (fp32)",
    "hf-paged PagedAdamW8bit",
    "hf-paged PagedAdamW4bit",
    "hf-paged PagedAdamW4bit (rank-1)",
    "torchao AdamW8bit",
    "torchao AdamW4bit",
    "bitsandbytes AdamW8bit",
    "bitsandbytes reference AdEMAMix (fp32)",
    "hf-paged PagedAdEMAMix",
    "hf-paged PagedAdEMAMix8bit",
    "hf-paged PagedAdEMAMix4bit",
    "bitsandbytes AdEMAMix8bit",
]
COLUMNS = [
    "task",
    "lr",
    "weight decay",
    "optimizer",
    "final loss",
    "loss gap to fp32",
    "loss gap range",
    "weight deviation from fp32",
    "note",
]
OURS_4BIT_QUICK_BOUNDS = {"mlp teacher": (2.2, 0.07), "tiny LM": (3.0, 0.05), "tiny LoRA": (0.1, 0.05)}
"""Upper bounds on PagedAdamW4bit's loss gap (percent) and weight deviation per task in the quick run: the figures
when this test was written (1.71%, 0.0555; 2.40%, 0.0389; 0.02%, 0.0583; rank-1 on the MLP teacher: 1.75%, 0.0567)
with about a quarter's slack, so a change that loses fidelity fails the test; the LoRA's since its ``B`` matrices
keep 8-bit state (0.01%, 0.0376; 0.0583 with 4-bit state, which this bound refuses)."""
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
GRID_COLUMNS = [
    "task",
    "lr",
    "weight decay",
    "loss gap: PagedAdamW4bit",
    "loss gap: torchao AdamW4bit",
    "deviation: PagedAdamW4bit",
    "deviation: torchao AdamW4bit",
    "rank-1: loss gap, deviation",
    "PagedAdamW4bit closer on",
]
"""The columns of README.md's table of the 4-bit comparison on the whole grid."""


@pytest.fixture(scope="module")
def quick_rows() -> dict[tuple[str, str], dict[str, str]]:
    """The quick run's table, by (task, optimizer); its summary has a row for each optimizer but the references."""
    table, summary = markdown_tables(run_benchmark("fidelity.py", "--quick"))
    references = {"torch AdamW (fp32)", "bitsandbytes reference AdEMAMix (fp32)"}
    assert [(row["optimizer"], row["cells"]) for row in summary] == [
        (name, str(len(TASKS))) for name in OPTIMIZERS if name not in references
    ]
    assert list(table[0]) == COLUMNS
    assert [(row["task"], row["optimizer"]) for row in table] == [(t, o) for t in TASKS for o in OPTIMIZERS]
    assert {(row["lr"], row["weight decay"]) for row in table} == {("1e-03", "0.1")}
    return {(row["task"], row["optimizer"]): row for row in table}


def figures(row: dict[str, str]) -> tuple[float, float, float]:
    """A measured row's final loss, loss gap in percent and weight deviation."""
    assert row["loss gap to fp32"].endswith("%"), row
    return (
        float(row["final loss"]),
        float(row["loss gap to fp32"][:-1]),
        float(row["weight deviation from fp32"]),
    )


@pytest.mark.slow  # the quick run of benchmarks/fidelity.py, about 25 s
@pytest.mark.parametrize("task", TASKS)
def test_quick_table_has_the_fp32_references_and_labels_what_did_not_run(quick_rows, task):
    for reference in ("torch AdamW (fp32)", "bitsandbytes reference AdEMAMix (fp32)"):
        loss, gap, deviation = figures(quick_rows[task, reference])
        assert math.isfinite(loss) and loss > 0 and gap == 0 and deviation == 0
    for name in ["torchao AdamW8bit", "torchao AdamW4bit"]:
        assert (quick_rows[task, name]["final loss"] == "—") == (not HAS_TORCHAO)
    for name in [
        "hf-paged PagedAdamW8bit",
        "hf-paged PagedAdamW4bit",
        "hf-paged PagedAdamW4bit (rank-1)",
        "hf-paged PagedAdEMAMix8bit",
        "hf-paged PagedAdEMAMix4bit",
    ]:
        loss, gap, deviation = figures(quick_rows[task, name])
        assert math.isfinite(loss) and 0 < deviation < 1 and quick_rows[task, name]["note"] == ""


@pytest.mark.slow  # the quick run of benchmarks/fidelity.py, about 25 s
@pytest.mark.parametrize("variant", ["hf-paged PagedAdamW4bit", "hf-paged PagedAdamW4bit (rank-1)"])
@pytest.mark.parametrize("task", TASKS)
def test_quick_4bit_is_closer_to_fp32_than_torchaos_and_holds_its_figures(quick_rows, task, variant):
    """Both 4-bit variants; the rank-1 one differs from block scales on the MLP teacher only (its 512 x 512 matrix): no
    matrix of the tiny Llama or of its adapters is large enough for rank-1 statistics to cost no more than block
    scales, so they keep block scales, as ``normalization="rank1"`` does by design."""
    _, gap, deviation = figures(quick_rows[task, variant])
    assert gap <= 5.0
    most_gap, most_deviation = OURS_4BIT_QUICK_BOUNDS[task]
    assert gap <= most_gap and deviation <= most_deviation
    if HAS_TORCHAO:
        _, their_gap, their_deviation = figures(quick_rows[task, "torchao AdamW4bit"])
        assert gap <= their_gap and deviation <= their_deviation


@pytest.mark.slow  # the quick run of benchmarks/fidelity.py, about 25 s
@pytest.mark.parametrize("task", TASKS)
def test_quick_8bit_deviates_less_than_the_other_8bit_optimizers(quick_rows, task):
    _, gap, deviation = figures(quick_rows[task, "hf-paged PagedAdamW8bit"])
    assert gap <= 0.1
    for name in ["torchao AdamW8bit", "bitsandbytes AdamW8bit"]:
        if quick_rows[task, name]["final loss"] != "—":
            assert deviation <= figures(quick_rows[task, name])[2]


@pytest.mark.slow  # the quick run of benchmarks/fidelity.py, about 25 s
@pytest.mark.parametrize("task", TASKS)
def test_quick_ademamix_rows_follow_bitsandbytes_reference(quick_rows, task):
    """PagedAdEMAMix (fp32) trains as the reference to rounding; its 8-bit state deviates less than bitsandbytes'
    AdEMAMix8bit's and its 4-bit state within the bounds of PagedAdamW4bit."""
    _, gap, deviation = figures(quick_rows[task, "hf-paged PagedAdEMAMix"])
    assert gap <= 1e-3 and deviation <= 1e-5
    _, gap, deviation = figures(quick_rows[task, "hf-paged PagedAdEMAMix8bit"])
    assert gap <= 0.1 and deviation <= figures(quick_rows[task, "bitsandbytes AdEMAMix8bit"])[2]
    _, gap, deviation = figures(quick_rows[task, "hf-paged PagedAdEMAMix4bit"])
    most_gap, most_deviation = OURS_4BIT_QUICK_BOUNDS[task]
    assert gap <= most_gap and deviation <= most_deviation


def test_the_grid_runs_each_task_at_three_learning_rates_over_10x_with_and_without_weight_decay():
    grid = fidelity.cells(fidelity.LR_FACTORS, fidelity.WEIGHT_DECAYS)
    assert len(grid) == 3 * 3 * 2
    for task in TASKS:
        rates = sorted({lr for name, lr, _ in grid if name == task})
        assert len(rates) == 3 and rates[-1] / rates[0] == pytest.approx(10) and rates[1] == 1e-3
        assert {decay for name, _, decay in grid if name == task} == {0.0, 0.1}


def test_held_out_records_are_not_trained_on_and_batches_are_seeded():
    batches, held_out = fidelity.byte_windows(3)
    assert held_out.shape[1] == fidelity.WINDOW and held_out.shape[0] >= 8
    assert [batch.shape for batch in batches] == [(fidelity.LM_BATCH, fidelity.WINDOW)] * 3
    again, held_out_again = fidelity.byte_windows(3)
    assert all(torch.equal(a, b) for a, b in zip(batches, again)) and torch.equal(held_out, held_out_again)
    train_text = b"".join(bytes(batch.flatten().tolist()) for batch in fidelity.byte_windows(400)[0])
    records = [json.loads(line) for line in fidelity.INSTRUCTIONS.read_text(encoding="utf-8").splitlines()]
    texts = {f"{record['instruction']}\n{record['response']}" for record in records}
    held_records = set(bytes(held_out.flatten().tolist()).decode().split("\n\n")) & texts
    assert len(held_records) >= 10
    assert not set(train_text.decode(errors="replace").split("\n\n")) & held_records


def test_an_8bit_optimizer_that_fails_on_the_cpu_is_reported_skipped_with_its_error(monkeypatch):
    bitsandbytes = pytest.importorskip("bitsandbytes")

    def unsupported(*args, **kwargs):
        raise RuntimeError("no CPU kernel")

    monkeypatch.setattr(bitsandbytes.optim, "AdamW8bit", unsupported)
    reason = fidelity.bitsandbytes_optimizer("AdamW8bit")
    assert isinstance(reason, str) and reason.startswith("skipped:") and "RuntimeError: no CPU kernel" in reason


def test_seed_sets_change_every_seed_and_the_table_gives_their_means_and_the_gaps_range():
    """Seed set 1 draws other initial weights, teacher and batches than set 0 (the benchmark's own seeds); a result
    over seed sets holds the means of loss, gap and deviation and the range of the gaps."""
    assert not torch.equal(fidelity.flat(fidelity.student(0)), fidelity.flat(fidelity.student(1)))
    assert not torch.equal(fidelity.teacher_batches(2, 0)[0][1], fidelity.teacher_batches(2, 1)[0][1])
    assert not torch.equal(fidelity.byte_windows(2, 0)[0][0], fidelity.byte_windows(2, 1)[0][0])
    assert torch.equal(fidelity.byte_windows(2, 1)[1], fidelity.byte_windows(2, 0)[1])  # the same held-out records
    result = fidelity.summary([(1.0, 2.0, 0.25), (3.0, 6.0, 0.75)])
    assert result == fidelity.Result(loss=2.0, gap_percent=4.0, deviation=0.5, gap_range=(2.0, 6.0))
    assert fidelity.summary("skipped: why") == "skipped: why"


def test_the_grid_summary_gives_each_optimizers_means_and_largest_figures_and_counts_the_rivals_cells():
    def result(gap: float, deviation: float) -> fidelity.Result:
        return fidelity.Result(loss=1.0, gap_percent=gap, deviation=deviation, gap_range=(gap, gap))

    ours, theirs = fidelity.RIVALS[0]
    results = {
        ("mlp teacher", 1e-3, 0.0): {
            "torch AdamW (fp32)": result(0.0, 0.0),
            ours: result(1.0, 0.01),
            theirs: result(2.0, 0.005),
        },
        ("tiny LM", 1e-3, 0.0): {
            "torch AdamW (fp32)": result(0.0, 0.0),
            ours: result(3.0, 0.03),
            theirs: "skipped: not here",
        },
        ("tiny LoRA", 1e-3, 0.0): {
            "torch AdamW (fp32)": result(0.0, 0.0),
            ours: result(0.5, 0.02),
            theirs: result(1.0, 0.04),
        },
    }
    lines = fidelity.grid_summary(results)
    assert lines[2:4] == [
        f"| {ours} | 3 | 1.50% | 3.00% | 0.0200 | 0.0300 |",
        f"| {theirs} | 2 | 1.50% | 2.00% | 0.0225 | 0.0400 |",
    ]
    assert lines[4:] == [
        f"- {ours} closer to its fp32 reference than {theirs}: loss gap in 2 of 2 cells, weight deviation in 1"
    ]


def test_every_named_group_names_optimizers_of_the_benchmark():
    for group, names in fidelity.GROUPS.items():
        assert set(names) <= set(fidelity.optimizers()), group
    assert {name for pair in fidelity.RIVALS for name in pair} <= set(fidelity.optimizers())


def written(cell: fidelity.Cell) -> tuple[str, str, str]:
    """A cell as the tables write it: task, lr (``3e-04``) and weight decay (``0.1``)."""
    task, lr, weight_decay = cell
    return task, f"{lr:.0e}", f"{weight_decay:g}"


def readme_grid() -> dict[tuple[str, str, str], dict[str, str]]:
    """README.md's table of the 4-bit comparison on the whole grid, by cell as :func:`written` gives it."""
    section = README.split("\n### Fidelity\n", 1)[1].split("\n### ", 1)[0]
    (table,) = [table for table in markdown_tables(section) if list(table[0]) == GRID_COLUMNS]
    return {(row["task"], row["lr"], row["weight decay"]): row for row in table}


def leading(cell: str) -> float:
    """The first figure of a table cell (``"2.19% (1.97-2.41%)"``: 2.19)."""
    return float(re.match(r"[\d.]+", cell).group())


def test_the_readme_grid_has_every_cell_and_its_verdicts_follow_its_figures():
    """Every cell of the grid once, each verdict what its figures say, and the counts the text gives."""
    rows = readme_grid()
    assert list(rows) == [written(cell) for cell in fidelity.cells(fidelity.LR_FACTORS, fidelity.WEIGHT_DECAYS)]
    closer_gap = closer_deviation = 0
    for row in rows.values():
        gap = leading(row["loss gap: PagedAdamW4bit"]) <= leading(row["loss gap: torchao AdamW4bit"])
        deviation = leading(row["deviation: PagedAdamW4bit"]) <= leading(row["deviation: torchao AdamW4bit"])
        verdict = {(True, True): "both", (False, True): "deviation", (True, False): "loss gap"}.get((gap, deviation))
        assert row["PagedAdamW4bit closer on"] == (verdict or "neither"), row
        closer_gap += gap
        closer_deviation += deviation
    text = " ".join(README.split())
    counts = re.search(r"in weight deviation in (\d+) of 18 cells and in loss gap in (\d+)", text)
    assert counts and (int(counts.group(1)), int(counts.group(2))) == (closer_deviation, closer_gap)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # about 25 min of one core, beyond the suite's 600 s per test
@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao not importable")
def test_the_whole_grid_measures_what_the_readme_says():
    """``fidelity.py --only 4bit`` (200 steps, 18 cells, 3 seed sets; about 25 min of one core): every figure of
    README.md's table to its printed digits, give or take one in the last (rounding), so that its verdicts, which the
    test above holds to its figures, are what a run measures."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = fidelity.measure(200, 3, names=fidelity.GROUPS["4bit"])
    finally:
        torch.set_num_threads(threads)
    rows = readme_grid()
    assert [written(cell) for cell in results] == list(rows)
    for cell, row in zip(results, rows.values()):
        ours, theirs = results[cell][fidelity.OURS_4BIT], results[cell][fidelity.THEIRS_4BIT]
        figures = [
            (ours.gap_percent, row["loss gap: PagedAdamW4bit"], 0.01),
            (theirs.gap_percent, row["loss gap: torchao AdamW4bit"], 0.01),
            (ours.deviation, row["deviation: PagedAdamW4bit"], 1e-4),
            (theirs.deviation, row["deviation: torchao AdamW4bit"], 1e-4),
        ]
        rank1 = results[cell][fidelity.OURS_RANK1]
        if cell[0] == "mlp teacher":
            rank1_gap, rank1_deviation = row["rank-1: loss gap, deviation"].split(", ")
            figures += [(rank1.gap_percent, rank1_gap, 0.01), (rank1.deviation, rank1_deviation, 1e-4)]
        else:  # no matrix of the tiny Llama or its adapters takes rank-1 statistics: the rows are the same
            assert rank1 == ours and row["rank-1: loss gap, deviation"] == "as block scales", cell
        for measured, text, unit in figures:
            assert abs(measured - leading(text)) <= unit * 1.01, (cell, measured, text)
