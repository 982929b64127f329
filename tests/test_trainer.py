"""The optimizer names work with transformers' Trainer like its own optimizers, and resume exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers
from transformers import HfArgumentParser, Trainer, TrainingArguments

import hf_paged
from hf_paged.integrations import OPTIMIZER_NAMES, parse_optim_args
from hf_paged.integrations import trainer as trainer_integration

from trainer_utils import tiny_llama, token_dataset, training_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fit(tmp_path, optim: str, model=None, **overrides):
    trainer = Trainer(
        model=model or tiny_llama(), args=training_args(tmp_path / optim, optim=optim, **overrides), train_dataset=token_dataset()
    )
    trainer.train()
    return trainer


def flat_params(model) -> torch.Tensor:
    return torch.cat([param.detach().float().reshape(-1) for param in model.parameters()])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_names_are_accepted_by_training_arguments_and_parsers(tmp_path):
    for name in OPTIMIZER_NAMES:
        assert TrainingArguments(output_dir=str(tmp_path), optim=name).optim == name
    parser = HfArgumentParser(TrainingArguments)
    (parsed,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--optim", "hf_paged_lion_8bit"])
    assert parsed.optim == "hf_paged_lion_8bit"
    assert "hf_paged_adamw_8bit" in parser.format_help()
    (from_dict,) = parser.parse_dict({"output_dir": str(tmp_path), "optim": "hf_paged_adamw_32bit"})
    assert from_dict.optim == "hf_paged_adamw_32bit"
    config = tmp_path / "args.yaml"
    config.write_text(f"output_dir: {tmp_path}\noptim: hf_paged_adamw_8bit\n")
    assert parser.parse_yaml_file(str(config))[0].optim == "hf_paged_adamw_8bit"
    hf_paged.register()
    hf_paged.register()
    values = [member.value for member in transformers.training_args.OptimizerNames]
    assert all(values.count(name) == 1 for name in OPTIMIZER_NAMES)


def test_trainer_creates_our_optimizer_with_its_hyperparameters(tmp_path):
    trainer = Trainer(
        model=tiny_llama(),
        args=training_args(tmp_path, optim="hf_paged_adamw_8bit", adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7,
                           optim_args="device_budget=64KiB,page_size=16KiB,prefetch=1,block_size=128"),
        train_dataset=token_dataset(),
    )
    trainer.create_optimizer()
    optimizer = trainer.optimizer
    assert isinstance(optimizer, hf_paged.PagedAdamW8bit)
    decay, no_decay = optimizer.param_groups  # the Trainer's groups as given; the embedding (in decay) keeps fp32 state
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0 and "state_format" not in decay
    assert optimizer._keeps_fp32(trainer.model.model.embed_tokens.weight)
    assert decay["lr"] == 1e-3 and decay["betas"] == (0.8, 0.95) and decay["eps"] == 1e-7 and decay["block_size"] == 128
    assert optimizer.device_budget == 64 * 1024 and optimizer.page_size == 16 * 1024 and optimizer.prefetch == 1
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, hf_paged.PagedAdamW8bit)
    assert trainer.optimizer.optimizer.paging_stats()["page_outs"] > 0


def test_trainer_creates_adamw_4bit_with_its_layout_arguments(tmp_path):
    trainer = Trainer(
        model=tiny_llama(),
        args=training_args(tmp_path, optim="hf_paged_adamw_4bit", adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7,
                           optim_args="device_budget=32KiB,page_size=16KiB,block_size=64,min_4bit_size=8192"),
        train_dataset=token_dataset(),
    )
    trainer.create_optimizer()
    optimizer = trainer.optimizer
    assert isinstance(optimizer, hf_paged.PagedAdamW4bit)
    decay = optimizer.param_groups[0]
    assert decay["betas"] == (0.8, 0.95) and decay["eps"] == 1e-7 and decay["weight_decay"] == 0.1
    assert decay["block_size"] == 64 and decay["min_4bit_size"] == 8192
    trainer.train()
    state = trainer.optimizer.optimizer.state_dict()["state"]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    embedding = trainer.model.model.embed_tokens.weight  # 8192 elements, its state kept in fp32
    assert any("exp_avg_packed_codes" in entry for entry in state.values())
    assert all(
        ("exp_avg_packed_codes" in entry) == (params[index].numel() >= 8192 and params[index] is not embedding)
        for index, entry in state.items()
    )
    assert trainer.optimizer.optimizer.paging_stats()["page_outs"] > 0
    with pytest.raises(ValueError, match="min_8bit_size"):
        parse_optim_args({"min_8bit_size": "1024"}, hf_paged.PagedAdamW4bit)
    assert parse_optim_args({"min_4bit_size": "1024", "block_size": "128"}, hf_paged.PagedAdamW4bit) == {
        "min_4bit_size": 1024, "block_size": 128}


@pytest.mark.parametrize("short_rows", [None, "4bit"])
def test_optim_args_keep_short_rows_4bit(tmp_path, short_rows):
    """The tiny Llama's matrices but down_proj have rows of 64, shorter than a block of 128: 8-bit state by default,
    4-bit with ``optim_args="short_rows=4bit"``, which an 8-bit optimizer refuses."""
    optim_args = None if short_rows is None else f"short_rows={short_rows}"
    trainer = fit(tmp_path, "hf_paged_adamw_4bit", max_steps=1, optim_args=optim_args)
    optimizer = trainer.optimizer.optimizer
    layout = optimizer._layout
    kinds = {layout[param].kind for param in trainer.model.parameters() if param.ndim == 2}
    assert kinds == ({"4bit", "32bit"} if short_rows == "4bit" else {"4bit", "8bit", "32bit"})
    assert optimizer.short_rows == (short_rows or "8bit")
    with pytest.raises(ValueError, match="short_rows"):
        parse_optim_args({"short_rows": "4bit"}, hf_paged.PagedAdamW8bit)


def test_ademamix_takes_the_hyperparameters_transformers_gives_bitsandbytes_ademamix(tmp_path, monkeypatch):
    """beta1, beta2 and eps from optim_args or the Trainer's adam_* settings, beta3, alpha, t_alpha and t_beta3 from
    optim_args (defaults 0.9999, 5.0, none), as transformers builds bitsandbytes' AdEMAMix; with
    HF_PAGED_REPLACE_BITSANDBYTES=1, bitsandbytes' paged AdEMAMix names select ours (and are checked as ours)."""
    settings = {"adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-7, "use_cpu": True}
    for optim_args in ("", "beta1=0.7,beta3=0.999,alpha=8,t_alpha=100,t_beta3=200,eps=1e-6"):
        theirs = TrainingArguments(str(tmp_path), optim="paged_ademamix_8bit", optim_args=optim_args, **settings)
        _, expected = Trainer.get_optimizer_cls_and_kwargs(theirs)
        ours = TrainingArguments(str(tmp_path), optim="hf_paged_ademamix_8bit", optim_args=optim_args, **settings)
        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(ours)
        assert optimizer_cls is hf_paged.PagedAdEMAMix8bit
        defaults = optimizer_cls([torch.zeros(1, requires_grad=True)], **kwargs).defaults
        for key in ("lr", "betas", "alpha", "eps", "t_alpha", "t_beta3"):
            assert defaults[key] == expected.get(key), key
    monkeypatch.setenv(trainer_integration.REPLACE_BITSANDBYTES_ENV, "1")
    assert trainer_integration.optimizer_class_for("paged_ademamix_32bit") is hf_paged.PagedAdEMAMix
    assert trainer_integration.optimizer_class_for("paged_ademamix_8bit") is hf_paged.PagedAdEMAMix8bit
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
        TrainingArguments(str(tmp_path), optim="paged_ademamix_8bit", optim_args="alpha=-3", **settings)


def test_optim_args_are_typed_and_checked():
    parsed = parse_optim_args(
        {"device_budget": "2GiB", "page_size": "8MiB", "prefetch": "2", "min_8bit_size": "4096", "block_size": "256"},
        hf_paged.PagedAdamW8bit,
    )
    assert parsed == {"device_budget": 2**31, "page_size": 8 * 2**20, "prefetch": 2, "min_8bit_size": 4096, "block_size": 256}
    assert parse_optim_args({"device_budget": "none", "compiled": "false"}, hf_paged.PagedLion) == {
        "device_budget": None, "compiled": False}
    with pytest.raises(ValueError, match=r"'budget'.*allowed keys: compiled, device_budget, page_size, prefetch"):
        parse_optim_args({"budget": "1GiB"}, hf_paged.PagedAdamW)
    with pytest.raises(ValueError, match="block_size"):
        parse_optim_args({"block_size": "256"}, hf_paged.PagedAdamW)
    with pytest.raises(ValueError, match="prefetch"):
        parse_optim_args({"prefetch": "two"}, hf_paged.PagedAdamW)
    with pytest.raises(ValueError, match="device_budget"):
        parse_optim_args({"device_budget": "lots"}, hf_paged.PagedAdamW)


@pytest.mark.parametrize(
    ("optim", "settings", "message"),
    [
        ("hf_paged_adamw_8bit", {"optim_args": "budget=1GiB"}, r"optim_args key 'budget' is not accepted by PagedAdamW8bit"),
        ("hf_paged_adamw_32bit", {"optim_args": "prefetch=-1"}, r"prefetch must be an integer >= 0, got -1"),
        ("hf_paged_lion_8bit", {"optim_args": "block_size=100"}, r"block_size must be a power of two"),
        ("hf_paged_adamw_8bit", {"optim_args": "page_size=8MiB,device_budget=1MiB"}, r"device_budget=1048576 is smaller"),
        ("hf_paged_lion_32bit", {"optim_args": "prefetch"}, r"optim_args entry 'prefetch' is not of the form key=value"),
        ("hf_paged_adamw_32bit", {"adam_beta1": 1.5}, r"betas\[0\] must be in \[0, 1\)"),
        ("hf_paged_ademamix_8bit", {"optim_args": "alpha=-1"}, r"alpha must be a finite number >= 0, got -1.0"),
        ("hf_paged_ademamix", {"optim_args": "t_beta3=0"}, r"t_beta3 must be None \(no scheduler\) or an integer"),
        ("hf_paged_ademamix_4bit", {"optim_args": "beta3=1"}, r"betas\[2\] must be in \[0, 1\)"),
        ("hf_paged_ademamix", {"optim_args": "block_size=64"}, r"optim_args key 'block_size' is not accepted"),
    ],
)
def test_bad_optimizer_settings_fail_when_the_arguments_are_built(tmp_path, optim, settings, message):
    output = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"optim='{optim}'.*{message}"):
        TrainingArguments(output_dir=str(output), optim=optim, use_cpu=True, **settings)
    command_line = [f"--{key}={value}" for key, value in settings.items()]
    with pytest.raises(ValueError, match=message):
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(output), "--optim", optim, "--use_cpu", *command_line]
        )
    if "optim_args" in settings:
        args = TrainingArguments(output_dir=str(output), use_cpu=True)
        before = args.to_dict()
        with pytest.raises(ValueError, match=message):
            args.set_optimizer(optim, args=settings["optim_args"])
        assert args.to_dict() == before
    assert not output.exists()


