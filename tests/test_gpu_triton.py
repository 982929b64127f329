"""The Triton kernels (hf_paged/kernels/triton_kernels.py) compiled for a CUDA device, against the PyTorch kernels.

Until a GPU runs these, the Triton kernels have run only under Triton's CPU interpreter (tests/test_triton_kernels.py);
here they are compiled by Triton for the device (``enable_fp_fusion=False``) and checked: every rule, state format
(rank-1 normalized 4-bit AdamW state included: its update and its gathering of statistics) and dtype against the eager
PyTorch kernel on the CPU (bitwise where the CPU's lerp is one fused multiply-add, as the module documents) and on the
device (within the module's bound); the first-use self-check passing for every combination and catching a corrupted
element; the whole optimizer with ``HF_PAGED_KERNELS=triton`` bitwise the CPU's eager optimizer on the same
gradients, with and without a budget of one page; and at most one launch per page batch
and state format per step. Marker ``gpu``; skipped without CUDA (``python -m pytest -q -m gpu tests/test_gpu_triton.py``).

hf_paged.kernels.triton_kernels is imported inside the tests only: imported at collection outside Triton's interpreter
it would make tests/test_triton_kernels.py skip itself on a machine without CUDA.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, second_moment_midpoints
from triton_cases import (
    BLOCK,
    CASES,
    DTYPES,
    FORMATS,
    RANK1_CODECS,
    RULES,
    codecs_of,
    rank1_case,
    scalars_of,
    squared_gradient_state,
)

from hf_paged import PagedAdamW4bit
from hf_paged.codecs import PageFormat, random_page_buffers
from hf_paged.kernels import SegmentKernel
from hf_paged.kernels.batch import PageBatch
from hf_paged.kernels.pytorch import update_in_buffers
from hf_paged.kernels.rules import adamw_update_
from hf_paged.optim.executor import StepRun
from hf_paged.stochastic_rounding import ElementRounding, step_keys

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = torch.device("cuda", 0)


@pytest.fixture
def triton_kernels(monkeypatch):
    """hf_paged.kernels.triton_kernels, where the installed Triton compiles for the device, with no self-check
    verdicts yet in this process."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    module = importlib.import_module("hf_paged.kernels.triton_kernels")
    if module.INTERPRETED or not module.runs_on(DEVICE):
        pytest.skip(f"the Triton kernels do not run on {torch.cuda.get_device_name(DEVICE)} here")
    monkeypatch.setattr(module, "_SELF_CHECKS", {})
    return module


def fp32_scalars(rule_name: str) -> dict[str, float]:
    """The rule's scalars, each rounded once to fp32 (as a batch's scalar table holds them)."""
    return {name: float(torch.tensor(value, dtype=torch.float32)) for name, value in scalars_of(rule_name).items()}


SEGMENTS = [
    # (tensor, start, length, page, offset): tensor 0 in two segments on two pages, partial last blocks
    (0, 0, 20 * BLOCK, 0, 0),
    (0, 20 * BLOCK, 17 * BLOCK + 17, 1, 8 * BLOCK),
    (1, 0, 5 * BLOCK + 3, 0, 24 * BLOCK),
]
LENGTHS = (37 * BLOCK + 17, 5 * BLOCK + 3)
CAPACITY = 32 * BLOCK


def batch_case(rule_name: str, state_format: str, dtype: torch.dtype, rounds: bool):
    """CPU inputs of a batch: params and grads of ``dtype`` (grads of tensor 1 fp32), two pages, SEGMENTS, and
    stochastic rounding keys for the segments of tensor 0 where ``rounds``."""
    generator = torch.Generator().manual_seed(11)
    params = [torch.randn(n, generator=generator).to(dtype) for n in LENGTHS]
    grads = [
        (torch.randn(n, generator=generator) * 10.0 ** torch.randint(-4, 1, (n,), generator=generator)).to(grad_dtype)
        for n, grad_dtype in zip(LENGTHS, (dtype, torch.float32))
    ]
    page_format = PageFormat(codecs_of(rule_name, state_format))
    pages = [random_page_buffers(page_format, CAPACITY, generator) for _ in range(2)]
    keys = step_keys(seed=31, step=3) if rounds else None
    return params, grads, pages, keys


