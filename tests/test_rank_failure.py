"""A failure on one rank of a distributed Trainer run (gloo on the CPU): tests/scripts/rank_failure.py under torchrun.

An out-of-memory error injected in backward on one rank ends every rank within seconds with hf-paged's note, also
when the failed rank's process holds on to its connections (as the peers of a failed rank wait in an NCCL collective
until its timeout); the last checkpoint resumes bitwise. A micro-batch inside DDP's ``no_sync`` and the optimizer's
step recover on their rank, bitwise. A failure or a kill while a checkpoint is written leaves no checkpoint that
``get_last_checkpoint`` or ``resume_from_checkpoint=True`` would take incomplete, whatever the save strategy; an error
in a save or an evaluation ends every rank as one in backward does. The default run covers DDP on one node;
``HF_PAGED_SLOW=1`` adds two nodes, FSDP2, DeepSpeed ZeRO-3, torchrun's restarts and more save strategies.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from transformers.trainer_utils import get_last_checkpoint

from hf_paged.rank_failure import EXIT_CODE, RankFailure, RankFailureWatcher, failure_key

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "scripts", "rank_failure.py")
ENDS_WITHIN = 60.0
"""Seconds from the failure until every rank of the job has ended."""
NOTE = "hf-paged: ending rank 0 because rank 1 failed in the forward/backward of step 3 with OutOfMemoryError"

needs_torchrun = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (from ``/proc``; none where it is missing or the process has ended)."""
    found = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError), open(task) as file:
            for child in map(int, file.read().split()):
                found += [child, *descendants(child)]
    return found


def missing_files(checkpoint: str) -> list[str]:
    """What a checkpoint of the DDP run lacks to resume on two ranks."""
    files = [
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "trainer_state.json",
        "rng_state_0.pth",
        "rng_state_1.pth",
    ]
    return [name for name in files if not os.path.isfile(os.path.join(checkpoint, name))]


def noted_checkpoint(text: str) -> str | None:
    """The checkpoint a failure's note tells to resume from."""
    found = re.search(r"Resume from the last checkpoint, (.+?checkpoint-\d+)\.", text)
    return found and found.group(1)


def read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as file:
        return json.load(file)


@dataclass
class Launch:
    returncodes: list[int]
    seconds_after_failure: float | None
    """From the failing rank's error until the last launcher ended."""
    output: str
    results: dict[int, dict]
    failure: dict | None


def launch(
    folder,
    *options: str,
    nodes: int = 1,
    timeout: float = 240,
    launcher: tuple[str, ...] = (),
    script: str = SCRIPT,
    repo: str = REPO,
) -> Launch:
    """Run ``script`` with ``options`` under torchrun (with ``launcher``'s options): one node of two processes, or two
    nodes of one each (two launchers on this machine, ``--master-addr 127.0.0.1``)."""
    os.makedirs(folder, exist_ok=True)
    port = free_port()
    if nodes == 1:
        commands = [["--standalone", "--nproc-per-node", "2"]]
    else:
        commands = [
            [
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
            ]
            for node in range(2)
        ]
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([repo, os.path.join(repo, "tests")]),
        "OMP_NUM_THREADS": "1",
        "HF_PAGED_COMPILE": "0",
    }
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *command,
                *launcher,
                script,
                "--output-dir",
                str(folder),
                *options,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environment,
        )
        for command in commands
    ]
    outputs, ended = [], []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout)[0])
            ended.append(time.time())
    finally:
        for process in processes:
            for pid in [process.pid, *descendants(process.pid)]:  # torchrun starts its workers in sessions of their own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.communicate()
    failure = read_json(os.path.join(folder, "failure.json"))
    results = {rank: read_json(os.path.join(folder, f"rank{rank}.json")) for rank in range(2)}
    return Launch(
        returncodes=[process.returncode for process in processes],
        seconds_after_failure=None if failure is None else max(ended) - failure["time"],
        output="\n".join(outputs),
        results={rank: result for rank, result in results.items() if result is not None},
        failure=failure,
    )


