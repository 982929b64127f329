"""The ``hf-paged`` command: the default fine-tune end to end, configs and overrides, ``env``, the notebook."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.version import Version
from test_examples import unwanted_lines

from hf_paged.cli import main
from hf_paged.cli.config import ConfigError, apply_override, default_config, load_config, to_dict, update
from hf_paged.cli.tokenizer import byte_tokenizer
from hf_paged.cli.train import IGNORE_INDEX, SHIPPED_DATA, load_records, tokenize, training_arguments
from hf_paged.integrations.trainer import OPTIMIZER_NAMES

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
FAST = [
    "--set",
    "training.optim_args=device_budget=auto,page_size=64KiB,min_8bit_size=1024,compiled=false",
    "--set",
    "training.disable_tqdm=true",
]
"""Overrides for runs that only check mechanics: no kernel compilation, no progress bar."""


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache")}


def _losses(output_dir: Path) -> list[float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


# The default run, once for the module -----------------------------------------------------------------


NETWORK_GUARD = """
import sys, traceback

def _record(event, args):
    if event in ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname"):
        with open({path!r}, "a") as attempts:
            stack = [f"{{frame.filename}}:{{frame.lineno}}" for frame in traceback.extract_stack()]
            attempts.write(f"{{event}} {{args[:2]}} from {{' <- '.join(reversed(stack[-12:-1]))}}\\n")

sys.addaudithook(_record)
"""
"""A ``sitecustomize`` that records every attempt of the process to reach the network, in a file."""


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """``hf-paged train`` with no config, as a subprocess, as a user runs it: the Hub's offline variables unset, and
    every attempt to reach the network recorded (``network_attempts.txt`` in the output's parent)."""
    tmp_path = tmp_path_factory.mktemp("default-run")
    output_dir = tmp_path / "out"
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(NETWORK_GUARD.format(path=str(tmp_path / "network_attempts.txt")))
    environment = {key: value for key, value in _env(tmp_path).items() if key not in OFFLINE}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(guard), environment.get("PYTHONPATH")]))
    completed = subprocess.run(
        ["hf-paged", "train", "--output-dir", str(output_dir)],
        check=False,
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=540,
    )
    return completed, output_dir


def test_default_run_reaches_no_network(default_run):
    """The default run needs nothing from the network and asks nothing of it: not bitsandbytes' kernel lookup on
    the Hub when it is imported, not datasets' count of a load."""
    completed, output_dir = default_run
    assert completed.returncode == 0, completed.stderr[-4000:]
    attempts = output_dir.parent / "network_attempts.txt"
    assert not attempts.exists(), attempts.read_text()


