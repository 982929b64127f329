"""hf_paged/rounding.py: square roots rounded as IEEE 754 rounds them, whatever MKL's vector math does here."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import torch

from hf_paged.rounding import ieee_sqrt


def every_third_float_in_one_to_four() -> torch.Tensor:
    """A third of the fp32 values in [1, 4): every significand, both parities of the exponent, so every rounding
    case of a square root up to a power of two."""
    bits = torch.arange(0x3F800000, 0x40800000, 3, dtype=torch.int32)
    return bits.view(torch.float32)


def test_ieee_sqrt_is_correctly_rounded():
    values = torch.cat(
        [
            every_third_float_in_one_to_four(),
            torch.tensor([0.0, -0.0, 1e-45, 1e-40, 1.1754942e-38, 3.4028235e38, float("inf")]),
            torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 1e-30,
        ]
    )
    expected = torch.from_numpy(np.sqrt(values.numpy()))
    roots = ieee_sqrt(values)
    assert roots.dtype == torch.float32
    assert torch.equal(roots, expected), f"{(roots != expected).sum()} of {values.numel()} differ"
    assert ieee_sqrt(torch.tensor([-1.0, float("nan")])).isnan().all()


def test_ieee_sqrt_does_not_depend_on_mkls_code_path():
    """MKL chooses its vector code by the processor; with its SSE4.2 code (MKL_ENABLE_INSTRUCTIONS), torch.sqrt is
    one ulp off for about a sixth of fp32 values, and ieee_sqrt still exact."""
    script = (
        "import numpy as np, torch\n"
        "from hf_paged.rounding import ieee_sqrt\n"
        "x = torch.arange(0x3F800000, 0x40800000, 97, dtype=torch.int32).view(torch.float32)\n"
        "expected = torch.from_numpy(np.sqrt(x.numpy()))\n"
        "print(int((x.sqrt() != expected).sum()), int((ieee_sqrt(x) != expected).sum()))\n"
    )
    environment = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    plain_misses, ieee_misses = map(int, result.stdout.split())
    assert ieee_misses == 0
    if torch.backends.mkl.is_available():
        assert plain_misses > 0  # the setting took effect: MKL's square root is not IEEE's there


def test_ieee_sqrt_compiles_to_the_vector_units_square_root():
    """Traced, it is a plain square root (no fp64 temporary), and Inductor's CPU code for it is IEEE's."""
    graphs = []

    def inspect(graph_module, example_inputs):
        graphs.append(graph_module.code)
        return graph_module.forward

    values = every_third_float_in_one_to_four()[::64].contiguous()
    torch.compile(lambda tensor: ieee_sqrt(tensor), backend=inspect, fullgraph=True)(values)
    assert "sqrt" in graphs[0] and "float64" not in graphs[0]
    compiled = torch.compile(lambda tensor: ieee_sqrt(tensor), fullgraph=True)(values)
    assert torch.equal(compiled, torch.from_numpy(np.sqrt(values.numpy())))
