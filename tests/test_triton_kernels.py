"""The Triton kernels (hf_paged/kernels/triton_kernels.py) on the CPU under Triton's interpreter: the same parameters,
codes and scales as the eager PyTorch kernels and the C++ host kernels, bitwise, for every rule and state format,
per segment and per page batch; and the whole optimizer with ``HF_PAGED_KERNELS=triton``: the eager kernels'
results, paging invariance under budgets, resume, and recovery inside the step.

Triton reads ``TRITON_INTERPRET`` when it is first imported (its own ``tl`` functions become interpreted ones), so
tests/conftest.py imports it with ``TRITON_INTERPRET=1`` before any test module, and this module sets it only while
its own tests run: other test files see the environment as it was. Where a CUDA device is present (whose tests
compile Triton kernels) or Triton was imported outside the interpreter, the module is skipped.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from unittest import mock

import pytest
import torch


def _interpreted_triton_kernels():
    """hf_paged.kernels.triton_kernels with Triton imported under its interpreter, or why it cannot be."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (the test extra installs it)", allow_module_level=True)
    version = tuple(int(part) for part in importlib.metadata.version("triton").split(".")[:2])
    if version < (3, 9):
        pytest.skip(
            "Triton's interpreter before 3.9 rounds an fma twice (a multiply, then an add)", allow_module_level=True
        )
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: Triton compiles for it, not in the interpreter", allow_module_level=True)
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        import triton.language
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(triton.language.standard.cdiv, InterpretedFunction):
            pytest.skip("Triton was imported outside its interpreter (see tests/conftest.py)", allow_module_level=True)
        module = importlib.import_module("hf_paged.kernels.triton_kernels")
    if not module.INTERPRETED:
        pytest.skip("hf_paged.kernels.triton_kernels was imported outside the interpreter", allow_module_level=True)
    return module


TRITON_KERNELS = _interpreted_triton_kernels()

from conftest import (
    OPTIMIZERS,
    decay_groups,
    make_mlp,
    optimizer_kwargs,
    regression_batches,
    second_moment_midpoints,
    train,
)
from test_step_failures import FailingAllocations, failing_step, mark_streaming, snapshot
from triton_cases import (
    ADAMW_GROUP,
    BLOCK,
    CASES,
    DTYPES,
    FORMATS,
    RULES,
    codecs_of,
    scalars_of,
    squared_gradient_state,
)

from hf_paged.codecs import Blockwise8bitCodec, Float32Codec, PageFormat, random_page_buffers, to_blocks
from hf_paged.kernels import HostKernel, SegmentKernel, kernel_family, segment_kernel
from hf_paged.kernels.batch import PageBatch
from hf_paged.kernels.host import host_rule_name
from hf_paged.kernels.pytorch import update_in_buffers, update_segment
from hf_paged.kernels.rules import adamw_scalars, adamw_update_, lion_update_
from hf_paged.native import build_failure
from hf_paged.stochastic_rounding import ElementRounding, step_keys