# The watcher alone, in one process -------------------------------------------------------------------------


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)


def test_watcher_ends_the_process_when_another_rank_fails(store, caplog):
    ended = []
    watcher = RankFailureWatcher(store, rank=0, poll_interval=0.05, end_process=ended.append).start()
    publisher = RankFailureWatcher(store, rank=1, poll_interval=0.05, end_process=ended.append)
    publisher.publish(RankFailure.of(torch.OutOfMemoryError("injected"), rank=1, step=7, phase="forward/backward"))
    deadline = time.monotonic() + 10
    while not ended and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended == [EXIT_CODE]
    assert "ending rank 0 because rank 1 failed in the forward/backward of step 7 with OutOfMemoryError: injected" in (
        caplog.text
    )
    assert "lower the batch size per device" in caplog.text
    watcher.stop()


def test_watcher_ignores_its_own_failure_and_keeps_the_first(store):
    ended = []
    watcher = RankFailureWatcher(store, rank=1, poll_interval=0.05, end_process=ended.append).start()
    first = RankFailure.of(RuntimeError("first"), rank=1, step=2, phase="optimizer step")
    assert watcher.publish(first) == first
    assert watcher.publish(RankFailure.of(RuntimeError("second"), rank=0, step=2, phase="forward/backward")) == first
    time.sleep(0.5)
    watcher.stop()
    assert ended == []
    record = json.loads(store.get(failure_key()))
    assert (record["rank"], record["error"]) == (1, "RuntimeError: first")
    assert record["advice"] == "See rank 1's traceback for the cause."


def test_watcher_waits_for_a_checkpoint_being_written(store):
    ended = []
    watcher = RankFailureWatcher(store, rank=0, poll_interval=0.05, grace=30, end_process=ended.append).start()
    with watcher.checkpointing():
        RankFailureWatcher(store, rank=1).publish(RankFailure.of(RuntimeError("x"), 1, 1, "forward/backward"))
        time.sleep(0.5)
        assert ended == []
    deadline = time.monotonic() + 10
    while not ended and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended == [EXIT_CODE]


def test_watcher_ends_the_process_when_the_store_is_gone():
    host = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", host.port, 1, False)
    ended = []
    watcher = RankFailureWatcher(client, rank=1, poll_interval=0.05, store_lost_after=0.5, end_process=ended.append)
    watcher.start()
    del host
    deadline = time.monotonic() + 15
    while not ended and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended == [EXIT_CODE]


@pytest.mark.parametrize("name", ["poll_interval", "grace", "store_lost_after"])
def test_watcher_refuses_bad_durations(store, name):
    with pytest.raises(ValueError, match=name):
        RankFailureWatcher(store, rank=0, **{name: -1})


# Through the Trainer, under torchrun ------------------------------------------------------------------------

ACCUMULATE = ("--steps", "4", "--save-steps", "2", "--grad-accum", "2")
"""Four optimizer steps of two micro-batches each, a checkpoint after step 2."""
HOLD_ON = ("--fail-step", "3", "--fail-micro-batch", "1", "--linger", "600", "--pg-timeout", "1200")
"""Rank 1 runs out of memory in the backward of step 3's last micro-batch, the one whose gradients DDP all-reduces
(rank 0 waits in that collective, a replay cannot be exact), every time. The failing rank keeps its process for 10 minutes after its error, and a collective may wait 20: its peers end
within seconds only because hf-paged's watcher ends them."""


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    run = launch(tmp_path_factory.mktemp("clean"), *ACCUMULATE, "--fail-in", "none")
    assert run.returncodes == [0], run.output[-4000:]
    return run


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("failed")
    return folder, launch(folder, *ACCUMULATE, *HOLD_ON, timeout=150)


