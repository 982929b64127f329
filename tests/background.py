"""Launches that a test module starts together and reads one by one.

A module whose fixtures each launch training processes that use one thread apiece (``OMP_NUM_THREADS=1``, as
torchrun and accelerate set them) starts them all at once, so that they share the machine's cores instead of
taking turns; each fixture then waits for its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pytest


class BackgroundRun:
    """A command started now, its output kept in temporary files (a pipe left unread would block it)."""

    def __init__(
        self,
        command: Sequence[str],
        env: dict[str, str],
        cwd: str | None = None,
        timeout: float = 600,
        output: Path | None = None,
    ):
        self.command = list(command)
        self.output = output
        """Where the run writes its result (the caller's)."""
        self.timeout = timeout
        self._stdout = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by wait)
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by wait)
        self._process = subprocess.Popen(
            self.command, stdout=self._stdout, stderr=self._stderr, text=True, env=env, cwd=cwd, start_new_session=True
        )
        self._completed: subprocess.CompletedProcess | None = None

    def wait(self) -> subprocess.CompletedProcess:
        """The finished run, as ``subprocess.run`` gives it (killed after ``timeout`` seconds: ``TimeoutExpired``)."""
        if self._completed is None:
            try:
                returncode = self._process.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                raise
            outputs = []
            for stream in (self._stdout, self._stderr):
                stream.seek(0)
                outputs.append(stream.read())
                stream.close()
            self._completed = subprocess.CompletedProcess(self.command, returncode, *outputs)
        return self._completed

    def stop(self) -> None:
        """End the run and every process it started (its session), and drop its output."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait()
        self._stdout.close()
        self._stderr.close()


class Launches:
    """Runs by name, started together: the first one asked for starts every one that the run's selected tests need."""

    def __init__(self, starts: dict[str, Callable[[], BackgroundRun]], needed: Iterable[str]) -> None:
        self._starts = starts
        self._needed = set(needed)
        self._started: dict[str, BackgroundRun] = {}

    def __getitem__(self, name: str) -> BackgroundRun:
        if name not in self._started:
            for other in sorted(self._needed | {name}):
                if other not in self._started:
                    self._started[other] = self._starts[other]()
        return self._started[name]

    def stop(self) -> None:
        for run in self._started.values():
            run.stop()


def selected_items(request: pytest.FixtureRequest) -> list[pytest.Item]:
    """The tests of ``request``'s module that this run collected and does not skip."""
    return [
        item
        for item in request.session.items
        if item.module is request.module and item.get_closest_marker("skip") is None
    ]


def selected_params(request: pytest.FixtureRequest, name: str) -> set:
    """The values that the selected tests of ``request``'s module (:func:`selected_items`) give the parameter
    ``name``."""
    values = set()
    for item in selected_items(request):
        callspec = getattr(item, "callspec", None)
        if callspec is not None and name in callspec.params:
            values.add(callspec.params[name])
    return values
