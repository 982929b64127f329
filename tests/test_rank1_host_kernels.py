"""The host kernels of rank-1 normalized 4-bit AdamW state (hf_paged/native/host_kernels.cpp: ``adamw_rank1_batch_``
and ``adamw_rank1_gather_``, through ``HostKernel.update_batch`` and ``gather_batch``) against their references, one
call of ``gather_in_buffers`` and ``update_in_buffers`` per segment.

A batch holds segments of four matrices on three pages: a matrix cut across pages inside a row, a segment that starts
off its block in the matrix, blocks that span several rows of a narrow matrix, partial last blocks, two rows of
scalars, and its table in no particular order. Each step gathers the next statistics and then updates, as the
optimizer's step does (``StepRun.gather_statistics``, then the update).
"""

from __future__ import annotations

import pytest
import torch
from test_batch_kernels import ADAMW_ROWS, assert_same, bits, clone_all, rounding_keys

import hf_paged
from hf_paged.codecs import Blockwise4bitCodec, PageFormat, Rank1Normalized4bitCodec, Rank1Statistics
from hf_paged.kernels import HostKernel, SegmentKernel, host_rule_name, segment_kernel
from hf_paged.kernels.batch import NO_ROUNDING, PageBatch
from hf_paged.kernels.host import fits_vector_lanes
from hf_paged.kernels.pytorch import gather_in_buffers, update_in_buffers
from hf_paged.kernels.rules import adamw_moments_, adamw_update_, lion_update_
from hf_paged.stochastic_rounding import ElementRounding

CPU = torch.device("cpu")
BLOCK = 64
FORMAT = PageFormat((Rank1Normalized4bitCodec(BLOCK, True), Rank1Normalized4bitCodec(BLOCK, False)))
SHAPES = [(40, 50), (13, 37), (100, 10), (7, 200)]
CAPACITY = 2560
SEGMENTS = [  # (tensor, start, length, page, offset, scalar row), in no particular order
    (2, 0, 1000, 1, 1408, 1),  # ten columns: each block spans rows
    (0, 640, 1360, 1, 0, 1),  # starts inside row 12
    (1, 100, 381, 0, 768, 0),  # starts off its block, inside row 7
    (0, 0, 640, 0, 0, 0),
    (3, 192, 1208, 2, 0, 1),
    (1, 0, 100, 0, 640, 0),
    (3, 0, 192, 2, 1280, 0),
]


def host_kernel() -> HostKernel:
    return HostKernel("adamw", FORMAT.codecs, SegmentKernel(adamw_update_, FORMAT.codecs, False))


def random_maxima(count: int, generator: torch.Generator) -> torch.Tensor:
    """Maxima over seven orders of magnitude, with zeros (a row or column never written) and a subnormal."""
    maxima = torch.rand(count, generator=generator) * 10.0 ** torch.randint(-6, 1, (count,), generator=generator)
    maxima[1] = 0.0
    maxima[-1] = 1e-40
    return maxima


