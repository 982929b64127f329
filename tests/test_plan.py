"""The memory planner against the truth: the peak of live tensor bytes the CPU allocator reports to the profiler.

Each case builds a small Llama from a config as ``hf-paged train`` would, trains two steps for real under
``torch.profiler`` (``profile_memory=True``), sums the allocator's events into the live bytes over time and takes
each phase's peak; the plan of the same setup, traced under fake tensors, must be within 0.25% of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import hf_paged
from hf_paged import native as native_module
from hf_paged.cli import main
from hf_paged.cli.config import load_config
from hf_paged.cli.plan import (
    TrainingSetup,
    architecture,
    build_model,
    build_optimizer,
    make_batch,
    plan_setup,
    setup_from_config,
)
from hf_paged.planner import (
    FORWARD_BACKWARD,
    KINDS,
    OPTIMIZER_STEP,
    MemoryPlan,
    allocations_inside,
    default_loss,
    plan,
)

from plan_utils import SMALL_LLAMA, check_bfloat16_mlp, check_plan, measured_peaks, measured_setup_peaks


def _setup(method: str, *overrides: str, reentrant: bool = False, checkpointing: bool | None = None) -> TrainingSetup:
    setup = setup_from_config(load_config(None, [*SMALL_LLAMA, *overrides]), method)
    if checkpointing is not None:
        setup = setup.with_changes(gradient_checkpointing=checkpointing, reentrant=reentrant)
    return setup


CASES = {
    "full": _setup("full", "training.optim=adamw_torch", checkpointing=False),
    "lora": _setup("lora", "training.optim=adamw_torch", checkpointing=False),
    "lora-checkpointing": _setup("lora", "training.optim=adamw_torch", checkpointing=True),
    "lora-checkpointing-reentrant": _setup("lora", "training.optim=adamw_torch", checkpointing=True, reentrant=True),
    "qlora": _setup("qlora", "training.optim=adamw_torch", checkpointing=False),
    "qlora-checkpointing": _setup("qlora", "training.optim=adamw_torch", checkpointing=True),
    # the built-in model is converted with Module.to(dtype) in its builder
    "full-bfloat16": _setup("full", "training.optim=adamw_torch", "model.dtype=bfloat16", checkpointing=False),
    "lora-bfloat16": _setup("lora", "training.optim=adamw_torch", "model.dtype=bfloat16", checkpointing=True),
    "qlora-bfloat16": _setup(
        "qlora", "training.optim=adamw_torch", "model.dtype=bfloat16", "lora.compute_dtype=bfloat16", checkpointing=True
    ),
}
for _name in ("adamw_32bit", "adamw_8bit", "adamw_4bit", "lion_32bit", "lion_8bit"):
    _args = "page_size=256KiB,min_8bit_size=1024" if "8bit" in _name else "page_size=256KiB"
    if _name == "adamw_4bit":
        _args = "page_size=256KiB,min_4bit_size=1024"
    for _budget in ("", ",device_budget=256KiB"):
        CASES[f"full-hf_paged_{_name}{'-budget' if _budget else ''}"] = _setup(
            "full",
            "model.tiny.num_hidden_layers=1",  # paging concerns the step: one layer traces faster
            f"training.optim=hf_paged_{_name}",
            f"training.optim_args={_args}{_budget}",
            checkpointing=False,
        )


@pytest.mark.parametrize("case", list(CASES))
def test_plan_matches_the_measured_peak_of_live_tensors(case: str) -> None:
    setup = CASES[case]
    planned = plan_setup(setup)
    assert not check_plan(planned, measured_setup_peaks(setup))
    for item in planned.phases:
        assert sum(item.by_kind.values()) == item.peak_bytes


def test_plan_of_a_plain_module_without_transformers() -> None:
    def build() -> nn.Module:
        return _SquaredMean(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)))

    def batch() -> torch.Tensor:
        return torch.randn(64, 256)

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), foreach=False)

    planned = plan(build, batch, optimizer)
    assert not check_plan(planned, measured_peaks(build, batch, optimizer))
    weights = (2 * 256 * 1024 + 1024 + 256) * 4
    step = planned.peak(OPTIMIZER_STEP).by_kind
    assert step["trainable_weights"] == step["gradients"] == weights
    assert step["optimizer_state"] >= 2 * weights
    assert planned.trainable_params == planned.total_params == weights // 4
    with_loss = plan(lambda: build().inner, batch, optimizer, loss=lambda model, inputs: model(inputs).pow(2).mean())
    assert with_loss.forward_backward_peak == planned.forward_backward_peak


class _SquaredMean(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.inner(inputs).pow(2).mean()


def test_plan_counts_the_working_memory_of_bfloat16_matrix_products() -> None:
    """oneDNN's bfloat16 matrix products allocate scratch (packed operands, fp32 accumulators) through PyTorch's
    allocator and free it before returning: on this machine's CPU."""
    check_bfloat16_mlp()


