"""pyproject.toml ships every package of the source tree, and its test extra what the tests import."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib comes with Python 3.11")

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_of_hf_paged_is_listed():
    """A non-editable install takes only the packages listed: a subpackage missing there fails to import."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(settings["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "hf_paged").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert on_disk <= listed, sorted(on_disk - listed)


def test_the_test_extra_installs_triton():
    """tests/test_triton_kernels.py runs the Triton kernels in Triton's interpreter, from the test extra."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(requirement.startswith("triton") for requirement in extras["test"])