def run_reference(rule_name, state_format, params, grads, pages, keys, device):
    """The eager PyTorch kernel's results on ``device``: [params..., page buffers...] on the CPU."""
    rule, _ = RULES[rule_name]
    codecs = codecs_of(rule_name, state_format)
    params = [p.to(device, copy=True) for p in params]
    pages = [[b.to(device, copy=True) for b in page] for page in pages]
    for tensor, start, length, page, offset in SEGMENTS:
        rounding = ElementRounding(*keys, start) if keys is not None and tensor == 0 else None
        update_in_buffers(
            rule,
            codecs,
            params[tensor][start : start + length],
            grads[tensor][start : start + length].to(device),
            pages[page],
            offset,
            fp32_scalars(rule_name),
            rounding,
        )
    return [t.cpu() for t in (*params, *(b for page in pages for b in page))]


def run_triton(triton_kernels, rule_name, state_format, params, grads, pages, keys, device):
    """The Triton kernel's results on ``device`` (one update_batch): [params..., page buffers...] on the CPU."""
    rule, _ = RULES[rule_name]
    codecs = codecs_of(rule_name, state_format)
    kernel = triton_kernels.TritonKernel(rule, codecs, SegmentKernel(rule, codecs, False))
    params = [p.to(device, copy=True) for p in params]
    pages = [tuple(b.to(device, copy=True) for b in page) for page in pages]
    scalars = fp32_scalars(rule_name)
    table = torch.tensor([[*segment, 0] for segment in SEGMENTS], dtype=torch.int64)
    rounding = None
    if keys is not None:
        rounding = torch.tensor([list(keys) if tensor == 0 else [-1, -1] for tensor, *_ in SEGMENTS])
    batch = PageBatch(
        params,
        [g.to(device) for g in grads],
        list(pages),
        table.to(device),
        torch.tensor([[scalars[name] for name in kernel.scalar_names]], dtype=torch.float32).to(device),
        None if rounding is None else rounding.to(device),
    )
    kernel.update_batch(batch)
    return [t.cpu() for t in (*params, *(b for page in pages for b in page))]


def disagreements(triton_kernels, actual, expected, state_format, exact) -> list[int]:
    """Per tensor, the elements of ``actual`` that differ from ``expected`` (bitwise or beyond the bound)."""
    return [
        triton_kernels._disagreement(a, e, packed=state_format == "4bit" and e.dtype == torch.uint8, exact=exact)
        for a, e in zip(actual, expected)
    ]


