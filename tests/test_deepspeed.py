"""DeepSpeed ZeRO 1, 2 and 3 through the Trainer, with the paged optimizers as DeepSpeed's client optimizer.

Three launches of ``tests/scripts/deepspeed_train.py`` (module fixtures) train a tiny causal LM with every
configuration of :data:`deepspeed_train.CONFIGS` and save and resume a DeepSpeed checkpoint; the tests read
what they wrote:

- one process: ZeRO 1, 2 and 3, ZeRO-1 with bf16 parameters (DeepSpeed's BF16_Optimizer), and ZeRO-Offload
  under stages 2 and 3;
- two processes (``torchrun``): ZeRO 2 and 3, each rank's client holding its own partitions;
- two processes under ``accelerate launch --config_file configs/accelerate/zero3.yaml`` (bf16).

DeepSpeed runs on the CPU with its gloo fallback; the script keeps DeepSpeed from JIT-compiling its
shared-memory op (see its docstring), so no launch compiles anything.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from background import BackgroundRun, Launches, selected_items, selected_params
from conftest import runs_slow_tests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "scripts", "deepspeed_train.py")
sys.path.insert(0, os.path.dirname(SCRIPT))

from deepspeed_train import CONFIGS, SETUPS

from trainer_utils import tiny_llama

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (pip install deepspeed)"
)

STEPS, SAVE_AT = 6, 3
SINGLE_PROCESS = ["zero1", "zero2", "zero3", "zero1_bf16", "zero2_offload", "zero3_offload"]
TWO_RANKS = ["zero2", "zero3"]
SLOW_RUN_ONLY = {("single_process", "zero2"), ("single_process", "zero3")}
"""Setups the default run takes in two processes only (where ZeRO really partitions); the slow run in one too."""
RUNS = [("single_process", setup) for setup in SINGLE_PROCESS] + [("two_ranks", setup) for setup in TWO_RANKS]
"""(fixture, setup) pairs: every setup of the two ``torch.distributed`` launches."""

PAGED = [name for name in CONFIGS if name != "adamw_torch"]
CLIENTS = {
    "adamw_torch": "AdamW",
    "adamw_32bit": "PagedAdamW",
    "adamw_32bit_budget": "PagedAdamW",
    "adamw_8bit": "PagedAdamW8bit",
    "adamw_8bit_budget": "PagedAdamW8bit",
    "adamw_4bit": "PagedAdamW4bit",
    "lion_32bit": "PagedLion",
    "lion_8bit": "PagedLion8bit",
    "ademamix_8bit": "PagedAdEMAMix8bit",
}
"""The client optimizer class each configuration's ``optim`` selects."""


def deepspeed_optimizer(setup: str) -> str:
    """The class of the optimizer DeepSpeed wraps the client in under ``setup``."""
    if SETUPS[setup].stage == 3:
        return "DeepSpeedZeroOptimizer_Stage3"
    if SETUPS[setup].stage == 1 and SETUPS[setup].bf16:
        return "BF16_Optimizer"  # bf16 parameters with fp32 gradient accumulation
    return "DeepSpeedZeroOptimizer"


def start(launcher: list[str], folder, *options: str) -> BackgroundRun:
    """Start the training script under ``launcher``; its ``output`` is where rank 0 writes its result."""
    output = folder / "result.pt"
    command = [
        *launcher,
        SCRIPT,
        "--folder",
        str(folder / "runs"),
        "--output",
        str(output),
        "--steps",
        str(STEPS),
        "--save-at",
        str(SAVE_AT),
        *options,
    ]
    environment = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    return BackgroundRun(command, environment, output=output)


def result_of(run: BackgroundRun) -> dict:
    """What rank 0 of a run of :func:`start` wrote, once it ended without an error."""
    completed = run.wait()
    assert completed.returncode == 0, completed.stderr[-4000:]
    return torch.load(run.output, weights_only=True)


def launch(launcher: list[str], folder, *options: str) -> dict:
    """Run the training script under ``launcher``; what rank 0 wrote."""
    return result_of(start(launcher, folder, *options))


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory) -> Iterator[Launches]:
    """The launch of every setup of :data:`SINGLE_PROCESS` in one process (but :data:`SLOW_RUN_ONLY` outside the slow
    run) and of :data:`TWO_RANKS` in two, those the selected tests read started together (a thread per process: they
    share the cores)."""
    single = [
        setup
        for setup in SINGLE_PROCESS
        if runs_slow_tests(request.config) or ("single_process", setup) not in SLOW_RUN_ONLY
    ]
    two_ranks = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    starts = {
        "single_process": lambda: start(
            [sys.executable], tmp_path_factory.mktemp("deepspeed_single"), "--setups", *single
        ),
        "two_ranks": lambda: start(two_ranks, tmp_path_factory.mktemp("deepspeed_two_ranks"), "--setups", *TWO_RANKS),
    }
    needed = {launch_name for launch_name, _ in selected_params(request, "run")}
    needed.update(name for name in starts for item in selected_items(request) if name in item.fixturenames)
    runs = Launches(starts, needed)
    yield runs
    runs.stop()