def random_setup(
    dtype: torch.dtype, seed: int, shapes=SHAPES, capacity=CAPACITY, pages=3
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, ...]], list[Rank1Statistics]]:
    """Parameters, gradients (a zero run), pages of random codes, and statistics of random current maxima."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]
    grads = [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]
    grads[0].view(-1)[:70] = 0
    buffers = [
        tuple(
            torch.randint(0, 256, (n,), generator=generator, dtype=torch.uint8)
            for n, _ in FORMAT.buffer_specs(capacity)
        )
        for _ in range(pages)
    ]
    statistics = []
    for shape in shapes:
        tensor_statistics = Rank1Statistics(shape, 2)
        for state in range(2):
            tensor_statistics.rows[state].copy_(random_maxima(shape[0], generator))
            tensor_statistics.cols[state].copy_(random_maxima(shape[1], generator))
        statistics.append(tensor_statistics)
    return params, grads, buffers, statistics


def clone_statistics(statistics: list[Rank1Statistics]) -> list[Rank1Statistics]:
    copies = []
    for tensor_statistics in statistics:
        copy = Rank1Statistics(tensor_statistics.shape, 2)
        for name in ("rows", "cols", "next_rows", "next_cols"):
            for mine, theirs in zip(getattr(copy, name), getattr(tensor_statistics, name)):
                mine.copy_(theirs)
        copies.append(copy)
    return copies


def make_batch(kernel, params, grads, pages, statistics, keys, segments=SEGMENTS) -> PageBatch:
    table = torch.tensor(segments, dtype=torch.int64)
    scalars = torch.tensor([[row[name] for name in kernel.scalar_names] for row in ADAMW_ROWS], dtype=torch.float32)
    rounding = None
    if any(key is not None for key in keys):
        rounding = torch.tensor(
            [keys[tensor] if keys[tensor] is not None else (NO_ROUNDING, NO_ROUNDING) for tensor, *_ in segments],
            dtype=torch.int64,
        )
    entries = [tensor_statistics.batch_entry() for tensor_statistics in statistics]
    return PageBatch(params, grads, list(pages), table, scalars, rounding, entries)


def reference_gather(grads, pages, statistics, segments=SEGMENTS) -> None:
    for tensor, start, length, page, offset, row in segments:
        grad = grads[tensor].view(-1)[start : start + length]
        gather_in_buffers(
            adamw_moments_, FORMAT.codecs, grad, pages[page], offset, ADAMW_ROWS[row], statistics[tensor], start
        )


def reference_update(params, grads, pages, statistics, keys, segments=SEGMENTS) -> None:
    for tensor, start, length, page, offset, row in segments:
        param = params[tensor].view(-1)[start : start + length]
        grad = grads[tensor].view(-1)[start : start + length]
        rounding = None if keys[tensor] is None else ElementRounding(*keys[tensor], start)
        update_in_buffers(
            adamw_update_,
            FORMAT.codecs,
            param,
            grad,
            pages[page],
            offset,
            ADAMW_ROWS[row],
            rounding,
            statistics=statistics[tensor],
            first=start,
        )


def assert_same_statistics(statistics, expected) -> None:
    for index, (mine, theirs) in enumerate(zip(statistics, expected)):
        for name in ("rows", "cols", "next_rows", "next_cols"):
            for state, (a, b) in enumerate(zip(getattr(mine, name), getattr(theirs, name))):
                assert torch.equal(bits(a), bits(b)), f"tensor {index}: {name}[{state}]: {(a != b).sum()} differ"


def steps_both_ways(kernel, setup, keys, steps=2, segments=SEGMENTS) -> None:
    """``steps`` steps of the kernel and of the references from ``setup``: after each gathering the next maxima, and
    after each update the parameters, pages and statistics, bitwise equal."""
    params, grads, pages, statistics = setup
    mine = (*clone_all(params, pages), clone_statistics(statistics))
    theirs = (*clone_all(params, pages), clone_statistics(statistics))
    for _ in range(steps):
        for tensor_statistics in (*mine[2], *theirs[2]):
            tensor_statistics.begin()
        batch = make_batch(kernel, mine[0], grads, mine[1], mine[2], keys, segments)
        kernel.gather_batch(batch)
        reference_gather(grads, theirs[1], theirs[2], segments)
        assert any(maxima.any() for entry in batch.statistics for maxima in entry[4:])  # it did gather
        assert_same_statistics(mine[2], theirs[2])
        kernel.update_batch(batch)
        reference_update(theirs[0], grads, theirs[1], theirs[2], keys, segments)
        assert_same(mine[:2], theirs[:2])
        for tensor_statistics in (*mine[2], *theirs[2]):
            tensor_statistics.commit()
    assert not all(torch.equal(a, b) for a, b in zip(mine[0], params))  # it did update


@pytest.mark.parametrize("rounds", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rank1_batches_match_the_references(built, dtype, rounds):
    kernel = host_kernel()
    assert kernel.takes_batch(CPU, dtype, dtype)
    setup = random_setup(dtype, seed=0)
    steps_both_ways(kernel, setup, rounding_keys(setup[0], rounds))


def test_rank1_batches_of_mixed_dtypes_match_the_references(built):
    """Each tensor's parameter and gradient dtypes on their own (fp32 parameters with bf16 gradients, ...)."""
    kernel = host_kernel()
    params, grads, pages, statistics = random_setup(torch.float32, seed=1)
    dtypes = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16), (torch.float16, torch.float32)]
    params = [param.to(dtypes[k % 3][0]) for k, param in enumerate(params)]
    grads = [grad.to(dtypes[k % 3][1]) for k, grad in enumerate(grads)]
    steps_both_ways(kernel, (params, grads, pages, statistics), rounding_keys(params, True))