def test_hub_offline_restores_the_flags_and_environment_it_set(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    from hf_paged.cli.sources import hub_offline

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with hub_offline():
        assert huggingface_hub.constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
        assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert not huggingface_hub.constants.HF_HUB_OFFLINE and not datasets.config.HF_HUB_OFFLINE
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["HF_DATASETS_OFFLINE"] == "0"


def test_default_run_succeeds_and_the_loss_falls(default_run):
    completed, output_dir = default_run
    assert completed.returncode == 0, completed.stderr[-4000:]
    losses = _losses(output_dir)
    assert len(losses) == 17  # step 1, then every 10 of 160 steps
    assert losses[0] / losses[-1] > 2.5, losses
    match = re.search(r"loss\s+([\d.]+) -> ([\d.]+)", completed.stdout)
    assert match, completed.stdout
    assert float(match.group(1)) == pytest.approx(losses[0], abs=1e-4)
    assert float(match.group(2)) == pytest.approx(losses[-1], abs=1e-4)
    assert "160/160" in completed.stderr  # the Trainer's progress bar


def test_default_run_prints_no_warning_the_user_cannot_act_on(default_run):
    """No third-party warning, failed optional load or deprecation notice reaches a user of the default run."""
    completed, _ = default_run
    assert completed.returncode == 0, completed.stderr[-4000:]
    noise = re.compile(r"warning|failed to load|deprecat", re.IGNORECASE)
    lines = (completed.stdout + completed.stderr).splitlines()
    assert [line for line in lines if noise.search(line) and not line.startswith("hf-paged")] == []


def _readme_transcript() -> list[str]:
    """The lines of the README's "What you should see" block of the quick start."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return readme.split("What you should see", 1)[1].split("```text\n", 1)[1].split("```", 1)[0].splitlines()


def test_the_readme_shows_what_the_default_run_prints(default_run):
    """The quick start's transcript is this run's, trimmed: hf-paged's lines, the data's progress bars by name, the
    keys of the Trainer's first log line, the training metrics and the summary's rows, in the order printed."""
    completed, _ = default_run
    transcript = _readme_transcript()
    printed = [line.strip() for line in re.split(r"[\r\n]", completed.stdout + completed.stderr) if line.strip()]
    said = [line for line in transcript if line.startswith("hf-paged:")]
    assert said == [line for line in completed.stdout.splitlines() if line.startswith("hf-paged:")]
    bars = [line.split(":", 1)[0] for line in transcript[1:] if re.search(r"\d examples/s\]$", line)]
    assert bars == ["Generating train split", "tokenizing", "keeping examples with a labelled token"]
    assert all(any(line.startswith(f"{bar}: ") and "285" in line for line in printed) for bar in bars)
    logs = [ast.literal_eval(line) for line in completed.stdout.splitlines() if line.startswith("{'")]
    shown = [line for line in transcript if line.startswith("{'")]
    first_keys = re.findall(r"'([\w/]+)': ", shown[0])
    assert set(first_keys) <= set(logs[0]) and first_keys[:2] == ["loss", "grad_norm"]
    assert list(ast.literal_eval(shown[-1])) == list(logs[-1])  # train_runtime ... epoch, shown whole
    assert re.search(r"^100%\|\S+\| 160/160 ", transcript[transcript.index("hf-paged train summary") - 1])
    rows = transcript[transcript.index("hf-paged train summary") + 1 :]
    summary = completed.stdout.split("hf-paged train summary\n", 1)[1].splitlines()
    assert [re.split(r"\s{2,}", row.strip())[0] for row in rows] == [
        re.split(r"\s{2,}", row.strip())[0] for row in summary
    ]


def test_quiet_drops_only_the_messages_it_names(caplog):
    from hf_paged.cli import quiet

    quiet.install()
    quiet.install()  # idempotent: one filter per logger
    bitsandbytes = logging.getLogger("bitsandbytes.backends.cpu.ops")
    try:
        assert len(bitsandbytes.filters) == 1
        with caplog.at_level(logging.WARNING, logger="bitsandbytes.backends.cpu.ops"):
            bitsandbytes.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "offline")
            bitsandbytes.warning("Failed to load CPU gemv")
        assert [record.getMessage() for record in caplog.records] == ["Failed to load CPU gemv"]
        assert quiet.notes() == [
            "4-bit matmuls use bitsandbytes' portable CPU path (its optional fast kernel is not installed)"
        ]
    finally:
        for name, message_filter in quiet._FILTERS.items():
            logging.getLogger(name).removeFilter(message_filter)
            message_filter.dropped = 0


def test_default_run_writes_a_trained_adapter_and_tokenizer(default_run):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    _, output_dir = default_run
    weights = load_file(output_dir / "adapter_model.safetensors")
    lora_b = [tensor for name, tensor in weights.items() if "lora_B" in name]
    assert lora_b and len(lora_b) == len([name for name in weights if "lora_A" in name])
    assert all(tensor.abs().max() > 0 for tensor in lora_b)  # initialised to zero, so trained
    adapter_config = json.loads((output_dir / "adapter_config.json").read_text())
    assert adapter_config["r"] == 16
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert tokenizer("hé")["input_ids"] == [byte + 3 for byte in "hé".encode()]


def test_default_run_writes_the_memory_timeline_and_summary(default_run):
    from PIL import Image

    completed, output_dir = default_run
    summary = json.loads((output_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (output_dir / "memory_timeline.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 161))
    assert summary["steps"] == 160
    assert summary["timeline_path"] == str(output_dir / "memory_timeline.jsonl")
    assert summary["forward_backward_peak_bytes"] == max(row["forward_backward_peak"] for row in rows)
    assert summary["optimizer_device_bytes"] > 0
    # paging at work: every step after the first brings state in and writes it back, under the budget
    assert summary["pages_total"] > 2 and summary["device_budget"] < summary["pages_total"] * summary["page_size"]
    assert all(row["page_ins"] > 0 and row["page_outs"] > 0 for row in rows[1:])
    assert all(row["state_bytes_after_step"] <= row["device_budget"] for row in rows)
    assert summary["bytes_to_device"] == sum(row["bytes_to_device"] for row in rows) > 0
    assert summary["bytes_to_host"] == sum(row["bytes_to_host"] for row in rows) > 0
    assert summary["oom_recoveries"] == 0 and "oom recoveries   0" in completed.stdout
    assert re.search(r"moved\s+[\d.]+ [KM]iB to the device in [\d,]+ page-ins", completed.stdout), completed.stdout
    with Image.open(output_dir / "memory_timeline.png") as image:
        assert image.format == "PNG" and image.width > 100
    for path in (summary["adapter_path"], summary["timeline_path"], summary["plot_path"]):
        assert f"  {path}\n" in completed.stdout + "\n"


# Mechanics with few steps ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "final", "said"),
    [(6.0, 2.0, ", 3.0x lower"), (2.0, 4.0, ", 2.0x higher"), (6.0644, 6.0644, ""), (6.0, 6.01, ""), (1.0, 0.0, "")],
)
def test_summary_says_how_the_loss_changed(first, final, said):
    from hf_paged.cli.train import _loss_change

    assert _loss_change(first, final) == said


def test_set_overrides_reach_the_run(tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"q": f"say {word}", "a": word}) + "\n" for word in ("red", "blue", "green")))
    output_dir = tmp_path / "out"
    status = main(
        [
            "train",
            *FAST,
            "--set", "training.max_steps=3",
            "--set", "training.logging_steps=1",
            "--set", "lora.quantize=false",
            "--set", "lora.r=4",
            "--set", "lora.target_modules=[q_proj, v_proj]",
            "--set", f"data.path={data}",
            "--set", "data.instruction_field=q",
            "--set", "data.response_field=a",
            "--set", "memory.enabled=false",
            "--output-dir", str(output_dir),
        ]
    )  # fmt: skip
    assert status == 0
    printed = capsys.readouterr().out
    assert "tiny with LoRA on cpu" in printed and "memory timeline  not written" in printed
    assert len(_losses(output_dir)) == 3
    adapter_config = json.loads((output_dir / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and sorted(adapter_config["target_modules"]) == ["q_proj", "v_proj"]
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["examples"] == 3 and summary["trainable_params"] < 69_632
    assert not (output_dir / "memory_timeline.jsonl").exists()
    saved = yaml.safe_load((output_dir / "config.yaml").read_text())
    assert saved["lora"]["quantize"] is False and saved["data"]["instruction_field"] == "q"


def test_simulated_spike_is_recovered_and_reported(tmp_path, capsys, caplog):
    output_dir = tmp_path / "out"
    overrides = [
        "training.optim_args=device_budget=32KiB,page_size=16KiB,min_8bit_size=1024,compiled=false",
        "training.disable_tqdm=true",
        "training.max_steps=3",
        "training.logging_steps=1",
        "memory.simulate_spike_at=2",
        "memory.plot=false",
    ]
    with caplog.at_level("WARNING"):
        assert main(["train", *(f"--set={override}" for override in overrides), "--output-dir", str(output_dir)]) == 0
    printed = capsys.readouterr().out
    assert "oom recoveries   1 (step 2): state moved to the host, step replayed" in printed
    (warning,) = [record.message for record in caplog.records if "out of memory" in record.message]
    assert "step 2 (micro-batch 1)" in warning
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["oom_recoveries"] == 1 and summary["oom_recovery_steps"] == [2]
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert [entry["memory/oom_recoveries"] for entry in state["log_history"] if "loss" in entry] == [0, 1, 1]


def test_a_seed_gives_the_same_run(tmp_path):
    from safetensors.torch import load_file

    from hf_paged.cli.train import run

    weights = []
    for name in ("first", "second"):
        overrides = ["training.max_steps=2", "memory.enabled=false", f"training.output_dir={tmp_path / name}"]
        summary = run(load_config(overrides=overrides + [item for item in FAST if item != "--set"]))
        weights.append(load_file(summary["adapter_path"]))
    assert weights[0].keys() == weights[1].keys()
    assert all(weights[0][key].equal(weights[1][key]) for key in weights[0])


def test_quant_storage_in_bfloat16_trains_as_uint8_does(tmp_path):
    """``lora.quant_storage=bfloat16`` builds 4-bit weights stored in bfloat16 (what FSDP2 and ZeRO-3 shard) over the
    same codes, and training gives the losses and adapter of uint8 storage, bitwise."""
    import bitsandbytes as bnb
    import torch
    from safetensors.torch import load_file

    from hf_paged.cli.train import build_model, run

    fast = [item for item in FAST if item != "--set"]
    config = load_config(overrides=[*fast, "lora.quant_storage=bfloat16"])
    model = build_model(config, byte_tokenizer(), torch.device("cpu"))
    weights = [module.weight for module in model.modules() if isinstance(module, bnb.nn.Linear4bit)]
    assert weights and all(type(w) is bnb.nn.Params4bit and w.dtype == torch.bfloat16 for w in weights)
    assert model.config.quantization_config.bnb_4bit_quant_storage == torch.bfloat16
    summaries = {}
    for storage in ("uint8", "bfloat16"):
        overrides = ["training.max_steps=3", "training.logging_steps=1", "memory.enabled=false"]
        overrides += [f"lora.quant_storage={storage}", f"training.output_dir={tmp_path / storage}"]
        summaries[storage] = run(load_config(overrides=[*fast, *overrides]))
    assert summaries["uint8"]["total_params"] == summaries["bfloat16"]["total_params"]
    losses = _losses(tmp_path / "uint8")
    assert len(losses) == 3 and _losses(tmp_path / "bfloat16") == losses
    expected, got = (load_file(summaries[storage]["adapter_path"]) for storage in ("uint8", "bfloat16"))
    assert expected.keys() == got.keys() and all(expected[key].equal(got[key]) for key in expected)


def test_resume_from_checkpoint_continues_the_saved_run(tmp_path, capsys):
    """``training.resume_from_checkpoint`` reaches ``Trainer.train``: resumed from step 2 of a 4-step run, under
    another seed (which a run from scratch would initialise its adapters from; the data's order has its own seed), the
    run ends with the uninterrupted run's adapter and losses bitwise."""
    from safetensors.torch import load_file

    from hf_paged.cli.train import run

    def train(name: str, *overrides: str) -> dict:
        fixed = ["training.max_steps=4", "training.logging_steps=1", "training.data_seed=42", "memory.enabled=false"]
        fast = [item for item in FAST if item != "--set"]
        return run(load_config(overrides=[*fixed, *fast, f"training.output_dir={tmp_path / name}", *overrides]))

    whole = train("whole", "training.save_strategy=steps", "training.save_steps=2")
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    resumed = train("resumed", "training.seed=7", f"training.resume_from_checkpoint={checkpoint}")
    expected, got = load_file(whole["adapter_path"]), load_file(resumed["adapter_path"])
    assert expected.keys() == got.keys() and all(expected[key].equal(got[key]) for key in expected)
    assert resumed["steps"] == 4 and _losses(tmp_path / "resumed") == _losses(tmp_path / "whole")
    assert f"resuming from {checkpoint}" in capsys.readouterr().out


def test_resume_from_a_folder_that_is_no_checkpoint_is_a_config_error(tmp_path, capsys):
    for path, found in ((tmp_path / "missing", "no such folder"), (tmp_path, "a folder without trainer_state.json")):
        assert main(["train", "--set", f"training.resume_from_checkpoint={path}", "--output-dir", str(tmp_path)]) == 2
        assert f"training.resume_from_checkpoint: {str(path)!r} is {found}" in capsys.readouterr().err


def test_adamw_4bit_from_a_config(tmp_path):
    from hf_paged.cli.train import run

    overrides = [
        "training.max_steps=2",
        "memory.enabled=false",
        f"training.output_dir={tmp_path}",
        "training.disable_tqdm=true",
        "training.logging_steps=1",
        "training.optim=hf_paged_adamw_4bit",
        "training.optim_args=device_budget=auto,page_size=64KiB,min_4bit_size=1024,compiled=false",
    ]
    summary = run(load_config(overrides=overrides))
    assert summary["optimizer"] == "hf_paged_adamw_4bit"
    assert len(_losses(tmp_path)) == 2


def test_plain_text_file_trains_on_every_token(tmp_path):
    text = tmp_path / "lines.txt"
    text.write_text("the cat sat\nthe dog ran\n")
    config = load_config(overrides=[f"data.path={text}"])
    dataset = tokenize(load_records(config.data), config, byte_tokenizer())
    assert [row["labels"] for row in dataset] == [row["input_ids"] for row in dataset]
    assert dataset[0]["input_ids"] == [byte + 3 for byte in b"the cat sat"] + [2]


def test_typo_in_set_names_the_nearest_key(capsys):
    assert main(["train", "--set", "lora.rr=8"]) == 2
    error = capsys.readouterr().err
    assert "unknown key 'lora.rr' in --set lora.rr=8" in error and "did you mean 'lora.r'?" in error
    assert main(["train", "--set", "training.learnig_rate=0.1"]) == 2
    assert "did you mean 'training.learning_rate'?" in capsys.readouterr().err


@pytest.mark.parametrize("quantize", [True, False])
def test_lora_targets_that_match_nothing_are_a_config_error(tmp_path, capsys, quantize):
    """An empty list at once; a name no module has once the model is built (QLoRA and LoRA alike): one error line
    naming ``lora.target_modules`` and exit status 2, not a traceback."""
    assert main(["train", "--set", "lora.target_modules=[]", "--output-dir", str(tmp_path)]) == 2
    assert "lora.target_modules in --set lora.target_modules=[] must be 'all-linear'" in capsys.readouterr().err
    overrides = ["lora.target_modules=[q_proj, bogus_proj]", f"lora.quantize={str(quantize).lower()}", *FAST[1::2]]
    status = main(["train", *(f"--set={item}" for item in overrides), "--output-dir", str(tmp_path)])
    error = capsys.readouterr().err
    assert status == 2 and error.startswith("hf-paged: error: lora.target_modules: 'bogus_proj' matches no module")
    assert "Traceback" not in error


PEFT_ADAPTS_EXPERTS_UNDER_QLORA = Version(importlib.metadata.version("peft")) >= Version("0.22")


@pytest.mark.parametrize(
    "method",
    [
        "lora",
        pytest.param(
            "qlora",
            marks=pytest.mark.skipif(
                not PEFT_ADAPTS_EXPERTS_UNDER_QLORA, reason="peft adapts experts' 3D weights under QLoRA from 0.22"
            ),
        ),
    ],
)
def test_adapters_peft_refuses_are_a_config_error(tmp_path, capsys, method):
    """peft's adapters of a mixture of experts' 3D weights refuse ``lora_dropout`` (LoRA's, and QLoRA's from peft
    0.22): ``hf-paged train`` names ``lora.lora_dropout`` with peft's reason and the value that works, and exits with
    status 2, as ``hf-paged plan`` does, not with peft's traceback."""
    import transformers

    sizes = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}
    config = transformers.MixtralConfig(vocab_size=259, num_hidden_layers=1, num_local_experts=2, **sizes)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "model")
    capsys.readouterr()
    overrides = [f"model.name={tmp_path / 'model'}", "tokenizer.name=byte", f"lora.quantize={method == 'qlora'}"]
    overrides += ["lora.target_modules=all-linear", "lora.lora_dropout=0.05", *FAST[1::2]]
    status = main(["train", *(f"--set={item}" for item in overrides), "--output-dir", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert status == 2 and "Traceback" not in error, error
    last = error.splitlines()[-1]
    assert last.startswith(f"hf-paged: error: lora.lora_dropout: {method} of "), error
    assert "lora_dropout != 0" in last and last.endswith("set lora.lora_dropout=0"), error


def test_a_model_that_is_not_a_causal_lm_is_a_config_error_naming_the_model(tmp_path, capsys):
    """A saved T5 (an encoder-decoder) for LoRA: ``model.name`` with transformers' reason and status 2, not
    ``lora`` (the adapters were never reached) nor a traceback."""
    import transformers

    config = transformers.T5Config(vocab_size=259, d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "model")
    capsys.readouterr()
    overrides = [f"model.name={tmp_path / 'model'}", "tokenizer.name=byte", "lora.quantize=false", *FAST[1::2]]
    status = main(["train", *(f"--set={item}" for item in overrides), "--output-dir", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert status == 2 and "Traceback" not in error, error
    assert error.splitlines()[-1].startswith("hf-paged: error: model.name: "), error
    assert "cannot be loaded as a causal LM" in error, error


def test_typo_in_yaml_names_the_nearest_key_at_any_depth(tmp_path):
    cases = {
        "model:\n  tiny:\n    hiden_size: 64\n": ("model.tiny.hiden_size", "model.tiny.hidden_size"),
        "trainng:\n  max_steps: 3\n": ("trainng", "training"),
        "training:\n  per_device_train_batchsize: 2\n": (
            "training.per_device_train_batchsize",
            "training.per_device_train_batch_size",
        ),
        "memory:\n  spike_margn: 0.2\n": ("memory.spike_margn", "memory.spike_margin"),
    }
    for text, (wrong, nearest) in cases.items():
        path = tmp_path / "config.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError) as raised:
            load_config(path)
        assert f"unknown key {wrong!r} in {path}" in str(raised.value)
        assert f"did you mean {nearest!r}?" in str(raised.value)


def test_wrong_types_and_values_are_named():
    config = default_config()
    cases = {
        "lora.r=abc": "lora.r in --set lora.r=abc must be an integer, got 'abc'",
        "lora.quant_type=nf5": "must be one of 'nf4', 'fp4', got 'nf5'",
        "lora.quant_storage=int4": "lora.quant_storage in --set lora.quant_storage=int4 must be one of 'uint8', 'int8', "
        "'bfloat16', 'float16', 'float32', 'float64', got 'int4'",
        "lora.lora_dropout=1.5": "lora.lora_dropout in --set lora.lora_dropout=1.5 must be in [0, 1), got 1.5",
        "training.max_steps=ten": "training.max_steps in --set training.max_steps=ten must be an integer",
        "memory.plot=maybe": "memory.plot in --set memory.plot=maybe must be true or false",
        "model=tiny": "model in --set model=tiny must be a mapping",
        "lora.r": "--set expects dotted.key=value",
        "prompt.template=Q {instruction}": "prompt.template in --set prompt.template=Q {instruction} must contain "
        "{response}",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as raised:
            apply_override(config, override)
        assert message in str(raised.value)
    assert config == default_config()  # a rejected override changes nothing


def test_set_values_are_read_as_yaml():
    config = load_config(
        overrides=[
            "lora.target_modules=[q_proj, v_proj]",
            "training.learning_rate=2e-4",  # YAML 1.1 reads this as a string; the float field parses it
            "data.max_samples=null",
            "tokenizer.max_length=64",
            "training.optim_args=device_budget=256MiB,page_size=1MiB",
            "lora={r: 8, quantize: false}",
        ]
    )
    assert config.lora.target_modules == ["q_proj", "v_proj"]
    assert config.training["learning_rate"] == 2e-4
    assert config.data.max_samples is None and config.tokenizer.max_length == 64
    assert config.training["optim_args"] == "device_budget=256MiB,page_size=1MiB"
    assert (config.lora.r, config.lora.quantize, config.lora.lora_alpha) == (8, False, 32)
    assert config.training["max_steps"] == default_config().training["max_steps"]


def test_print_config_round_trips(tmp_path, capsys):
    assert main(["train", "--set", "lora.r=8", "--output-dir", "elsewhere", "--print-config"]) == 0
    path = tmp_path / "printed.yaml"
    path.write_text(capsys.readouterr().out)
    expected = load_config(overrides=["lora.r=8", "training.output_dir=elsewhere"])
    assert load_config(path) == expected
    assert to_dict(expected)["lora"]["r"] == 8


# Config files ---------------------------------------------------------------------------------------------


def test_default_yaml_is_the_built_in_default():
    assert load_config(ROOT / "configs" / "default.yaml") == default_config()


def test_qlora_7b_recipe_parses_and_validates():
    config = load_config(ROOT / "configs" / "qlora_7b_24gb.yaml")
    assert config.model.name == "meta-llama/Llama-2-7b-hf" and config.tokenizer.max_length == 2048
    assert config.lora.quantize and config.lora.gradient_checkpointing
    training = config.training
    assert training["per_device_train_batch_size"] in (1, 2) and training["gradient_accumulation_steps"] == 16
    assert training["bf16"] is True and training["optim"] == "hf_paged_adamw_8bit"
    assert "device_budget=" in training["optim_args"]
    # bf16 needs a GPU; with it off on this CPU every other TrainingArguments value is accepted as written.
    update(config, {"training": {"bf16": False, "use_cpu": True}}, source="test")
    args = training_arguments(config)
    assert args.optim == "hf_paged_adamw_8bit" and args.gradient_accumulation_steps == 16
    assert args.optim_args == training["optim_args"] and args.warmup_steps == 0.03


def test_bad_optim_args_are_a_config_error_before_anything_loads(tmp_path):
    config = default_config()
    update(
        config,
        {"training": {"output_dir": str(tmp_path / "out"), "optim_args": "device_budget=auto,budget=1GiB"}},
        source="test",
    )
    with pytest.raises(ConfigError, match=r"training: .*optim_args key 'budget' is not accepted by PagedAdamW8bit"):
        training_arguments(config)
    assert not (tmp_path / "out").exists()


# Data, prompt and tokenizer --------------------------------------------------------------------------------


def test_prompt_is_masked_unless_trained_on():
    from datasets import Dataset

    records = Dataset.from_list([{"instruction": "2+2?", "response": "4"}])
    tokenizer = byte_tokenizer()
    masked = tokenize(records, default_config(), tokenizer)[0]
    prompt = b"### Instruction:\n2+2?\n\n### Response:\n"
    assert masked["input_ids"] == [byte + 3 for byte in prompt + b"4"] + [tokenizer.eos_token_id]
    assert masked["labels"] == [IGNORE_INDEX] * len(prompt) + [ord("4") + 3, tokenizer.eos_token_id]
    on_prompt = tokenize(records, load_config(overrides=["prompt.train_on_prompt=true"]), tokenizer)[0]
    assert on_prompt["labels"] == on_prompt["input_ids"]
    short = tokenize(records, load_config(overrides=["tokenizer.max_length=38"]), tokenizer)[0]
    assert len(short["input_ids"]) == 38 == len(prompt) + 1 and short["labels"][-1] == ord("4") + 3


def test_bad_data_paths_are_named(tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ConfigError, match=f"data.path: no such file: '{missing}'"):
        load_records(load_config(overrides=[f"data.path={missing}"]).data)
    table = tmp_path / "table.xlsx"
    table.write_text("")
    with pytest.raises(ConfigError, match=r"suffix '.xlsx'; local files must be one of .csv, .json, .jsonl, .txt"):
        load_records(load_config(overrides=[f"data.path={table}"]).data)


@pytest.mark.parametrize(
    ("name", "content", "override", "message"),
    [
        ("empty.jsonl", "", None, r"data.path: cannot load '.*empty.jsonl': StopIteration: it holds no records"),
        ("empty.csv", "", None, r"data.path: cannot load '.*empty.csv': .*"),
        ("header.csv", "instruction,response\n", None, r"data.path: cannot load '.*header.csv' \(split 'train'\)"),
        ("nothing", None, None, r"data.path: cannot load '.*nothing': FileNotFoundError"),
        ("records.jsonl", '{"instruction": "a", "response": "b"}\n', "data.split=validation", r"data.split: .*validation"),
    ],
)
def test_data_that_cannot_be_loaded_is_named_with_its_key(tmp_path, name, content, override, message):
    """Before, each raised the datasets library's own error, with a traceback and exit status 1."""
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    overrides = [f"data.path={path}", *([override] if override else [])]
    with pytest.raises(ConfigError, match=message):
        load_records(load_config(overrides=overrides).data)


@pytest.mark.parametrize(
    ("name", "content", "key", "column"),
    [
        ("some.jsonl", '{"instruction": "a", "response": "b"}\n{"instruction": "c"}\n', "response_field", "response"),
        ("some.csv", "instruction,response\nhi,there\n,bar\n", "instruction_field", "instruction"),
    ],
)
def test_a_record_without_a_field_is_named_not_trained_on_as_none(tmp_path, name, content, key, column):
    """datasets gives a missing key or an empty CSV cell as None, which was trained on as the text "None"."""
    path = tmp_path / name
    path.write_text(content)
    config = load_config(overrides=[f"data.path={path}"])
    with pytest.raises(ConfigError, match=rf"data.{key}: example 1 of the data has no '{column}' \(missing or null\)"):
        tokenize(load_records(config.data), config, byte_tokenizer())


def test_missing_data_column_is_named():
    from datasets import Dataset

    records = Dataset.from_list([{"question": "2+2?", "answer": "4"}])
    with pytest.raises(
        ConfigError,
        match=r"data.instruction_field: the data has no column 'instruction' \(its columns: question, answer\)",
    ):
        tokenize(records, default_config(), byte_tokenizer())


def test_byte_tokenizer_round_trips_and_saves(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = byte_tokenizer()
    text = "Grüße, 12+3=15 ✓\n"
    ids = tokenizer(text)["input_ids"]
    assert ids == [byte + 3 for byte in text.encode()] and len(tokenizer) == 259
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == text
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(text)["input_ids"] == ids


def test_shipped_data_is_what_the_script_writes(tmp_path):
    out = tmp_path / "instructions.jsonl"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_instructions.py"), "--out", str(out)], check=True)
    assert out.read_bytes() == SHIPPED_DATA.read_bytes()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert 200 <= len(rows) <= 500 and all(set(row) == {"instruction", "response"} for row in rows)
    assert len({row["instruction"] for row in rows}) == len(rows)


# env and imports -------------------------------------------------------------------------------------------


def test_env_prints_versions_devices_and_optimizer_names(tmp_path):
    from hf_paged.device import HostMemory
    from hf_paged.sizes import format_size

    completed = subprocess.run(
        [sys.executable, "-m", "hf_paged.cli", "env"],
        check=False,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    out = completed.stdout
    for package in ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "datasets", "hf-paged"):
        assert re.search(
            rf"^{re.escape(package)}\s+{re.escape(importlib.metadata.version(package))}$", out, re.MULTILINE
        )
    assert f"{format_size(HostMemory().total())} total" in out.split("\n  cpu ", 1)[1].splitlines()[0]
    assert all(name in out for name in OPTIMIZER_NAMES)


def test_env_installs_the_filters_of_train_and_plan(tmp_path):
    """``hf-paged env`` keeps out what ``train`` and ``plan`` keep out: the stack it reports on (peft imports
    torchao, bitsandbytes asks for its optional CPU kernel), imported in its process, prints none of those lines."""
    code = "from hf_paged.cli import main; main(['env']); import peft, bitsandbytes"
    completed = subprocess.run(
        [sys.executable, "-c", code], check=False, env=_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    assert "optimizers (TrainingArguments optim=)" in completed.stdout
    assert unwanted_lines(completed.stdout + completed.stderr) == {}


def test_importing_hf_paged_leaves_the_cli_out():
    code = (
        "import sys, hf_paged; "
        "print(any(m.startswith('hf_paged.cli') for m in sys.modules), 'transformers' in sys.modules)"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert completed.stdout.split() == ["False", "False"]


# The notebook ----------------------------------------------------------------------------------------------


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    notebook_path = tmp_path / "quickstart.ipynb"
    shutil.copy(ROOT / "examples" / "quickstart.ipynb", notebook_path)
    notebook = nbformat.read(notebook_path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")  # stored clean
    NotebookClient(
        notebook, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    assert any("image/png" in output.get("data", {}) for output in outputs)
    assert (tmp_path / "quickstart-output" / "memory_timeline.png").is_file()
    text = "".join(output.get("text", "") for output in outputs)  # stdout and stderr streams
    assert "hf-paged train summary" in text
    assert unwanted_lines(text) == {}  # quiet.install() in the first cell, as in the example scripts
