"""``model.name`` and ``tokenizer.name`` that cannot be loaded: one ``hf-paged: error:`` line and exit 2, at once.

No test reaches the network: offline is ``HF_HUB_OFFLINE``; online, the Hub is a local address that refuses
connections or a local server that answers as the Hub does for a model it does not have.
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub.constants
import pytest

from hf_paged.cli import main
from hf_paged.cli.config import ConfigError
from hf_paged.cli.sources import check_source

MISSING = "no-such-org/no-such-model"


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, online unless a test says otherwise."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return cache


def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    started = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - started < 10
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-paged: error: "), lines
    return lines[0]


@pytest.mark.parametrize("command", ["train", "plan"])
def test_offline_a_model_neither_local_nor_cached_is_one_line(command, empty_cache, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    line = _one_error_line(capsys, [command, "--set", f"model.name={MISSING}"])
    assert line == (
        f"hf-paged: error: model.name: {MISSING!r} is neither a local directory nor in the Hugging Face cache "
        f"({empty_cache}), and HF_HUB_OFFLINE is set: download it where there is a connection (hf download "
        f"{MISSING}) or give a local directory"
    )


def test_online_an_unreachable_hub_is_one_line(empty_cache, monkeypatch, capsys):
    with socket.socket() as probe:  # a port nothing listens on: the connection is refused at once
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    line = _one_error_line(capsys, ["train", "--set", f"model.name={MISSING}"])
    assert "and the Hugging Face Hub cannot be reached (" in line
    assert line.endswith("set HF_HUB_OFFLINE=1 to use local and cached models only")


class _HubWithoutModels(BaseHTTPRequestHandler):
    """Answers every request as the Hub answers for a repository it does not have."""

    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "Repository not found"}')

    def log_message(self, *args: object) -> None:
        pass


def test_online_a_model_the_hub_does_not_have_is_one_line(empty_cache, monkeypatch, capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HubWithoutModels)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        line = _one_error_line(capsys, ["train", "--set", f"tokenizer.name={MISSING}"])
    finally:
        server.shutdown()
        server.server_close()
    assert line == (
        f"hf-paged: error: tokenizer.name: {MISSING!r} is neither a local directory nor in the Hugging Face cache "
        f"({empty_cache}), and the Hugging Face Hub has no such model (a private or gated one needs hf auth login)"
    )


def test_local_directories_cached_names_and_the_embedded_ones_pass_offline(empty_cache, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    commit = "0" * 40
    repository = empty_cache / "models--some-org--cached-model"
    (repository / "refs").mkdir(parents=True)
    (repository / "refs" / "main").write_text(commit)
    (repository / "snapshots" / commit).mkdir(parents=True)
    (repository / "snapshots" / commit / "config.json").write_text("{}")
    check_source("model.name", "some-org/cached-model")
    check_source("model.name", str(tmp_path))
    check_source("model.name", "tiny")
    check_source("tokenizer.name", "byte")


def test_paths_that_are_not_model_directories_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"^model.name: no directory '\./nowhere/model', and it is not a Hugging"):
        check_source("model.name", "./nowhere/model")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"is a file; give the directory that holds the model's config.json"):
        check_source("model.name", str(tmp_path / "config.json"))
