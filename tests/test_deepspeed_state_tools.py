"""DeepSpeed's ``safe_get_full_optimizer_state``, ``safe_set_full_optimizer_state``,
``safe_get_local_optimizer_state`` and ``safe_set_local_optimizer_state`` on paged client optimizers under ZeRO 3,
2 and 1, and ZeRO-1 with bf16 parameters (DeepSpeed's ``BF16_Optimizer``).

One two-process launch (``torchrun``, gloo on the CPU) of ``tests/scripts/deepspeed_state_tools.py`` runs every
check under every stage for ``torch.optim.AdamW`` (the control) and paged AdamW with 32-bit, 8-bit and 4-bit
state; the tests read what each rank found. Before hf-paged served these tools, they raised ``KeyError:
'exp_avg'`` (ZeRO-3) or ``ValueError: exp_avg not found in optimizer state fragment`` (ZeRO-1 and 2) for a paged
client; under ``BF16_Optimizer`` they still raised the latter until hf-paged wrapped its parameter links too.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "scripts", "deepspeed_state_tools.py")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (pip install deepspeed)"
)

STAGES = ["zero3", "zero2", "zero1", "zero1_bf16"]
CONFIGS = ["adamw_torch", "adamw_32bit", "adamw_8bit", "adamw_4bit"]
CHECKS = {
    "zero3": ["full_vs_saved", "local_vs_saved", "full_after_set", "local_after_set", "saved_after_set"],
    "zero2": ["full_vs_saved", "full_after_set", "saved_after_set"],
    "zero1": ["full_vs_saved", "full_after_set", "saved_after_set"],
    "zero1_bf16": ["full_vs_saved", "full_after_set", "saved_after_set"],
}
"""The checks of each stage (DeepSpeed's local tools are for ZeRO-3 only)."""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of the two ranks found, by configuration."""
    output = tmp_path_factory.mktemp("deepspeed_state_tools") / "result.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT]
    environment = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*command, "--output", str(output)], check=False, capture_output=True, text=True, env=environment, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    summary = torch.load(output, weights_only=True)
    assert summary["world_size"] == 2
    return summary["ranks"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", CONFIGS)
def test_the_state_tools_answer_for_every_parameter_with_the_saved_state(ranks, stage, name):
    """Every parameter's local and full ``exp_avg`` and ``exp_avg_sq`` equal the state the engine saves, decoded
    by the client's codec (8-bit and 4-bit codes and scales), on both ranks; writes through
    ``safe_set_full_optimizer_state`` and ``safe_set_local_optimizer_state`` read back as the codec re-encodes
    them, and the saved state follows."""
    for rank, found in enumerate(ranks):
        result = found[f"{stage}/{name}"]
        assert "errors" not in result, f"rank {rank}: {result.get('errors', [])[:2]}"
        assert result["answered"] == result["parameters"] == 6
        assert result["differences"] == dict.fromkeys(CHECKS[stage], 0.0), f"rank {rank}"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", ["adamw_32bit", "adamw_8bit", "adamw_4bit"])
def test_the_paged_state_leaves_only_the_step_in_optimizer_state(ranks, stage, name):
    """The decoded state is in ``optimizer.state`` (ZeRO-3) or the fragment mappings (ZeRO-1 and 2) only during
    DeepSpeed's call: afterwards only ``step``, and no fragment."""
    for found in ranks:
        assert found[f"{stage}/{name}"]["state_keys"] == ["step"]
        assert found[f"{stage}/{name}"]["fragment_keys"] == []


@pytest.mark.parametrize("stage", STAGES)
def test_the_paged_32bit_state_and_the_step_after_writing_it_match_torch_adamw(ranks, stage):
    """Paged 32-bit AdamW: the full states the tools read after training, and the weights after one
    more step from the written states, match ``torch.optim.AdamW`` (the step used the written state)."""
    for found in ranks:
        paged, control = found[f"{stage}/adamw_32bit"], found[f"{stage}/adamw_torch"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert len(paged["full"][key]) == len(control["full"][key]) == 6
            for paged_state, torch_state in zip(paged["full"][key], control["full"][key]):
                torch.testing.assert_close(paged_state, torch_state, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(paged["weights_after_set"], control["weights_after_set"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_4bit"])
def test_the_decoded_quantized_state_approximates_torch_adamw(ranks, stage, name):
    """The 8-bit and 4-bit moments the tools decode are those of AdamW, within the codecs' quantization."""
    tolerance = {"adamw_8bit": 0.02, "adamw_4bit": 0.2}[name]
    for found in ranks:
        for key in ("exp_avg", "exp_avg_sq"):
            decoded = torch.cat(found[f"{stage}/{name}"]["full"][key])
            reference = torch.cat(found[f"{stage}/adamw_torch"]["full"][key])
            assert (decoded - reference).norm() <= tolerance * reference.norm(), key