def test_rank1_batches_match_the_references_on_arbitrary_next_maxima(built):
    """Next maxima that do not bound the new state (saturated codes), zero (the code of 0) and subnormal."""
    kernel = host_kernel()
    params, grads, pages, statistics = random_setup(torch.float32, seed=2)
    generator = torch.Generator().manual_seed(3)
    for tensor_statistics in statistics:
        for state in range(2):
            tensor_statistics.next_rows[state].copy_(random_maxima(tensor_statistics.shape[0], generator))
            tensor_statistics.next_cols[state].copy_(random_maxima(tensor_statistics.shape[1], generator))
    mine = (*clone_all(params, pages), statistics)
    theirs = clone_all(params, pages)
    kernel.update_batch(make_batch(kernel, mine[0], grads, mine[1], statistics, [None] * 4))
    reference_update(theirs[0], grads, theirs[1], statistics, [None] * 4)
    assert_same(mine[:2], theirs)


def test_rank1_gathering_counts_nan_as_zero_and_infinity_as_the_largest_float(built):
    kernel = host_kernel()
    params, grads, pages, statistics = random_setup(torch.float32, seed=4)
    grads[0][3, 5], grads[0][30, 7] = float("nan"), float("inf")
    grads[2][50, 3] = float("-inf")
    theirs = clone_statistics(statistics)
    kernel.gather_batch(make_batch(kernel, params, grads, pages, statistics, [None] * 4))
    reference_gather(grads, pages, theirs)
    assert_same_statistics(statistics, theirs)
    largest = torch.finfo(torch.float32).max
    assert statistics[0].next_rows[1][30] == largest and statistics[2].next_cols[0][3] == largest


def test_rank1_batches_are_independent_of_the_number_of_threads(built):
    """A matrix of many blocks over two pages, updated on one thread and on two (threads share its rows and
    columns' maxima while gathering), bitwise the references either way."""
    shapes = [(300, 500), (9, 1100)]
    segments = [(0, 0, 70_001, 0, 0, 0), (0, 70_001, 79_999, 1, 0, 1), (1, 0, 9900, 0, 70_016, 1)]
    setup = random_setup(torch.bfloat16, seed=5, shapes=shapes, capacity=2**17, pages=2)
    keys = rounding_keys(setup[0], True)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            steps_both_ways(host_kernel(), setup, keys, steps=1, segments=segments)
    finally:
        torch.set_num_threads(threads)


