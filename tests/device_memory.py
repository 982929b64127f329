"""A pseudo-device's memory for multi-process tests on the CPU: ``tests/native/device_memory.cpp``, built once into
PyTorch's extension cache by :func:`hf_paged.native.load_extension` (one process at a time, so that the ranks of a
launch do not build it together, and a build killed on the way leaves no lock that makes later processes wait).

:func:`install` replaces the CPU allocator of this process with one that counts the bytes of every CPU tensor
allocated from then on, on any thread (the profiler follows only the threads it profiles: a block a gloo worker frees
when its collective's work ends would stay live for it), keeps their peak, and with a cap raises
``torch.OutOfMemoryError`` when an allocation would pass it, as an accelerator's allocator does. Memory allocated
inside :func:`host_memory` is host memory beside the pseudo-device (a paged optimizer's host buffers): not counted,
never refused.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "device_memory.cpp")


NAME = "hf_paged_test_device_memory"
"""The extension's name, and its folder's in the cache (:func:`hf_paged.native.extension_directory`)."""


@functools.cache
def _extension() -> Any:
    from hf_paged.native import load_extension

    return load_extension(NAME, [SOURCE], "the tests' device memory", extra_cflags=["-O2"])


def build() -> None:
    """Build the extension (or load it from the cache) without installing it: a launcher builds it once before its
    processes load it."""
    _extension()


def install(cap: int | None = None) -> None:
    """Count CPU allocations from now on; refuse those past ``cap`` bytes (``None``: no cap)."""
    _extension().install(-1 if cap is None else cap)


def live() -> int:
    """Bytes counted and not yet freed."""
    return _extension().live()


def peak() -> int:
    """The highest live bytes since the last :func:`reset_peak`."""
    return _extension().peak()


def reset_peak() -> None:
    """The peak starts again from the live bytes."""
    _extension().reset_peak()


@contextlib.contextmanager
def host_memory() -> Iterator[None]:
    """This thread's allocations inside are host memory: not counted, never refused."""
    _extension().enter_host_scope()
    try:
        yield
    finally:
        _extension().exit_host_scope()