def test_frees_of_blocks_allocated_under_an_earlier_profile_are_left_out() -> None:
    """The profiler reports the free of a block that an earlier profile saw allocated (garbage of earlier work,
    collected during a later measurement): it is not the later work's, in a plan's measured scratch or a truth."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        old = torch.zeros(1000)
    address = old.data_ptr()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as later:
        new = torch.zeros(10)
        del old
    events = []
    pending = list(later.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        if event.typed[0] == _EventType.Allocation:
            events.append((event.start_time_ns, event.typed[1].ptr, event.typed[1].alloc_size))
        pending.extend(event.children)
    events.sort()
    assert (address, -4000) in [event[1:] for event in events]
    assert [size for _, _, size in allocations_inside(events)] == [new.numel() * 4]


def test_plan_counts_the_working_memory_of_another_instruction_set() -> None:
    """The scratch depends on the CPU: capped at AVX-512 with bfloat16 instructions and no AMX, it is larger than on
    an AMX CPU (the tiny Mistral of tests/test_plan_architectures.py was planned 6% low on such a CPU). oneDNN reads
    the cap when it starts, so in a fresh process."""
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    command = [sys.executable, "-c", "from plan_utils import check_bfloat16_mlp; check_bfloat16_mlp()"]
    result = subprocess.run(command, check=False, env=environment, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_plan_kinds_of_qlora() -> None:
    planned = plan_setup(CASES["qlora-checkpointing"])
    step = planned.peak(OPTIMIZER_STEP).by_kind
    assert step["quantization_state"] > 0
    assert step["gradients"] == step["trainable_weights"]
    assert set(step) == set(KINDS)


def test_cuda_plan_rounds_allocations_and_adds_the_workspace() -> None:
    setup = CASES["lora"]
    on_cpu, on_cuda = plan_setup(setup), plan_setup(setup, device="cuda")
    assert on_cuda.forward_backward_peak > on_cpu.forward_backward_peak + 32 * 2**20
    assert all(item.peak_bytes % 512 == 0 for item in on_cuda.phases)


def test_cuda_plan_keeps_paged_state_on_the_device_within_the_budget() -> None:
    budget = 256 * 2**10
    unlimited = plan_setup(CASES["full-hf_paged_adamw_32bit"], device="cuda")
    budgeted = plan_setup(CASES["full-hf_paged_adamw_32bit-budget"], device="cuda")
    assert budgeted.paged_state_bytes == unlimited.paged_state_bytes > 3 * budget
    assert unlimited.peak(OPTIMIZER_STEP).by_kind["optimizer_state"] >= unlimited.paged_state_bytes
    scalars = 16 * 2**10  # step counters and allocator rounding of the state that is not paged
    for item in budgeted.phases:
        assert item.by_kind["optimizer_state"] <= budget + scalars
    assert budgeted.optimizer_step_peak < unlimited.optimizer_step_peak - (unlimited.paged_state_bytes - budget) / 2


def test_cuda_plan_traces_the_kernels_that_run_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host kernels update CPU pages only: a CUDA plan traces the PyTorch kernels, with their temporaries."""

    def build() -> nn.Module:
        return _SquaredMean(nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)))

    def batch() -> torch.Tensor:
        return torch.randn(8, 1024)

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return hf_paged.PagedAdamW8bit(model.parameters(), compiled=False)

    planned = {native: {} for native in ("", "0")}
    for native, plans in planned.items():
        monkeypatch.setenv("HF_PAGED_NATIVE", native)
        for device in ("cpu", "cuda"):
            plans[device] = plan(build, batch, optimizer, steps=1, device=device).optimizer_step_peak
    assert planned[""]["cuda"] == planned["0"]["cuda"]
    if native_module.build_failure() is None:  # on the CPU the host kernels run, without the chunks' temporaries
        assert planned[""]["cpu"] < planned["0"]["cpu"]


