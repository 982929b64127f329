"""A process that succeeded must not abort in the interpreter's finalization (``hf_paged/process_exit.py``).

The hazard, reproduced without a second rank: a thread blocked in C++ with the GIL released (here a c10d store's
``wait``, in a gloo job also gloo's worker threads) comes back while the interpreter finalizes, takes the GIL,
and CPython ends it with ``pthread_exit``, which aborts the process through C++'s terminate handler.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from datetime import timedelta
    import torch.distributed as dist
    from hf_paged.process_exit import exit_without_finalizing

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))

    def wait_in_cpp():
        try:
            store.wait(["never set"], timedelta(seconds=1))  # returns to Python in 1 s, with an error
        except Exception:
            pass

    class SlowFinalizer:
        def __del__(self, sleep=time.sleep):
            sleep(3)  # the interpreter finalizes for 3 s, while the waiting thread comes back

    slow = SlowFinalizer()
    threading.Thread(target=wait_in_cpp, daemon=True).start()
    atexit.register(print, "atexit handler ran")
    with open(sys.argv[2], "w") as file:
        file.write("written before the exit")
    print("work done")
    if sys.argv[1] == "exit_without_finalizing":
        exit_without_finalizing(0)
    """
)


def run_python(
    source: str, tmp_path, *args: str, runner: tuple[str, ...] = (), timeout: float = 120, **environment: str
) -> subprocess.CompletedProcess:
    """Run ``source`` as a script with ``args`` (through ``runner``, such as ``("-m", "hf_paged.run")``), the repo
    importable and ``environment`` added, for at most ``timeout`` seconds."""
    script = tmp_path / "script.py"
    script.write_text(source)
    environment = {
        **os.environ,
        "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        **environment,
    }
    return subprocess.run(
        [sys.executable, *runner, str(script), *args],
        check=False,
        capture_output=True,
        text=True,
        env=environment,
        timeout=timeout,
    )


def run(how: str, tmp_path) -> subprocess.CompletedProcess:
    return run_python(SCRIPT, tmp_path, how, str(tmp_path / "output.txt"))


def test_a_thread_that_comes_back_while_the_interpreter_finalizes_aborts_a_normal_exit(tmp_path):
    """The hazard itself, so that this file notices when PyTorch or CPython no longer has it."""
    completed = run("return", tmp_path)
    assert completed.returncode == -signal.SIGABRT, (completed.returncode, completed.stderr[-2000:])
    assert "terminate called without an active exception" in completed.stderr


def test_exit_without_finalizing_ends_with_status_0_after_the_exit_handlers(tmp_path):
    completed = run("exit_without_finalizing", tmp_path)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.splitlines() == ["work done", "atexit handler ran"]
    assert (tmp_path / "output.txt").read_text() == "written before the exit"


END_RUN = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist
    from hf_paged.process_exit import end_distributed_run

    if sys.argv[1] == "group":
        dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    end_distributed_run()
    print("returned", dist.is_initialized())
    """
)


@pytest.mark.parametrize(
    ("case", "world_size", "expected"),
    [("group", "1", ""), ("no group", "2", ""), ("no group", "1", "returned False\n")],
)
def test_end_distributed_run_ends_a_process_of_a_job_and_returns_elsewhere(tmp_path, case, world_size, expected):
    """With a process group (destroyed first) or as one of several processes of a launch, the process ends with
    status 0 at the call; a lone process without a group goes on."""
    completed = run_python(END_RUN, tmp_path, case, str(tmp_path / "rendezvous"), WORLD_SIZE=world_size)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout == expected


KEPT_POOL = textwrap.dedent(
    """
    import atexit, concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # kept alive, as libraries keep theirs
    atexit.register(lambda: print("pool workers ended:", not any(worker.is_alive() for worker in pool._threads)))
    print("result", pool.submit(lambda: 42).result())
    """
)


def test_a_run_ends_while_a_thread_pool_keeps_an_idle_worker(tmp_path):
    """``python -m hf_paged.run`` of a launch ends a script whose thread pool lives on (huggingface_hub's for
    ``run_as_future``, Inductor's for compiling): the pool's exit callback stops its idle worker before the join."""
    completed = run_python(KEPT_POOL, tmp_path, runner=("-m", "hf_paged.run"), timeout=60, WORLD_SIZE="2")
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.splitlines() == ["result 42", "pool workers ended: True"]
