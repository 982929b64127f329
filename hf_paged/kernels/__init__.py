"""Update kernels by family, and the choice among them.

- :mod:`~hf_paged.kernels.rules`: the update rules in PyTorch operations, the reference of every family;
- :mod:`~hf_paged.kernels.pytorch`: the PyTorch kernels, eager or through ``torch.compile``, on every device;
- :mod:`~hf_paged.kernels.host`: the C++ host kernels of 8-bit and 4-bit state on the CPU;
- :mod:`~hf_paged.kernels.triton_kernels`: the Triton kernels of 8-bit, 4-bit, rank-1 normalized 4-bit (AdamW) and fp32
  state on accelerators (and on the CPU under Triton's interpreter, ``TRITON_INTERPRET=1``).

:func:`segment_kernel` gives the kernel of a rule, page format and device, of the family :func:`kernel_family`
chooses (``HF_PAGED_KERNELS``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from types import ModuleType

import torch

from ..codecs import Codec
from ..native import host_kernels_enabled
from .host import HostKernel, fits_vector_lanes, host_rule_name
from .pytorch import (
    COMPILE_MIN_ELEMENTS,
    SegmentKernel,
    compile_available,
    prepare_scalars,
    resolve_compiled,
    update_or_undo,
    update_segment,
)
from .rules import UpdateRule

__all__ = [
    "COMPILE_MIN_ELEMENTS",
    "KERNEL_FAMILIES",
    "HostKernel",
    "SegmentKernel",
    "UpdateRule",
    "compile_available",
    "host_rule_name",
    "kernel_family",
    "prepare_scalars",
    "resolve_compiled",
    "runs_compiled",
    "segment_kernel",
    "stubbed_triton_kernels",
    "triton_module",
    "update_or_undo",
    "update_segment",
]


KERNEL_FAMILIES = ("triton", "native", "torch")
"""The kernel families ``HF_PAGED_KERNELS`` may name."""


def kernel_family(device: torch.device) -> str:
    """The kernel family that updates pages of ``device``: ``HF_PAGED_KERNELS`` (read at each call) when set, else
    the best available: ``"native"`` (the C++ host kernels) for CPU pages, ``"triton"`` for CUDA and XPU pages where
    Triton imports and runs on the device, ``"torch"`` (the PyTorch kernels) otherwise.

    ``HF_PAGED_KERNELS=triton`` requires Triton to import and run on ``device`` (on the CPU: under its interpreter,
    ``TRITON_INTERPRET=1`` before Triton is first imported); ``native`` takes the host kernels for CPU pages where
    ``HF_PAGED_NATIVE`` lets them run and the PyTorch kernels elsewhere; ``torch`` the PyTorch kernels everywhere.
    A format a family has no kernel for (a rule without one, mixed state formats) takes the PyTorch kernels.
    """
    setting = os.environ.get("HF_PAGED_KERNELS", "").strip().lower()
    if setting and setting not in KERNEL_FAMILIES:
        raise ValueError(f"HF_PAGED_KERNELS={setting!r} is not allowed: use one of {', '.join(KERNEL_FAMILIES)}")
    if setting == "triton":
        module = triton_module()
        if module is None:
            raise RuntimeError("HF_PAGED_KERNELS=triton, but Triton does not import (pip install triton)")
        if not module.runs_on(device):
            hint = " (on the CPU only under its interpreter, TRITON_INTERPRET=1)" if device.type == "cpu" else ""
            raise RuntimeError(f"HF_PAGED_KERNELS=triton, but the Triton kernels do not run on {device}{hint}")
        return setting
    if setting:
        return setting
    if device.type == "cpu":
        return "native"
    if device.type in ("cuda", "xpu"):
        module = triton_module()
        if module is not None and module.runs_on(device):
            return "triton"
    return "torch"


@functools.cache
def triton_module() -> ModuleType | None:
    """:mod:`hf_paged.kernels.triton_kernels`, imported at the first call, or ``None`` where Triton does not import.

    Triton is optional, so it is imported only where a step may use it (not at ``import hf_paged``)."""
    try:
        from . import triton_kernels as module
    except ImportError:
        return None
    return module


@contextlib.contextmanager
def stubbed_triton_kernels() -> Iterator[bool]:
    """Inside, pages of every device take the Triton kernels, and every launch of their compiled kernels does
    nothing: the rest of a step on an accelerator runs as it does there (the launches' preparation, their tables
    written into pinned host memory and copied to the device, the page stream), so that it can be timed or traced on
    the CPU (``benchmarks/optimizer_step.py`` times it on real tensors, :mod:`hf_paged.planner` traces it on fake
    ones). The first-use self-check still runs the real kernels (on the CPU, under Triton's interpreter,
    ``TRITON_INTERPRET=1``; under ``FakeTensorMode`` it is skipped). Yields ``False``, changing nothing, where
    Triton does not import or ``HF_PAGED_KERNELS=torch`` chooses the PyTorch kernels."""
    module = triton_module()
    if module is None or os.environ.get("HF_PAGED_KERNELS", "").strip().lower() == "torch":
        yield False
        return
    kernels = {name: getattr(module, name) for name in ("_update_batch_kernel", "_gather_batch_kernel")}
    self_check = module.self_check

    def self_check_with_the_kernels(*args: object, **kwargs: object) -> str | None:
        idle = {name: getattr(module, name) for name in kernels}
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
        try:
            return self_check(*args, **kwargs)
        finally:
            for name, kernel in idle.items():
                setattr(module, name, kernel)

    patches = [
        (sys.modules[__name__], "kernel_family", lambda device: "triton"),
        (module, "runs_on", lambda device: True),
        (module, "self_check", self_check_with_the_kernels),
        *((module, name, _IdleKernel()) for name in kernels),
    ]
    originals = [getattr(owner, name) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield True
    finally:
        for (owner, name, _), original in zip(patches, originals):
            setattr(owner, name, original)


class _IdleKernel:
    """A compiled kernel whose launches (``kernel[grid](*args)``) do nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return _do_nothing