@pytest.fixture(autouse=True)
def triton_kernels(monkeypatch):
    """hf_paged.kernels.triton_kernels, imported under the interpreter; ``TRITON_INTERPRET=1`` while a test runs
    (Triton imports some of its modules at a kernel's first launch, and they read it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return TRITON_KERNELS


def assert_equal_bits(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for index, (a, b) in enumerate(zip(actual, expected)):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), index


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("state_format", FORMATS)
@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_a_segment_matches_the_eager_and_host_kernels_bitwise(triton_kernels, rule_name, state_format, dtype):
    """One segment of five blocks through the per-segment call: the parameter, codes and scales of the eager
    PyTorch kernel and, for 8-bit and 4-bit state, of the C++ host kernel, bit for bit."""
    rule, _ = RULES[rule_name]
    codecs = codecs_of(rule_name, state_format)
    page_format = PageFormat(codecs)
    generator = torch.Generator().manual_seed(1)
    length = 5 * BLOCK
    param = torch.randn(length, generator=generator).to(dtype)
    grad = torch.randn(length, generator=generator) * 10.0 ** torch.randint(-4, 1, (length,), generator=generator)
    grad = grad.to(dtype)
    buffers = random_page_buffers(page_format, length, generator)
    scalars = scalars_of(rule_name)

    results = {}
    kernels = {"triton": triton_kernels.TritonKernel(rule, codecs, SegmentKernel(rule, codecs, False))}
    if state_format != "fp32" and build_failure() is None:
        kernels["host"] = HostKernel(host_rule_name(rule, codecs), codecs, SegmentKernel(rule, codecs, False))
    for name, kernel in {"eager": None, **kernels}.items():
        p, state = param.clone(), [buffer.clone() for buffer in buffers]
        encoded = [codec.select(array, 0, length) for codec, array in zip(codecs, page_format.arrays(state))]
        p_blocks, g_blocks = to_blocks(p, page_format.alignment), to_blocks(grad, page_format.alignment)
        if kernel is None:
            update_segment(rule, codecs, p_blocks, g_blocks, encoded, scalars)
        else:
            assert kernel.allocates_nothing(p_blocks, g_blocks)
            kernel(p_blocks, g_blocks, encoded, scalars)
        results[name] = [p, *state]
    assert not torch.equal(results["eager"][0], param)  # the update moved the parameter
    for name in kernels:
        assert_equal_bits(results[name], results["eager"])


def test_the_4bit_second_moment_takes_the_eager_codes_at_its_midpoints(triton_kernels):
    """AdamW's second moment on and beside the midpoints of the 4-bit levels in the square-root domain: the Triton
    kernel's codes are the eager kernel's and within tests/conftest.py's bounds."""
    grad, lowest, highest = second_moment_midpoints(BLOCK)
    _, _, packed, scales = squared_gradient_state(triton_kernels, "4bit", grad, "cpu")
    codes = torch.cat([packed & 15, packed >> 4], dim=1)
    assert torch.equal(scales, torch.tensor([1.0, 2.0**-20]))
    assert ((codes >= lowest) & (codes <= highest)).all(), codes


@pytest.mark.parametrize("state_format", ["8bit", "4bit"])
def test_a_subnormal_second_moments_block_takes_the_eager_codes(triton_kernels, state_format):
    """Gradients near 1e-20 square to subnormal second moments (about 1e-40), so their block's scale is subnormal:
    its inverse square root is taken as for a normal scale, not as that of the smallest normal fp32."""
    grad = torch.randn(2, BLOCK, generator=torch.Generator().manual_seed(0)) * 1e-20
    scales = squared_gradient_state(triton_kernels, state_format, grad, "cpu")[3]
    assert ((scales > 0) & (scales < torch.finfo(torch.float32).tiny)).all()


def eager_and_triton(triton_kernels, rule, codecs, param, grad, buffers, scalars) -> list[tuple[list, list]]:
    """One segment updated by the eager PyTorch kernel and by the Triton kernel, each on copies of ``param`` and the
    page ``buffers``: for each, the parameter and buffers, and the segment's encoded state."""
    page_format = PageFormat(codecs)
    results = []
    for kernel in (None, triton_kernels.TritonKernel(rule, codecs, SegmentKernel(rule, codecs, False))):
        p, state = param.clone(), [buffer.clone() for buffer in buffers]
        encoded = [codec.select(array, 0, param.numel()) for codec, array in zip(codecs, page_format.arrays(state))]
        p_blocks, g_blocks = to_blocks(p, page_format.alignment), to_blocks(grad, page_format.alignment)
        if kernel is None:
            update_segment(rule, codecs, p_blocks, g_blocks, encoded, scalars)
        else:
            kernel(p_blocks, g_blocks, encoded, scalars)
        results.append(([p, *state], encoded))
    return results


