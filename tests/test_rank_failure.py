"""A failure on one rank of a distributed Trainer run (gloo on the CPU): tests/scripts/rank_failure.py under torchrun.

Under DDP an out-of-memory error in the forward or in the middle of the backward (after some gradient buckets were
all-reduced) of one rank's synchronized micro-batch is replayed on every rank, and every rank's weights and optimizer
state end bitwise as in a run without the error; one that comes back more often than ``oom_retries`` allows, an error
that is not out-of-memory, and any such error under FSDP2 or DeepSpeed ZeRO-3 end every rank within seconds with
hf-paged's note (saying why it was not replayed), also when the failed rank's process holds on to its connections (as
the peers of a failed rank wait in an NCCL collective until its timeout); the last checkpoint resumes bitwise. A
micro-batch inside DDP's ``no_sync`` and the optimizer's step recover on their rank, bitwise. A failure or a kill while
a checkpoint is written leaves no checkpoint that ``get_last_checkpoint`` or ``resume_from_checkpoint=True`` would take
incomplete, whatever the save strategy; an error in a save or an evaluation ends every rank as one in backward does.
The default run covers DDP on one node of two processes (a replay mid-backward among them); ``HF_PAGED_SLOW=1`` adds
four processes, two nodes, ``accelerate launch``, two ranks failing in one step, FSDP2, DeepSpeed ZeRO-3, torchrun's
restarts and more save strategies.
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
from store_utils import CountedConnections
from transformers.trainer_utils import get_last_checkpoint

import hf_paged
from hf_paged import replay_requests
from hf_paged.rank_failure import EXIT_CODE, RankFailure, RankFailureWatcher, failure_key
from hf_paged.replay_requests import ReplayRequest, ReplayRequests

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
    processes: int = 2,
    timeout: float = 240,
    launcher: tuple[str, ...] = (),
    script: str = SCRIPT,
    repo: str = REPO,
    accelerate: bool = False,
) -> Launch:
    """Run ``script`` with ``options`` under torchrun (with ``launcher``'s options), or ``accelerate launch`` with
    ``configs/accelerate/ddp.yaml``: ``processes`` on one node, or on two nodes of half as many each (two launchers on
    this machine, ``--master-addr 127.0.0.1``)."""
    os.makedirs(folder, exist_ok=True)
    port = free_port()
    per_node = processes // nodes
    if accelerate:
        config = os.path.join(repo, "configs", "accelerate", "ddp.yaml")
        commands = [
            [
                "accelerate.commands.launch",
                "--config_file",
                config,
                "--num_machines",
                str(nodes),
                "--machine_rank",
                str(node),
                "--num_processes",
                str(processes),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                str(port),
            ]
            for node in range(nodes)
        ]
    elif nodes == 1:
        commands = [["torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]]
    else:
        commands = [
            [
                "torch.distributed.run",
                "--nnodes",
                str(nodes),
                "--node-rank",
                str(node),
                "--nproc-per-node",
                str(per_node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
            ]
            for node in range(nodes)
        ]
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([repo, os.path.join(repo, "tests")]),
        "OMP_NUM_THREADS": "1",
        "HF_PAGED_COMPILE": "0",
    }
    started = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
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
        for process in started:
            outputs.append(process.communicate(timeout=timeout)[0])
            ended.append(time.time())
    finally:
        for process in started:
            for pid in [process.pid, *descendants(process.pid)]:  # torchrun starts its workers in sessions of their own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.communicate()
    failure = read_json(os.path.join(folder, "failure.json"))
    results = {rank: read_json(os.path.join(folder, f"rank{rank}.json")) for rank in range(processes)}
    return Launch(
        returncodes=[process.returncode for process in started],
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


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("name", ["poll_interval", "grace", "store_lost_after"])
def test_watcher_refuses_durations_that_are_not_finite(store, name, value):
    """An infinite or NaN duration would kill the watcher's thread (OverflowError in a wait) or make it read the store
    in a busy loop, so that it never ends the process when a peer fails."""
    with pytest.raises(ValueError, match=f"{name} must be a finite number of seconds >= 0, got {value!r}"):
        RankFailureWatcher(store, rank=0, **{name: value})


def replay_request(rank: int, phase: str = "backward") -> ReplayRequest:
    return ReplayRequest(rank, 3, phase, 1, 2, "OutOfMemoryError: injected", 2048, 5, 12, 1, 2)


def test_replay_requests_of_an_attempt_are_read_by_every_rank_in_order(store):
    """Two ranks ask to replay window 7's first attempt; a third rank (its own connection) reads both, and nothing for
    the next attempt or another window."""
    first, second, reader = ReplayRequests(store), ReplayRequests(store), ReplayRequests(store)
    first.publish(7, 0, replay_request(1))
    second.publish(7, 0, replay_request(0, "forward"))
    assert reader.read(7, 0) == [replay_request(1), replay_request(0, "forward")]
    assert reader.read(7, 1) == [] and reader.read(8, 0) == []
    assert replay_request(1).describe() == (
        "rank 1 ran out of memory in the backward of step 3 (micro-batch 2 of 2, after 5 of 12 gradients were handed "
        "to the all-reduce: OutOfMemoryError: injected); it moved 2.0 KiB of optimizer state to the host, freed cached "
        "memory and joined the all-reduces it owed with zero gradients (retry 1 of 2)"
    )


def test_replay_requests_share_one_connection_to_the_default_store(store, monkeypatch):
    """Opening a connection takes hundreds of milliseconds: every ReplayRequests() of a process (one per
    OOMRecovery, so one per recover_oom call) shares one per default store; a new process group's store gets its own."""
    monkeypatch.setattr(replay_requests, "_connection", None, raising=False)
    for _ in range(2):
        default = CountedConnections(store)
        monkeypatch.setattr(replay_requests, "default_store", lambda default=default: default)
        publisher, reader = (ReplayRequests() for _ in range(2))
        publisher.publish(7, 0, replay_request(1))
        assert [ReplayRequests().read(7, 0) for _ in range(3)] == [[replay_request(1)]] * 3
        assert reader.read(7, 0) == [replay_request(1)]
        assert default.connections == 1
        store.delete_key(f"{publisher.prefix}/7/0")


@needs_torchrun
@pytest.mark.slow
def test_recover_oom_with_a_ddp_model_opens_one_store_connection_per_process(tmp_path):
    """recover_oom(..., model=ddp_model) once per step, as its docstring shows it: 5 steps open one connection to the
    job's store per rank, not one per step."""
    script = os.path.join(REPO, "tests", "scripts", "recover_oom_connections.py")
    run = launch(tmp_path, "--steps", "5", script=script, timeout=120)
    assert run.returncodes == [0], run.output[-4000:]
    assert run.results == {rank: {"steps": 5, "connections": 1} for rank in (0, 1)}


def test_a_failure_hf_paged_did_not_recover_from_says_why():
    """An out-of-memory error that outlasts the retries reaches the other ranks with the reason it was not recovered."""
    model = torch.nn.Linear(4, 4)
    optimizer = hf_paged.PagedAdamW(model.parameters())

    def always_out_of_memory(micro_batch):
        raise torch.OutOfMemoryError("injected")

    with pytest.raises(torch.OutOfMemoryError) as raised:
        hf_paged.recover_oom(always_out_of_memory, [0], optimizer, retries=1)
    failure = RankFailure.of(raised.value, rank=1, step=3, phase="forward/backward")
    assert (
        "with OutOfMemoryError: injected. hf-paged did not recover: it ran out of memory in forward/backward 2 times in "
        "this step, more than the 1 recoveries allowed (oom_retries). To fit"
    ) in failure.describe()
    assert "did not recover" not in RankFailure.of(RuntimeError("x"), 1, 3, "forward/backward").describe()


# Through the Trainer, under torchrun ------------------------------------------------------------------------

ACCUMULATE = ("--steps", "4", "--save-steps", "2", "--grad-accum", "2", "--layers", "2")
"""Four optimizer steps of two micro-batches each, a checkpoint after step 2; a Llama of two decoder layers, whose
gradients DDP all-reduces in 12 buckets (and its map of unused parameters: the Trainer's find_unused_parameters=True)."""
HOLD_ON = ("--fail-step", "3", "--fail-micro-batch", "1", "--linger", "600", "--pg-timeout", "1200")
"""Rank 1 runs out of memory in the backward of step 3's last micro-batch, the one whose gradients DDP all-reduces, in
the step and in each of its replays (rank 0 waits in the collectives of each), until the retries are spent. The failing
rank keeps its process for 10 minutes after its error, and a collective may wait 20: its peers end within seconds only
because hf-paged's watcher ends them."""
REPLAY_NOTE = "Every rank drops the step's gradients and replays its 2 micro-batch(es)."


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
    """Rank 1's step 3 runs out of memory three times: the step is replayed on both ranks twice (oom_retries=2), and
    the third error ends every rank, the note saying so."""
    _, run = failed_run
    assert run.returncodes != [0]
    assert run.seconds_after_failure < ENDS_WITHIN, run.output[-4000:]
    assert run.output.count(REPLAY_NOTE) == 4, run.output[-4000:]  # two replays, logged on both ranks
    assert "(retry 2 of 2)" in run.output
    spent = "hf-paged did not recover: it ran out of memory in forward/backward 3 times in this step, more than the 2"
    assert spent in run.output
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


def assert_replayed_bitwise(run: Launch, clean: Launch, failed_ranks: list[int], step: int = 3) -> None:
    """Every rank of ``run`` finished with the weights, optimizer state and losses of ``clean``, and counted one replay
    of ``step`` that ``failed_ranks`` asked for (the memory callback's summary, and rank 0's timeline)."""
    assert run.returncodes == [0] * len(run.returncodes), run.output[-4000:]
    assert sorted(run.results) == sorted(clean.results)
    for rank, result in run.results.items():
        assert result["digest"] == clean.results[rank]["digest"], rank
        assert result["losses"] == clean.results[rank]["losses"], rank
        assert (result["oom_recoveries"], result["oom_recovery_steps"]) == (1, [step]), rank
        assert result["oom_ranks"] == {str(step): failed_ranks}, rank
    for rank in failed_ranks:
        assert f"rank {rank} ran out of memory in the " in run.output
    assert run.output.count(REPLAY_NOTE) == len(run.results), run.output[-4000:]


@needs_torchrun
def test_an_oom_mid_backward_on_one_rank_is_replayed_on_every_rank_bitwise(clean_run, tmp_path):
    """Rank 1 runs out of memory in the backward of step 3's last micro-batch, after DDP all-reduced some of the
    gradient buckets (rank 0 waits in the next one): rank 1 joins the rest with zero gradients, both ranks replay
    the step, and both end with the weights and optimizer state of the clean run, bitwise."""
    run = launch(tmp_path, *ACCUMULATE, "--fail-in", "backward", "--fail-micro-batch", "1", "--fail-times", "1")
    assert_replayed_bitwise(run, clean_run, failed_ranks=[1])
    (reduced_before_error,) = run.results[1]["collectives_before_error"]
    assert 0 < reduced_before_error < clean_run.results[1]["collectives_per_backward"][2]
    assert "hf-paged: rank 1 ran out of memory in the backward of step 3 (micro-batch 2 of 2, after " in run.output
    timeline = [json.loads(line) for line in (tmp_path / "memory_timeline.jsonl").read_text().splitlines()]
    assert [(row["step"], row.get("oom_ranks")) for row in timeline if row["oom_recoveries"]] == [(3, [1])]


@pytest.fixture(scope="module")
def clean_runs(tmp_path_factory):
    """Clean runs by (processes, find_unused), made once each."""
    made: dict[tuple[int, str], Launch] = {}

    def clean(processes: int, find_unused: str) -> Launch:
        if (processes, find_unused) not in made:
            folder = tmp_path_factory.mktemp(f"clean-{processes}-{find_unused}")
            run = launch(
                folder, *ACCUMULATE, "--fail-in", "none", "--find-unused", find_unused, processes=processes, timeout=400
            )
            assert run.returncodes == [0], run.output[-4000:]
            made[processes, find_unused] = run
        return made[processes, find_unused]

    return clean


@needs_torchrun
@pytest.mark.slow
@pytest.mark.parametrize(
    ("processes", "nodes", "where", "find_unused", "failed_rank", "step", "accelerate"),
    [
        (2, 1, "forward", "default", 1, 3, False),
        (2, 1, "backward", "false", 1, 3, False),
        (2, 1, "forward", "false", 0, 3, False),
        (4, 1, "backward", "default", 2, 3, False),
        (4, 1, "forward", "false", 3, 3, False),
        (4, 1, "backward", "false", 0, 1, False),  # the step whose gradient order DDP rebuilds its buckets from
        (2, 2, "backward", "default", 1, 3, False),
        (4, 2, "forward", "default", 1, 3, False),
        (2, 1, "backward", "default", 1, 3, True),
    ],
)
def test_an_oom_on_one_rank_is_replayed_on_every_rank_bitwise(
    clean_runs, tmp_path, processes, nodes, where, find_unused, failed_rank, step, accelerate
):
    """Two or four ranks, on one node or two (torchrun, or accelerate launch), DDP finding unused parameters or not:
    one rank runs out of memory in the forward or the backward of a step's synchronized micro-batch, and every rank ends
    with the weights and optimizer state of the clean run, bitwise."""
    failure = ["--fail-rank", str(failed_rank), "--fail-step", str(step), "--fail-in", where]
    run = launch(
        tmp_path,
        *ACCUMULATE,
        *failure,
        "--fail-micro-batch",
        "1",
        "--fail-times",
        "1",
        "--find-unused",
        find_unused,
        processes=processes,
        nodes=nodes,
        accelerate=accelerate,
        timeout=400,
    )
    assert_replayed_bitwise(run, clean_runs(processes, find_unused), failed_ranks=[failed_rank], step=step)
    assert f"hf-paged: rank {failed_rank} ran out of memory in the {where} of step {step}" in run.output


@needs_torchrun
@pytest.mark.slow
def test_a_loop_of_its_own_replays_on_every_rank_with_oom_recovery(tmp_path):
    """Without the Trainer: a DDP loop whose micro-batches run through OOMRecovery(optimizer, model=ddp_model); rank 1
    runs out of memory in step 3's synchronized backward, and both ranks end bitwise as the loop without the error."""
    loop = os.path.join(REPO, "tests", "scripts", "ddp_loop_replay.py")
    clean = launch(tmp_path / "clean", script=loop)
    run = launch(tmp_path / "failed", "--fail-rank", "1", script=loop)
    assert clean.returncodes == run.returncodes == [0], run.output[-4000:]
    for rank in (0, 1):
        assert run.results[rank]["digest"] == clean.results[rank]["digest"]
        assert run.results[rank]["losses"] == clean.results[rank]["losses"]
        assert (run.results[rank]["oom_recoveries"], clean.results[rank]["oom_recoveries"]) == (1, 0)
    assert "rank 1 ran out of memory in the backward of step 3" in run.output


@needs_torchrun
@pytest.mark.slow
def test_two_ranks_running_out_of_memory_in_one_step_are_replayed_together(clean_runs, tmp_path):
    """Rank 1 runs out of memory mid-backward and rank 0 in the forward of step 3's synchronized micro-batch: both ask
    for the replay, and both ranks end bitwise as the clean run."""
    run = launch(
        tmp_path,
        *ACCUMULATE,
        "--fail-in",
        "backward",
        "--also-fail",
        "0",
        "forward",
        "--fail-micro-batch",
        "1",
        "--fail-times",
        "1",
    )
    assert_replayed_bitwise(run, clean_runs(2, "default"), failed_ranks=[0, 1])


@needs_torchrun
@pytest.mark.slow
def test_an_error_in_the_replay_beyond_the_retries_ends_every_rank(tmp_path):
    """With oom_retries=1, rank 1 runs out of memory in step 3 and again in its replay: the replay ran on both ranks,
    and the second error ends every rank within seconds, the note saying the retries were spent."""
    run = launch(tmp_path, *ACCUMULATE, *HOLD_ON, "--fail-times", "2", "--oom-retries", "1", timeout=150)
    assert run.returncodes != [0]
    assert run.seconds_after_failure < ENDS_WITHIN, run.output[-4000:]
    assert run.output.count(REPLAY_NOTE) == 2 and "(retry 1 of 1)" in run.output
    spent = "hf-paged did not recover: it ran out of memory in forward/backward 2 times in this step, more than the 1"
    assert spent in run.output
    assert NOTE in run.output


@needs_torchrun
@pytest.mark.slow
def test_an_error_that_is_not_out_of_memory_ends_every_rank_unreplayed(tmp_path):
    """A RuntimeError in rank 1's synchronized backward is not replayed: every rank ends within seconds as before."""
    run = launch(tmp_path, *ACCUMULATE, *HOLD_ON, "--fail-error", "runtime", timeout=150)
    assert run.returncodes != [0]
    assert run.seconds_after_failure < ENDS_WITHIN, run.output[-4000:]
    assert REPLAY_NOTE not in run.output and "did not recover" not in run.output
    assert "hf-paged: ending rank 0 because rank 1 failed in the forward/backward of step 3 with RuntimeError: " in (
        run.output
    )
    assert "See rank 1's traceback for the cause." in run.output


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
    nodes the failed rank's node holds the job's store, so its lingering process ends when the store goes away. DDP
    replays the step until the retries are spent; FSDP2 and DeepSpeed replay none, and the note says why."""
    run = launch(tmp_path / "failed", "--engine", engine, *ACCUMULATE, *HOLD_ON, nodes=nodes, timeout=300)
    assert run.returncodes[0] != 0 and all(code != 0 for code in run.returncodes), run.output[-4000:]
    assert run.seconds_after_failure < ENDS_WITHIN, run.output[-4000:]
    assert NOTE in run.output
    why = {
        "ddp": "hf-paged did not recover: it ran out of memory in forward/backward 3 times in this step",
        "fsdp2": "hf-paged did not recover: the model's parameters are DTensors (FSDP2 or tensor parallelism)",
        "deepspeed": "hf-paged did not recover: DeepSpeed's engine gathers parameters (ZeRO-3)",
    }[engine]
    assert why in run.output, run.output[-4000:]
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