def _do_nothing(*args: object, **kwargs: object) -> None:
    return None


def segment_kernel(
    rule: UpdateRule, codecs: tuple[Codec, ...], compiled: bool, device: torch.device
) -> SegmentKernel | HostKernel:
    """The kernel of ``rule`` for ``codecs`` on pages of ``device``, made once per process, of the family
    :func:`kernel_family` chooses for ``device``.

    ``native``: for CPU pages of AdamW's and Lion's 8-bit and 4-bit states a :class:`HostKernel` while the host
    kernels are enabled (``HF_PAGED_NATIVE``, read at each call; see :mod:`hf_paged.native`), whatever ``compiled``
    says. ``triton``: a :class:`~hf_paged.kernels.triton_kernels.TritonKernel` for AdamW's and Lion's 8-bit, 4-bit
    and fp32 states and AdamW's rank-1 normalized 4-bit states. Otherwise, and for the segments those kernels hand
    on (another device), the :class:`SegmentKernel` that ``compiled`` chooses.
    """
    family = kernel_family(device)
    if family == "native" and (
        device.type != "cpu"
        or host_rule_name(rule, codecs) is None
        or not host_kernels_enabled()
        or not fits_vector_lanes(codecs)
    ):
        family = "torch"
    if family == "triton" and triton_module().triton_rule(rule, codecs) is None:
        family = "torch"
    return _segment_kernel(rule, codecs, compiled, family)


@functools.cache
def _segment_kernel(
    rule: UpdateRule, codecs: tuple[Codec, ...], compiled: bool, family: str
) -> SegmentKernel | HostKernel:
    if family == "torch":
        return SegmentKernel(rule, codecs, compiled)
    fallback = _segment_kernel(rule, codecs, compiled, "torch")
    if family == "triton":
        return triton_module().TritonKernel(rule, codecs, fallback)
    return HostKernel(host_rule_name(rule, codecs), codecs, fallback)


def runs_compiled(rule: UpdateRule, codecs: tuple[Codec, ...]) -> bool:
    """Whether the compiled PyTorch kernel of ``rule`` for ``codecs`` still compiles in this process: ``False`` once
    its compilation failed (it then updates eagerly, with an eager kernel's chunks and temporaries)."""
    return _segment_kernel(rule, codecs, True, "torch").compiled