@pytest.mark.parametrize("state_format", ["fp32", "8bit"])
def test_lion_stores_a_nan_gradients_momentum_as_zero(triton_kernels, state_format):
    """A NaN gradient element: its Lion momentum is stored as zero, as the eager kernel stores it, bit for bit."""
    rule, _ = RULES["lion"]
    codecs = codecs_of("lion", state_format)
    generator = torch.Generator().manual_seed(2)
    param, grad = torch.randn(3 * BLOCK, generator=generator), torch.randn(3 * BLOCK, generator=generator)
    grad[BLOCK + 5] = float("nan")
    buffers = random_page_buffers(PageFormat(codecs), param.numel(), generator)
    (eager, _), (triton, encoded) = eager_and_triton(
        triton_kernels, rule, codecs, param, grad, buffers, scalars_of("lion")
    )
    assert codecs[0].decode(encoded[0]).reshape(-1)[BLOCK + 5] == 0.0
    assert_equal_bits(triton, eager)


@pytest.mark.parametrize("eps", [0.0, float("inf")])
@pytest.mark.parametrize("state_format", FORMATS)
def test_adamw_takes_every_eps_torch_takes(triton_kernels, state_format, eps):
    """eps = 0 and infinity, as torch.optim.AdamW takes them: the eager kernel's results, bit for bit, all finite."""
    rule, _ = RULES["adamw"]
    codecs = codecs_of("adamw", state_format)
    generator = torch.Generator().manual_seed(3)
    param, grad = torch.randn(3 * BLOCK, generator=generator), torch.randn(3 * BLOCK, generator=generator)
    buffers = random_page_buffers(PageFormat(codecs), param.numel(), generator)
    scalars = adamw_scalars({**ADAMW_GROUP, "eps": eps}, 3)
    (eager, _), (triton, _) = eager_and_triton(triton_kernels, rule, codecs, param, grad, buffers, scalars)
    assert_equal_bits(triton, eager)
    assert triton[0].isfinite().all() and not torch.equal(triton[0], param)


@pytest.mark.parametrize("start", [0, 2**32 - 3 * BLOCK])
@pytest.mark.parametrize(("rule_name", "state_format"), [("adamw", "8bit"), ("lion", "fp32")])
def test_stochastic_rounding_draws_the_eager_bits(triton_kernels, rule_name, state_format, start):
    """bf16 parameters rounded stochastically take the bits of hf_paged.stochastic_rounding's hash, from a start
    whose indices cross 2**32 (the hash's high word) too."""
    rule, _ = RULES[rule_name]
    codecs = codecs_of(rule_name, state_format)
    page_format = PageFormat(codecs)
    generator = torch.Generator().manual_seed(7)
    length = 6 * BLOCK
    param = torch.randn(length, generator=generator).to(torch.bfloat16)
    grad = torch.randn(length, generator=generator).to(torch.bfloat16)
    buffers = random_page_buffers(page_format, length, generator)
    rounding = ElementRounding(*step_keys(seed=12345, step=4), start)
    results = []
    for kernel in (None, triton_kernels.TritonKernel(rule, codecs, SegmentKernel(rule, codecs, False))):
        p, state = param.clone(), [buffer.clone() for buffer in buffers]
        encoded = [codec.select(array, 0, length) for codec, array in zip(codecs, page_format.arrays(state))]
        p_blocks, g_blocks = to_blocks(p, page_format.alignment), to_blocks(grad, page_format.alignment)
        if kernel is None:
            update_segment(rule, codecs, p_blocks, g_blocks, encoded, scalars_of(rule_name), rounding)
        else:
            kernel(p_blocks, g_blocks, encoded, scalars_of(rule_name), rounding)
        results.append([p, *state])
    nearest = param.clone()
    update_in_buffers(rule, codecs, nearest, grad, [b.clone() for b in buffers], 0, scalars_of(rule_name))
    assert not torch.equal(results[0][0], nearest)  # stochastic rounding changed some bits
    assert_equal_bits(results[1], results[0])


