"""The torch versions pyproject.toml allows are the versions CI tests: the floor is the version .ci/run installs."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def torch_requirement() -> Requirement:
    """The torch requirement of pyproject.toml's dependencies."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (requirement,) = [Requirement(line) for line in dependencies if Requirement(line).name == "torch"]
    return requirement


def ci_torch_version() -> Version:
    """The torch version .ci/run installs."""
    (version,) = re.findall(r"torch==(\S+)", (ROOT / ".ci" / "run").read_text())
    return Version(version)


def test_the_torch_floor_is_the_version_ci_installs():
    floors = [Version(spec.version) for spec in torch_requirement().specifier if spec.operator == ">="]
    assert floors == [ci_torch_version()]


def test_the_installed_torch_satisfies_the_requirement():
    installed = importlib.metadata.version("torch")
    assert torch_requirement().specifier.contains(installed, prereleases=True), installed


def test_the_readme_states_the_required_torch():
    assert f"`{torch_requirement()}`" in (ROOT / "README.md").read_text()