@needs_torchrun
def test_a_failure_on_one_rank_ends_every_rank_with_a_note(failed_run):
    _, run = failed_run
    assert run.returncodes != [0]
    assert run.seconds_after_failure < ENDS_WITHIN, run.output[-4000:]
    assert NOTE in run.output
    assert "Resume from the last checkpoint" in run.output and "checkpoint-2" in run.output
    assert "lower the batch size per device" in run.output
    note = "hf-paged: rank 1 failed in the forward/backward of step 3 with OutOfMemoryError: injected in backward."
    assert note in run.failure["traceback"]  # the failed rank's own error carries it too
    assert run.results == {}


@needs_torchrun
@pytest.mark.slow  # about 9 s; the default run keeps the failure's note and the recoveries on their rank
def test_the_last_checkpoint_resumes_bitwise_after_the_failure(failed_run, clean_run, tmp_path):
    folder, _ = failed_run
    checkpoint = os.path.join(folder, "checkpoint-2")
    resumed = launch(tmp_path, *ACCUMULATE, "--fail-in", "none", "--resume-from", checkpoint)
    assert resumed.returncodes == [0], resumed.output[-4000:]
    for rank in (0, 1):
        assert resumed.results[rank]["checksum"] == clean_run.results[rank]["checksum"]
        assert resumed.results[rank]["norm"] == clean_run.results[rank]["norm"]
        assert {step: loss for step, loss in resumed.results[rank]["losses"].items() if int(step) > 2} == {
            step: loss for step, loss in clean_run.results[rank]["losses"].items() if int(step) > 2
        }


@needs_torchrun
def test_no_sync_micro_batch_and_optimizer_step_recover_on_their_rank(clean_run, tmp_path):
    """Rank 1 runs out of memory in the backward of step 3's first micro-batch (inside DDP's no_sync: the replay runs
    no collective) and in that step's optimizer step; the run goes on, bitwise that of the clean run."""
    run = launch(
        tmp_path,
        *ACCUMULATE,
        "--fail-step",
        "3",
        "--fail-in",
        "backward",
        "optimizer",
        "--fail-micro-batch",
        "0",
        "--fail-times",
        "1",
    )
    assert run.returncodes == [0], run.output[-4000:]
    assert run.results[1]["oom_recoveries"] == 2
    assert run.results[0]["oom_recoveries"] == 0
    for rank in (0, 1):
        assert run.results[rank]["checksum"] == clean_run.results[rank]["checksum"]
        assert run.results[rank]["losses"] == clean_run.results[rank]["losses"]


INTERRUPTED_SAVE = ("--run-ahead", "--interrupt-save", "2", "6")
"""Rank 0 writes the rest of checkpoint-2 6 s after its model weights, and step 3 starts without a collective: rank 1
fails in step 3 while rank 0 writes, unless the ranks wait for each other after a save."""


@needs_torchrun
@pytest.mark.parametrize(
    ("strategy", "failed_rank", "resume"),
    [  # the default run resumes with True in tests/test_whole_checkpoints.py
        ("epoch", "holds on", False),
        pytest.param("best", "holds on", True, marks=pytest.mark.slow),
        pytest.param("steps", "exits", True, marks=pytest.mark.slow),
    ],
)
def test_a_failure_while_a_checkpoint_is_written_leaves_it_complete(tmp_path, strategy, failed_rank, resume):
    """Rank 1 fails in the backward of step 3 while rank 0 would still write checkpoint-2 (a save at the end of an
    epoch, of a new best evaluation, or of ``save_steps``), and holds on or exits (torchrun's agent then ends rank 0
    with SIGTERM): the failure's note names checkpoint-2 whole, and ``resume_from_checkpoint=True`` resumes from it."""
    options = [*ACCUMULATE, "--save-strategy", strategy, *(["--eval-steps", "2"] if strategy == "best" else [])]
    failure = [*INTERRUPTED_SAVE, "--fail-step", "3", "--fail-micro-batch", "1"]
    failure += ["--linger", "600", "--pg-timeout", "1200"] if failed_rank == "holds on" else []
    run = launch(tmp_path, *options, *failure, timeout=150)
    assert run.returncodes != [0]
    assert run.seconds_after_failure < ENDS_WITHIN, run.output[-4000:]
    checkpoint = str(tmp_path / "checkpoint-2")
    assert noted_checkpoint(run.failure["traceback"]) == checkpoint, run.failure["traceback"]
    assert missing_files(checkpoint) == []
    assert get_last_checkpoint(str(tmp_path)) == checkpoint
    if not resume:
        return
    resumed = launch(tmp_path, *options, "--fail-in", "none", "--resume-from", "last")
    assert resumed.returncodes == [0], resumed.output[-4000:]
    assert [resumed.results[rank]["resumed_from"] for rank in (0, 1)] == [checkpoint, checkpoint]