@pytest.mark.parametrize("rounds", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("state_format", FORMATS)
@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_triton_kernels_match_the_pytorch_kernels_on_cuda(triton_kernels, rule_name, state_format, dtype, rounds):
    """A batch of three segments (two pages, partial last blocks, two tensors, fp32 gradients beside ``dtype``
    ones, stochastic rounding of bf16 where asked): the parameters, codes, scales and fp32 state of the eager PyTorch
    kernel on the CPU, bit for bit where its lerp is one fma (else within the bound), and of the eager PyTorch kernel
    on the device within the bound. A miscompiled element fails the first comparison: every element of the inputs
    is updated (the parameters move, asserted) and compared by its bits."""
    if rounds and dtype != torch.bfloat16:
        pytest.skip("stochastic rounding rounds bf16 parameters only")
    inputs = batch_case(rule_name, state_format, dtype, rounds)
    triton_results = run_triton(triton_kernels, rule_name, state_format, *inputs, DEVICE)
    on_cpu = run_reference(rule_name, state_format, *inputs, torch.device("cpu"))
    on_device = run_reference(rule_name, state_format, *inputs, DEVICE)
    for before, after in zip(inputs[0], on_cpu):
        assert not torch.equal(before, after)  # the update moved the parameters
    exact = triton_kernels.lerp_rounds_once()
    assert disagreements(triton_kernels, triton_results, on_cpu, state_format, exact) == [0] * len(on_cpu)
    assert disagreements(triton_kernels, triton_results, on_device, state_format, False) == [0] * len(on_cpu)


def test_the_4bit_second_moment_takes_the_cpu_codes_at_its_midpoints_on_cuda(triton_kernels):
    """The second moments of tests/conftest.py's ``second_moment_midpoints`` (on and beside the rounding thresholds;
    tests/test_triton_kernels.py checks the same under the interpreter)."""
    grad, lowest, highest = second_moment_midpoints(BLOCK)
    packed = squared_gradient_state(triton_kernels, "4bit", grad, DEVICE)[2]
    codes = torch.cat([packed & 15, packed >> 4], dim=1)
    assert ((codes >= lowest) & (codes <= highest)).all()


@pytest.mark.parametrize("state_format", ["8bit", "4bit"])
def test_a_subnormal_second_moments_block_takes_the_cpu_codes_on_cuda(triton_kernels, state_format):
    """Second moments near 1e-40 in a block whose scale is subnormal: the device must not flush it to zero."""
    grad = torch.randn(2, BLOCK, generator=torch.Generator().manual_seed(0)) * 1e-20
    scales = squared_gradient_state(triton_kernels, state_format, grad, DEVICE)[3]
    assert ((scales > 0) & (scales < torch.finfo(torch.float32).tiny)).all()


@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("state_format", FORMATS)
@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_every_combination_passes_the_self_check_on_cuda(
    triton_kernels, rule_name, state_format, param_dtype, grad_dtype
):
    """The first-use self-check of every rule, format and dtype pair passes on the device: else the optimizer would
    take the PyTorch kernels for that combination (and log it)."""
    rule, _ = RULES[rule_name]
    codecs = codecs_of(rule_name, state_format)
    kernel = triton_kernels.TritonKernel(rule, codecs, SegmentKernel(rule, codecs, False))
    assert triton_kernels.self_check(kernel, DEVICE, param_dtype, grad_dtype) is None
    assert kernel.takes_batch(DEVICE, param_dtype, grad_dtype)


@pytest.mark.parametrize("corrupted", ["parameter", "code", "scale"])
def test_the_self_check_catches_a_corrupted_element_on_cuda(triton_kernels, monkeypatch, corrupted):
    """One element changed after the compiled kernel ran (the parameter, a code, a scale) fails the self-check and
    sends the combination to the PyTorch kernels: the check compares each element, so the guard is the
    comparison, and it catches one element."""
    rule, codecs = adamw_update_, codecs_of("adamw", "8bit")
    kernel = triton_kernels.TritonKernel(rule, codecs, SegmentKernel(rule, codecs, False))
    launch = triton_kernels.TritonKernel._launch

    def corrupting(self, batch, round_shift):
        launch(self, batch, round_shift)
        target = {"parameter": batch.params[0], "code": batch.buffers[0][0], "scale": batch.buffers[0][1]}[corrupted]
        target[1] += 1 if corrupted == "code" else 1.0

    monkeypatch.setattr(triton_kernels.TritonKernel, "_launch", corrupting)
    failure = triton_kernels.self_check(kernel, DEVICE, torch.float32, torch.float32)
    expected = "the parameter" if corrupted == "parameter" else f"state buffer {0 if corrupted == 'code' else 1}"
    assert failure is not None and failure.startswith(f"{expected} differs from the PyTorch kernel's in 1 of")
    assert not kernel.takes_batch(DEVICE, torch.float32, torch.float32)


def train_with_fixed_grads(name: str, device: torch.device, steps: int = 3, **paging):
    """``steps`` steps of an optimizer of the tiny MLP's parameters on ``device`` with gradients drawn on the CPU (the
    same on every device; no forward pass, whose matmuls differ between devices): the model and the optimizer."""
    case = dict(CASES[name])
    dtype = case.pop("dtype", torch.float32)
    model = make_mlp(dtype=dtype).to(device)
    optimizer = OPTIMIZERS[name](decay_groups(model), compiled=False, **case, **optimizer_kwargs(name, **paging))
    generator = torch.Generator().manual_seed(4)
    for _ in range(steps):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator).to(device, dtype)
        optimizer.step()
    return model, optimizer


def assert_same(model_a, optimizer_a, model_b, optimizer_b) -> None:
    for param_a, param_b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(param_a.cpu(), param_b.cpu())
    state_a, state_b = optimizer_a.state_dict()["state"], optimizer_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        for key in state_a[index]:
            assert torch.equal(state_a[index][key].cpu(), state_b[index][key].cpu()), (index, key)


