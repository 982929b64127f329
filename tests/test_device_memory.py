"""The tests' pseudo-device memory (``tests/device_memory.py``): it counts, caps and raises as an accelerator's
allocator does, and its build shares hf_paged's protection against a build killed on the way.

Each check runs in a process of its own: installing the allocator replaces the CPU allocator of the process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import device_memory

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def built() -> Path:
    """The extension's build folder, built (or loaded from the cache) once."""
    from hf_paged.native import extension_directory

    device_memory.build()
    return extension_directory(device_memory.NAME)


def _run(script: str, environment: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        cwd=TESTS,
        env={**os.environ, "PYTHONPATH": f"{TESTS.parent}{os.pathsep}{TESTS}", **(environment or {})},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_it_counts_caps_and_leaves_host_memory_out(built: Path) -> None:
    """Live bytes and their peak follow tensors of any size; past the cap an allocation raises
    ``torch.OutOfMemoryError`` and the count is unchanged; inside ``host_memory`` nothing is counted or refused."""
    script = """
import torch, device_memory
device_memory.install(cap=1_000_000)
base = device_memory.live()
a = torch.empty(100_000, dtype=torch.uint8)
assert device_memory.live() == base + 100_000, device_memory.live()
del a
assert device_memory.live() == base and device_memory.peak() >= base + 100_000
device_memory.reset_peak()
assert device_memory.peak() == base
try:
    torch.empty(2_000_000, dtype=torch.uint8)
except torch.OutOfMemoryError as error:
    assert "out of memory allocating 2000000 bytes" in str(error), error
else:
    raise AssertionError("no out-of-memory error past the cap")
assert device_memory.live() == base
with device_memory.host_memory():
    b = torch.empty(5_000_000, dtype=torch.uint8)
assert device_memory.live() == base
del b
assert device_memory.live() == base
print("ok")
"""
    done = _run(script)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_build_killed_on_the_way_does_not_make_later_processes_wait(built: Path, tmp_path: Path) -> None:
    """A process killed while it built the extension leaves PyTorch's ``lock`` file in its folder, and every later
    process (each rank of a launch) waited for it forever; the build goes through
    :func:`hf_paged.native.load_extension`, so the next process removes it, with a warning, and loads the build."""
    cache = tmp_path / "extensions"
    directory = cache / built.relative_to(built.parents[1])
    shutil.copytree(built, directory)  # the build itself is cached: loading it takes a second
    (directory / "lock").touch()
    script = "import logging; logging.basicConfig(); import device_memory; device_memory.build(); print('ok')"
    done = _run(script, {"TORCH_EXTENSIONS_DIR": str(cache)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert f"removing {directory / 'lock'}, left by a build of the tests' device memory that did not finish" in (
        done.stderr
    )
    assert not (directory / "lock").exists()