@pytest.fixture(scope="module")
def single_process(launches) -> dict:
    """Every configuration under every setup of :data:`SINGLE_PROCESS`, in one process."""
    return result_of(launches["single_process"])


@pytest.fixture(scope="module")
def two_ranks(launches) -> dict:
    """Every configuration under every setup of :data:`TWO_RANKS`, in two processes."""
    return result_of(launches["two_ranks"])


@pytest.fixture(scope="module")
def accelerate_zero3(tmp_path_factory) -> dict:
    """``adamw_torch`` and 8-bit AdamW, two processes, as ``configs/accelerate/zero3.yaml`` sets DeepSpeed up."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    launcher = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(REPO, "configs", "accelerate", "zero3.yaml"),
        "--main_process_port",
        str(port),
    ]
    folder = tmp_path_factory.mktemp("deepspeed_accelerate")
    return launch(launcher, folder, "--setups", "accelerate", "--configs", "adamw_torch", "adamw_8bit")


@pytest.fixture(scope="module")
def sub_groups(tmp_path_factory) -> dict:
    """ZeRO-3 stepping its flat partition in sub-groups of 20,000 elements, one process: fp32 AdamW as the reference,
    the fp32 and 8-bit paged clients."""
    folder = tmp_path_factory.mktemp("deepspeed_sub_groups")
    configs = ["adamw_torch", "adamw_32bit", "adamw_8bit_budget"]
    return launch([sys.executable], folder, "--setups", "zero3_sub_groups", "--configs", *configs)


@pytest.fixture(
    params=[pytest.param(run, marks=(pytest.mark.slow,) if run in SLOW_RUN_ONLY else ()) for run in RUNS],
    ids=[f"{setup}-{'1' if run == 'single_process' else '2'}rank" for run, setup in RUNS],
)
def run(request) -> tuple[dict, str]:
    """The summary of one launch and one of its setups."""
    launch_name, setup = request.param
    return request.getfixturevalue(launch_name), setup


def completed(summary: dict, setup: str, name: str) -> dict:
    """The result of configuration ``name``, which must have trained, saved and resumed without an error."""
    result = summary["results"][setup][name]
    full = result["full"]
    assert result["error"] is None, (
        f"{name} under {setup} ({summary['world_size']} rank(s)) failed: {result['error']}; "
        f"logged before it: losses {full.get('losses')}, grad norms {full.get('grad_norms')}"
    )
    return result


def final_loss(result: dict) -> float:
    return result["full"]["losses"][-1]


def assert_finite(result: dict) -> None:
    for run_name in ("full", "resumed"):
        values = result[run_name]["losses"] + result[run_name]["grad_norms"]
        assert all(math.isfinite(value) for value in values), (run_name, result[run_name])


def assert_zero_checkpoint(summary: dict, result: dict) -> None:
    """The checkpoint has DeepSpeed's folder with the ZeRO optimizer state of each rank."""
    saved = {path.split("/")[-1] for path in result["checkpoint_files"] if path.startswith(f"global_step{SAVE_AT}/")}
    for rank in range(summary["world_size"]):
        name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        assert {name, f"bf16_{name}"} & saved, result["checkpoint_files"]


def test_deepspeed_is_in_effect(run):
    summary, setup = run
    stage, offload, bf16 = SETUPS[setup].stage, SETUPS[setup].offload, SETUPS[setup].bf16
    assert not summary["shm_op"]  # nothing was compiled
    for name, result in summary["results"][setup].items():
        record = result["full"]
        assert "engine" in record, f"{name} stopped before training began: {result['error']}"
        assert record["engine"] == "DeepSpeedEngine" and record["deepspeed_is_engine"], name
        assert (record["zero_stage"], record["offload"], record["bf16"]) == (stage, offload, bf16), name
        assert record["optimizers"] == ["DeepSpeedOptimizerWrapper", deepspeed_optimizer(setup), CLIENTS[name]], name
    assert_zero_checkpoint(summary, completed(summary, setup, "adamw_torch"))


