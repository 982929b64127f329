"""The Triton kernels of rank-1 normalized 4-bit AdamW state (hf_paged/kernels/triton_kernels.py) on the CPU under
Triton's interpreter: ``update_batch`` bitwise the per-segment reference (``update_in_buffers`` with the tensors'
statistics) and ``gather_batch`` bitwise ``gather_in_buffers``' maxima over segments that cross rows, start inside
rows and end in partial blocks, of several tensors and dtypes; refusal of bad batches before any write; the choice
of the kernel, its per-segment fallback and its first-use self-check; and ``PagedAdamW4bit(normalization="rank1")``
under ``HF_PAGED_KERNELS=triton``: one launch per page batch, bitwise ``HF_PAGED_KERNELS=torch``.

The interpreter is set up as in tests/test_triton_kernels.py (whose import skips this module where it cannot be).
"""

from __future__ import annotations

import pytest
import torch
from conftest import regression_batches, train
from test_rank1 import PAGE, build
from test_step_failures import assert_same, snapshot
from test_triton_kernels import TRITON_KERNELS, assert_equal_bits
from triton_cases import RANK1_BLOCK, RANK1_CODECS, RANK1_SEGMENTS, codecs_of, rank1_case

from hf_paged.codecs import Blockwise4bitCodec, PageFormat, Rank1Normalized4bitCodec, Rank1Statistics, to_blocks
from hf_paged.kernels import SegmentKernel, segment_kernel, stubbed_triton_kernels
from hf_paged.kernels.batch import PageBatch
from hf_paged.kernels.pytorch import update_segment
from hf_paged.kernels.rules import adamw_update_, lion_update_
from hf_paged.optim import executor

FLOAT32_MAX = torch.finfo(torch.float32).max


@pytest.fixture(autouse=True)
def triton_kernels(monkeypatch):
    """hf_paged.kernels.triton_kernels under the interpreter, ``TRITON_INTERPRET=1`` while a test runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return TRITON_KERNELS


def rank1_kernel(triton_kernels):
    return triton_kernels.TritonKernel(adamw_update_, RANK1_CODECS, SegmentKernel(adamw_update_, RANK1_CODECS, False))


def pages_of(batch: PageBatch) -> list[torch.Tensor]:
    return [buffer for page in batch.buffers for buffer in page]


@pytest.mark.parametrize("rounds", [False, True], ids=["nearest", "stochastic"])
def test_update_batch_is_the_per_segment_path_bitwise(triton_kernels, rounds):
    """Five segments of three tensors (fp32, bf16, fp16 parameters; bf16, fp32, fp16 gradients) on two pages, two
    scalar rows, segments across and inside rows, partial last blocks at and before a tensor's end, zero normalizers
    and next maxima below the new values (saturated codes), bf16 rounded stochastically or not: the parameters and
    packed codes of update_in_buffers with each tensor's statistics, bit for bit; the statistics untouched."""
    case = rank1_case(seed=3, rounds=rounds)
    expected_params, expected_pages = case.updated()
    batch = case.batch()
    rank1_kernel(triton_kernels).update_batch(batch)
    for before, after in zip(case.params, expected_params):
        assert not torch.equal(before, after)  # every tensor moved
    assert_equal_bits(batch.params, expected_params)
    assert_equal_bits(pages_of(batch), [buffer for page in expected_pages for buffer in page])
    assert_equal_bits([t for entry in batch.statistics for t in entry], [t for e in case.statistics for t in e])


def test_gather_batch_raises_the_next_maxima_as_the_reference_and_writes_nothing_else(triton_kernels):
    """The next row and column maxima of both states after gather_batch: bitwise gather_in_buffers' over the same
    segments, from maxima partly raised already, with an infinite gradient (the largest fp32 value) and a NaN one
    (0); the parameters, gradients, pages and current maxima unchanged."""
    case = rank1_case(seed=5, gathering=True)
    expected = case.gathered()
    batch = case.batch()
    rank1_kernel(triton_kernels).gather_batch(batch)
    for actual_entry, expected_entry, before in zip(batch.statistics, expected, case.statistics):
        assert_equal_bits(list(actual_entry), list(expected_entry))
        assert any(not torch.equal(a, b) for a, b in zip(actual_entry[4:], before[4:]))  # raised
    assert (batch.statistics[0][4] == FLOAT32_MAX).sum() == 1  # the infinite gradient's row, in both states
    assert (batch.statistics[0][6] == FLOAT32_MAX).sum() == 1
    assert_equal_bits([*batch.params, *batch.grads], [*case.params, *case.grads])
    assert_equal_bits(pages_of(batch), [buffer for page in case.pages for buffer in page])


