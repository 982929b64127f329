"""README.md's figures and lists that a CPU checks in seconds, against the code: bytes of optimizer state per
parameter (measured), the config's sections and data files, the ``optim_args`` keys, the Layout table."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
import torch

import hf_paged
from hf_paged.cli.config import Config
from hf_paged.cli.train import _LOCAL_BUILDERS
from hf_paged.integrations.trainer import OPTIMIZER_NAMES, parse_optim_args

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _between(start: str, end: str) -> str:
    """The README's text from ``start`` up to ``end`` (the first after it), newlines as spaces."""
    text = README.split(start, 1)[1].split(end, 1)[0]
    return " ".join(text.split())


def _top_level_names(text: str) -> list[str]:
    """The names in backticks of ``text`` outside parentheses."""
    names, depth = [], 0
    for token in re.finditer(r"`([^`]+)`|[()]", text):
        if token.group() == "(":
            depth += 1
        elif token.group() == ")":
            depth -= 1
        elif depth == 0:
            names.append(token.group(1))
    return names


def _state_bytes_per_parameter(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[float, float]:
    """(in memory: every page and the rank-1 statistics, in a state dict: its tensors but the step) per element."""
    param.grad = torch.full_like(param, 1e-3)
    optimizer.step()
    stats = optimizer.paging_stats()
    in_memory = stats["device_bytes"] + stats["host_bytes"] + stats["statistics_bytes"]
    saved = sum(
        value.numel() * value.element_size()
        for state in optimizer.state_dict()["state"].values()
        for key, value in state.items()
        if key != "step"
    )
    return in_memory / param.numel(), saved / param.numel()


def _agrees(measured: float, written: str) -> bool:
    """Whether ``measured`` rounds to ``written`` at the digits written."""
    digits = len(written.split(".")[1]) if "." in written else 0
    return round(measured, digits) == float(written)


TABLE_CLASSES = {
    "PagedAdamW": (hf_paged.PagedAdamW, {}),
    "PagedAdamW8bit": (hf_paged.PagedAdamW8bit, {}),
    "PagedAdamW4bit": (hf_paged.PagedAdamW4bit, {}),
    'PagedAdamW4bit(normalization="rank1")': (hf_paged.PagedAdamW4bit, {"normalization": "rank1"}),
    "PagedLion": (hf_paged.PagedLion, {}),
    "PagedLion8bit": (hf_paged.PagedLion8bit, {}),
    "PagedAdEMAMix": (hf_paged.PagedAdEMAMix, {}),
    "PagedAdEMAMix8bit": (hf_paged.PagedAdEMAMix8bit, {}),
    "PagedAdEMAMix4bit": (hf_paged.PagedAdEMAMix4bit, {}),
}


def test_bytes_per_parameter_are_measured():
    """The class table's bytes of state per parameter (a 1024 x 1024 parameter; the rank-1 row's 4096 x 4096
    matrix, in memory and saved), the same figures in the comparison with bitsandbytes and in the text."""
    rows = dict(re.findall(r"^\| `([^`]+)` \| [^|]+ \| ([^|]+) \|$", README, re.MULTILINE))
    assert set(TABLE_CLASSES) <= set(rows)
    measured = {}
    for name, (optimizer_class, kwargs) in TABLE_CLASSES.items():
        shape = (4096, 4096) if kwargs else (1024, 1024)
        param = torch.nn.Parameter(torch.zeros(shape))
        measured[name] = _state_bytes_per_parameter(optimizer_class([param], **kwargs), param)
        written = rows[name]
        assert _agrees(measured[name][0], written.split()[0]), (name, measured[name], written)
    rank1 = measured['PagedAdamW4bit(normalization="rank1")']
    assert rank1 == (1 + 2 * 2 * 4 * 2 * 4096 / 4096**2, 1 + 2 * 2 * 4 * 4096 / 4096**2)  # two sets, one saved
    saved = re.search(r"\(4096 x 4096; ([\d.]+) saved\)", rows['PagedAdamW4bit(normalization="rank1")']).group(1)
    assert _agrees(rank1[1], saved)
    for figure in re.findall(r"\b1\.00\d+\b", README):  # the rank-1 figures wherever the text gives them
        assert _agrees(rank1[0], figure) or _agrees(rank1[1], figure), figure
    compared = dict(re.findall(r"^\| (\d)-bit state \| [^|]+ \| ([\d.]+) bytes per parameter", README, re.MULTILINE))
    assert _agrees(measured["PagedAdamW8bit"][0], compared["8"])
    assert _agrees(measured["PagedAdamW4bit"][0], compared["4"])


def test_config_sections_and_data_files_are_the_schemas():
    sentence = _between("A config has the sections ", ". ")
    assert _top_level_names(sentence) == [field.name for field in dataclasses.fields(Config)]
    kinds = re.search(r"a local ([\w/]+) file", sentence).group(1).split("/")
    assert {"." + kind.lower().replace("text", "txt") for kind in kinds} == set(_LOCAL_BUILDERS)


def _accepted_keys(optimizer_class: type) -> set[str]:
    with pytest.raises(ValueError, match="allowed keys: ") as raised:
        parse_optim_args({"no_such_key": "1"}, optimizer_class)
    return set(str(raised.value).split("allowed keys: ", 1)[1].split(", "))


def test_optim_args_keys_are_what_each_optimizer_accepts():
    """Every optimizer takes the keys given for every one; those named in a clause of their own also its keys."""
    clauses = _between("`optim_args` keys: ", " They are checked").rstrip(".").split("; ")
    common = set(_top_level_names(clauses[0].split(" for every optimizer")[0]))
    extra: dict[str, set[str]] = {}
    for clause in clauses[1:]:
        names, keys = clause.split(" also ", 1)
        for name in re.findall(r"`(hf_paged_\w+)`", names):
            extra[name] = set(_top_level_names(keys))
    assert set(extra) <= set(OPTIMIZER_NAMES)
    for name, optimizer_class in OPTIMIZER_NAMES.items():
        assert _accepted_keys(optimizer_class) == common | extra.get(name, set()), name
    assert "(`block` or `rank1`)" in clauses[-1]
    for normalization in ("block", "rank1"):
        parsed = parse_optim_args({"normalization": normalization}, hf_paged.PagedAdamW4bit)
        hf_paged.PagedAdamW4bit([torch.nn.Parameter(torch.zeros(4))], **parsed)


def _tracked_sources() -> list[str]:
    try:
        listed = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "hf_paged", "callbacks", "benchmarks", "scripts"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [path for path in listed if path.endswith((".py", ".cpp"))]


def test_the_layout_table_is_the_tree():
    """Every path of the table exists; every source file is in a row (itself or its folder); a row of folders that
    names files of them names all their files (but ``__init__.py``, ``__main__.py`` and files with rows of their
    own), each of which exists."""
    table = README.split("## Layout\n", 1)[1].split("\n\n", 1)[0]
    rows = [
        (re.findall(r"`([^`]+)`", cell), description)
        for cell, description in (line.split(" | ", 1) for line in table.splitlines()[2:])
    ]
    paths = [path for row_paths, _ in rows for path in row_paths]
    for path in paths:
        assert (ROOT / path).exists(), path
    sources = _tracked_sources()
    for source in sources:
        assert any(source == path or (path.endswith("/") and source.startswith(path)) for path in paths), source
    for row_paths, description in rows:
        folders = [path for path in row_paths if path.endswith("/")]
        named = set(re.findall(r"`([\w.]+\.(?:py|cpp))`", description))
        if not folders or not named:
            continue
        for name in named:
            assert any((ROOT / folder / name).is_file() for folder in folders), (folders, name)
        own = {
            source.rsplit("/", 1)[1]
            for source in sources
            if source.rsplit("/", 1)[0] + "/" in folders and source not in paths
        }
        assert own - {"__init__.py", "__main__.py"} <= named, (folders, sorted(own - named))