@pytest.fixture
def counted(triton_kernels, monkeypatch):
    """Kernel launches inside the page batches a step launches (``TritonLaunches.update``; not the self-check's), and
    those batches, of the Triton kernels: a dict of counts."""
    counts = {"launches": 0, "batches": 0, "inside": 0}
    kernel = triton_kernels._update_batch_kernel
    update = triton_kernels.TritonLaunches.update

    class Counted:
        def __getitem__(self, grid):
            counts["launches"] += counts["inside"]
            return kernel[grid]

    def counted_update(self, pages, version):
        counts["batches"] += 1
        counts["inside"] = 1
        try:
            return update(self, pages, version)
        finally:
            counts["inside"] = 0

    monkeypatch.setattr(triton_kernels, "_update_batch_kernel", Counted())
    monkeypatch.setattr(triton_kernels.TritonLaunches, "update", counted_update)
    return counts


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_optimizer_with_triton_kernels_on_cuda_is_the_cpu_eager_optimizer(
    name, triton_kernels, counted, monkeypatch
):
    """Three steps with HF_PAGED_KERNELS=triton on the device, without a budget and with a budget of one page: the
    same bits with and without paging (rule 1), bitwise the eager PyTorch kernels on the CPU on the same gradients
    (where the CPU's lerp is one fma), and at most one launch per page batch (the executor's ``update_pages`` call
    on the resident pages the store yields) and state format among its pages. A kernel that is not used (a failed
    self-check) fails the counts (no launch); one that changed an element fails the comparisons."""
    monkeypatch.setenv("HF_PAGED_KERNELS", "torch")
    reference = train_with_fixed_grads(name, torch.device("cpu"))
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    page_batches = []
    update_pages = StepRun.update_pages

    def counted_update_pages(self, pages):
        before = counted["launches"]
        update_pages(self, pages)
        page_batches.append((counted["launches"] - before, len({page.format for page in pages})))

    monkeypatch.setattr(StepRun, "update_pages", counted_update_pages)
    results = []
    for paging in ({}, {"device_budget": 4096, "prefetch": 0}):
        counted.update(launches=0, batches=0)
        page_batches.clear()
        model, optimizer = train_with_fixed_grads(name, DEVICE, **paging)
        assert 0 < counted["launches"] == counted["batches"], counted
        assert all(launches <= formats for launches, formats in page_batches), page_batches
        if paging:
            assert optimizer.paging_stats()["page_outs"] > 0
        results.append((model, optimizer))
    assert_same(*results[1], *results[0])
    if triton_kernels.lerp_rounds_once():
        assert_same(*results[0], *reference)


# Rank-1 normalized 4-bit AdamW state ------------------------------------------------------------------------------


@pytest.mark.parametrize("rounds", [False, True], ids=["nearest", "stochastic"])
def test_rank1_kernels_match_the_pytorch_references_on_cuda(triton_kernels, rounds):
    """update_batch and gather_batch of rank-1 state compiled for the device (tests/triton_cases.py's batch: segments
    across and inside rows, partial last blocks, fp32, bf16 and fp16 tensors, zero normalizers, saturated codes; for
    the gather, maxima partly raised and non-finite gradients): the parameters, codes and gathered maxima of
    update_in_buffers and gather_in_buffers on the CPU, bit for bit where the CPU's lerp is one fma (else within the
    module's bound). The parameters move and the maxima rise, so a kernel that skipped elements would fail."""
    kernel = triton_kernels.TritonKernel(adamw_update_, RANK1_CODECS, SegmentKernel(adamw_update_, RANK1_CODECS, False))
    exact = triton_kernels.lerp_rounds_once()

    case = rank1_case(seed=21, rounds=rounds)
    expected_params, expected_pages = case.updated()
    batch = case.batch(DEVICE)
    kernel.update_batch(batch)
    actual = [t.cpu() for t in (*batch.params, *(b for page in batch.buffers for b in page))]
    expected = [*expected_params, *(b for page in expected_pages for b in page)]
    for before, after in zip(case.params, expected_params):
        assert not torch.equal(before, after)
    differing = [triton_kernels._disagreement(a, e, e.dtype == torch.uint8, exact) for a, e in zip(actual, expected)]
    assert differing == [0] * len(expected)

    case = rank1_case(seed=22, gathering=True)
    expected_statistics = case.gathered()
    batch = case.batch(DEVICE)
    kernel.gather_batch(batch)
    for actual_entry, expected_entry, before in zip(batch.statistics, expected_statistics, case.statistics):
        assert any(not torch.equal(e, b) for e, b in zip(expected_entry[4:], before[4:]))
        for a, e in zip(actual_entry, expected_entry):
            assert triton_kernels._disagreement(a.cpu(), e, False, exact) == 0
    assert all(torch.equal(p.cpu(), q) for p, q in zip(batch.params, case.params))