def test_deepspeed_hands_the_client_flat_partitions(run):
    """What any client optimizer meets (recorded with ``adamw_torch``): the Trainer built it on the model's
    parameters (two groups, with and without weight decay); DeepSpeed swaps in one flat fp32 partition per
    group and, but for the BF16_Optimizer, steps one group at a time (that group's tensor and nothing else)."""
    summary, setup = run
    world = summary["world_size"]
    record = completed(summary, setup, "adamw_torch")["full"]
    between, at_steps = record["groups_between_steps"], record["groups_at_steps"]
    wrapper = deepspeed_optimizer(setup)
    if wrapper == "DeepSpeedZeroOptimizer_Stage3":
        assert between == [[], []]  # params are empty between steps
        assert len(at_steps) == 2 * STEPS  # one step() per group
        assert all(len(groups) == 2 and sorted(map(len, groups)) == [0, 1] for groups in at_steps), at_steps
    elif wrapper == "DeepSpeedZeroOptimizer":
        assert [len(group) for group in between] == [1, 1]
        assert len(at_steps) == 2 * STEPS  # param_groups narrowed to the one group stepped
        assert all(len(groups) == 1 and len(groups[0]) == 1 for groups in at_steps), at_steps
    else:
        assert [len(group) for group in between] == [1, 1]
        assert at_steps == [between] * STEPS  # one step() over both groups
    seen = [shape for groups in at_steps for group in groups for shape in group]
    assert all(len(shape) == 1 for shape in seen), seen
    partition = sum(shape[0] for shape in seen[:2])  # this rank's share of both groups
    numel = sum(param.numel() for param in tiny_llama().parameters())
    if world == 1:
        assert partition == numel
    else:
        assert numel / world <= partition < numel


def test_paged_adamw_32bit_matches_adamw_torch(run):
    """To fp32 rounding; with bf16 parameters a master weight that differs in its last fp32 bit can round to
    another bf16 value (a step of 2**-8), so the losses drift apart faster (2.7e-4 after 6 steps, measured)."""
    summary, setup = run
    loss_tolerance, weight_tolerance = (1e-3, 1e-3) if SETUPS[setup].bf16 else (1e-4, 1e-5)
    reference = completed(summary, setup, "adamw_torch")["full"]
    paged = completed(summary, setup, "adamw_32bit")["full"]
    assert paged["steps"] == reference["steps"] == list(range(1, STEPS + 1))
    for step, loss, expected in zip(paged["steps"], paged["losses"], reference["losses"]):
        assert abs(loss - expected) <= loss_tolerance * abs(expected), (step, paged["losses"], reference["losses"])
    deviation = (paged["weights"] - reference["weights"]).norm() / reference["weights"].norm()
    assert deviation.item() < weight_tolerance


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_4bit"])
def test_quantized_adamw_learns_like_32bit(run, name):
    summary, setup = run
    reference = completed(summary, setup, "adamw_torch")
    result = completed(summary, setup, name)
    assert_finite(result)
    assert abs(final_loss(result) - final_loss(reference)) <= 0.03 * final_loss(reference), (
        result["full"]["losses"],
        reference["full"]["losses"],
    )


@pytest.mark.parametrize("name", ["lion_32bit", "lion_8bit", "ademamix_8bit"])
def test_lion_and_ademamix_learn(run, name):
    summary, setup = run
    result = completed(summary, setup, name)
    assert_finite(result)
    losses = result["full"]["losses"]  # the same batch at every step
    assert all(later < earlier for earlier, later in itertools.pairwise(losses)), losses
    assert losses[-1] < 0.95 * losses[0], losses


@pytest.mark.parametrize("name", list(CONFIGS))
def test_deepspeed_checkpoint_resumes_bitwise(run, name):
    summary, setup = run
    result = completed(summary, setup, name)
    assert_zero_checkpoint(summary, result)
    full, resumed = result["full"], result["resumed"]
    assert resumed["steps"] == list(range(SAVE_AT + 1, STEPS + 1))
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    assert resumed["grad_norms"] == full["grad_norms"][SAVE_AT:]
    assert torch.equal(resumed["weights"], full["weights"])


