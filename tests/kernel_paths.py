"""The kernel path a step takes, for tests that name one: each ``gpu`` test of a kernel family pins it
(:func:`pin_kernel_path`) and checks, with :func:`record_kernel_paths`, that its steps took it; on a CUDA machine with
Triton every page would otherwise take the Triton kernels, whatever ``compiled`` says, and a test of the compiled
PyTorch kernels would never reach ``torch.compile``. tests/test_kernel_paths.py runs the same pins on the CPU."""

from __future__ import annotations

import os
from collections import Counter
from unittest import mock

import pytest
import torch

from hf_paged import kernels

FAMILIES = {"triton": "triton", "compiled": "torch", "eager": "torch", "native": "native"}
"""The kernel family (``HF_PAGED_KERNELS``) of each path: the Triton kernels, the PyTorch kernels compiled or eager, the
host kernels."""


def pin_kernel_path(monkeypatch: pytest.MonkeyPatch, path: str) -> bool:
    """Make steps take ``path`` (one of :data:`FAMILIES`): set ``HF_PAGED_KERNELS``; return the optimizers'
    ``compiled`` for it."""
    monkeypatch.setenv("HF_PAGED_KERNELS", FAMILIES[path])
    return path == "compiled"


def record_kernel_paths(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Count, until the test ends, the kernel calls of each path: ``triton`` (a launch of the Triton kernels),
    ``compiled`` and ``eager`` (a call of a PyTorch segment kernel, by its ``compiled``), ``native`` (a host kernel's
    call, per segment or batch) and ``fused`` (torch's fused AdamW, fp32 ``PagedAdamW``'s path)."""
    paths: Counter = Counter()

    def counted(owner: object, name: str, path) -> None:
        original = getattr(owner, name)

        def call(*args, **kwargs):
            paths[path(*args) if callable(path) else path] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, call)

    counted(kernels.SegmentKernel, "__call__", lambda kernel, *args: "compiled" if kernel.compiled else "eager")
    counted(kernels.HostKernel, "__call__", "native")
    counted(kernels.HostKernel, "update_batch", "native")
    counted(torch, "_fused_adamw_", "fused")
    # imported as tests/conftest.py imports Triton: under the interpreter where no GPU runs the kernels
    interpreted = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}
    with mock.patch.dict(os.environ, interpreted):
        triton_kernels = kernels.triton_module()
    if triton_kernels is not None:
        counted(triton_kernels.TritonKernel, "_run", "triton")
    return paths