@needs_torchrun
@pytest.mark.slow  # about 40 s; tests/test_whole_checkpoints.py has a save that fails in one process
def test_a_checkpoint_killed_while_written_is_not_resumed(clean_run, tmp_path):
    """Rank 0 is killed (SIGKILL) while it writes checkpoint-4; torchrun restarts the job, which resumes with
    ``resume_from_checkpoint=True`` from checkpoint-2, the last one written whole, and ends bitwise as the clean run."""
    run = launch(
        tmp_path,
        *ACCUMULATE,
        "--fail-in",
        "none",
        "--interrupt-save",
        "4",
        "-1",
        "--resume-from",
        "auto",
        "--pg-timeout",
        "120",
        launcher=("--max-restarts", "1"),
        timeout=300,
    )
    assert run.returncodes == [0], run.output[-4000:]
    for rank in (0, 1):
        assert run.results[rank]["resumed_from"] == str(tmp_path / "checkpoint-2")
        assert run.results[rank]["checksum"] == clean_run.results[rank]["checksum"]
    assert missing_files(str(tmp_path / "checkpoint-4")) == []


@needs_torchrun
@pytest.mark.parametrize(
    ("where", "rank", "step"), [("save", 0, 4), pytest.param("evaluation", 1, 2, marks=pytest.mark.slow)]
)
def test_a_failure_in_a_save_or_an_evaluation_ends_every_rank(tmp_path, where, rank, step):
    """Rank 0 fails in writing checkpoint-4 (no space left), or rank 1 in the evaluation after step 2, and holds on:
    the other rank ends within seconds, told where it failed and which checkpoint to resume from."""
    run = launch(
        tmp_path,
        *ACCUMULATE,
        *(["--eval-steps", "2"] if where == "evaluation" else []),
        "--fail-rank",
        str(rank),
        "--fail-in",
        where,
        "--fail-step",
        str(step),
        "--linger",
        "600",
        "--pg-timeout",
        "1200",
        timeout=150,
    )
    assert run.returncodes != [0]
    assert run.seconds_after_failure < ENDS_WITHIN, run.output[-4000:]
    phase = {"save": "checkpoint save", "evaluation": "evaluation"}[where]
    note = f"hf-paged: ending rank {1 - rank} because rank {rank} failed in the {phase} of step {step} with "
    assert note in run.output, run.output[-4000:]
    checkpoint = str(tmp_path / "checkpoint-2") if where == "save" else None
    assert noted_checkpoint(run.failure["traceback"]) == checkpoint, run.failure["traceback"]
    assert get_last_checkpoint(str(tmp_path)) == checkpoint


# The full matrix (HF_PAGED_SLOW=1) ---------------------------------------------------------------------------