@pytest.mark.parametrize("name", PAGED)
def test_safe_get_full_optimizer_state_reads_the_paged_moments(run, name):
    """``deepspeed.utils.safe_get_full_optimizer_state(param, "exp_avg")`` after training through the Trainer answers
    for every parameter of a paged client (it raised before; with bf16 parameters under ZeRO-1, DeepSpeed's
    BF16_Optimizer, until issue 28), and after the resume (which links DeepSpeed's parameters to their partitions
    anew) bitwise as in the uninterrupted run."""
    summary, setup = run
    result = completed(summary, setup, name)
    moments = result["full"]["first_moments"]
    assert isinstance(moments, torch.Tensor), moments
    assert moments.shape == (sum(param.numel() for param in tiny_llama().parameters()),)
    assert torch.equal(result["resumed"]["first_moments"], moments)


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_4bit"])
def test_safe_get_full_optimizer_state_decodes_quantized_moments(run, name):
    """The 8-bit and 4-bit first moments read through DeepSpeed's tool are those of 32-bit paged AdamW (which
    matches torch's AdamW, above) within the codecs' quantization."""
    summary, setup = run
    reference = completed(summary, setup, "adamw_32bit")["full"]["first_moments"]
    moments = completed(summary, setup, name)["full"]["first_moments"]
    tolerance = {"adamw_8bit": 0.05, "adamw_4bit": 0.25}[name]
    assert ((moments - reference).norm() / reference.norm()).item() < tolerance


@pytest.mark.parametrize("name", ["adamw_32bit", "adamw_8bit"])
def test_paging_under_a_small_budget_is_bitwise(run, name):
    summary, setup = run
    unbounded = completed(summary, setup, name)["full"]
    paged = completed(summary, setup, f"{name}_budget")["full"]
    assert unbounded["paging"]["page_outs"] == 0
    assert paged["paging"]["page_outs"] > 0
    assert paged["paging"]["device_bytes"] <= paged["paging"]["device_budget"]
    assert paged["losses"] == unbounded["losses"]
    assert paged["grad_norms"] == unbounded["grad_norms"]
    assert torch.equal(paged["weights"], unbounded["weights"])


@pytest.mark.parametrize("setup", ["zero2_offload", "zero3_offload"])
@pytest.mark.parametrize("name", PAGED)
def test_zero_offload_steps_paged_state_on_the_host(single_process, setup, name):
    """``offload_optimizer: cpu`` with ``zero_force_ds_cpu_optimizer: false``: DeepSpeed steps our optimizer
    (not its CPU Adam) on partitions in host memory, and the pages stay on the host."""
    result = completed(single_process, setup, name)
    record = result["full"]
    assert record["offload"] and record["optimizers"][-1] == CLIENTS[name]
    assert set(record["paging"]["devices"]) == {"cpu"}
    assert_finite(result)
    assert record["losses"][-1] < 0.95 * record["losses"][0]


def test_accelerate_zero3_config_trains_paged_optimizer(accelerate_zero3):
    """``accelerate launch --config_file configs/accelerate/zero3.yaml``, the Trainer in bf16 as the config's mixed
    precision requires: the Trainer's optimizer is DeepSpeed's client under ZeRO-3, trains like ``adamw_torch``
    and resumes bitwise."""
    assert accelerate_zero3["world_size"] == 2
    reference = completed(accelerate_zero3, "accelerate", "adamw_torch")
    result = completed(accelerate_zero3, "accelerate", "adamw_8bit")
    record = result["full"]
    assert record["engine"] == "DeepSpeedEngine" and record["zero_stage"] == 3 and record["bf16"]
    assert record["optimizers"] == ["DeepSpeedOptimizerWrapper", "DeepSpeedZeroOptimizer_Stage3", "PagedAdamW8bit"]
    assert_finite(result)
    assert abs(final_loss(result) - final_loss(reference)) <= 0.03 * final_loss(reference)
    assert result["resumed"]["losses"] == record["losses"][SAVE_AT:]
    assert torch.equal(result["resumed"]["weights"], record["weights"])


def test_zero3_sub_groups_take_turns_in_a_paged_client(sub_groups):
    """ZeRO-3 lists one sub-group's flat fp32 partition at a time, each of its own size, in the client's param group
    (recorded with ``adamw_torch``): a paged client steps each with its own state, as ``torch.optim.AdamW`` does, and
    resumes bitwise (it refused the second sub-group before: a new tensor of another shape where a stepped one
    stood)."""
    reference = completed(sub_groups, "zero3_sub_groups", "adamw_torch")["full"]
    sizes = [shape for groups in reference["groups_at_steps"] for group in groups for shape in group]
    per_step = len(sizes) // STEPS
    assert per_step >= 3 and len({tuple(shape) for shape in sizes[:per_step]}) >= 2, sizes
    assert sum(shape[0] for shape in sizes[:per_step]) == sum(p.numel() for p in tiny_llama().parameters())
    test_paged_adamw_32bit_matches_adamw_torch((sub_groups, "zero3_sub_groups"))
    for name in ("adamw_32bit", "adamw_8bit_budget"):
        result = completed(sub_groups, "zero3_sub_groups", name)
        assert_finite(result)
        full, resumed = result["full"], result["resumed"]
        assert resumed["losses"] == full["losses"][SAVE_AT:] and torch.equal(resumed["weights"], full["weights"])
    eight_bit = final_loss(completed(sub_groups, "zero3_sub_groups", "adamw_8bit_budget"))
    assert abs(eight_bit - reference["losses"][-1]) <= 0.03 * reference["losses"][-1]


