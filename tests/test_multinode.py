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
import json
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


def node_launchers(
    launcher: str, per_node: int, port: int, config: str = "ddp.yaml", *accelerate_options: str
) -> list[list[str]]:
    """The command line that starts each node's processes, with ``launcher`` ``"torchrun"`` or ``"accelerate"``
    (``config``: the file of ``configs/accelerate`` it reads, ``accelerate_options`` more of its options)."""
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
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *accelerate_options,
        ]
        for node in range(NODES)
    ]


def launch_nodes(launchers: list[list[str]], script_and_args: list[str], folder) -> tuple[float, list[str]]:
    """Start every node's launcher at once with ``-m hf_paged.run SCRIPT ARGS``, wait for all; the wall time
    (seconds) and each node's output. Fails with the output of the nodes that failed; a node left waiting for its
    peers is stopped."""
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
    return wall, outputs


# DDP ---------------------------------------------------------------------------------------------------------------

DDP_OPTIMS = ["adamw_torch", "hf_paged_adamw_8bit"]
DDP_STEPS, DDP_SAVE_AT = 4, 2


def ddp_results(folder, launcher: str, per_node: int, save_on_each_node: bool) -> dict:
    """What ``multinode_ddp.py`` found for every optimizer in :data:`DDP_OPTIMS`, from one launch of two nodes; and
    ``outputs``, each node's output."""
    arguments = [
        os.path.join(SCRIPTS, "multinode_ddp.py"), "--optim", *DDP_OPTIMS, "--output-dir", str(folder),
        "--steps", str(DDP_STEPS), "--save-at", str(DDP_SAVE_AT),
    ]
    if save_on_each_node:
        arguments.append("--save-on-each-node")
    wall, outputs = launch_nodes(node_launchers(launcher, per_node, free_port()), arguments, folder)
    print(f"DDP, {launcher}, {NODES} nodes x {per_node}, save_on_each_node={save_on_each_node}: {wall:.1f} s")
    return {**torch.load(folder / "results.pt", weights_only=False), "outputs": outputs}


def check_ddp(results: dict, per_node: int, save_on_each_node: bool) -> None:
    """Every rank of each optimizer trained, checkpointed where it should, and resumed bitwise; the memory metrics
    came from global rank 0 only, combined over the processes of each node; hf-paged's messages (the callback's
    note on adamw_torch, out-of-memory recovery's on several processes) came from node 0, none from node 1."""
    first, *others = results["outputs"]
    assert "hf-paged: MemorySpikeCallback" in first, first[-3000:]
    for node, output in enumerate(others, start=1):
        assert not [line for line in output.splitlines() if "hf-paged:" in line], (node, output[-3000:])
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
    first = DDP_SAVE_AT + 1 if kind == "resumed" else 1  # earlier rows and logs are read back from the checkpoint
    for rank, run in enumerate(runs[1:], start=1):
        entries = [entry for entry in run["log_history"] if entry["step"] >= first]
        assert not any(key.startswith("memory/") for entry in entries for key in entry), (kind, rank)
    logged = {entry["step"]: entry for entry in runs[0]["log_history"] if "loss" in entry}
    measured = [{row["step"]: row for row in run["rows"]} for run in runs]
    steps = sorted(measured[0])
    assert steps and steps[-1] == DDP_STEPS, (kind, steps)
    for step in range(first, DDP_STEPS + 1):
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
    for run in runs:  # after training, every process's summary has the job's peaks and each node's
        for phase in ("forward_backward", "optimizer_step"):
            nodes = [measured[node * per_node : (node + 1) * per_node] for node in range(NODES)]
            node_peaks = [
                max(row[f"{phase}_peak"] for member in members for row in member.values()) for members in nodes
            ]
            assert [node[f"{phase}_peak_bytes"] for node in run["summary"]["node_peaks"]] == node_peaks, (kind, phase)
            assert run["summary"][f"{phase}_peak_bytes"] == max(node_peaks), (kind, phase)


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


# FSDP2 --------------------------------------------------------------------------------------------------------------

