"""The Trainer under accelerate's FSDP2, two CPU processes, with every hf-paged optimizer (issue 18).

One launch of ``tests/scripts/fsdp2_trainer.py`` as the README launches a training script with
``configs/accelerate/fsdp2.yaml`` (mixed precision off on the CPU). Through the Trainer the optimizer is built
on the full parameters; accelerate then shards the model with ``fully_shard`` and puts the sharded DTensor
parameters into the optimizer's param groups. Each optimizer trains 6 steps with a checkpoint at step 3, and
a second Trainer resumes from that checkpoint; ``adamw_torch`` is the reference. Every test runs for two launches:
parameters sharded on the device, and offloaded to the host with ``--fsdp_offload_params true`` (FSDP2's
``CPUOffloadPolicy``: the optimizer steps on host shards, as in offloaded training on GPUs).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator

import pytest
import torch
from background import BackgroundRun, Launches, selected_params

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "scripts", "fsdp2_trainer.py")
CONFIG = os.path.join(REPO, "configs", "accelerate", "fsdp2.yaml")
sys.path.insert(0, os.path.dirname(SCRIPT))

from fsdp2_trainer import sharded_llama

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

STEPS, SAVE_AT, WORLD = 6, 3, 2
REFERENCE = "adamw_torch"
PAGED = [
    "hf_paged_adamw_32bit",
    "hf_paged_adamw_8bit",
    "hf_paged_adamw_4bit",
    "hf_paged_lion_32bit",
    "hf_paged_lion_8bit",
    "hf_paged_ademamix_8bit",
]
OPTIMS = [REFERENCE, *PAGED]
RUNS = ("uninterrupted", "resumed")


LAUNCH_NAMES = {False: "on-device", True: "cpu-offload"}
"""Each launch's name, by whether it offloads."""


@pytest.fixture(scope="module", params=list(LAUNCH_NAMES), ids=list(LAUNCH_NAMES.values()))
def offload(request) -> bool:
    """Whether the launch offloads the sharded parameters, their gradients and the optimizer step to the host
    (``--fsdp_offload_params true``: FSDP2's ``CPUOffloadPolicy``, issue 21)."""
    return request.param


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory) -> Iterator[Launches]:
    """``fsdp2_trainer.py`` for every optimizer, a two-process launch without offload and one with it, those the
    selected tests read started together (a thread per process: they share the cores)."""

    def start(offloads: bool) -> BackgroundRun:
        folder = tmp_path_factory.mktemp("fsdp2_trainer")
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG,
            "--mixed_precision", "no", "--main_process_port", "0",  # port 0: a free one
            "--fsdp_offload_params", str(offloads).lower(),
            "-m", "hf_paged.run", SCRIPT, "--optim", *OPTIMS,
            "--steps", str(STEPS), "--save-at", str(SAVE_AT), "--output-dir", str(folder),
        ]  # fmt: skip
        environment = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        return BackgroundRun(command, environment, cwd=REPO, output=folder / "results.pt")

    needed = {LAUNCH_NAMES[offloads] for offloads in selected_params(request, "offload")}
    runs = Launches({name: functools.partial(start, offloads) for offloads, name in LAUNCH_NAMES.items()}, needed)
    yield runs
    runs.stop()


@pytest.fixture(scope="module")
def results(launches, offload) -> dict:
    """What ``fsdp2_trainer.py`` found for every optimizer, from the two-process launch of ``offload``."""
    run = launches[LAUNCH_NAMES[offload]]
    completed = run.wait()
    assert completed.returncode == 0, completed.stderr[-4000:]
    return torch.load(run.output, weights_only=True)


def runs(results: dict, optim: str, kind: str) -> list[dict]:
    """Every rank's ``kind`` run (``"uninterrupted"`` or ``"resumed"``) of ``optim``."""
    return [rank[kind] for rank in results[optim]["ranks"]]


def succeeded(results: dict, optim: str, kind: str) -> list[dict]:
    """Every rank's ``kind`` run of ``optim``; fails the test with the error of a run that failed."""
    each = runs(results, optim, kind)
    failed = [rank for rank, run in enumerate(each) if run["error"]]
    if failed:
        first = each[failed[0]]
        pytest.fail(
            f"{optim}: the {kind} run failed on rank(s) {failed}, after logging the losses {first['losses']}; "
            f"rank {failed[0]}:\n{first['error']}"
        )
    return each


def losses(run: dict) -> list[float]:
    """The run's logged loss of every step, in order."""
    assert sorted(run["losses"]) == list(range(1, STEPS + 1)), run["losses"]
    return [run["losses"][step] for step in range(1, STEPS + 1)]


