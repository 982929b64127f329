"""End a process of a ``torch.distributed`` job after it succeeded, without a crash in the interpreter's shutdown.

A gloo process group's worker threads are C++ threads that live until the process ends. When one of them drops
the last reference to a finished collective's tensors after the interpreter has begun to finalize, it must take
the GIL to free their Python objects; a finalizing CPython ends such a thread with ``pthread_exit``, whose
unwinding through C++ frames aborts the process: SIGABRT and "terminate called without an active exception", after
a run that succeeded. On a loaded 2-core machine this ended 3 of 31 two-process FSDP2 runs of
``tests/scripts/fsdp2_train.py`` (PyTorch 2.13, Python 3.11), and torchrun then reports the job as failed. Any
thread blocked in C++ with the GIL released (a store's ``wait``) meets the same end.

:func:`exit_without_finalizing` does what a normal exit does before the finalization (``threading``'s shutdown,
which first runs the callbacks registered with it, as ``concurrent.futures``' that wakes idle pool workers, then joins
the threads that are not daemons; the ``atexit`` handlers; a flush of the standard streams) and then ends the process
with ``os._exit``, so that no thread can meet a finalizing interpreter. :func:`end_distributed_run` first ends the job's
process group as PyTorch asks of a program before it exits.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

import torch.distributed as dist


def exit_without_finalizing(status: int = 0) -> NoReturn:
    """End the process with exit ``status`` after ``threading``'s shutdown (its exit callbacks, which stop the idle
    workers of thread pools a library keeps, then a join of the threads that are not daemons), the ``atexit`` handlers
    and a flush of the standard streams, skipping the interpreter's finalization (objects left in modules are not
    finalized: write files and close resources before). Call it from the main thread, as the interpreter's exit runs."""
    threading._shutdown()  # what the interpreter's exit runs first; a join alone would wait on an idle pool worker
    atexit._run_exitfuncs()  # logging's own shutdown among them
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(status)


def end_distributed_run() -> None:
    """After a process of a distributed job finished its work: meet the other ranks (so that none tears down its
    connections while another still uses them), destroy the default process group and end the process with exit
    status 0 through :func:`exit_without_finalizing`.

    A process whose group is already destroyed, but that is one of several of a launch (``WORLD_SIZE`` above 1),
    ends the same way (its gloo threads outlive the group); any other process returns at once."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    elif int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    exit_without_finalizing(0)