@needs_torchrun
@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "nodes"), [("ddp", 2), ("fsdp2", 1), ("fsdp2", 2), ("deepspeed", 1), ("deepspeed", 2)]
)
def test_every_engine_ends_every_rank_and_resumes(tmp_path, engine, nodes):
    """DDP, FSDP2 through the Trainer and DeepSpeed ZeRO-3, on one node of two processes or two nodes of one; on two
    nodes the failed rank's node holds the job's store, so its lingering process ends when the store goes away."""
    run = launch(tmp_path / "failed", "--engine", engine, *ACCUMULATE, *HOLD_ON, nodes=nodes, timeout=300)
    assert run.returncodes[0] != 0 and all(code != 0 for code in run.returncodes), run.output[-4000:]
    assert run.seconds_after_failure < ENDS_WITHIN, run.output[-4000:]
    assert NOTE in run.output
    checkpoint = str(tmp_path / "failed" / "checkpoint-2")
    resumed = launch(
        tmp_path / "resumed",
        "--engine",
        engine,
        *ACCUMULATE,
        "--fail-in",
        "none",
        "--resume-from",
        checkpoint,
        nodes=nodes,
        timeout=300,
    )
    assert resumed.returncodes == [0] * len(resumed.returncodes), resumed.output[-4000:]
    assert sorted(resumed.results) == [0, 1]
    assert all(result["resumed_from"] == checkpoint for result in resumed.results.values())


@needs_torchrun
@pytest.mark.slow
def test_torchrun_restarts_from_the_last_checkpoint(clean_run, tmp_path):
    """torchrun --max-restarts 1: the failure ends the first attempt's ranks, torchrun starts them again, and they
    resume from the last checkpoint (the failure record of the first attempt does not end the second) and finish
    bitwise as the clean run."""
    run = launch(
        tmp_path,
        *ACCUMULATE,
        "--fail-step",
        "3",
        "--fail-micro-batch",
        "1",
        "--resume-from",
        "auto",
        "--pg-timeout",
        "120",  # a process group that does not form in the restarted attempt fails the test in minutes
        launcher=("--max-restarts", "1"),
        timeout=300,
    )
    assert run.returncodes == [0], run.output[-4000:]
    assert NOTE in run.output or "hf-paged: rank 1 failed in the forward/backward of step 3" in run.output
    for rank in (0, 1):
        assert run.results[rank]["resumed_from"] == str(tmp_path / "checkpoint-2")
        assert run.results[rank]["checksum"] == clean_run.results[rank]["checksum"]


@needs_torchrun
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_optimizer_step_recovers_on_its_rank_under_sharding(tmp_path, engine):
    """An out-of-memory error in rank 1's optimizer step under FSDP2 or DeepSpeed ZeRO-3 (the step updates that rank's
    shards only) is recovered there; the run ends bitwise as a clean one."""
    clean = launch(tmp_path / "clean", "--engine", engine, *ACCUMULATE, "--fail-in", "none", timeout=300)
    assert clean.returncodes == [0], clean.output[-4000:]
    run = launch(
        tmp_path / "recovered",
        "--engine",
        engine,
        *ACCUMULATE,
        "--fail-step",
        "3",
        "--fail-in",
        "optimizer",
        "--fail-times",
        "1",
        timeout=300,
    )
    assert run.returncodes == [0], run.output[-4000:]
    assert (run.results[0]["oom_recoveries"], run.results[1]["oom_recoveries"]) == (0, 1)
    for rank in (0, 1):
        assert run.results[rank]["checksum"] == clean.results[rank]["checksum"]
        assert run.results[rank]["losses"] == clean.results[rank]["losses"]


@needs_torchrun
@pytest.mark.slow
def test_a_failed_optimizer_step_ends_every_rank(tmp_path):
    """Rank 1's optimizer step runs out of memory more often than it may recover and rank 1 holds on: rank 0, gone
    on to the next step's collectives, ends within seconds, told that the optimizer step failed."""
    run = launch(tmp_path, *ACCUMULATE, *HOLD_ON, "--fail-in", "optimizer", timeout=150)
    assert run.returncodes != [0]
    assert run.seconds_after_failure < ENDS_WITHIN, run.output[-4000:]
    assert "hf-paged: ending rank 0 because rank 1 failed in the optimizer step of step 3 with OutOfMemoryError" in (
        run.output
    )
    assert "hf-paged: rank 1 failed in the optimizer step of step 3" in run.failure["traceback"]