def test_bad_arguments_are_named() -> None:
    def build() -> nn.Module:
        return nn.Linear(2, 2)

    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        plan(build, lambda: torch.zeros(2), lambda m: torch.optim.SGD(m.parameters()), steps=0)
    with pytest.raises(TypeError, match="model must be a callable that builds it"):
        plan(build(), lambda: torch.zeros(2), lambda m: torch.optim.SGD(m.parameters()))
    with pytest.raises(ValueError, match="no scalar loss"):
        plan(build, lambda: torch.zeros(3, 2), lambda m: torch.optim.SGD(m.parameters()))
    for device in ("gpu", None, 0, "meta"):
        with pytest.raises(ValueError, match=f"device must be 'cpu' or a CUDA device .*, got {device!r}"):
            plan(build, lambda: torch.zeros(2), lambda m: torch.optim.SGD(m.parameters()), device=device)
    for name in ("step_temporaries", "host_memory_apart"):
        with pytest.raises(TypeError, match=f"{name} must be True or False, got 'yes'"):
            plan(build, lambda: torch.zeros(2), lambda m: torch.optim.SGD(m.parameters()), **{name: "yes"})
    planned = plan(
        build, lambda: torch.zeros(2), lambda m: torch.optim.SGD(m.parameters()), loss=lambda m, b: m(b).sum()
    )
    assert planned.fits("1GiB") and not planned.fits(1)
    with pytest.raises(ValueError, match="capacity must be a finite, non-negative size, got -1"):
        planned.fits(-1)


def test_cli_verdict_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    overrides = [*SMALL_LLAMA, "model.tiny.num_hidden_layers=1", "training.optim=adamw_torch"]
    arguments = ["plan", *(item for override in overrides for item in ("--set", override))]
    started = time.perf_counter()
    assert main([*arguments, "--device-memory", "1GiB", "--device", "cpu"]) == 0
    output = capsys.readouterr().out
    assert "fits" in output and "does not fit" not in output
    assert main([*arguments, "--device-memory", "2MiB", "--device", "cpu"]) == 1
    output = capsys.readouterr().out
    assert "does not fit" in output
    assert "alternatives" in output.lower()
    assert time.perf_counter() - started < 120


def test_cli_plans_a_config_file_reading_only_config_json(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import LlamaConfig

    model_dir = tmp_path / "model"
    LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    ).save_pretrained(model_dir)
    assert sorted(path.name for path in model_dir.iterdir()) == ["config.json"]
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model:\n  name: {model_dir}\nlora:\n  quantize: false\ntokenizer:\n  max_length: 64\n"
        "training:\n  per_device_train_batch_size: 2\n  optim: adamw_torch\n  optim_args: null\n"
    )
    assert main(["plan", str(config), "--device", "cpu"]) == 0
    output = capsys.readouterr().out
    assert "lora, batch 2 x 64 tokens" in output
    assert "give --device-memory" in output


