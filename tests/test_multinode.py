"""Training across two nodes, tested on one machine (issue 28 point 1).

Each node is a launcher of its own, started together, as on separate machines: ``torchrun --nnodes 2 --node-rank
0|1 --master-addr 127.0.0.1`` or ``accelerate launch --num_machines 2 --machine_rank 0|1 --main_process_ip
127.0.0.1``, with one or two processes per node (gloo on the CPU). DDP, FSDP2 and DeepSpeed ZeRO-3 through the
Trainer train, checkpoint and resume with ``save_on_each_node`` off (one output directory, as on shared storage) and
on (a directory per node), each against its own ``adamw_torch`` control. The default run has the DDP case with a
directory per node (and MemorySpikeCallback's per-node metrics); the rest is marked slow.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "scripts")
sys.path.insert(0, SCRIPTS)

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

NODES = 2
GIB = 2**30
LAUNCH_TIMEOUT = 600
"""Seconds a node's launcher may run before the test stops every node and fails."""


def free_port() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def node_launchers(launcher: str, per_node: int, port: int, config: str = "ddp.yaml") -> list[list[str]]:
    """The command line that starts each node's processes, with ``launcher`` ``"torchrun"`` or ``"accelerate"``
    (``config``: the file of ``configs/accelerate`` it reads)."""
    if launcher == "torchrun":
        return [
            [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node-rank", str(node),
                "--nproc-per-node", str(per_node), "--master-addr", "127.0.0.1", "--master-port", str(port),
            ]
            for node in range(NODES)
        ]
    return [
        [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", os.path.join(REPO, "configs", "accelerate", config),
            "--num_machines", str(NODES), "--machine_rank", str(node), "--num_processes", str(NODES * per_node),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
        ]
        for node in range(NODES)
    ]


def launch_nodes(launchers: list[list[str]], script_and_args: list[str], folder) -> float:
    """Start every node's launcher at once with ``-m hf_paged.run SCRIPT ARGS``, wait for all; the wall time
    (seconds). Fails with the output of the nodes that failed; a node left waiting for its peers is stopped."""
    environment = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    logs = [open(folder / f"node{node}.log", "w+") for node in range(len(launchers))]  # noqa: SIM115
    started = time.perf_counter()
    processes = [
        subprocess.Popen(
            [*launcher, "-m", "hf_paged.run", *script_and_args], cwd=REPO, env=environment, stdout=log, stderr=log
        )
        for launcher, log in zip(launchers, logs)
    ]
    deadline = started + LAUNCH_TIMEOUT
    codes = [None] * len(processes)
    try:
        while None in codes and time.perf_counter() < deadline:
            time.sleep(0.2)
            codes = [process.poll() for process in processes]
            if any(code not in (None, 0) for code in codes):  # one node failed: the others would wait for it
                time.sleep(5)
                break
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    wall = time.perf_counter() - started
    outputs = []
    for node, log in enumerate(logs):
        log.seek(0)
        outputs.append(log.read())
        log.close()
    codes = [process.returncode for process in processes]
    assert codes == [0] * len(processes), "\n".join(
        f"node {node} (exit {code}):\n{output[-3000:]}" for node, (code, output) in enumerate(zip(codes, outputs))
    )
    return wall


# DDP ---------------------------------------------------------------------------------------------------------------

DDP_OPTIMS = ["adamw_torch", "hf_paged_adamw_8bit"]
DDP_STEPS, DDP_SAVE_AT = 4, 2


def ddp_results(folder, launcher: str, per_node: int, save_on_each_node: bool) -> dict:
    """What ``multinode_ddp.py`` found for every optimizer in :data:`DDP_OPTIMS`, from one launch of two nodes."""
    arguments = [
        os.path.join(SCRIPTS, "multinode_ddp.py"), "--optim", *DDP_OPTIMS, "--output-dir", str(folder),
        "--steps", str(DDP_STEPS), "--save-at", str(DDP_SAVE_AT),
    ]
    if save_on_each_node:
        arguments.append("--save-on-each-node")
    wall = launch_nodes(node_launchers(launcher, per_node, free_port()), arguments, folder)
    print(f"DDP, {launcher}, {NODES} nodes x {per_node}, save_on_each_node={save_on_each_node}: {wall:.1f} s")
    return torch.load(folder / "results.pt", weights_only=False)