def test_gather_then_update_encodes_each_rows_largest_value_exactly(triton_kernels):
    """gather_batch from zero, then update_batch with what it gathered: the largest magnitude of every row and column
    of the new first moment decodes exactly (its normalizer is itself), as the reference's."""
    case = rank1_case(seed=6)
    for tensor, entry in enumerate(case.statistics):
        case.statistics[tensor] = (*entry[:4], *(torch.zeros_like(t) for t in entry[4:]))
    kernel = rank1_kernel(triton_kernels)
    batch = case.batch()
    kernel.gather_batch(batch)
    kernel.update_batch(batch)
    case.statistics = case.gathered()
    expected_params, expected_pages = case.updated()
    assert_equal_bits(batch.params, expected_params)
    assert_equal_bits(pages_of(batch), [buffer for page in expected_pages for buffer in page])
    # tensor 2 lies in two segments on page 1: its decoded first moment has each row's maximum exactly
    statistics = Rank1Statistics((16, 7), 2)
    statistics.rows = [batch.statistics[2][4], batch.statistics[2][6]]
    statistics.cols = [batch.statistics[2][5], batch.statistics[2][7]]
    values = []
    for _, start, length, _, offset, _ in [segment for segment in RANK1_SEGMENTS if segment[0] == 2]:
        (packed,) = RANK1_CODECS[0].select((batch.buffers[1][0],), offset, length)
        (attached,) = statistics.attach([(packed,)], start, length, RANK1_BLOCK, gathering=True)
        values.append(RANK1_CODECS[0].decode(attached).reshape(-1)[:length])
    decoded = torch.cat(values).view(16, 7)
    assert torch.equal(decoded.abs().amax(dim=1), statistics.rows[0])


@pytest.mark.parametrize("operation", ["update_batch", "gather_batch"])
def test_bad_batches_are_refused_before_any_write(triton_kernels, operation):
    """No statistics, statistics that do not fit a parameter or its states, statistics off the contiguous layout,
    a segment outside its parameter or page or off a block: a ValueError that says what is wrong, nothing written."""
    case = rank1_case(seed=7)
    batch = case.batch()
    kernel = rank1_kernel(triton_kernels)
    everything = [*batch.params, *pages_of(batch), *(t for entry in batch.statistics for t in entry)]
    before = [t.clone() for t in everything]
    entry = batch.statistics[0]
    bad_statistics = {
        "needs the tensors' statistics": None,
        "different shapes": [(*entry[:4], entry[4][:-1].clone(), *entry[5:]), *batch.statistics[1:]],
        "statistics of a 6 x 40 tensor for a parameter of 150": [entry, entry, batch.statistics[2]],
        "contiguous": [(torch.zeros(12)[::2], *entry[1:]), *batch.statistics[1:]],
        "8 fp32 tensors": [entry[:7], *batch.statistics[1:]],
    }
    for message, statistics in bad_statistics.items():
        bad = PageBatch(
            batch.params, batch.grads, batch.buffers, batch.table, batch.scalars, batch.rounding, statistics
        )
        with pytest.raises(ValueError, match=message):
            getattr(kernel, operation)(bad)
    bad_rows = {
        "outside its parameter": (2, 45, 68, 1, 10 * RANK1_BLOCK, 1),
        "outside its page": (2, 45, 67, 1, 14 * RANK1_BLOCK, 1),
        "multiple of the block size": (2, 45, 67, 1, 10 * RANK1_BLOCK + 16, 1),
    }
    for message, row in bad_rows.items():
        table = batch.table.clone()
        table[-1] = torch.tensor(row)
        bad = PageBatch(batch.params, batch.grads, batch.buffers, table, batch.scalars, None, batch.statistics)
        with pytest.raises(ValueError, match=message):
            getattr(kernel, operation)(bad)
    assert_equal_bits(everything, before)


