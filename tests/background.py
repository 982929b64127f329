"""Launches that a test module starts together and reads one by one.

A module whose fixtures each launch training processes that use one thread apiece (``OMP_NUM_THREADS=1``, as
torchrun and accelerate set them) starts them all at once, so that they share the machine's cores instead of
taking turns; each fixture then waits for its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Sequence


class BackgroundRun:
    """A command started now, its output kept in temporary files (a pipe left unread would block it)."""

    def __init__(self, command: Sequence[str], env: dict[str, str], cwd: str | None = None, timeout: float = 600):
        self.command = list(command)
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
        """End the run and the processes it started (its session) if it is still going."""
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
