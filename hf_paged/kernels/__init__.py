"""Update kernels by family, and the choice among them.

- :mod:`~hf_paged.kernels.rules`: the update rules in PyTorch operations, the reference of every family;
- :mod:`~hf_paged.kernels.pytorch`: the PyTorch kernels, eager or through ``torch.compile``, on every device;
- :mod:`~hf_paged.kernels.host`: the C++ host kernels of 8-bit and 4-bit state on the CPU.

:func:`segment_kernel` gives the kernel of a rule, page format and device.
"""

from __future__ import annotations

import functools

import torch

from ..codecs import Codec
from ..native import host_kernels_enabled
from .host import HostKernel, host_rule_name
from .pytorch import (
    COMPILE_MIN_ELEMENTS,
    SegmentKernel,
    compile_available,
    prepare_scalars,
    resolve_compiled,
    update_segment,
)
from .rules import UpdateRule

__all__ = [
    "COMPILE_MIN_ELEMENTS",
    "HostKernel",
    "SegmentKernel",
    "UpdateRule",
    "compile_available",
    "host_rule_name",
    "prepare_scalars",
    "resolve_compiled",
    "runs_compiled",
    "segment_kernel",
    "update_segment",
]


def segment_kernel(
    rule: UpdateRule, codecs: tuple[Codec, ...], compiled: bool, device: torch.device
) -> SegmentKernel | HostKernel:
    """The kernel of ``rule`` for ``codecs`` on pages of ``device``, made once per process.

    For CPU pages of AdamW's and Lion's 8-bit and 4-bit states it is a :class:`HostKernel` while the host kernels
    are enabled (``HF_PAGED_NATIVE``, read at each call; see :mod:`hf_paged.native`), whatever ``compiled`` says:
    CPU segments take the C++ kernel, others the :class:`SegmentKernel` that ``compiled`` chooses. Otherwise (pages
    on another device, which never build the host kernels, or where they cannot be built) the
    :class:`SegmentKernel`.
    """
    native = device.type == "cpu" and host_rule_name(rule, codecs) is not None and host_kernels_enabled()
    return _segment_kernel(rule, codecs, compiled, native)


@functools.cache
def _segment_kernel(
    rule: UpdateRule, codecs: tuple[Codec, ...], compiled: bool, native: bool
) -> SegmentKernel | HostKernel:
    if not native:
        return SegmentKernel(rule, codecs, compiled)
    return HostKernel(host_rule_name(rule, codecs), codecs, _segment_kernel(rule, codecs, compiled, False))


def runs_compiled(rule: UpdateRule, codecs: tuple[Codec, ...]) -> bool:
    """Whether the compiled PyTorch kernel of ``rule`` for ``codecs`` still compiles in this process: ``False`` once
    its compilation failed (it then updates eagerly, with an eager kernel's chunks and temporaries)."""
    return _segment_kernel(rule, codecs, True, False).compiled