_DEFAULT_CAPABILITY_SCRIPT = """
import torch
from hf_paged.codecs import Float32Codec
from hf_paged.kernels import triton_kernels
from hf_paged.kernels.pytorch import SegmentKernel, update_segment
from hf_paged.kernels.rules import adamw_scalars, adamw_update_, lion_update_

assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
generator = torch.Generator().manual_seed(0)
cases = [
    (adamw_update_, 2, adamw_scalars({"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1, "eps": 1e-8}, 3)),
    (lion_update_, 1, {"lr": 1e-3, "decay": 0.9999, "direction_weight": 0.1, "avg_weight": 0.01}),
]
for rule, states, scalars in cases:
    codecs = (Float32Codec(),) * states
    weight = scalars["avg_weight"]
    param, grad = torch.randn(4096, generator=generator), torch.randn(4096, generator=generator)
    old = [torch.rand(4096, generator=generator) for _ in range(states)]
    results = []
    for kernel in (None, triton_kernels.TritonKernel(rule, codecs, SegmentKernel(rule, codecs, False))):
        p, moments = param.clone(), [m.clone() for m in old]
        if kernel is None:
            update_segment(rule, codecs, p, grad, [(m,) for m in moments], scalars)
        else:
            kernel(p, grad, [(m,) for m in moments], scalars)
        results.append(moments[0])
    eager, triton = results
    product = (weight * (grad - old[0])).abs()
    bound = (torch.nextafter(product, product + 1) - product) + (torch.nextafter(eager.abs(), eager.abs() + 1) - eager.abs())
    assert ((triton - eager).abs() <= bound).all(), rule.__name__
    print(rule.__name__, int((triton != eager).sum()))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's default capability lacks FMA")
def test_without_fma_the_pytorch_kernels_differ_only_within_the_lerps_rounding():
    """Where PyTorch's CPU kernels have no fused multiply-add (ATEN_CPU_CAPABILITY=default), their lerp rounds its
    product and its sum apart: a momentum differs from the Triton kernels' by at most an ulp of the product
    ``w (g - m)`` and one of the result (a subprocess, in that capability)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "TRITON_INTERPRET": "1", "HF_PAGED_NATIVE": "0"}
    command = [sys.executable, "-c", _DEFAULT_CAPABILITY_SCRIPT]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    differing = dict(line.split() for line in result.stdout.splitlines())
    assert int(differing["adamw_update_"]) > 0  # the bound is reached for some elements, not vacuous


def make_batch(triton_kernels, rule_name, state_format, generator):
    """A batch over two pages of three tensors (fp32, bf16 and fp16 parameters with gradients of other dtypes),
    segments with partial last blocks, two scalar rows, and stochastic rounding of the bf16 tensor's segments; and
    the per-segment reference of it: ``(batch, segments)``, segments as (tensor, start, length, page, offset, row)."""
    codecs = codecs_of(rule_name, state_format)
    page_format = PageFormat(codecs)
    capacity = 16 * BLOCK
    params = [
        torch.randn(5 * BLOCK + 17, generator=generator),
        torch.randn(3 * BLOCK + 40, generator=generator).to(torch.bfloat16),
        torch.randn(2 * BLOCK, generator=generator).to(torch.float16),
    ]
    grads = [
        torch.randn(params[0].numel(), generator=generator).to(torch.bfloat16),
        torch.randn(params[1].numel(), generator=generator),
        torch.randn(params[2].numel(), generator=generator).to(torch.float16),
    ]
    pages = [random_page_buffers(page_format, capacity, generator) for _ in range(2)]
    segments = [
        (0, 0, 3 * BLOCK, 0, 0, 0),  # tensor 0 in two segments, on two pages
        (0, 3 * BLOCK, 2 * BLOCK + 17, 1, 4 * BLOCK, 0),
        (1, 0, 3 * BLOCK + 40, 0, 4 * BLOCK, 1),
        (2, 0, 2 * BLOCK, 1, 8 * BLOCK, 1),
    ]
    rows = [scalars_of(rule_name, step=3), scalars_of(rule_name, step=1)]
    if rule_name == "lion":
        rows[1] = {**rows[1], "lr": 3e-3, "decay": 0.999}
    kernel = triton_kernels.TritonKernel(RULES[rule_name][0], codecs, SegmentKernel(RULES[rule_name][0], codecs, False))
    scalars = torch.tensor([[row[name] for name in kernel.scalar_names] for row in rows], dtype=torch.float32)
    keys = step_keys(seed=99, step=3)
    rounding = torch.tensor([[-1, -1], [-1, -1], list(keys), [-1, -1]], dtype=torch.int64)
    batch = PageBatch(params, grads, [tuple(page) for page in pages], torch.tensor(segments), scalars, rounding)
    return kernel, batch, segments, rows, keys