def test_optimizer_settings_checked_early_only_for_our_optimizers(tmp_path, monkeypatch):
    TrainingArguments(output_dir=str(tmp_path), optim="hf_paged_adamw_8bit", optim_args="device_budget=auto,prefetch=1")
    TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch", optim_args="anything=1")
    monkeypatch.setattr(trainer_integration, "_replace_choice", None)
    monkeypatch.delenv(trainer_integration.REPLACE_BITSANDBYTES_ENV, raising=False)
    TrainingArguments(output_dir=str(tmp_path), optim="paged_adamw_8bit", optim_args="anything=1")
    monkeypatch.setenv(trainer_integration.REPLACE_BITSANDBYTES_ENV, "1")
    with pytest.raises(ValueError, match="'anything' is not accepted by PagedAdamW8bit"):
        TrainingArguments(output_dir=str(tmp_path), optim="paged_adamw_8bit", optim_args="anything=1")


@pytest.mark.parametrize(
    "overrides",
    [
        {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
        {"max_grad_norm": 0.01},
        {"bf16": True},
    ],
    ids=["accumulation", "clipping", "bf16"],
)
def test_matches_trainer_with_torch_adamw(tmp_path, overrides):
    ours = fit(tmp_path, "hf_paged_adamw_32bit", optim_args="device_budget=32KiB,page_size=16KiB", **overrides)
    theirs = fit(tmp_path, "adamw_torch", **overrides)
    assert isinstance(ours.optimizer.optimizer, hf_paged.PagedAdamW)
    tolerance = 1e-2 if overrides.get("bf16") else 1e-5
    assert relative(flat_params(ours.model), flat_params(theirs.model)) < tolerance
    assert [log.get("loss") for log in ours.state.log_history[:-1]] == pytest.approx(
        [log.get("loss") for log in theirs.state.log_history[:-1]], rel=tolerance
    )


@pytest.mark.parametrize("scheduler", [scheduler.value for scheduler in transformers.SchedulerType])
def test_every_lr_scheduler(tmp_path, scheduler):
    kwargs = {"lr_scheduler_type": scheduler, "warmup_steps": 1, "max_steps": 3}
    if scheduler in ("reduce_lr_on_plateau", "greedy"):
        kwargs.update(eval_strategy="steps", eval_steps=1, metric_for_best_model="loss")
    if "min_lr" in scheduler:
        kwargs["lr_scheduler_kwargs"] = {"min_lr": 1e-5}
    if scheduler == "warmup_stable_decay":
        kwargs["lr_scheduler_kwargs"] = {"num_decay_steps": 1}
    dataset = token_dataset()
    runs = {}
    for optim in ("hf_paged_lion_8bit", "adamw_torch"):
        trainer = Trainer(model=tiny_llama(), args=training_args(tmp_path / optim, optim=optim, **kwargs),
                          train_dataset=dataset, eval_dataset=dataset[:4] if "eval_strategy" in kwargs else None)
        trainer.train()
        runs[optim] = {group["lr"] for group in trainer.optimizer.param_groups}  # ours: the embedding's group too
    assert runs["hf_paged_lion_8bit"] == runs["adamw_torch"]


@pytest.mark.parametrize(
    ("optim", "extra_args"),
    [
        ("hf_paged_adamw_32bit", ""),
        ("hf_paged_adamw_8bit", ""),
        ("hf_paged_adamw_4bit", ""),
        pytest.param("hf_paged_adamw_4bit", ",normalization=rank1,block_size=16", id="hf_paged_adamw_4bit-rank1"),
        ("hf_paged_lion_8bit", ""),
        ("hf_paged_ademamix", ",t_alpha=4,t_beta3=4"),
        ("hf_paged_ademamix_8bit", ",t_alpha=4,t_beta3=4"),
    ],
)
def test_resume_from_checkpoint_is_bitwise_identical(tmp_path, optim, extra_args):
    options = {"max_steps": 6, "save_strategy": "steps", "save_steps": 3,
               "optim_args": "device_budget=48KiB,page_size=16KiB" + extra_args}
    uninterrupted = fit(tmp_path / "full", optim, **options)
    layout = uninterrupted.optimizer.optimizer._layout
    kinds = {layout[param].kind for param in uninterrupted.model.parameters() if param.ndim == 2}
    if "rank1" in extra_args:  # every matrix of the tiny Llama but its embedding (fp32) takes rank-1 state
        embedding = uninterrupted.model.model.embed_tokens.weight
        assert kinds == {"4bit-rank1", "32bit"} and layout[embedding].kind == "32bit"
    elif optim.endswith("4bit"):  # down_proj's rows (128) fill a block; the other matrices' (64) take 8-bit state
        assert kinds == {"4bit", "8bit", "32bit"}
    checkpoint = tmp_path / "full" / optim / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").exists()
    resumed = Trainer(model=tiny_llama(seed=99), args=training_args(tmp_path / "resumed" / optim, optim=optim, **options),
                      train_dataset=token_dataset())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert torch.equal(flat_params(resumed.model), flat_params(uninterrupted.model))
    state = resumed.optimizer.state_dict()["state"]
    reference = uninterrupted.optimizer.state_dict()["state"]
    for index in reference:
        for key in reference[index]:
            assert torch.equal(state[index][key], reference[index][key])


def test_save_only_model_and_8bit_checkpoint_size(tmp_path):
    sizes = {}
    for optim in ("hf_paged_adamw_32bit", "hf_paged_adamw_8bit", "hf_paged_adamw_4bit"):
        quantized_embeddings = None if optim.endswith("32bit") else "fp32_embeddings=false"
        # hidden 128: no matrix's rows are shorter than a block of 4-bit state (128), which would keep 8-bit state
        model = tiny_llama(hidden_size=128, intermediate_size=256)
        fit(tmp_path, optim, model, max_steps=2, save_strategy="steps", save_steps=2, optim_args=quantized_embeddings)
        sizes[optim] = os.path.getsize(tmp_path / optim / "checkpoint-2" / "optimizer.pt")
    assert 0.2 < sizes["hf_paged_adamw_8bit"] / sizes["hf_paged_adamw_32bit"] < 0.35
    assert sizes["hf_paged_adamw_4bit"] / sizes["hf_paged_adamw_8bit"] < 0.6
    fit(tmp_path / "only", "hf_paged_adamw_8bit", max_steps=2, save_strategy="steps", save_steps=2, save_only_model=True)
    checkpoint = tmp_path / "only" / "hf_paged_adamw_8bit" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").exists() and not (checkpoint / "optimizer.pt").exists()


def run_script(*args, env=None):
    command = [sys.executable, "-m", "hf_paged.run", os.path.join(REPO, "tests", "scripts", "train_unmodified.py"), *args]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")]), **(env or {})}
    return subprocess.run(command, check=False, capture_output=True, text=True, env=environment, timeout=300)


def test_runner_registers_names_for_unmodified_scripts(tmp_path):
    result = run_script("--output_dir", str(tmp_path), "--optim", "hf_paged_adamw_8bit", "--max_steps", "2")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["optimizer"] == "PagedAdamW8bit"


def test_runner_replaces_bitsandbytes_names_only_when_asked(tmp_path):
    """With and without ``HF_PAGED_REPLACE_BITSANDBYTES=1``, the two scripts run side by side (one thread each)."""
    arguments = ["--optim", "paged_adamw_8bit", "--max_steps", "1"]
    one_thread = {"OMP_NUM_THREADS": "1"}
    with ThreadPoolExecutor(2) as pool:
        replacing = pool.submit(
            run_script, "--output_dir", str(tmp_path / "replaced"), *arguments,
            env={**one_thread, "HF_PAGED_REPLACE_BITSANDBYTES": "1"},
        )  # fmt: skip
        by_default = pool.submit(run_script, "--output_dir", str(tmp_path / "default"), *arguments, env=one_thread)
        replaced, default = replacing.result(), by_default.result()
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads(replaced.stdout.strip().splitlines()[-1])["optimizer"] == "PagedAdamW8bit"
    assert replaced.stderr.count("now select hf-paged optimizers") == 1
    assert default.returncode == 0, default.stderr
    assert json.loads(default.stdout.strip().splitlines()[-1])["optimizer"] != "PagedAdamW8bit"


@pytest.mark.parametrize(
    "ending",
    [
        pytest.param("", id="returns"),
        pytest.param("import sys\nsys.exit(0)\n", id="exit-0", marks=pytest.mark.slow),  # the path of sys.exit()
        pytest.param("import sys\nsys.exit()\n", id="exit"),
    ],
)
def test_runner_ends_the_process_group_a_script_leaves_open(tmp_path, ending):
    """As PyTorch asks of a program before it exits (the ranks meet first, so none tears down a live peer); then the
    runner ends the process after its exit handlers, without the interpreter's finalization (hf_paged/process_exit.py),
    with status 0: whether the script returns or ends with ``sys.exit(main())`` as example scripts do."""
    script = tmp_path / "leaves_a_group.py"
    script.write_text(
        "import atexit\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "atexit.register(lambda: print('initialized at exit:', dist.is_initialized(), flush=True))\n" + ending
    )
    code = (
        "import sys\n"
        "from hf_paged.run import main\n"
        "main(sys.argv[1:])\n"
        "print('main returned')\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(script)], check=False, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["initialized at exit: False"]


def test_runner_keeps_a_failing_scripts_exit_status(tmp_path):
    """A script that exits with an error status is not taken for one that finished: the runner does not wait for the
    other ranks (which may never arrive), and the status reaches the launcher."""
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    result = subprocess.run([sys.executable, "-m", "hf_paged.run", str(script)], check=False, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": REPO, "WORLD_SIZE": "2"}, timeout=120)
    assert result.returncode == 3, result.stderr


def test_runner_leaves_transformers_to_the_script(tmp_path):
    """The names are registered by the import hook as the script loads transformers; a script that does not load it
    (a launcher's helper, a failing script) is not made to wait for transformers, peft and their integrations."""
    script = tmp_path / "no_transformers.py"
    script.write_text("import sys\nprint(sorted(set(sys.modules) & {'transformers', 'peft', 'torchao'}))\n")
    result = subprocess.run([sys.executable, "-m", "hf_paged.run", str(script)], check=False, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": REPO}, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]"]


def test_runner_without_a_script_explains_usage():
    result = subprocess.run([sys.executable, "-m", "hf_paged.run"], check=False, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 2 and "SCRIPT.py" in result.stdout


def test_grad_scaler_skips_the_step_on_overflow_and_leaves_state_untouched():
    model = tiny_llama()
    optimizer = hf_paged.PagedAdamW8bit(model.parameters(), lr=1e-3, page_size="16KiB", device_budget="32KiB")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    batch = torch.stack([row["input_ids"] for row in token_dataset()[:4]])

    def backward():
        optimizer.zero_grad()
        scaler.scale(model(input_ids=batch, labels=batch).loss).backward()

    backward()
    scaler.step(optimizer)
    scaler.update()
    before_params = flat_params(model)
    before_state = optimizer.state_dict()["state"]
    backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    assert torch.equal(flat_params(model), before_params)
    after_state = optimizer.state_dict()["state"]
    for index, entry in before_state.items():
        for key, value in entry.items():
            assert torch.equal(after_state[index][key], value)
    backward()
    scaler.step(optimizer)
    assert not torch.equal(flat_params(model), before_params)


def test_trl_sft_config_accepts_the_names(tmp_path):
    trl = pytest.importorskip("trl")
    config = trl.SFTConfig(output_dir=str(tmp_path), optim="hf_paged_adamw_8bit", use_cpu=True, report_to=[])
    assert config.optim == "hf_paged_adamw_8bit"
    assert Trainer.get_optimizer_cls_and_kwargs(config)[0] is hf_paged.PagedAdamW8bit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 mixed precision needs a CUDA device")
def test_fp16_loss_scaling_on_cuda(tmp_path):
    trainer = Trainer(
        model=tiny_llama(),
        args=training_args(tmp_path, optim="hf_paged_adamw_8bit", fp16=True, use_cpu=False, max_steps=6,
                           optim_args="device_budget=48KiB,page_size=16KiB"),
        train_dataset=token_dataset(),
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert trainer.optimizer.optimizer.paging_stats()["page_outs"] > 0


def test_an_explicit_choice_of_replacing_bitsandbytes_wins_over_the_environment(tmp_path, monkeypatch):
    """``hf_paged.register(replace_bitsandbytes=False)`` keeps bitsandbytes' names for bitsandbytes where
    ``HF_PAGED_REPLACE_BITSANDBYTES=1`` is set, and ``True`` routes them where it is not."""
    pytest.importorskip("bitsandbytes")
    monkeypatch.setattr(trainer_integration, "_replace_choice", None)
    monkeypatch.setenv(trainer_integration.REPLACE_BITSANDBYTES_ENV, "1")
    hf_paged.register(replace_bitsandbytes=False)
    args = TrainingArguments(output_dir=str(tmp_path), optim="paged_adamw_8bit", optim_args="x=1", use_cpu=True)
    assert "bitsandbytes" in Trainer.get_optimizer_cls_and_kwargs(args)[0].__module__
    monkeypatch.delenv(trainer_integration.REPLACE_BITSANDBYTES_ENV)
    hf_paged.register(replace_bitsandbytes=True)
    args = TrainingArguments(output_dir=str(tmp_path), optim="paged_adamw_8bit", use_cpu=True)
    assert Trainer.get_optimizer_cls_and_kwargs(args)[0] is hf_paged.PagedAdamW8bit


def test_replacing_bitsandbytes_asked_after_the_imports_builds_what_was_checked(tmp_path, monkeypatch):
    """HF_PAGED_REPLACE_BITSANDBYTES=1 set once transformers' Trainer was imported: the arguments were checked as
    hf-paged's (``device_budget`` accepted) and the Trainer built bitsandbytes' AdamW, ignoring them; it now builds
    hf-paged's. Unset, bitsandbytes' names build bitsandbytes' optimizers as before."""
    pytest.importorskip("bitsandbytes")
    monkeypatch.setattr(trainer_integration, "_replace_choice", None)
    monkeypatch.delenv(trainer_integration.REPLACE_BITSANDBYTES_ENV, raising=False)
    args = TrainingArguments(output_dir=str(tmp_path), optim="paged_adamw_8bit", use_cpu=True)
    assert "bitsandbytes" in Trainer.get_optimizer_cls_and_kwargs(args)[0].__module__
    monkeypatch.setenv(trainer_integration.REPLACE_BITSANDBYTES_ENV, "1")
    settings = {"optim_args": "device_budget=1MiB,page_size=1MiB", "use_cpu": True}
    args = TrainingArguments(output_dir=str(tmp_path), optim="paged_adamw_8bit", **settings)
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert optimizer_cls is hf_paged.PagedAdamW8bit and kwargs["device_budget"] == 2**20
