"""Arithmetic that every kernel family rounds alike, whatever the machine.

Eager PyTorch on the CPU takes fp32 square roots from MKL's vector math where PyTorch is built with MKL, and MKL
picks its code by the processor, not by ``ATEN_CPU_CAPABILITY``: on AVX2 it is correctly rounded, on AVX-512 about
0.6% of results are one ulp off, with SSE4.2 code about 17%. The host kernels, compiled kernels and CUDA round
square roots as IEEE 754 does, so the PyTorch kernels take theirs through :func:`ieee_sqrt`.
"""

from __future__ import annotations

import torch


def ieee_sqrt(values: torch.Tensor) -> torch.Tensor:
    """The square roots of fp32 ``values``, correctly rounded (as IEEE 754's ``sqrt``) on every device.

    Eager on the CPU they are taken in fp64 and rounded once to fp32: fp64's result is within one of its ulps,
    and the square root of an fp32 value is never closer than four fp64 ulps to a midpoint of fp32 values, so
    the rounding is exact. That holds an fp64 temporary of ``values`` (8 bytes per element). Elsewhere, and
    while ``torch.compile`` traces (its CPU code takes the vector unit's square root), ``values.sqrt()``.
    """
    if values.device.type == "cpu" and values.dtype == torch.float32 and not torch.compiler.is_compiling():
        return values.double().sqrt_().float()
    return values.sqrt()