@pytest.mark.parametrize("state_format", FORMATS)
@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_a_batch_updates_each_segment_as_the_per_segment_path(triton_kernels, rule_name, state_format):
    """update_batch on segments of several tensors, dtypes, pages and scalar rows, with partial last blocks and
    stochastic rounding of a bf16 tensor: bitwise the eager per-segment path that pads partial blocks."""
    generator = torch.Generator().manual_seed(3)
    kernel, batch, segments, rows, keys = make_batch(triton_kernels, rule_name, state_format, generator)
    rule, _ = RULES[rule_name]
    params = [p.clone() for p in batch.params]
    pages = [[b.clone() for b in page] for page in batch.buffers]
    for tensor, start, length, page, offset, row in segments:
        rounding = ElementRounding(*keys, start) if tensor == 1 else None
        scalars = {name: float(torch.tensor(value, dtype=torch.float32)) for name, value in rows[row].items()}
        grad = batch.grads[tensor][start : start + length]
        update_in_buffers(
            rule, kernel.codecs, params[tensor][start : start + length], grad, pages[page], offset, scalars, rounding
        )
    kernel.update_batch(batch)
    assert_equal_bits(batch.params, params)
    for page, expected in zip(batch.buffers, pages):
        assert_equal_bits(list(page), expected)