OOM_UNDER_ZERO = """
import json, os, sys, tempfile
sys.path[:0] = [os.path.join(sys.argv[1], "tests"), os.path.join(sys.argv[1], "tests", "scripts")]
from deepspeed_train import prepare_process, skip_shm_op_build
prepare_process()
skip_shm_op_build()
import torch
from transformers import Trainer, TrainerCallback
from hf_paged.callbacks import MemorySpikeCallback
from trainer_utils import tiny_llama, token_dataset, training_args, trainer_deepspeed_config

class SecondMicroBatchFails(TrainerCallback):
    def on_substep_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            self.hook = model.register_forward_pre_hook(self.fail)

    def fail(self, module, inputs):
        self.hook.remove()
        raise torch.OutOfMemoryError("injected")

args = training_args(tempfile.mkdtemp(), optim="hf_paged_adamw_32bit", max_steps=1, gradient_accumulation_steps=2,
                     per_device_train_batch_size=2, deepspeed=trainer_deepspeed_config({"stage": 2}))
callbacks = [MemorySpikeCallback(plot=False), SecondMicroBatchFails()]
trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset(), callbacks=callbacks)
try:
    trainer.train()
    print(json.dumps({"recoveries": callbacks[0].oom_recoveries}))
except torch.OutOfMemoryError as error:
    print(json.dumps({"notes": getattr(error, "__notes__", [])}))
"""


def test_one_process_does_not_replay_a_micro_batch_deepspeed_accumulated(tmp_path):
    """DeepSpeed accumulates a micro-batch's gradients into buffers of its own that a replay cannot rewind: replaying
    the step's first micro-batch after an error in its second counted it twice (the parameters after the step differed
    from an uninterrupted run's by 1e-3), so the error is raised with a note, in one process as in several."""
    environment = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    command = [sys.executable, "-c", OOM_UNDER_ZERO, REPO]
    result = subprocess.run(command, check=False, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert "notes" in outcome, outcome
    assert any("DeepSpeed's engine" in note for note in outcome["notes"]), outcome


PHASES_UNDER_ZERO = """
import json, os, sys, tempfile
sys.path[:0] = [os.path.join(sys.argv[1], "tests"), os.path.join(sys.argv[1], "tests", "scripts")]
from deepspeed_train import prepare_process, skip_shm_op_build
prepare_process()
skip_shm_op_build()
from transformers import Trainer
from hf_paged.callbacks import MemorySpikeCallback
from hf_paged.recovery import paged_optimizer_of
from trainer_utils import tiny_llama, token_dataset, training_args, trainer_deepspeed_config

args = training_args(tempfile.mkdtemp(), optim="hf_paged_adamw_32bit", optim_args="page_size=16KiB,device_budget=32KiB",
                     max_steps=2, deepspeed=trainer_deepspeed_config({"stage": 2}))
callback = MemorySpikeCallback(plot=False)
trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset(), callbacks=[callback])
trainer.train()
engine = trainer.model_wrapped
print(json.dumps({
    "page_ins_during_step": [row["page_ins_during_step"] for row in callback.rows],
    "page_ins": [row["page_ins"] for row in callback.rows],
    "engine_step_restored": "step" not in vars(engine),
}))
"""


def test_memory_callback_measures_deepspeeds_optimizer_step_in_its_phase(tmp_path):
    """DeepSpeed steps the optimizer inside the backward of a step's last micro-batch (accelerate's engine wrapper),
    before the Trainer's ``on_pre_optimizer_step``: the callback measured that step in the forward/backward phase
    and an empty optimizer-step phase (no page moved in it under a budget); it now measures the engine's step."""
    environment = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    command = [sys.executable, "-c", PHASES_UNDER_ZERO, REPO]
    result = subprocess.run(command, check=False, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["page_ins"][-1] > 0 and outcome["page_ins_during_step"] == outcome["page_ins"], outcome
    assert outcome["engine_step_restored"], outcome