FSDP2_OPTIMS = ["adamw_torch", "hf_paged_adamw_8bit"]
FSDP2_STEPS, FSDP2_SAVE_AT = 4, 2


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
@pytest.mark.parametrize("per_node", [1, 2])
@pytest.mark.parametrize("save_on_each_node", [False, True], ids=["shared-directory", "directory-per-node"])
def test_fsdp2_two_nodes(tmp_path, launcher, per_node, save_on_each_node):
    """FSDP2 through the Trainer (``tests/scripts/fsdp2_trainer.py``) across two nodes: the model is sharded over
    every process of both, each rank's shards resume bitwise from its node's (sharded, DCP) checkpoint. With a
    directory per node, DCP writes the checkpoint's ``.metadata`` on node 0 only (its coordinator, global rank 0)
    and each replicated tensor in one rank's file: the nodes resume once their DCP files are copied between them, as
    the README says."""
    arguments = [
        os.path.join(SCRIPTS, "fsdp2_trainer.py"), "--optim", *FSDP2_OPTIMS, "--output-dir", str(tmp_path),
        "--steps", str(FSDP2_STEPS), "--save-at", str(FSDP2_SAVE_AT),
    ]
    if save_on_each_node:
        arguments.append("--save-on-each-node")
    launchers = node_launchers(launcher, per_node, free_port(), "fsdp2.yaml", "--mixed_precision", "no")
    wall, _ = launch_nodes(launchers, arguments, tmp_path)
    print(f"FSDP2, {launcher}, {NODES} nodes x {per_node}, save_on_each_node={save_on_each_node}: {wall:.1f} s")
    results = torch.load(tmp_path / "results.pt", weights_only=True)
    world = NODES * per_node
    for optim in FSDP2_OPTIMS:
        ranks = results[optim]["ranks"]
        assert len(ranks) == world
        for rank, result in enumerate(ranks):
            for kind in ("uninterrupted", "resumed"):
                run = result[kind]
                assert run["error"] is None, f"{optim}, rank {rank}, {kind} run:\n{run['error']}"
                facts = run["fsdp"]
                assert facts["is_fsdp2"] and facts["params_are_sharded_dtensors"], facts
                assert facts["world_size"] == world and world * facts["local_elements"] == facts["full_elements"]
            uninterrupted, resumed = result["uninterrupted"], result["resumed"]
            steps = sorted(uninterrupted["losses"])
            assert steps == list(range(1, FSDP2_STEPS + 1)), uninterrupted["losses"]
            after = steps[FSDP2_SAVE_AT:]
            assert [resumed["losses"][step] for step in after] == [uninterrupted["losses"][step] for step in after]
            assert resumed["weights"].keys() == uninterrupted["weights"].keys()
            for name, weight in uninterrupted["weights"].items():
                assert torch.equal(resumed["weights"][name], weight), f"{optim}, rank {rank}: {name}"
            files = results[optim]["checkpoints"][rank]  # as saved: before the nodes' files are copied
            node_ranks = range(rank - rank % per_node, rank - rank % per_node + per_node)
            writers = node_ranks if save_on_each_node else range(world)
            for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
                assert {f"__{other}_0.distcp" for other in writers} <= set(files[folder]), (rank, files)
                assert (".metadata" in files[folder]) == (rank < per_node or not save_on_each_node), (rank, files)
        losses = ranks[0]["uninterrupted"]["losses"]
        assert losses[FSDP2_STEPS] < losses[1], losses


# DeepSpeed ZeRO-3 ---------------------------------------------------------------------------------------------------