def test_rank1_batch_calls_allocate_nothing(built):
    kernel = host_kernel()
    params, grads, pages, statistics = random_setup(torch.bfloat16, seed=6)
    batch = make_batch(kernel, params, grads, pages, statistics, rounding_keys(params, True))
    kernel.gather_batch(batch)
    kernel.update_batch(batch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        kernel.gather_batch(batch)
        kernel.update_batch(batch)
    allocations = [e for e in profile.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0]
    assert allocations == []


def replace_row(index, **changes):
    columns = ("tensor", "start", "length", "page", "offset", "row")
    row = dict(zip(columns, SEGMENTS[index]))
    row.update(changes)
    return [*SEGMENTS[:index], tuple(row[column] for column in columns), *SEGMENTS[index + 1 :]]


def bad_batches(kernel, params, grads, pages, statistics):
    """Batches that break the contract, each with its error, for both operators."""
    good = make_batch(kernel, params, grads, pages, statistics, [None] * 4)
    entries = good.statistics
    short = [*entries[:3], (*entries[3][:5], entries[3][5][:-1], *entries[3][6:])]
    narrower = [*entries[:2], Rank1Statistics((100, 9), 2).batch_entry(), entries[3]]
    shared = [(*entries[0][:4], entries[0][0], *entries[0][5:]), *entries[1:]]

    def with_table(segments):
        return make_batch(kernel, params, grads, pages, statistics, [None] * 4, segments)

    return {
        "no statistics": (PageBatch(params, grads, pages, good.table, good.scalars), "needs statistics"),
        "statistics of three tensors": (
            PageBatch(params, grads, pages, good.table, good.scalars, None, entries[:3]),
            "must hold 8 tensors per parameter",
        ),
        "a next column maximum missing": (
            PageBatch(params, grads, pages, good.table, good.scalars, None, short),
            r"statistics\[29\] must be a contiguous CPU fp32 tensor of 200",
        ),
        "fp64 maxima": (
            PageBatch(
                params,
                grads,
                pages,
                good.table,
                good.scalars,
                None,
                [*entries[:3], (entries[3][0].double(), *entries[3][1:])],
            ),
            r"statistics\[24\] must be a contiguous CPU fp32 tensor",
        ),
        "statistics of another shape": (
            PageBatch(params, grads, pages, good.table, good.scalars, None, narrower),
            r"params\[2\] has 1000 elements, its statistics 100 rows of 9 columns",
        ),
        "the next maxima of the current ones": (
            PageBatch(params, grads, pages, good.table, good.scalars, None, shared),
            r"statistics\[4\] shares memory with statistics\[0\]",
        ),
        "scales in the pages": (
            PageBatch(
                params,
                grads,
                [(*page, torch.zeros(40), torch.zeros(40)) for page in pages],
                good.table,
                good.scalars,
                None,
                entries,
            ),
            r"buffers\[2\] must be a contiguous CPU tensor of Byte",
        ),
        "past the page's end": (
            with_table(replace_row(4, offset=1408)),
            "of page 2, whose state 0 has 1280 code bytes",
        ),
        "past the tensor's end": (
            with_table(replace_row(2, length=382)),
            r"takes elements \[100, 100 \+ 382\) of a tensor of 481",
        ),
        "overlapping state": (with_table(replace_row(5, offset=704)), "overlap in their pages' state"),
        "a bf16 rounding key of an fp32 parameter": (
            PageBatch(
                params,
                grads,
                pages,
                good.table,
                good.scalars,
                torch.zeros(len(SEGMENTS), 2, dtype=torch.int64),
                entries,
            ),
            "only bf16 parameters round stochastically",
        ),
    }


BAD_CASES = [
    "no statistics",
    "statistics of three tensors",
    "a next column maximum missing",
    "fp64 maxima",
    "statistics of another shape",
    "scales in the pages",
    "past the page's end",
    "past the tensor's end",
    "overlapping state",
]


@pytest.mark.parametrize(
    "operation, case",
    [
        *(("update_batch", case) for case in BAD_CASES),
        ("update_batch", "a bf16 rounding key of an fp32 parameter"),  # the gathering does not round
        *(("gather_batch", case) for case in BAD_CASES),
        ("gather_batch", "the next maxima of the current ones"),  # the update does not write them
    ],
)
def test_bad_rank1_batches_raise_and_change_nothing(built, operation, case):
    kernel = host_kernel()
    params, grads, pages, statistics = random_setup(torch.float32, seed=7)
    for tensor_statistics in statistics:
        tensor_statistics.begin()
    before = (*clone_all(params, pages), clone_statistics(statistics))
    batch, message = bad_batches(kernel, params, grads, pages, statistics)[case]
    with pytest.raises((RuntimeError, ValueError), match=message):
        getattr(kernel, operation)(batch)
    assert_same((params, pages), before[:2])
    assert_same_statistics(statistics, before[2])


def test_rank1_state_has_a_host_kernel_for_adamw_only(built):
    assert host_rule_name(adamw_update_, FORMAT.codecs) == "adamw"
    assert host_rule_name(adamw_update_, FORMAT.codecs[::-1]) is None
    assert host_rule_name(lion_update_, FORMAT.codecs[:1]) is None
    assert fits_vector_lanes(FORMAT.codecs)
    narrow = (Rank1Normalized4bitCodec(16, True), Rank1Normalized4bitCodec(16, False))
    assert fits_vector_lanes(narrow) == (torch.ops.hf_paged.vector_lanes() <= 8)
    assert not host_kernel().allocates_nothing(torch.zeros(1), torch.zeros(1))  # its segments take the fallback
    blockwise = (Blockwise4bitCodec(BLOCK, True), Blockwise4bitCodec(BLOCK, False))
    with pytest.raises(TypeError, match="Blockwise4bitCodec state has no statistics"):
        HostKernel("adamw", blockwise, SegmentKernel(adamw_update_, blockwise, False)).gather_batch(None)


def test_rank1_segments_go_to_the_fallback(built):
    """The per-segment path (a page the optimizer updates segment by segment) hands rank-1 segments, whose encoded
    state carries its normalizers, to the PyTorch kernel: bitwise its result."""
    params, grads, pages, statistics = random_setup(torch.bfloat16, seed=8)
    tensor_statistics = statistics[0]
    for state in range(2):
        tensor_statistics.next_rows[state].copy_(tensor_statistics.rows[state])
        tensor_statistics.next_cols[state].copy_(tensor_statistics.cols[state])
    results = []
    for kernel in (host_kernel(), SegmentKernel(adamw_update_, FORMAT.codecs, False)):
        param, page = params[0].view(-1)[:640].clone(), tuple(buffer.clone() for buffer in pages[0])
        arrays = FORMAT.arrays(page)
        encoded = [codec.select(array, 0, 640) for codec, array in zip(FORMAT.codecs, arrays)]
        encoded = tensor_statistics.attach(encoded, 0, 640, BLOCK)
        kernel(param.view(-1, BLOCK), grads[0].view(-1)[:640].view(-1, BLOCK), encoded, dict(ADAMW_ROWS[0]))
        results.append((param, page))
    assert not torch.equal(results[0][0], params[0].view(-1)[:640])
    assert_same(([results[0][0]], [results[0][1]]), ([results[1][0]], [results[1][1]]))


def fit(monkeypatch, kernels: str, dtype: torch.dtype, rounds: bool):
    """Three steps of ``PagedAdamW4bit(normalization="rank1")`` on a 256 x 320 matrix (rank-1 state over several
    pages, cut inside rows), a 64 x 64 one (block scales) and a vector, with ``HF_PAGED_KERNELS=kernels``."""
    monkeypatch.setenv("HF_PAGED_KERNELS", kernels)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in ((256, 320), (64, 64), (300,))]
    optimizer = hf_paged.PagedAdamW4bit(
        [{"params": params, "bf16_stochastic_round": rounds}],
        lr=1e-2,
        weight_decay=0.1,
        block_size=BLOCK,
        min_4bit_size=256,
        page_size=16384,
        normalization="rank1",
    )
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(dtype)
        optimizer.step()
    assert optimizer._layout[params[0]].kind == "4bit-rank1"
    assert len(optimizer._layout[params[0]].segments) > 1
    return params, optimizer