def test_train_plans_for_the_device_the_trainer_trains_on(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With training.use_cpu on a machine with a GPU, the run trains on the CPU, and so is planned."""
    monkeypatch.setattr(hf_paged.cli, "torch_cuda_available", lambda: True)
    monkeypatch.setattr(hf_paged.cli.train, "_accelerator_available", lambda: True)
    overrides = [*SMALL_LLAMA, "model.tiny.num_hidden_layers=1", "training.optim=adamw_torch", "training.use_cpu=true"]
    arguments = [item for override in overrides for item in ("--set", override)]
    assert main(["train", *arguments, "--set", "memory.device_capacity=1GiB", "--plan", "--print-config"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("hf-paged plan: ") and header.endswith(" on cpu"), header


def test_train_prints_the_plan_first(capsys: pytest.CaptureFixture[str]) -> None:
    overrides = [*SMALL_LLAMA, "model.tiny.num_hidden_layers=1", "training.optim=adamw_torch"]
    arguments = [item for override in overrides for item in ("--set", override)]
    assert main(["train", *arguments, "--set", "memory.device_capacity=1GiB", "--plan", "--print-config"]) == 0
    output = capsys.readouterr().out
    assert output.index("verdict: fits in 1.0 GiB") < output.index("model:\n  name: tiny")


@pytest.mark.parametrize("size", ["lots", "0", "0GiB"])
def test_cli_rejects_bad_device_memory(capsys: pytest.CaptureFixture[str], size: str) -> None:
    """A size that is no size, or none, is an argument error (exit status 2), not a plan that does not fit (1)."""
    assert main(["plan", "--device-memory", size]) == 2
    assert "--device-memory" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_cli_names_target_modules_that_match_nothing(capsys: pytest.CaptureFixture[str], method: str) -> None:
    """As ``hf-paged train`` does: exit status 2 naming ``lora.target_modules``, not a traceback (exit status 1, the
    status of a plan that does not fit)."""
    overrides = ["model.tiny.num_hidden_layers=1", "lora.target_modules=[q_proj, bogus_proj]"]
    arguments = [item for override in overrides for item in ("--set", override)]
    assert main(["plan", *arguments, "--method", method, "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("hf-paged: error: lora.target_modules: 'bogus_proj' matches no module"), error


@pytest.mark.parametrize(
    "override",
    [
        "training.per_device_train_batch_size=0",
        "training.gradient_accumulation_steps=0",
        "training.gradient_accumulation_steps=-2",
    ],
)
def test_cli_names_a_batch_of_no_examples(capsys: pytest.CaptureFixture[str], override: str) -> None:
    """No examples a step is a config error naming the key (exit status 2), not a traceback (exit status 1)."""
    assert main(["plan", "--set", "model.tiny.num_hidden_layers=1", "--set", override, "--device", "cpu"]) == 2
    key, value = override.split("=")
    assert f"hf-paged: error: {key} must be an integer >= 1, got {value}" in capsys.readouterr().err


def _write_config(directory: Path, name: str) -> str:
    import transformers

    sizes = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    make = {
        "mixtral": lambda: transformers.MixtralConfig(
            **sizes, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
        ),
        "falcon": lambda: transformers.FalconConfig(
            vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4
        ),
    }
    make[name]().save_pretrained(directory / name)
    return str(directory / name)


def test_cli_names_a_model_that_peft_or_quantization_refuses(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """peft's LoRA of a mixture of experts' 3D weights refuses lora_dropout (named), and a model whose linear layers
    are all subclasses of nn.Linear (Falcon's) has none that transformers quantizes: exit status 2 with the reason, not
    a traceback."""
    cases = {
        "mixtral": ("lora", "lora.lora_dropout", "lora_dropout != 0"),
        "falcon": ("qlora", "lora", "has no linear layers to quantize"),
    }
    for name, (method, key, reason) in cases.items():
        overrides = [f"model.name={_write_config(tmp_path, name)}", "tokenizer.max_length=16"]
        arguments = [item for override in overrides for item in ("--set", override)]
        assert main(["plan", *arguments, "--method", method, "--device", "cpu"]) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"hf-paged: error: {key}: ") and reason in error, error


def test_cli_reports_an_alternative_that_cannot_be_planned(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """A full fine-tune of a mixture of experts that does not fit: its QLoRA alternative cannot be planned (peft's
    LoRA of the experts refuses lora_dropout), which the report says, where it ended in a traceback."""
    overrides = [f"model.name={_write_config(tmp_path, 'mixtral')}", "tokenizer.max_length=16"]
    overrides += ["training.per_device_train_batch_size=1", "training.optim=adamw_torch", "training.optim_args=null"]
    arguments = [item for override in overrides for item in ("--set", override)]
    assert main(["plan", *arguments, "--method", "full", "--device", "cpu", "--device-memory", "64KiB"]) == 1
    output = capsys.readouterr().out
    line = next(line for line in output.splitlines() if line.strip().startswith("QLoRA"))
    assert "cannot plan" in line and "lora_dropout != 0" in line, output
    assert "all of these that can be planned together (4-bit state)" in output


def test_cli_names_the_optimizer_that_cannot_be_planned(capsys: pytest.CaptureFixture[str]) -> None:
    """bitsandbytes' 8-bit optimizers read values when they are built, which fake tensors do not have: the error
    names ``training.optim``, not the model."""
    arguments = ["--set", "training.optim=paged_adamw_8bit", "--set", "training.optim_args=null"]
    assert main(["plan", *arguments, "--device", "cpu", "--device-memory", "24GiB"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(
        "hf-paged: error: training.optim: 'paged_adamw_8bit': cannot plan the optimizer: building it reads the values "
        "of tensors"
    ), error
    assert "model.name" not in error and "mixture-of-experts" not in error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_plan_matches_cuda_max_memory_allocated() -> None:
    setup = _setup("lora", "training.optim=adamw_torch", checkpointing=True)
    planned = plan_setup(setup, device="cuda")
    vocab_size = architecture(setup.config).vocab_size
    model = build_model(setup, device="cuda").cuda()
    optimizer = build_optimizer(setup, model, device="cuda")
    for step in range(1, 3):
        for phase in (FORWARD_BACKWARD, OPTIMIZER_STEP):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if phase == FORWARD_BACKWARD:
                inputs = {key: value.cuda() for key, value in make_batch(setup, vocab_size).items()}
                loss = default_loss(model, inputs)
                loss.backward()
                del loss  # the Trainer holds the step's batch until the next step's is fetched
            else:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            truth = torch.cuda.max_memory_allocated()
            item = next(p for p in planned.phases if p.phase == phase and p.step == step)
            assert abs(item.peak_bytes / truth - 1) <= 0.03, (phase, step, item.peak_bytes, truth)
            assert abs(item.peak_bytes / torch.cuda.max_memory_reserved() - 1) <= 0.10


def test_train_hands_the_plan_to_the_automatic_budget_and_the_callback(tmp_path, monkeypatch) -> None:
    from hf_paged.budget import AutoBudget
    from hf_paged.callbacks import MemorySpikeCallback

    expected: list[tuple[AutoBudget, MemoryPlan]] = []
    callbacks: list[MemorySpikeCallback] = []
    expect, begin = AutoBudget.expect, MemorySpikeCallback.on_train_begin

    def recording_expect(self: AutoBudget, planned_peak: MemoryPlan) -> None:
        expected.append((self, planned_peak))
        expect(self, planned_peak)

    def recording_begin(self: MemorySpikeCallback, *args, **kwargs) -> None:
        callbacks.append(self)
        begin(self, *args, **kwargs)

    monkeypatch.setattr(AutoBudget, "expect", recording_expect)
    monkeypatch.setattr(MemorySpikeCallback, "on_train_begin", recording_begin)
    overrides = [
        *SMALL_LLAMA,
        "model.tiny.num_hidden_layers=1",
        "training.optim=hf_paged_adamw_8bit",
        "training.optim_args=device_budget=auto,page_size=64KiB",
        "training.max_steps=2",
        "memory.device_capacity=1GiB",
        "memory.plot=false",
    ]
    arguments = [item for override in overrides for item in ("--set", override)]
    assert main(["train", *arguments, "--plan", "--output-dir", str(tmp_path)]) == 0
    (callback,) = callbacks
    (budget, planned), *_ = expected
    assert isinstance(planned, MemoryPlan) and planned.device == "cpu" and callback.plan is planned
    assert budget.planned_peak == planned.peak_without_state("forward_backward") > 0
    assert callback.planned_peaks["optimizer_step"] == planned.optimizer_step_peak
    assert callback.plan_differences is None  # on the CPU the probe reads resident memory: not compared


@pytest.mark.parametrize(
    "training",
    [
        {"activation_checkpointing": True},
        {"gradient_checkpointing": True},
        {"activation_checkpointing": False, "gradient_checkpointing": True},
        {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": True}},
        {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
        {"gradient_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": True}},
    ],
)
def test_the_plan_checkpoints_as_the_training_arguments_resolve_the_two_names(tmp_path, training) -> None:
    from transformers import TrainingArguments

    config = load_config(None, [*SMALL_LLAMA, "lora.gradient_checkpointing=false"])
    config.training.update(training)
    setup = setup_from_config(config, "lora")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated name
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **training)
    assert setup.gradient_checkpointing == args.activation_checkpointing
    reentrant = bool((args.activation_checkpointing_kwargs or {}).get("use_reentrant"))
    assert setup.reentrant == (args.activation_checkpointing and reentrant)


def test_the_shipped_bf16_recipe_plans_for_a_gpu_on_a_machine_without_one(tmp_path, capsys) -> None:
    """``configs/qlora_7b_24gb.yaml`` trains in bf16, which TrainingArguments refuse to set up without a GPU that
    runs it: the plan, of that GPU, must not ask this machine for it (it exited with status 2)."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    ).save_pretrained(tmp_path)
    recipe = Path(__file__).resolve().parents[1] / "configs" / "qlora_7b_24gb.yaml"
    assert load_config(recipe).training["bf16"] is True
    arguments = ["--set", f"model.name={tmp_path}", "--set", "tokenizer.max_length=64", "--device-memory", "24GiB"]
    assert main(["plan", str(recipe), *arguments]) == 0
    assert "verdict: fits in 24.0 GiB" in capsys.readouterr().out
