"""The host kernels' batch operators (hf_paged/native/host_kernels.cpp, ``HostKernel.update_batch``) against the
per-segment path: the eager PyTorch kernel and the per-segment host operators, one call per segment with partial
last blocks through zero-padded copies, as the optimizer's step updates segments (``PagedOptimizer._update_segment``).

A batch holds segments of several tensors on several pages, tensors cut across pages, segments of odd lengths (partial
last blocks) at page offsets other than zero, two rows of scalars, and its table in no particular order.
"""

from __future__ import annotations

import pytest
import torch
from conftest import decay_groups, make_mlp, regression_batches, train
from torch._subclasses.fake_tensor import FakeTensorMode

import hf_paged
from hf_paged.codecs import Blockwise4bitCodec, Blockwise8bitCodec, Float32Codec, PageFormat, to_blocks
from hf_paged.kernels import HostKernel, SegmentKernel, host_rule_name, segment_kernel
from hf_paged.kernels.batch import NO_ROUNDING, PageBatch
from hf_paged.kernels.rules import adamw_scalars, adamw_update_, ademamix_scalars, ademamix_update_, lion_update_
from hf_paged.stochastic_rounding import ElementRounding, parameter_seed, step_keys

CPU = torch.device("cpu")
ADAMW_ROWS = [
    adamw_scalars({"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}, 3),
    adamw_scalars({"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0}, 1),
]
LION_ROWS = [
    {"lr": 1e-2, "decay": 1 - 1e-2 * 0.1, "direction_weight": 0.1, "avg_weight": 0.01},
    {
        "lr": 3e-4,
        "decay": 1.0,
        "direction_weight": 0.6,
        "avg_weight": 0.7,
    },  # weights of 0.5 and more: ATen's other lerp
]
ADEMAMIX_ROWS = [
    ademamix_scalars(
        {"lr": 1e-2, "betas": (0.9, 0.999, 0.9999), "alpha": 5.0, "t_alpha": None, "t_beta3": None, "eps": 1e-8,
         "weight_decay": 1e-2},
        3,
    ),
    ademamix_scalars(
        {"lr": 3e-3, "betas": (0.4, 0.99, 0.999), "alpha": 8.0, "t_alpha": 10, "t_beta3": 10, "eps": 1e-6,
         "weight_decay": 0.0},
        2,
    ),
]  # fmt: skip
RULES = {
    "adamw": (adamw_update_, (True, False), ADAMW_ROWS),
    "lion": (lion_update_, (True,), LION_ROWS),
    "ademamix": (ademamix_update_, (True, True, False), ADEMAMIX_ROWS),
}
FORMATS = {
    "8bit": lambda signed: Blockwise8bitCodec(64, signed),
    "4bit": lambda signed: Blockwise4bitCodec(64, signed),
    "fp32": lambda signed: Float32Codec(),
}
TENSOR_LENGTHS = [1000, 517, 77, 130]
CAPACITY = 1280
SEGMENTS = [  # (tensor, start, length, page, offset, scalar row), in no particular order
    (3, 0, 130, 2, 128, 1),
    (0, 0, 600, 0, 0, 0),
    (1, 0, 517, 0, 640, 1),
    (0, 600, 400, 1, 0, 0),
    (2, 0, 77, 1, 448, 0),
]


def page_format(rule_name: str, format_name: str) -> PageFormat:
    return PageFormat(tuple(FORMATS[format_name](signed) for signed in RULES[rule_name][1]))


def random_pages(
    page_format: PageFormat, signed: tuple[bool, ...], pages: int, generator: torch.Generator
) -> list[tuple[torch.Tensor, ...]]:
    """Pages of state spanning eight orders of magnitude (non-negative where not ``signed``), every element (padding
    included) encoded from a value."""
    result = []
    for _ in range(pages):
        buffers = []
        for codec, is_signed in zip(page_format.codecs, signed):
            arrays = tuple(torch.empty(n, dtype=dtype) for n, dtype in codec.buffer_specs(CAPACITY))
            values = torch.randn(CAPACITY // codec.alignment, codec.alignment, generator=generator)
            values = values * torch.logspace(-8, 0, values.shape[0]).unsqueeze(1)
            if not is_signed:
                values = values.square()
            values[1] = 0  # an all-zero block
            codec.encode(values if codec.alignment > 1 else values.view(-1), codec.select(arrays, 0, CAPACITY))
            buffers.extend(arrays)
        result.append(tuple(buffers))
    return result


def random_tensors(dtype: torch.dtype, generator: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params = [torch.randn(n, generator=generator).to(dtype) for n in TENSOR_LENGTHS]
    grads = [torch.randn(n, generator=generator).to(dtype) for n in TENSOR_LENGTHS]
    grads[0][:64] = 0
    return params, grads


def rounding_keys(params: list[torch.Tensor], rounds: bool) -> list[tuple[int, int] | None]:
    """Each tensor's stochastic rounding keys at step 3 where it rounds (bf16 tensors, when ``rounds``)."""
    return [
        step_keys(parameter_seed(1234, position), 3) if rounds and param.dtype == torch.bfloat16 else None
        for position, param in enumerate(params)
    ]


def clone_all(params, pages):
    return [param.clone() for param in params], [tuple(buffer.clone() for buffer in page) for page in pages]


def update_per_segment(kernel, page_format, params, grads, pages, rows, keys, segments=SEGMENTS) -> None:
    """One kernel call per segment's whole blocks, and one per partial last block through zero-padded copies."""
    alignment = page_format.alignment
    for tensor, start, length, page, offset, row in segments:
        param, grad = params[tensor][start : start + length], grads[tensor][start : start + length]
        arrays = page_format.arrays(pages[page])
        body = length - length % alignment
        scalars = dict(rows[row])
        head = None if keys[tensor] is None else ElementRounding(*keys[tensor], start)
        tail = None if keys[tensor] is None else ElementRounding(*keys[tensor], start + body)
        if body:
            encoded = [codec.select(array, offset, body) for codec, array in zip(page_format.codecs, arrays)]
            kernel(to_blocks(param[:body], alignment), to_blocks(grad[:body], alignment), encoded, scalars, head)
        if body < length:
            encoded = [
                codec.select(array, offset + body, length - body) for codec, array in zip(page_format.codecs, arrays)
            ]
            padded = to_blocks(param[body:], alignment)
            kernel(padded, to_blocks(grad[body:], alignment), encoded, scalars, tail)
            param[body:].copy_(padded.view(-1)[: length - body])


def make_batch(kernel, params, grads, pages, rows, keys, segments=SEGMENTS) -> PageBatch:
    table = torch.tensor(segments, dtype=torch.int64)
    scalars = torch.tensor([[row[name] for name in kernel.scalar_names] for row in rows], dtype=torch.float32)
    rounding = None
    if any(key is not None for key in keys):
        rounding = torch.tensor(
            [keys[tensor] if keys[tensor] is not None else (NO_ROUNDING, NO_ROUNDING) for tensor, *_ in segments],
            dtype=torch.int64,
        )
    return PageBatch(params, grads, list(pages), table, scalars, rounding)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaNs compare by payload)."""
    return tensor.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[tensor.element_size()])


def assert_same(result, expected) -> None:
    (params, pages), (expected_params, expected_pages) = result, expected
    for index, (param, expected_param) in enumerate(zip(params, expected_params)):
        differ = (bits(param) != bits(expected_param)).sum()
        assert torch.equal(bits(param), bits(expected_param)), f"tensor {index}: {differ} elements differ"
    for index, (page, expected_page) in enumerate(zip(pages, expected_pages)):
        for buffer, expected_buffer in zip(page, expected_page):
            differ = (bits(buffer) != bits(expected_buffer)).sum()
            assert torch.equal(bits(buffer), bits(expected_buffer)), (
                f"page {index}: {differ} of {buffer.numel()} entries differ"
            )


def host_kernel(rule_name: str, page_format: PageFormat) -> HostKernel:
    rule = RULES[rule_name][0]
    return HostKernel(rule_name, page_format.codecs, SegmentKernel(rule, page_format.codecs, False))


@pytest.mark.parametrize("rounds", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("format_name", sorted(FORMATS))
@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_a_batch_matches_the_per_segment_path(built, rule_name, format_name, dtype, rounds):
    rule, _, rows = RULES[rule_name]
    fmt = page_format(rule_name, format_name)
    generator = torch.Generator().manual_seed(0)
    params, grads = random_tensors(dtype, generator)
    pages = random_pages(fmt, RULES[rule_name][1], 3, generator)
    keys = rounding_keys(params, rounds)
    kernel = host_kernel(rule_name, fmt)
    assert kernel.takes_batch(CPU, dtype, dtype)
    eager = clone_all(params, pages)
    per_segment_host = clone_all(params, pages)
    batched = clone_all(params, pages)
    for _ in range(2):  # the second step reads the state the first wrote
        update_per_segment(SegmentKernel(rule, fmt.codecs, False), fmt, *eager[:1], grads, eager[1], rows, keys)
        update_per_segment(kernel, fmt, per_segment_host[0], grads, per_segment_host[1], rows, keys)
        kernel.update_batch(make_batch(kernel, batched[0], grads, batched[1], rows, keys))
    assert not all(torch.equal(a, b) for a, b in zip(batched[0], params))  # it did update
    assert_same(per_segment_host, eager)
    assert_same(batched, eager)


SHAPES = [(20, 50), (11, 47), (7, 11), (2, 5, 13)]
"""Shapes of the tensors of TENSOR_LENGTHS' lengths (in order)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("format_name", sorted(FORMATS))
@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_a_batch_takes_contiguous_tensors_of_any_shape(built, rule_name, format_name, dtype):
    """Parameters and gradients of any shape (a gradient's may differ from its parameter's) are addressed by their
    flat element order: bitwise the result of their 1-D views, stochastic rounding included."""
    _, _, rows = RULES[rule_name]
    fmt = page_format(rule_name, format_name)
    generator = torch.Generator().manual_seed(5)
    params, grads = random_tensors(dtype, generator)
    pages = random_pages(fmt, RULES[rule_name][1], 3, generator)
    keys = rounding_keys(params, rounds=True)
    kernel = host_kernel(rule_name, fmt)
    flat, shaped = clone_all(params, pages), clone_all(params, pages)
    shaped_params = [param.view(shape) for param, shape in zip(shaped[0], SHAPES)]
    shaped_grads = [grad.view(shape[::-1]) for grad, shape in zip(grads, SHAPES)]
    kernel.update_batch(make_batch(kernel, flat[0], grads, flat[1], rows, keys))
    kernel.update_batch(make_batch(kernel, shaped_params, shaped_grads, shaped[1], rows, keys))
    assert not all(torch.equal(a, b) for a, b in zip(flat[0], params))
    assert_same(shaped, flat)


@pytest.mark.parametrize("format_name", sorted(FORMATS))
@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_a_batch_is_independent_of_the_number_of_threads(built, rule_name, format_name):
    fmt = page_format(rule_name, format_name)
    generator = torch.Generator().manual_seed(1)
    lengths = [70_001, 50_000, 333]
    params = [torch.randn(n, generator=generator).to(torch.bfloat16) for n in lengths]
    grads = [torch.randn(n, generator=generator).to(torch.bfloat16) for n in lengths]
    capacity = 2**17
    pages = []
    for _ in range(2):
        buffers = []
        for codec in fmt.codecs:
            arrays = tuple(torch.zeros(n, dtype=dtype) for n, dtype in codec.buffer_specs(capacity))
            buffers.extend(arrays)
        pages.append(tuple(buffers))
    segments = [(0, 0, 70_001, 0, 0, 0), (1, 0, 50_000, 0, 70_016, 0), (2, 0, 333, 1, 64, 1)]
    rows = RULES[rule_name][2]
    keys = rounding_keys(params, True)
    kernel = host_kernel(rule_name, fmt)
    threads = torch.get_num_threads()
    results = []
    for count in (1, 2):
        state = clone_all(params, pages)
        torch.set_num_threads(count)
        try:
            for _ in range(2):
                kernel.update_batch(make_batch(kernel, state[0], grads, state[1], rows, keys, segments))
        finally:
            torch.set_num_threads(threads)
        results.append(state)
    assert_same(results[1], results[0])


def test_a_batch_call_allocates_nothing(built):
    fmt = page_format("adamw", "8bit")
    generator = torch.Generator().manual_seed(3)
    params, grads = random_tensors(torch.bfloat16, generator)
    pages = random_pages(fmt, RULES["adamw"][1], 3, generator)
    kernel = host_kernel("adamw", fmt)
    batch = make_batch(kernel, params, grads, pages, ADAMW_ROWS, rounding_keys(params, True))
    kernel.update_batch(batch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        kernel.update_batch(batch)
    allocations = [e for e in profile.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0]
    assert allocations == []


def replace_row(segments, index, **changes):
    columns = ("tensor", "start", "length", "page", "offset", "row")
    row = dict(zip(columns, segments[index]))
    row.update(changes)
    return [*segments[:index], tuple(row[column] for column in columns), *segments[index + 1 :]]


BAD_TABLES = {
    "tensor out of range": (replace_row(SEGMENTS, 4, tensor=4), "names tensor 4 of 4"),
    "negative tensor": (replace_row(SEGMENTS, 4, tensor=-1), "names tensor -1 of 4"),
    "past the tensor's end": (replace_row(SEGMENTS, 4, length=78), r"takes elements \[0, 0 \+ 78\) of a tensor of 77"),
    "negative start": (replace_row(SEGMENTS, 4, start=-1), "takes elements"),
    "page out of range": (replace_row(SEGMENTS, 4, page=3), "names page 3 of 3"),
    "past the page's end": (replace_row(SEGMENTS, 4, offset=1216, page=2), "of page 2"),
    "offset off its block": (replace_row(SEGMENTS, 4, offset=456), "must be a multiple of the block size 64"),
    "scalar row out of range": (replace_row(SEGMENTS, 4, row=2), "names scalar row 2 of 2"),
    "overlapping parameter elements": (
        replace_row(SEGMENTS, 4, tensor=0, start=590, length=20),
        "overlap in their parameter",
    ),
    "overlapping state": (replace_row(SEGMENTS, 4, offset=576, page=0), "overlap in their pages' state"),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_a_bad_table_raises_and_changes_nothing(built, case):
    segments, message = BAD_TABLES[case]
    fmt = page_format("adamw", "8bit")
    generator = torch.Generator().manual_seed(4)
    params, grads = random_tensors(torch.float32, generator)
    pages = random_pages(fmt, RULES["adamw"][1], 3, generator)
    before = clone_all(params, pages)
    kernel = host_kernel("adamw", fmt)
    with pytest.raises(RuntimeError, match=message):
        kernel.update_batch(make_batch(kernel, params, grads, pages, ADAMW_ROWS, [None] * 4, segments))
    assert_same((params, pages), before)


def bad_arguments(kernel, params, grads, pages):
    """Batches that break the contract in something other than the table's values, each with its error."""
    good = make_batch(kernel, params, grads, pages, ADAMW_ROWS, [None] * 4)
    keys = torch.zeros(len(SEGMENTS), 2, dtype=torch.int64)
    swapped = list(pages)
    swapped[1] = (pages[1][1], pages[1][0], *pages[1][2:])
    return {
        "int32 table": (PageBatch(params, grads, pages, good.table.int(), good.scalars), "table must be int64"),
        "table of 5 columns": (
            PageBatch(params, grads, pages, good.table[:, :5].contiguous(), good.scalars),
            r"shape \(segments, 6\)",
        ),
        "fp64 scalars": (PageBatch(params, grads, pages, good.table, good.scalars.double()), "scalars must be fp32"),
        "too few scalars": (
            PageBatch(params, grads, pages, good.table, good.scalars[:, :6].contiguous()),
            r"shape \(rows, 7\)",
        ),
        "fewer grads": (PageBatch(params, grads[:3], pages, good.table, good.scalars), "params has 4 tensors, grads 3"),
        "a grad of other length": (
            PageBatch(params, [*grads[:3], grads[3][:-1]], pages, good.table, good.scalars),
            r"grads\[3\] has 129 elements",
        ),
        "an fp64 parameter": (
            PageBatch([*params[:3], params[3].double()], grads, pages, good.table, good.scalars),
            "fp32, bf16 or fp16",
        ),
        "a buffer missing": (
            PageBatch(params, grads, [*pages[:2], pages[2][:3]], good.table, good.scalars),
            "4 tensors per page",
        ),
        "buffers out of order": (PageBatch(params, grads, swapped, good.table, good.scalars), r"buffers\[4\] must be"),
        "rounding keys of an fp32 parameter": (
            PageBatch(params, grads, pages, good.table, good.scalars, keys),
            "only bf16 parameters round stochastically",
        ),
        "rounding of another shape": (
            PageBatch(params, grads, pages, good.table, good.scalars, keys[:2]),
            r"rounding must be int64 of shape \(5, 2\)",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "int32 table",
        "table of 5 columns",
        "fp64 scalars",
        "too few scalars",
        "fewer grads",
        "a grad of other length",
        "an fp64 parameter",
        "a buffer missing",
        "buffers out of order",
        "rounding keys of an fp32 parameter",
        "rounding of another shape",
    ],
)
def test_bad_batch_arguments_raise_and_change_nothing(built, case):
    fmt = page_format("adamw", "8bit")
    generator = torch.Generator().manual_seed(5)
    params, grads = random_tensors(torch.float32, generator)
    pages = random_pages(fmt, RULES["adamw"][1], 3, generator)
    before = clone_all(params, pages)
    kernel = host_kernel("adamw", fmt)
    batch, message = bad_arguments(kernel, params, grads, pages)[case]
    with pytest.raises(RuntimeError, match=message):
        kernel.update_batch(batch)
    assert_same((params, pages), before)


def test_rounding_keys_out_of_range_raise(built):
    fmt = page_format("lion", "fp32")
    generator = torch.Generator().manual_seed(6)
    params, grads = random_tensors(torch.bfloat16, generator)
    pages = random_pages(fmt, RULES["lion"][1], 3, generator)
    before = clone_all(params, pages)
    kernel = host_kernel("lion", fmt)
    batch = make_batch(kernel, params, grads, pages, LION_ROWS, rounding_keys(params, True))
    batch.rounding[4, 1] = 2**32
    with pytest.raises(RuntimeError, match=r"keys must be in \[0, 2\*\*32\)"):
        kernel.update_batch(batch)
    assert_same((params, pages), before)


def test_a_batch_traces_under_fake_tensors(built):
    """The planner traces a step under FakeTensorMode: the batch operators take fake tensors and write nothing
    (PyTorch gives operators that return nothing a fake kernel of their own)."""
    fmt = page_format("adamw", "4bit")
    with FakeTensorMode(allow_fallback_kernels=False):
        params, grads = random_tensors(torch.bfloat16, torch.Generator())
        pages = [tuple(torch.empty(n, dtype=dtype) for n, dtype in fmt.buffer_specs(CAPACITY)) for _ in range(3)]
        kernel = host_kernel("adamw", fmt)
        kernel.update_batch(make_batch(kernel, params, grads, pages, ADAMW_ROWS, rounding_keys(params, True)))


@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_fp32_state_has_a_host_kernel(built, rule_name):
    """fp32 state (PagedAdamW, PagedLion, and the small tensors of the 8-bit and 4-bit optimizers) takes the host
    kernels too; a rule without one, or mixed formats, do not."""
    rule = RULES[rule_name][0]
    codecs = page_format(rule_name, "fp32").codecs
    assert host_rule_name(rule, codecs) == rule_name
    assert host_rule_name(rule, codecs[:1] + (Blockwise8bitCodec(64, False),) * (len(codecs) - 1)) == (
        rule_name if len(codecs) == 1 else None
    )
    assert host_rule_name(lambda *args, **kwargs: None, codecs) is None
    kernel = host_kernel(rule_name, page_format(rule_name, "fp32"))
    assert kernel.allocates_nothing(torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16))
    assert not kernel.takes_batch(CPU, torch.float64, torch.float64)
    assert not kernel.takes_batch(torch.device("meta"), torch.float32, torch.float32)
    assert kernel.table_device(CPU) == CPU


@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_an_fp32_segment_rounds_by_its_index_in_the_parameter(built, rule_name):
    """The per-segment host kernel of fp32 state rounds a chunk that starts inside its parameter as the eager
    kernel does, by each element's index in the parameter."""
    rule, _, rows = RULES[rule_name]
    fmt = page_format(rule_name, "fp32")
    generator = torch.Generator().manual_seed(7)
    param = torch.randn(3001, generator=generator).to(torch.bfloat16)
    grad = torch.randn(3001, generator=generator).to(torch.bfloat16)
    states = [torch.randn(3001, generator=generator).abs() for _ in fmt.codecs]
    rounding = ElementRounding(*step_keys(99, 5), 2**32 - 1000)  # indices that cross 2**32
    results = []
    for kernel in (host_kernel(rule_name, fmt), SegmentKernel(rule, fmt.codecs, False)):
        copies = param.clone(), [(state.clone(),) for state in states]
        kernel(copies[0], grad, copies[1], dict(rows[0]), rounding)
        results.append(copies)
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(results[0][1], results[1][1]))


@pytest.mark.parametrize(
    "name, dtype, rounds",
    [
        ("PagedLion", torch.float32, False),
        ("PagedLion", torch.bfloat16, True),
        ("PagedAdamW", torch.bfloat16, False),
        ("PagedAdamW", torch.bfloat16, True),
        ("PagedAdamW", torch.float16, False),
    ],
)
def test_optimizers_of_fp32_state_take_the_host_kernels_with_the_eager_results(built, monkeypatch, name, dtype, rounds):
    """PagedLion, and PagedAdamW on bf16 and fp16 parameters, update their CPU pages of fp32 state with the host
    kernels (one call per segment, no chunks, no undo copies): 20 steps over pages of 4 KiB, bitwise the parameters
    and state of the eager PyTorch kernels."""

    def fit(native_setting: str):
        monkeypatch.setenv("HF_PAGED_NATIVE", native_setting)
        model = make_mlp(dtype=dtype)
        groups = [{**group, "bf16_stochastic_round": rounds} for group in decay_groups(model)]
        optimizer = getattr(hf_paged, name)(groups, lr=1e-3 if "Lion" in name else 1e-2, page_size=4096)
        train(model, optimizer, regression_batches(20, dtype=dtype))
        return model, optimizer

    reference, reference_optimizer = fit("0")
    model, optimizer = fit("1")
    codecs = tuple(Float32Codec() for _ in optimizer.state_names)
    assert isinstance(segment_kernel(optimizer.update_rule(), codecs, False, CPU), HostKernel)
    for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(bits(param.detach()), bits(expected.detach()))
    saved, expected_state = optimizer.state_dict()["state"], reference_optimizer.state_dict()["state"]
    for index, entries in expected_state.items():
        for key, value in entries.items():
            assert torch.equal(saved[index][key], value), (index, key)