@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
def test_rank1_state_passes_the_self_check_on_cuda(triton_kernels, param_dtype, grad_dtype):
    """The first-use self-check of rank-1 state (gathered maxima, then the updates) passes on the device for every
    dtype pair: else the optimizer would take the PyTorch kernels for it."""
    kernel = triton_kernels.TritonKernel(adamw_update_, RANK1_CODECS, SegmentKernel(adamw_update_, RANK1_CODECS, False))
    assert triton_kernels.self_check(kernel, DEVICE, param_dtype, grad_dtype) is None
    assert kernel.takes_batch(DEVICE, param_dtype, grad_dtype)


def train_rank1_with_fixed_grads(device: torch.device, steps: int = 3, **paging):
    """``steps`` steps of PagedAdamW4bit(normalization="rank1", block_size=64) on a 256 x 304 matrix (rank-1 state over
    several pages, cut inside rows) and small tensors on ``device``, gradients drawn on the CPU: the parameters and the optimizer."""
    generator = torch.Generator().manual_seed(6)
    shapes = ((256, 304), (1024 + 37,), (300,), (5,))
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device)) for shape in shapes]
    optimizer = PagedAdamW4bit(params, lr=1e-2, block_size=64, page_size=32 * 2**10, normalization="rank1", **paging)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(device)
        optimizer.step()
    assert optimizer._layout[params[0]].kind == "4bit-rank1"
    return params, optimizer


def test_the_rank1_optimizer_on_cuda_is_the_cpu_eager_optimizer(triton_kernels, monkeypatch):
    """Three steps of a rank-1 optimizer with HF_PAGED_KERNELS=triton on the device, with and without a budget of
    one page: every rank-1 page batch gathered and updated by the Triton kernels, the same bits with and without
    paging, and bitwise the CPU's eager optimizer on the same gradients (where the CPU's lerp is one fma)."""
    monkeypatch.setenv("HF_PAGED_KERNELS", "torch")
    reference_params, reference = train_rank1_with_fixed_grads(torch.device("cpu"))
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    counts = {"gather_batch": 0, "update_batch": 0}

    def counting(name):
        method = getattr(triton_kernels.TritonKernel, name)

        def counted(self, batch):
            counts[name] += self.rank1
            return method(self, batch)

        return counted

    for name in counts:
        monkeypatch.setattr(triton_kernels.TritonKernel, name, counting(name))
    results = []
    for paging in ({}, {"device_budget": 32 * 2**10, "prefetch": 0}):
        counts.update(gather_batch=0, update_batch=0)
        params, optimizer = train_rank1_with_fixed_grads(DEVICE, **paging)
        assert counts["gather_batch"] >= 3 and counts["update_batch"] >= 3, counts
        if paging:
            assert optimizer.paging_stats()["page_outs"] > 0
        results.append((params, optimizer))
    comparisons = [results[0]] + ([(reference_params, reference)] if triton_kernels.lerp_rounds_once() else [])
    for params, optimizer in comparisons:
        for mine, theirs in zip(results[1][0], params):
            assert torch.equal(mine.detach().cpu(), theirs.detach().cpu())
        state, other = results[1][1].state_dict()["state"], optimizer.state_dict()["state"]
        assert state.keys() == other.keys()
        for index in state:
            for key in state[index]:
                assert torch.equal(state[index][key].cpu(), other[index][key].cpu()), (index, key)