def test_gather_batch_takes_rank1_state_only(triton_kernels):
    codecs = codecs_of("adamw", "4bit")
    kernel = triton_kernels.TritonKernel(adamw_update_, codecs, SegmentKernel(adamw_update_, codecs, False))
    table = torch.zeros((0, 6), dtype=torch.int64)
    batch = PageBatch([torch.zeros(64)], [torch.zeros(64)], [], table, torch.zeros((1, 7)))
    with pytest.raises(ValueError, match="rank-1 normalized state only"):
        kernel.gather_batch(batch)


def test_the_triton_kernel_takes_adamws_rank1_state_and_hands_single_segments_to_its_fallback(
    triton_kernels, monkeypatch
):
    """HF_PAGED_KERNELS=triton gives the Triton kernel for AdamW's rank-1 states (signed, then non-negative, one block
    size), not for Lion's or mixed ones; a segment called one by one (codes with normalizers appended) goes to the
    PyTorch fallback, bitwise its result, and allocates, so the optimizer chunks it."""
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    cpu = torch.device("cpu")
    assert triton_kernels.triton_rule(adamw_update_, RANK1_CODECS) == ("adamw", 4, RANK1_BLOCK)
    kernel = segment_kernel(adamw_update_, RANK1_CODECS, False, cpu)
    assert isinstance(kernel, triton_kernels.TritonKernel) and kernel.rank1
    unsigned, signed = Rank1Normalized4bitCodec(RANK1_BLOCK, False), Rank1Normalized4bitCodec(RANK1_BLOCK, True)
    for rule, codecs in [
        (lion_update_, (signed,)),
        (adamw_update_, (unsigned, signed)),
        (adamw_update_, (signed, Rank1Normalized4bitCodec(2 * RANK1_BLOCK, False))),
        (adamw_update_, (signed, Blockwise4bitCodec(RANK1_BLOCK, False))),
    ]:
        assert triton_kernels.triton_rule(rule, codecs) is None
        assert type(segment_kernel(rule, codecs, False, cpu)) is SegmentKernel

    case = rank1_case(seed=8)
    statistics = case.tracked(0)
    param, grad = case.params[0].view(-1)[:64], case.grads[0].view(-1)[:64]
    assert not kernel.allocates_nothing(param, grad)
    fallback, calls = kernel.fallback, []

    def counted_fallback(*args):
        calls.append(args)
        return fallback(*args)

    monkeypatch.setattr(kernel, "fallback", counted_fallback)
    results = []
    for update in (kernel, None):
        p, page = param.clone(), [b.clone() for b in case.pages[0]]
        arrays = PageFormat(RANK1_CODECS).arrays(tuple(page))
        encoded = [codec.select(array, 0, 64) for codec, array in zip(RANK1_CODECS, arrays)]
        encoded = statistics.attach(encoded, 0, 64, RANK1_BLOCK)
        p_blocks, g_blocks = to_blocks(p, RANK1_BLOCK), to_blocks(grad, RANK1_BLOCK)
        if update is None:
            update_segment(adamw_update_, RANK1_CODECS, p_blocks, g_blocks, encoded, case.scalars[0])
        else:
            update(p_blocks, g_blocks, encoded, case.scalars[0])
        results.append([p, *page])
    assert len(calls) == 1
    assert not torch.equal(results[1][0], param)
    assert_equal_bits(results[0], results[1])


@pytest.mark.parametrize("corrupted", [None, "maxima", "code"])
def test_the_self_check_checks_the_gathered_statistics_and_the_update(triton_kernels, monkeypatch, corrupted):
    """The first-use self-check of rank-1 state passes for fp32 and bf16 parameters, and fails where one next maximum
    gathered or one code written differs from the reference's."""
    kernel = rank1_kernel(triton_kernels)
    launch = triton_kernels.TritonKernel._launch

    def corrupting(self, batch, round_shift):
        launch(self, batch, round_shift)
        if corrupted == "maxima" and round_shift is None:
            batch.statistics[0][5][2] += 1.0
        if corrupted == "code" and round_shift is not None:
            batch.buffers[0][0][3] ^= 1

    monkeypatch.setattr(triton_kernels.TritonKernel, "_launch", corrupting)
    cpu = torch.device("cpu")
    failures = [
        triton_kernels.self_check(kernel, cpu, dtype, torch.float32) for dtype in (torch.float32, torch.bfloat16)
    ]
    if corrupted is None:
        assert failures == [None, None]
    elif corrupted == "maxima":
        assert all(
            f.startswith("the next column maxima of state 0 differ from the PyTorch kernel's in 1 of") for f in failures
        )
    else:
        assert all(f.startswith("state buffer 0 differs from the PyTorch kernel's in 1 of") for f in failures)