DEEPSPEED_CONFIGS = ["adamw_torch", "adamw_8bit"]
DEEPSPEED_STEPS, DEEPSPEED_SAVE_AT = 4, 2


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
@pytest.mark.parametrize("per_node", [1, 2])
@pytest.mark.parametrize("save_on_each_node", [False, True], ids=["shared-directory", "directory-per-node"])
def test_deepspeed_zero3_two_nodes(tmp_path, launcher, per_node, save_on_each_node):
    """DeepSpeed ZeRO-3 through the Trainer (``tests/scripts/deepspeed_train.py``) across two nodes, each rank's
    client holding its partitions: resumed from the checkpoint, the full weights and the losses are bitwise those of
    the uninterrupted run. With a directory per node each node holds its own ranks' files; DeepSpeed writes the
    ``latest`` tag file on global rank 0 alone, which the script copies to the other node, as the README says.
    Under accelerate, ``configs/accelerate/zero3.yaml`` (bf16) with DeepSpeed's ``standard`` multi-node launcher
    (torchrun on each node, not pdsh)."""
    setup = "zero3" if launcher == "torchrun" else "accelerate"
    arguments = [
        os.path.join(SCRIPTS, "deepspeed_train.py"), "--setups", setup, "--configs", *DEEPSPEED_CONFIGS,
        "--folder", str(tmp_path / "runs"), "--output", str(tmp_path / "result.pt"),
        "--steps", str(DEEPSPEED_STEPS), "--save-at", str(DEEPSPEED_SAVE_AT),
    ]
    if save_on_each_node:
        arguments.append("--save-on-each-node")
    options = ("--deepspeed_multinode_launcher", "standard")
    launchers = node_launchers(launcher, per_node, free_port(), "zero3.yaml", *options)
    wall, _ = launch_nodes(launchers, arguments, tmp_path)
    print(f"ZeRO-3, {launcher}, {NODES} nodes x {per_node}, save_on_each_node={save_on_each_node}: {wall:.1f} s")
    summary = torch.load(tmp_path / "result.pt", weights_only=True)
    world = NODES * per_node
    assert summary["world_size"] == world
    for name in DEEPSPEED_CONFIGS:
        result = summary["results"][setup][name]
        assert result["error"] is None, f"{name}: {result['error']}"
        full, resumed = result["full"], result["resumed"]
        assert full["zero_stage"] == 3 and full["engine"] == "DeepSpeedEngine", full
        assert full["steps"] == list(range(1, DEEPSPEED_STEPS + 1)) and full["losses"][-1] < full["losses"][0]
        assert resumed["steps"] == list(range(DEEPSPEED_SAVE_AT + 1, DEEPSPEED_STEPS + 1))
        assert resumed["losses"] == full["losses"][DEEPSPEED_SAVE_AT:]
        assert resumed["grad_norms"] == full["grad_norms"][DEEPSPEED_SAVE_AT:]
        assert torch.equal(resumed["weights"], full["weights"])
        for node in range(NODES if save_on_each_node else 1):
            folder = tmp_path / "runs" / (f"node{node}" if save_on_each_node else "") / setup / name / "full"
            checkpoint = folder / f"checkpoint-{DEEPSPEED_SAVE_AT}" / f"global_step{DEEPSPEED_SAVE_AT}"
            ranks = range(node * per_node, (node + 1) * per_node) if save_on_each_node else range(world)
            bf16 = "bf16_" if setup == "accelerate" else ""  # DeepSpeed's name of a bf16 run's optimizer states
            partitions = {f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" for rank in ranks} | {
                f"{bf16}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in ranks
            }
            assert partitions <= set(os.listdir(checkpoint)), (node, sorted(os.listdir(checkpoint)))


# hf-paged train -----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_two_nodes_prints_once_and_summarizes_the_job(tmp_path):
    """``hf-paged train`` under two torchrun launchers, each node with its own output directory and
    ``save_on_each_node``: global rank 0 alone prints the progress and the summary, and the summary's
    forward/backward peak is the job's, the highest of both nodes' timelines."""
    overrides = [
        "training.max_steps=3", "training.per_device_train_batch_size=4", "training.logging_steps=1",
        "training.disable_tqdm=true", "training.save_on_each_node=true", "data.max_samples=32", "memory.plot=false",
        "training.optim_args=device_budget=auto,page_size=64KiB,min_8bit_size=1024,compiled=false",
    ]
    launchers = node_launchers("torchrun", 1, free_port())
    environment = {
        **os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"), "CUDA_VISIBLE_DEVICES": "",
    }
    started = time.perf_counter()
    processes = [
        subprocess.Popen(
            [*launcher, "-m", "hf_paged.cli", "train", *(f"--set={item}" for item in overrides),
             "--output-dir", str(tmp_path / f"node{node}")],
            cwd=tmp_path, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node, launcher in enumerate(launchers)
    ]  # fmt: skip
    try:
        outputs = [process.communicate(timeout=LAUNCH_TIMEOUT) for process in processes]
    finally:
        for process in processes:
            process.kill()
    print(f"hf-paged train, torchrun, {NODES} nodes x 1: {time.perf_counter() - started:.1f} s")
    assert [process.returncode for process in processes] == [0, 0], [error[-3000:] for _, error in outputs]
    (first_out, _first_err), (second_out, second_err) = outputs
    assert first_out.count("hf-paged train summary") == 1 and "2 processes" in first_out
    assert not [line for line in (second_out + second_err).splitlines() if line.startswith("hf-paged")]
    summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert summary["processes"] == NODES and not (tmp_path / "node1" / "summary.json").exists()
    peaks = []
    for node in range(NODES):
        timeline = (tmp_path / f"node{node}" / "memory_timeline.jsonl").read_text()
        rows = [json.loads(line) for line in timeline.splitlines()]
        assert [row["step"] for row in rows] == [1, 2, 3]
        peaks.append(max(row["forward_backward_peak"] for row in rows))
    assert summary["forward_backward_peak_bytes"] == max(peaks)
