"""The host kernels in every CPU capability this machine runs, each against the eager kernels.

``ATEN_CPU_CAPABILITY`` lowers the capability PyTorch's kernels (and so the host kernels' build) use. The
comparisons of tests/test_native_kernels.py (per segment), tests/test_batch_kernels.py (page batches),
tests/test_nonfinite.py (non-finite and huge gradients) and tests/test_rank1_host_kernels.py (rank-1 normalized 4-bit
state) run in this process for the capability it has; here they run again, in one subprocess for each other capability
the machine can run (one interpreter and one collection per capability; the build, about 20 s of one core, starts in
the background when the session starts: tests/conftest.py).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CAPABILITY_LADDER

from hf_paged import native

TESTS = Path(__file__).parent
COMPARISONS = {
    "test_native_kernels.py": "matches_the_eager or tracks_the_eager or targets_the_cpu_capability",
    "test_batch_kernels.py": (
        "matches_the_per_segment_path or independent_of_the_number_of_threads or rounds_by_its_index"
    ),
    "test_nonfinite.py": "native or store_non_finite_values",
    "test_rank1_host_kernels.py": "match_the_references or counts_nan or independent_of_the_number_of_threads",
}
"""The comparisons rerun per capability: each test file and the ``-k`` expression of its comparisons."""


def comparisons_expression() -> str:
    """One ``-k`` expression for every file's comparisons, each file's own expression applying to that file alone."""
    return " or ".join(f"({test_file} and ({expression}))" for test_file, expression in COMPARISONS.items())


@functools.cache
def machine_capability() -> str:
    """The highest capability PyTorch finds on this machine (``ATEN_CPU_CAPABILITY`` unset)."""
    environment = {key: value for key, value in os.environ.items() if key != "ATEN_CPU_CAPABILITY"}
    script = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    result = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, check=True)
    return result.stdout.strip().lower()


def runnable_capabilities() -> list[str]:
    """``default``, and on x86 ``avx2`` and ``avx512`` up to the machine's."""
    top = machine_capability()
    return list(CAPABILITY_LADDER[: CAPABILITY_LADDER.index(top) + 1]) if top in CAPABILITY_LADDER else ["default", top]


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_host_kernels_match_the_eager_kernels_in_every_capability(capability):
    if capability not in runnable_capabilities():
        pytest.skip(f"this machine runs {machine_capability()} at most")
    if capability == torch.backends.cpu.get_cpu_capability().lower():
        pytest.skip("this process's capability: the comparisons' own files compare it")
    if native.native_setting() is False or native.build_failure() is not None:
        pytest.skip("host kernels off or unavailable here")
    environment = {key: value for key, value in os.environ.items() if key != "PYTEST_ADDOPTS"}
    environment.update(ATEN_CPU_CAPABILITY=capability, HF_PAGED_NATIVE="1")
    files = [str(TESTS / test_file) for test_file in COMPARISONS]
    command = [sys.executable, "-m", "pytest", "-q", "-rp", "-p", "no:cacheprovider", *files]
    result = subprocess.run(
        [*command, "-k", comparisons_expression()],
        env=environment,
        capture_output=True,
        text=True,
        timeout=540,
        cwd=TESTS.parent,
        check=False,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "skipped" not in summary and "passed" in summary, summary
    passed_in = {test_file for test_file in COMPARISONS if f"PASSED tests/{test_file}::" in result.stdout}
    assert passed_in == set(COMPARISONS), f"no comparison passed in {sorted(set(COMPARISONS) - passed_in)}"