@pytest.fixture
def counted(triton_kernels, monkeypatch):
    """HF_PAGED_KERNELS=triton; the launches of the gather and update kernels, the rank-1 page batches gathered and
    updated (the step's ``TritonLaunches.gather`` and ``update``), and the segments gathered by the PyTorch path: a
    dict of counts."""
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    counts = dict.fromkeys(["gather_launches", "update_launches", "gathers", "updates", "fallback_gathers"], 0)
    inside: list[str] = []

    class Counted:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            if inside:
                counts[self.name] += 1
            return self.kernel[grid]

    def counting(method, name):
        def counted_method(self, *args):
            if self.kernel.rank1:
                counts[name] += 1
                inside.append(name)
            try:
                return method(self, *args)
            finally:
                if self.kernel.rank1:
                    inside.pop()

        return counted_method

    def counted_fallback(*args, **kwargs):
        counts["fallback_gathers"] += 1
        return gather_segment_statistics(*args, **kwargs)

    gather_segment_statistics = executor.gather_segment_statistics
    for name, kernel in (("gather_launches", "_gather_batch_kernel"), ("update_launches", "_update_batch_kernel")):
        monkeypatch.setattr(triton_kernels, kernel, Counted(getattr(triton_kernels, kernel), name))
    launches = triton_kernels.TritonLaunches
    monkeypatch.setattr(launches, "gather", counting(launches.gather, "gathers"))
    monkeypatch.setattr(launches, "update", counting(launches.update, "updates"))
    monkeypatch.setattr(executor, "gather_segment_statistics", counted_fallback)
    return counts


def test_the_rank1_optimizer_steps_through_the_triton_kernels_as_the_pytorch_kernels(counted, monkeypatch):
    """Three steps of PagedAdamW4bit(normalization="rank1") with HF_PAGED_KERNELS=triton, with and without a budget
    of one page (the rank-1 matrix over five pages, cut inside rows): every rank-1 page batch gathered and updated in
    one launch each, nothing gathered segment by segment, and bitwise the parameters, codes and statistics of
    HF_PAGED_KERNELS=torch."""
    batches = regression_batches(3)
    monkeypatch.setenv("HF_PAGED_KERNELS", "torch")
    model, optimizer = build()
    train(model, optimizer, batches)
    expected = snapshot(model, optimizer)
    assert counted["gathers"] == counted["updates"] == 0
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    for budget in (None, PAGE):
        counted.update(dict.fromkeys(counted, 0))
        model, optimizer = build(budget=budget, prefetch=0)
        train(model, optimizer, batches)
        assert counted["gathers"] >= 3 and counted["updates"] >= 3, counted
        assert counted["gather_launches"] == counted["gathers"] and counted["update_launches"] == counted["updates"]
        assert counted["fallback_gathers"] == 0
        if budget is not None:
            assert counted["gathers"] >= 3 * 5 and optimizer.paging_stats()["page_outs"] > 0
        assert_same(snapshot(model, optimizer), expected)


def test_stubbed_triton_kernels_stub_the_gathers_too(counted, monkeypatch):
    """Inside stubbed_triton_kernels (the planner's and benchmarks' host-only steps) a rank-1 optimizer's step gathers
    and updates its page batches through its prepared launches, whose kernel launches do nothing: no kernel runs and
    nothing raises."""
    model, optimizer = build()
    train(model, optimizer, regression_batches(1))  # the self-checks, outside the stub
    counted.update(dict.fromkeys(counted, 0))
    with stubbed_triton_kernels() as stubbed:
        assert stubbed
        train(model, optimizer, regression_batches(1))
    assert counted["gathers"] > 0 and counted["updates"] > 0
    assert counted["gather_launches"] == counted["update_launches"] == counted["fallback_gathers"] == 0