def _shaped(tensor: torch.Tensor) -> torch.Tensor:
    """A view of a 1-D tensor with more dimensions: two rows where its length is even, else ``(1, n, 1)``."""
    n = tensor.numel()
    return tensor.view(2, n // 2) if n % 2 == 0 else tensor.view(1, n, 1)


def test_a_batch_takes_contiguous_tensors_of_any_shape(triton_kernels):
    """Parameters and gradients of more dimensions are addressed by their flat element order: bitwise the result
    of their 1-D views."""
    kernel, batch, *_ = make_batch(triton_kernels, "adamw", "8bit", torch.Generator().manual_seed(7))
    flat_params = [p.clone() for p in batch.params]
    flat_pages = [tuple(b.clone() for b in page) for page in batch.buffers]
    kernel.update_batch(PageBatch(flat_params, batch.grads, flat_pages, batch.table, batch.scalars, batch.rounding))
    shaped = [_shaped(p) for p in batch.params]
    kernel.update_batch(
        PageBatch(shaped, [_shaped(g) for g in batch.grads], batch.buffers, batch.table, batch.scalars, batch.rounding)
    )
    assert_equal_bits(batch.params, flat_params)
    for page, expected in zip(batch.buffers, flat_pages):
        assert_equal_bits(list(page), list(expected))


def test_a_batch_that_breaks_the_contract_is_refused_before_any_write(triton_kernels):
    """A table entry outside its tensor, page or scalars, a buffer of another dtype, or a misaligned offset: a
    ValueError that says what is wrong, and nothing written."""
    generator = torch.Generator().manual_seed(5)
    kernel, batch, *_ = make_batch(triton_kernels, "adamw", "8bit", generator)
    before = [t.clone() for t in [*batch.params, *(b for page in batch.buffers for b in page)]]
    bad_rows = {
        "outside its parameter": (0, 0, 6 * BLOCK, 0, 0, 0),
        "outside its page": (2, 0, 2 * BLOCK, 1, 15 * BLOCK, 1),
        "scalar row": (2, 0, 2 * BLOCK, 1, 8 * BLOCK, 2),
        "page index": (2, 0, 2 * BLOCK, 2, 8 * BLOCK, 1),
        "multiple of the block size": (2, 0, 2 * BLOCK, 1, 8 * BLOCK + 16, 1),
    }
    for message, bad in bad_rows.items():
        table = batch.table.clone()
        table[3] = torch.tensor(bad)
        with pytest.raises(ValueError, match=message):
            kernel.update_batch(
                PageBatch(batch.params, batch.grads, batch.buffers, table, batch.scalars, batch.rounding)
            )
    wrong_dtype = [(batch.buffers[0][0].view(torch.uint8), *batch.buffers[0][1:]), batch.buffers[1]]
    with pytest.raises(ValueError, match="dtypes"):
        kernel.update_batch(PageBatch(batch.params, batch.grads, wrong_dtype, batch.table, batch.scalars))
    after = [t for t in [*batch.params, *(b for page in batch.buffers for b in page)]]
    assert_equal_bits(after, before)


def test_fp64_segments_go_to_the_pytorch_kernel_whole_or_not_at_all(triton_kernels, monkeypatch):
    """fp64 tensors, which the Triton kernels do not take, are updated by the fallback as the eager kernel updates
    them; where the fallback fails half way, the segment is put back as it was."""
    rule, codecs = adamw_update_, codecs_of("adamw", "8bit")
    page_format = PageFormat(codecs)
    generator = torch.Generator().manual_seed(2)
    param = torch.randn(2, BLOCK, generator=generator, dtype=torch.float64)
    grad = torch.randn(2, BLOCK, generator=generator, dtype=torch.float64)
    buffers = random_page_buffers(page_format, 2 * BLOCK, generator)
    fallback = SegmentKernel(rule, codecs, False)
    kernel = triton_kernels.TritonKernel(rule, codecs, fallback)
    assert not kernel.takes_batch(param.device, param.dtype, grad.dtype) and not kernel.allocates_nothing(param, grad)
    results = []
    for update in (kernel, fallback):
        p, state = param.clone(), [buffer.clone() for buffer in buffers]
        update(
            p, grad, [c.select(a, 0, 2 * BLOCK) for c, a in zip(codecs, page_format.arrays(state))], scalars_of("adamw")
        )
        results.append([p, *state])
    assert not torch.equal(results[0][0], param)
    assert_equal_bits(results[0], results[1])

    def fails_after_writing(p, g, encoded, scalars):
        p.add_(1.0)
        encoded[0][0].zero_()
        raise torch.OutOfMemoryError("injected after the fallback's first writes")

    monkeypatch.setattr(kernel, "fallback", fails_after_writing)
    p, state = param.clone(), [buffer.clone() for buffer in buffers]
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        kernel(
            p, grad, [c.select(a, 0, 2 * BLOCK) for c, a in zip(codecs, page_format.arrays(state))], scalars_of("adamw")
        )
    assert_equal_bits([p, *state], [param, *buffers])


def test_hf_paged_kernels_chooses_the_family(triton_kernels, monkeypatch):
    """HF_PAGED_KERNELS=triton|native|torch chooses the kernels of CPU pages (Triton's under the interpreter);
    formats without a Triton kernel take the PyTorch kernels; other values are refused, naming the variable."""
    cpu = torch.device("cpu")
    codecs = codecs_of("adamw", "8bit")
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    assert kernel_family(cpu) == "triton"
    assert isinstance(segment_kernel(adamw_update_, codecs, False, cpu), triton_kernels.TritonKernel)
    assert isinstance(segment_kernel(lion_update_, codecs_of("lion", "fp32"), False, cpu), triton_kernels.TritonKernel)
    mixed = (Blockwise8bitCodec(BLOCK, True), Float32Codec())
    assert type(segment_kernel(adamw_update_, mixed, False, cpu)) is SegmentKernel
    monkeypatch.setenv("HF_PAGED_KERNELS", "torch")
    assert type(segment_kernel(adamw_update_, codecs, False, cpu)) is SegmentKernel
    monkeypatch.setenv("HF_PAGED_KERNELS", "native")
    native = segment_kernel(adamw_update_, codecs, False, cpu)
    assert isinstance(native, HostKernel if build_failure() is None else SegmentKernel)
    monkeypatch.delenv("HF_PAGED_KERNELS")
    assert kernel_family(cpu) == "native"
    assert type(segment_kernel(adamw_update_, codecs, False, cpu)) is type(native)
    assert kernel_family(torch.device("meta")) == "torch"
    monkeypatch.setenv("HF_PAGED_KERNELS", "cuda")
    with pytest.raises(ValueError, match="HF_PAGED_KERNELS='cuda' is not allowed: use one of triton, native, torch"):
        segment_kernel(adamw_update_, codecs, False, cpu)
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    monkeypatch.setattr(triton_kernels, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="HF_PAGED_KERNELS=triton.*TRITON_INTERPRET=1"):
        kernel_family(cpu)


@pytest.mark.parametrize(
    ("hip", "capability", "triton_backends", "expected"),
    [
        (None, (8, 0), ["nvidia"], "triton"),
        (None, (9, 0), ["amd", "nvidia"], "triton"),
        (None, (7, 5), ["nvidia"], "torch"),  # before Ampere: the PyTorch kernels
        (None, (9, 0), ["amd"], "torch"),  # a Triton without the NVIDIA backend
        ("6.4", (9, 4), ["amd"], "triton"),  # ROCm
        ("6.4", (9, 4), ["nvidia"], "torch"),
    ],
)
def test_cuda_pages_default_to_triton_where_it_runs(
    triton_kernels, monkeypatch, hip, capability, triton_backends, expected
):
    """Unset, HF_PAGED_KERNELS is triton on a GPU whose backend the installed Triton has (NVIDIA from compute
    capability 8.0, AMD under ROCm), else torch; outside the interpreter CPU pages never take Triton."""
    monkeypatch.delenv("HF_PAGED_KERNELS", raising=False)
    monkeypatch.setattr(triton_kernels, "INTERPRETED", False)
    monkeypatch.setattr(triton_kernels, "backends", dict.fromkeys(triton_backends))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert kernel_family(torch.device("cuda", 0)) == expected
    assert not triton_kernels.runs_on(torch.device("cpu"))


# The whole optimizer on the CPU (the tests' pseudo-device) with HF_PAGED_KERNELS=triton ----------------------------


def build(name: str, **paging):
    case = dict(CASES[name])
    dtype = case.pop("dtype", torch.float32)
    model = make_mlp(dtype=dtype)
    optimizer = OPTIMIZERS[name](decay_groups(model), compiled=False, **case, **optimizer_kwargs(name, **paging))
    return model, optimizer, regression_batches(4, dtype=dtype)


@pytest.fixture
def counted_launches(triton_kernels, monkeypatch):
    """HF_PAGED_KERNELS=triton, and the number of Triton kernel launches so far (a list of one count): calls of
    ``TritonKernel._run``, which every launch, of a page batch, a step's prepared batch or a segment, goes through."""
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    launches = [0]
    launch = triton_kernels.TritonKernel._run

    def counted(self, *args, **kwargs):
        launches[0] += 1
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(triton_kernels.TritonKernel, "_run", counted)
    return launches


def assert_same(model_a, optimizer_a, model_b, optimizer_b) -> None:
    for param_a, param_b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(param_a, param_b)
    state_a, state_b = optimizer_a.state_dict()["state"], optimizer_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        for key in state_a[index]:
            assert torch.equal(state_a[index][key], state_b[index][key]), (index, key)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_optimizer_with_triton_kernels_gives_the_eager_result_under_any_budget(name, counted_launches, monkeypatch):
    """Three steps with the Triton kernels, without a budget and with a budget of one page: bitwise the result of
    the eager PyTorch kernels (and so paging does not change it)."""
    results = {}
    for kernels, paging in (("torch", {}), ("triton", {}), ("triton", {"device_budget": 4096, "prefetch": 0})):
        monkeypatch.setenv("HF_PAGED_KERNELS", kernels)
        model, optimizer, batches = build(name, **paging)
        before = counted_launches[0]
        train(model, optimizer, batches[:3])
        assert (counted_launches[0] > before) == (kernels == "triton")
        results[kernels, bool(paging)] = model, optimizer
    assert results["triton", True][1].paging_stats()["page_outs"] > 0
    assert_same(*results["triton", False], *results["torch", False])
    assert_same(*results["triton", True], *results["torch", False])


@pytest.mark.parametrize("name", ["PagedAdamW4bit", "PagedLion"])
def test_resume_with_triton_kernels_is_bitwise(name, counted_launches):
    """Two steps, the state dict into a new optimizer (another budget), two more steps: bitwise four steps."""
    model, optimizer, batches = build(name)
    train(model, optimizer, batches)
    resumed_model, resumed, _ = build(name, device_budget=2 * 4096)
    interrupted_model, interrupted, _ = build(name)
    train(interrupted_model, interrupted, batches[:2])
    resumed_model.load_state_dict(interrupted_model.state_dict())
    resumed.load_state_dict(copy.deepcopy(interrupted.state_dict()))
    train(resumed_model, resumed, batches[2:])
    assert_same(resumed_model, resumed, model, optimizer)


def test_an_out_of_memory_error_in_a_step_with_triton_kernels_is_recovered_bitwise(counted_launches):
    """Step 2 fails at an allocation (a page, the kernel's tables): the step finishes under a smaller budget with
    bitwise the result of a step without the error."""
    name, budget = "PagedAdamW8bit", 2 * 4096
    model, optimizer, batches = build(name, device_budget=budget)
    train(model, optimizer, batches[:1])
    counted = FailingAllocations()
    mark_streaming(optimizer, counted)
    failing_step(model, optimizer, batches[1], counted)
    assert counted.in_step is not None and counted.count > counted.in_step
    reference_model, reference, _ = build(name, device_budget=budget)
    train(reference_model, reference, batches[:2])
    expected = snapshot(reference_model, reference)
    points = sorted({round(x) for x in torch.linspace(counted.in_step + 1, counted.count, 4).tolist()})
    for at in points:
        model, optimizer, _ = build(name, device_budget=budget)
        optimizer.oom_retries = 8
        recoveries = []
        optimizer.on_oom_recovery = recoveries.append
        train(model, optimizer, batches[:1])
        failing_step(model, optimizer, batches[1], FailingAllocations({at}))
        assert [r.phase for r in recoveries] == ["optimizer step"], at
        actual = snapshot(model, optimizer)
        for param, expected_param in zip(actual[0], expected[0]):
            assert torch.equal(param, expected_param), at
        for index, entry in actual[1]["state"].items():
            for key, value in entry.items():
                assert torch.equal(value, expected[1]["state"][index][key]), (at, index, key)


@pytest.mark.parametrize(
    ("name", "budget"),
    [
        pytest.param("PagedAdamW8bit", None, marks=pytest.mark.slow),  # resident pages: the streamed case's launches
        ("PagedAdamW4bit", 2 * 4096),
    ],
)
def test_an_out_of_memory_error_at_any_allocation_of_a_first_step_with_triton_kernels_is_recovered_bitwise(
    name, budget, counted_launches
):
    """The first step fails at each of its allocations in turn, the launch tables its first launch makes among them
    (the table of all rows, then the table of all page addresses): the step recovers, and after a second step the
    parameters and state equal those of a run without the error (its first step counted under the same dispatch
    mode, through which bf16 operations may round otherwise)."""
    warm_model, warm, batches = build(name)
    train(warm_model, warm, batches[:1])  # the Triton kernels check themselves here, once per process
    reference_model, reference, _ = build(name, device_budget=budget)
    counted = FailingAllocations()
    failing_step(reference_model, reference, batches[0], counted)
    train(reference_model, reference, batches[1:2])
    assert counted_launches[0] > 0 and counted.count > 2
    for at in range(1, counted.count + 1):
        model, optimizer, _ = build(name, device_budget=budget)
        optimizer.oom_retries = 8
        recoveries = []
        optimizer.on_oom_recovery = recoveries.append
        failing_step(model, optimizer, batches[0], FailingAllocations({at}))
        assert [r.phase for r in recoveries] == ["optimizer step"], at
        train(model, optimizer, batches[1:2])
        assert_same(model, optimizer, reference_model, reference)