def initial_shard(weight: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``weight`` as ``fully_shard`` places them (``Shard(0)``; every size here is even)."""
    return weight.chunk(WORLD, dim=0)[rank]


@pytest.mark.parametrize("optim", OPTIMS)
def test_fsdp2_is_in_effect(results, offload, optim):
    """accelerate really shards the model with FSDP2 (offloading it to the host when asked) and gives the optimizer
    the sharded parameters."""
    for kind in RUNS:
        for rank, run in enumerate(runs(results, optim, kind)):
            if kind == "resumed" and "fsdp" not in run:
                continue  # not run: the uninterrupted run failed, which the other tests report
            facts = run["fsdp"]
            assert facts["distributed_type"] == "DistributedType.FSDP", (kind, rank, facts)
            assert facts["is_fsdp2"] and facts["fsdp_version"] == 2 and facts["trainer_is_fsdp_enabled"], facts
            assert (facts["world_size"], facts["backend"]) == (WORLD, "gloo"), facts
            assert facts["fsdp_modules"] >= 3, facts  # both decoder layers and the root at least
            assert facts["params_are_sharded_dtensors"], facts
            assert facts["optimizer_holds_the_sharded_params"], facts
            assert WORLD * facts["local_elements"] == facts["full_elements"], facts
            assert facts["params_offloaded_to_cpu"] and set(facts["params_offloaded_to_cpu"]) == {offload}, facts


@pytest.mark.parametrize("optim", OPTIMS)
def test_model_trains(results, optim):
    """The loss falls: as adamw_torch's for 32-bit AdamW, clearly for the others; every rank's shards move."""
    reference = losses(succeeded(results, REFERENCE, "uninterrupted")[0])
    logged = runs(results, optim, "uninterrupted")[0]["losses"]
    if optim == "hf_paged_adamw_32bit":
        for step, loss in sorted(logged.items()):
            expected = reference[step - 1]
            assert abs(loss - expected) <= 1e-4 * abs(expected), f"step {step}: loss {loss}, adamw_torch {expected}"
    uninterrupted = succeeded(results, optim, "uninterrupted")
    trained = losses(uninterrupted[0])
    assert trained[-1] < 0.95 * trained[0], f"{optim}: losses {trained} (adamw_torch: {reference})"
    initial = dict(sharded_llama().named_parameters())
    for rank, run in enumerate(uninterrupted):
        assert run["weights"].keys() == initial.keys()
        for name, weight in run["weights"].items():
            start = initial_shard(initial[name].detach(), rank)
            assert weight.shape == start.shape, (rank, name)
            assert not torch.equal(weight, start), f"rank {rank}: {name} did not change"


@pytest.mark.parametrize("optim", PAGED)
def test_each_rank_pages_only_its_shard(results, optim):
    """Each rank's optimizer holds about half the pages of the same optimizer on the full model."""
    for kind in RUNS:
        for rank, run in enumerate(runs(results, optim, kind)):
            if run.get("pages") is None:
                continue  # the run failed before the Trainer built its optimizer
            full = run["unsharded_pages"]
            assert 0 < run["pages"] <= 0.6 * full, f"{kind} run, rank {rank}: {run['pages']} pages, unsharded {full}"
    for kind in RUNS:
        succeeded(results, optim, kind)


@pytest.mark.parametrize("optim", OPTIMS)
def test_checkpoint_resumes_bitwise(results, optim):
    """The Trainer saves sharded (DCP) checkpoints, and resuming from one repeats the uninterrupted run bitwise."""
    uninterrupted = succeeded(results, optim, "uninterrupted")
    checkpoint = results[optim]["checkpoint"]
    shards = [".metadata", *(f"__{rank}_0.distcp" for rank in range(WORLD))]
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert checkpoint.get(folder) == shards, checkpoint
    assert not {"optimizer.pt", "model.safetensors", "pytorch_model.bin"} & set(checkpoint["."]), checkpoint
    resumed = succeeded(results, optim, "resumed")
    for rank, (expected, actual) in enumerate(zip(uninterrupted, resumed)):
        after_checkpoint = slice(SAVE_AT, STEPS)
        assert losses(actual)[after_checkpoint] == losses(expected)[after_checkpoint], rank
        assert actual["weights"].keys() == expected["weights"].keys()
        for name, weight in expected["weights"].items():
            assert torch.equal(actual["weights"][name], weight), f"rank {rank}: {name}"