def check_ddp(results: dict, per_node: int, save_on_each_node: bool) -> None:
    """Every rank of each optimizer trained, checkpointed where it should, and resumed bitwise; the memory metrics
    came from global rank 0 only, combined over the processes of each node."""
    world = NODES * per_node
    for optim in DDP_OPTIMS:
        ranks = results[optim]["ranks"]
        for rank, result in enumerate(ranks):
            for kind in ("uninterrupted", "resumed"):
                assert result[kind]["error"] is None, f"{optim}, rank {rank}, {kind} run:\n{result[kind]['error']}"
            run = result["uninterrupted"]
            assert (run["process_index"], run["node_rank"], run["local_process_index"]) == (
                rank, rank // per_node, rank % per_node
            )
            assert run["is_world_process_zero"] == (rank == 0)
            saves = rank % per_node == 0 if save_on_each_node else rank == 0
            assert run["should_save"] == saves
        uninterrupted = [result["uninterrupted"] for result in ranks]
        resumed = [result["resumed"] for result in ranks]
        losses = uninterrupted[0]["losses"]
        assert sorted(losses) == list(range(1, DDP_STEPS + 1)) and losses[DDP_STEPS] < losses[1], losses
        for rank in range(world):
            assert torch.equal(uninterrupted[rank]["weights"], uninterrupted[0]["weights"]), (optim, rank)
            assert torch.equal(resumed[rank]["weights"], uninterrupted[rank]["weights"]), (optim, rank)
            after = range(DDP_SAVE_AT + 1, DDP_STEPS + 1)
            assert [resumed[rank]["losses"][step] for step in after] == [losses[step] for step in after], (optim, rank)
        writers = range(0, world, per_node) if save_on_each_node else [0]
        for rank, result in enumerate(ranks):
            files = result["checkpoint"]
            if rank in writers:
                assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(files["."]), (rank, files)
            node_ranks = range(rank - rank % per_node, rank - rank % per_node + per_node)
            if save_on_each_node and rank % per_node == 0:  # this node's directory: its own ranks' RNG states
                assert {name for name in files["."] if name.startswith("rng_state")} == {
                    f"rng_state_{other}.pth" for other in node_ranks
                }, files
        for kind, runs in (("uninterrupted", uninterrupted), ("resumed", resumed)):
            check_memory_metrics(runs, per_node, kind)


def check_memory_metrics(runs: list[dict], per_node: int, kind: str) -> None:
    """Global rank 0 alone logged the ``memory/`` metrics, at every step it measured: each the maximum over the
    job's processes of what they measured (host resident memory: the largest node's sum), and per node."""
    for rank, run in enumerate(runs[1:], start=1):
        assert not any(key.startswith("memory/") for entry in run["log_history"] for key in entry), (kind, rank)
    logged = {entry["step"]: entry for entry in runs[0]["log_history"] if "loss" in entry}
    measured = [{row["step"]: row for row in run["rows"]} for run in runs]
    steps = sorted(measured[0])
    assert steps and steps[-1] == DDP_STEPS, (kind, steps)
    for step in steps:
        entry = logged[step]
        nodes = [measured[node * per_node : (node + 1) * per_node] for node in range(NODES)]
        for node, members in enumerate(nodes):
            rows = [member[step] for member in members]
            for name in ("forward_backward_peak", "optimizer_step_peak", "allocated", "reserved"):
                assert entry[f"memory/node_{node}/{name}_gib"] == max(row[name] / GIB for row in rows), (kind, step)
            host = sum(row["host_resident"] / GIB for row in rows)
            assert entry[f"memory/node_{node}/host_resident_gib"] == host, (kind, step, node)
        every = [member[step] for member in measured]
        assert entry["memory/forward_backward_peak_gib"] == max(row["forward_backward_peak"] / GIB for row in every)
        assert entry["memory/host_resident_gib"] == max(
            entry[f"memory/node_{node}/host_resident_gib"] for node in range(NODES)
        )
        assert not any(key.startswith(f"memory/node_{NODES}/") for key in entry), entry


def test_ddp_two_nodes_torchrun_directory_per_node(tmp_path):
    """Two torchrun launchers of one process each, each node saving into its own directory: the uninterrupted run
    and the resumed one agree bitwise on every rank, for adamw_torch and 8-bit AdamW, and the memory callback's
    metrics come from global rank 0, per node."""
    check_ddp(ddp_results(tmp_path, "torchrun", 1, save_on_each_node=True), 1, save_on_each_node=True)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
@pytest.mark.parametrize("per_node", [1, 2])
@pytest.mark.parametrize("save_on_each_node", [False, True], ids=["shared-directory", "directory-per-node"])
def test_ddp_two_nodes(tmp_path, launcher, per_node, save_on_each_node):
    """DDP across two nodes of one or two processes, under either launcher and either way of saving."""
    if (launcher, per_node, save_on_each_node) == ("torchrun", 1, True):
        pytest.skip("the default run's test_ddp_two_nodes_torchrun_directory_per_node")
    check_ddp(ddp_results(tmp_path, launcher, per_node, save_on_each_node), per_node, save_on_each_node)
