"""A user's script imports hf-paged and the Hugging Face stack in any order, each case in a fresh interpreter.

``import hf_paged`` installs an import hook that registers the optimizer names while a transformers module is
still half imported; what the hook loads then must not need the rest of transformers. Which module loads
transformers first decides the path, so every case is its own interpreter. After its two imports, each case
checks that the Trainer picks the hf-paged optimizer for ``optim="hf_paged_adamw_8bit"``.

Each case costs a fresh interpreter that loads transformers (seconds), so the default run takes a few cases
that reach every import once, and the slow run every pair in both orders.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

OURS = [
    "import hf_paged",
    "from hf_paged.callbacks import MemorySpikeCallback",
    "from hf_paged.integrations import enable_oom_recovery",
    "import hf_paged.run",
    "from hf_paged.cli import main",
]
"""The documented ways in: the package, the callbacks, the integrations, the runner, the command line."""

THEIRS = [
    "from transformers import TrainerCallback",
    "import transformers.trainer_callback",
    "from transformers import TrainingArguments",
    "from transformers import Trainer",
    "from transformers import AutoModelForCausalLM",
    "from trl import SFTTrainer",
    "from peft import LoraConfig, get_peft_model",
    "from accelerate import Accelerator",
]
"""Public imports of transformers, TRL, peft and accelerate that a training script makes."""

CHECK = """
import tempfile
import hf_paged
from transformers import Trainer, TrainingArguments
with tempfile.TemporaryDirectory() as output_dir:
    args = TrainingArguments(output_dir=output_dir, optim="hf_paged_adamw_8bit", report_to="none")
optimizer_cls, _ = Trainer.get_optimizer_cls_and_kwargs(args)
assert optimizer_cls is hf_paged.PagedAdamW8bit, optimizer_cls
"""


DEFAULT_CASES = [
    ("import hf_paged", "from transformers import TrainerCallback"),
    ("from hf_paged.callbacks import MemorySpikeCallback", "from transformers import Trainer"),
    ("import hf_paged", "import transformers.trainer_callback"),
    ("from hf_paged.integrations import enable_oom_recovery", "from trl import SFTTrainer"),
    ("import hf_paged.run", "from peft import LoraConfig, get_peft_model"),
    ("from transformers import TrainingArguments", "import hf_paged"),
    ("from transformers import AutoModelForCausalLM", "from hf_paged.callbacks import MemorySpikeCallback"),
    ("from accelerate import Accelerator", "from hf_paged.cli import main"),
]
"""The default run's cases: the issue's three reproducers, then every import of ours and theirs at least once,
in both orders (the slow run takes every pair)."""


def _every_case() -> list[tuple[str, str]]:
    pairs = list(itertools.product(OURS, THEIRS))
    return pairs + [(theirs, ours) for ours, theirs in pairs]


def _run(first: str, second: str) -> tuple[str, str, subprocess.CompletedProcess]:
    code = f"{first}\n{second}\n{CHECK}"
    environment = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    command = [sys.executable, "-c", code]
    completed = subprocess.run(command, check=False, capture_output=True, text=True, env=environment, timeout=300)
    return first, second, completed


def _assert_all_import(cases: list[tuple[str, str]]) -> None:
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda case: _run(*case), cases))
    failures = [
        f"{first}; {second}  ->  exit {completed.returncode}: {completed.stderr.strip()[-300:]}"
        for first, second, completed in results
        if completed.returncode != 0
    ]
    assert not failures, "imports that fail in a fresh interpreter:\n" + "\n".join(failures)


def test_the_default_cases_reach_every_import_in_both_orders():
    imports = {module for case in DEFAULT_CASES for module in case}
    assert imports == set(OURS) | set(THEIRS)
    assert any(first in OURS for first, _ in DEFAULT_CASES) and any(first in THEIRS for first, _ in DEFAULT_CASES)


def test_imports_work_in_either_order():
    _assert_all_import(DEFAULT_CASES)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 80 interpreters that each load transformers: minutes on two cores
def test_every_pair_of_imports_works_in_either_order():
    _assert_all_import(_every_case())


def test_a_module_looked_up_before_it_is_imported_is_still_registered():
    """``importlib.util.find_spec`` of a module the hook waits for, without importing it (as availability checks do),
    left the hook without it: the names were never registered when the module was imported afterwards."""
    lookup = "import importlib.util\n" + "\n".join(
        f"importlib.util.find_spec({module!r})"
        for module in ("transformers.training_args", "transformers.trainer_optimizer", "transformers.trainer")
    )
    _assert_all_import([("import hf_paged", lookup)])


def test_dir_lists_the_names_loaded_at_first_use():
    """``dir(hf_paged)`` (and so completion) lists every public name, those loaded at first use too."""
    import hf_paged

    assert {"MemorySpikeCallback", "plan", "MemoryPlan"} <= set(hf_paged.__all__) <= set(dir(hf_paged))