@pytest.mark.parametrize(
    "dtype, rounds", [(torch.float32, False), (torch.bfloat16, True), (torch.float16, False)], ids=str
)
def test_rank1_optimizer_steps_take_the_host_kernels_with_the_eager_results(built, monkeypatch, dtype, rounds):
    monkeypatch.setenv("HF_PAGED_NATIVE", "1")
    reference, reference_optimizer = fit(monkeypatch, "torch", dtype, rounds)
    calls = []
    for name in ("gather_batch", "update_batch"):
        method = getattr(HostKernel, name)

        def counted(kernel, batch, method=method, name=name):
            calls.append((name, kernel.rank1))
            method(kernel, batch)

        monkeypatch.setattr(HostKernel, name, counted)
    params, optimizer = fit(monkeypatch, "native", dtype, rounds)
    assert isinstance(segment_kernel(adamw_update_, FORMAT.codecs, False, CPU), HostKernel)
    assert calls.count(("gather_batch", True)) >= 3 and calls.count(("update_batch", True)) >= 3
    for param, expected in zip(params, reference, strict=True):
        assert torch.equal(bits(param.detach()), bits(expected.detach()))
    saved, expected_state = optimizer.state_dict()["state"], reference_optimizer.state_dict()["state"]
    assert set(saved[0]) == set(expected_state[0]) and "exp_avg_row_max" in saved[0]
    for index, entries in expected_state.items():
        for key, value in entries.items():
            assert torch.equal(saved[index][key], value), (index, key)
