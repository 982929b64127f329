"""Rank-1 normalized 4-bit state (issue 29): ``PagedAdamW4bit(normalization="rank1")`` stores each element of a 2-D
tensor's moments as a 4-bit code of its value divided by the smaller of its row's and its column's largest magnitude.
The codec's round trip, which tensors take it, the statistics a step gathers over pages, paging invariance, resume,
loading ``torch.optim.AdamW`` state, and out-of-memory recovery in the step."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_mlp, regression_batches, train
from test_step_failures import FailingAllocations, assert_same, failing_step, mark_streaming, snapshot
from test_step_plan import OperatorCalls
from test_workspace import PeakAllocation, allocated_peak

import hf_paged
from hf_paged.codecs import Blockwise4bitCodec, Rank1Normalized4bitCodec, Rank1Statistics, rank1_eligible, to_blocks
from hf_paged.kernels import compile_available
from hf_paged.kernels.rules import adamw_moments_, adamw_scalars
from hf_paged.optim.executor import StepRun
from hf_paged.testing import simulated_streams

BLOCK = 16
"""Block size of the tests' optimizers: the MLP's 64 x 64 matrix takes rank-1 state, its 64 x 20 one block scales."""
PAGE = 1008
"""Page size of the tests' optimizers (bytes): the rank-1 matrix spans five pages, cut inside rows."""


def structured(rows: int, cols: int, signed: bool, seed: int = 0) -> torch.Tensor:
    """A state whose magnitudes follow its rows and columns over four orders of magnitude, as Adam's moments of a
    weight matrix do (an outlier feature, a rarely active unit), times noise."""
    generator = torch.Generator().manual_seed(seed)
    row_scale = 10.0 ** (4 * torch.rand(rows, 1, generator=generator) - 4)
    col_scale = 10.0 ** (4 * torch.rand(1, cols, generator=generator) - 4)
    noise = torch.rand(rows, cols, generator=generator) + 0.05
    if signed:
        noise = noise * torch.where(torch.rand(rows, cols, generator=generator) < 0.5, -1.0, 1.0)
    return row_scale * col_scale * noise


def rank1_round_trip(values: torch.Tensor, signed: bool, block_size: int = 128) -> torch.Tensor:
    codec = Rank1Normalized4bitCodec(block_size, signed)
    statistics = Rank1Statistics(tuple(values.shape), 1)
    statistics.set_from(0, values)
    numel = values.numel()
    (packed,) = codec.buffer_specs(numel)
    encoded = codec.select((torch.zeros(packed[0], dtype=packed[1]),), 0, numel)
    (attached,) = statistics.attach([encoded], 0, numel, block_size, gathering=True)
    codec.encode(to_blocks(values.reshape(-1), block_size), (*encoded, None, attached[1]))
    return codec.decode(attached).reshape(values.shape)


def block_round_trip(values: torch.Tensor, signed: bool, block_size: int = 128) -> torch.Tensor:
    codec = Blockwise4bitCodec(block_size, signed)
    numel = values.numel()
    buffers = tuple(torch.zeros(n, dtype=dtype) for n, dtype in codec.buffer_specs(numel))
    encoded = codec.select(buffers, 0, numel)
    codec.encode(to_blocks(values.reshape(-1), block_size), encoded)
    return codec.decode(encoded).reshape(values.shape)


@pytest.mark.parametrize("signed", [True, False], ids=["first moment", "second moment"])
def test_round_trip_keeps_each_rows_and_columns_largest_value_and_follows_rows_and_columns(signed):
    values = structured(96, 160, signed)
    decoded = rank1_round_trip(values, signed)
    magnitudes = values.abs()
    # the largest element of a row has its row's maximum as normalizer (its column's is no smaller): exact
    assert torch.equal(decoded.abs().amax(dim=1), magnitudes.amax(dim=1))
    assert torch.equal(decoded.abs().amax(dim=0), magnitudes.amax(dim=0))
    if not signed:
        assert (decoded > 0).all()  # the zero-excluding map: no second moment decodes to zero
    # closer than block scales, element by element and row by row
    block_decoded = block_round_trip(values, signed)
    relative = ((decoded - values).abs() / magnitudes).mean()
    block_relative = ((block_decoded - values).abs() / magnitudes).mean()
    assert relative < 0.7 * block_relative, (relative, block_relative)
    row_error = ((decoded - values).norm(dim=1) / values.norm(dim=1)).mean()
    block_row_error = ((block_decoded - values).norm(dim=1) / values.norm(dim=1)).mean()
    assert row_error < 0.7 * block_row_error, (row_error, block_row_error)


def test_round_trip_of_a_zero_state_and_of_non_finite_values():
    zeros = torch.zeros(32, 64)
    assert torch.equal(rank1_round_trip(zeros, True), zeros)
    assert torch.equal(rank1_round_trip(zeros, False), zeros)
    values = structured(32, 64, True)
    values[3, 5], values[7, 9] = float("nan"), float("inf")
    decoded = rank1_round_trip(values, True)
    assert torch.isfinite(decoded).all()
    assert decoded[3, 5] == 0 and decoded[7, 9] == torch.finfo(torch.float32).max


def test_rank1_takes_2d_tensors_whose_statistics_cost_no_more_than_block_scales():
    assert rank1_eligible((4096, 4096), 128) and rank1_eligible((4096, 14336), 128) and rank1_eligible((512, 512), 128)
    assert (
        not rank1_eligible((511, 512), 128) and not rank1_eligible((64, 64), 128) and not rank1_eligible((4096,), 128)
    )
    assert not rank1_eligible((2, 3, 4096), 128)
    model = make_mlp()
    optimizer = hf_paged.PagedAdamW4bit(
        model.parameters(), block_size=BLOCK, min_4bit_size=256, page_size=PAGE, normalization="rank1"
    )
    train(model, optimizer, regression_batches(1))
    kinds = [optimizer._layout[param].kind for param in model.parameters()]
    assert kinds == ["4bit", "32bit", "4bit-rank1", "32bit", "32bit", "32bit"]  # 64x20, 64, 64x64, 64, 3x64, 3
    matrix = list(model.parameters())[2]
    statistics = optimizer._layout[matrix].statistics
    statistics_bytes = sum(t.numel() * t.element_size() for t in statistics.batch_entry())  # both sets
    code_bytes = sum(page.nbytes for page, _ in optimizer._layout[matrix].segments)
    assert (code_bytes + statistics_bytes) / matrix.numel() <= 2 * (0.5 + 4 / BLOCK)  # what block scales would take
    assert optimizer.paging_stats()["statistics_bytes"] == statistics_bytes == 2 * 2 * (64 + 64) * 4
    state = optimizer.state_dict()["state"][2]
    assert set(state) == {
        "step",
        *(f"{name}_{field}" for name in ("exp_avg", "exp_avg_sq") for field in ("packed_codes", "row_max", "col_max")),
    }


def build(budget=None, prefetch=2, seed=0):
    model = make_mlp(seed)
    optimizer = hf_paged.PagedAdamW4bit(
        [
            {"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0},
        ],
        lr=1e-2,
        block_size=BLOCK,
        min_4bit_size=256,
        page_size=PAGE,
        normalization="rank1",
        device_budget=budget,
        prefetch=prefetch,
    )
    return model, optimizer


def test_a_step_gathers_the_statistics_of_the_whole_new_state_across_pages():
    """The rank-1 matrix spans several 4 KiB pages: after a step its statistics are the row and column maxima of the
    state AdamW computes from the decoded old state and the gradient, over the whole tensor."""
    model, optimizer = build(budget=PAGE)
    batches = regression_batches(3)
    train(model, optimizer, batches[:2])
    matrix = list(model.parameters())[2]
    assert len(optimizer._layout[matrix].segments) > 1
    exp_avg, exp_avg_sq = (optimizer.get_state_tensor(matrix, name) for name in ("exp_avg", "exp_avg_sq"))
    optimizer.zero_grad()
    inputs, targets = batches[2]
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    scalars = adamw_scalars(optimizer.param_groups[0], 3.0)
    adamw_moments_(matrix.grad.clone(), exp_avg, exp_avg_sq, **scalars)
    optimizer.step()
    statistics = optimizer._layout[matrix].statistics
    for state, values in enumerate((exp_avg, exp_avg_sq)):
        assert torch.equal(statistics.rows[state], values.abs().amax(dim=1))
        assert torch.equal(statistics.cols[state], values.abs().amax(dim=0))


def run(budget=None, prefetch=2, threads=None, steps=4):
    model, optimizer = build(budget, prefetch)
    if threads is None:
        train(model, optimizer, regression_batches(steps))
    else:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            train(model, optimizer, regression_batches(steps))
        finally:
            torch.set_num_threads(before)
    return snapshot(model, optimizer)


def test_paging_budgets_prefetch_and_threads_never_change_results():
    reference = run()
    for budget, prefetch, threads in ((PAGE, 0, None), (3 * PAGE, 1, None), (None, 2, 1), (PAGE, 2, 2)):
        assert_same(run(budget, prefetch, threads), reference)


def test_resume_from_a_saved_state_dict_is_bitwise(tmp_path):
    batches = regression_batches(6)
    model, optimizer = build()
    train(model, optimizer, batches)
    expected = snapshot(model, optimizer)

    model, optimizer = build()
    train(model, optimizer, batches[:3])
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "checkpoint.pt")
    saved = torch.load(tmp_path / "checkpoint.pt", map_location="cpu")
    resumed_model, resumed = build(budget=PAGE, seed=1)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["optimizer"])
    train(resumed_model, resumed, batches[3:])
    assert_same(snapshot(resumed_model, resumed), expected)

    copied = copy.deepcopy(optimizer)
    copied_model = copy.deepcopy(model)
    copied.param_groups[0]["params"][:] = [p for p in copied_model.parameters() if p.ndim > 1]
    copied.param_groups[1]["params"][:] = [p for p in copied_model.parameters() if p.ndim <= 1]
    copied.load_state_dict(optimizer.state_dict())
    train(copied_model, copied, batches[3:])
    assert_same(snapshot(copied_model, copied), expected)


def test_loads_torch_adamw_state_and_saves_state_other_optimizers_load():
    model = make_mlp()
    reference = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, reference, regression_batches(3))
    matrix = list(model.parameters())[2]
    paged_model = copy.deepcopy(model)
    _, optimizer = build()
    optimizer = hf_paged.PagedAdamW4bit(
        paged_model.parameters(), lr=1e-2, block_size=BLOCK, min_4bit_size=256, page_size=PAGE, normalization="rank1"
    )
    optimizer.load_state_dict(reference.state_dict())
    paged_matrix = list(paged_model.parameters())[2]
    assert optimizer._layout[paged_matrix].kind == "4bit-rank1"
    statistics = optimizer._layout[paged_matrix].statistics
    for state, name in enumerate(("exp_avg", "exp_avg_sq")):
        exact = reference.state[matrix][name]
        assert torch.equal(statistics.rows[state], exact.abs().amax(dim=1))
        assert torch.equal(statistics.cols[state], exact.abs().amax(dim=0))
        loaded = optimizer.get_state_tensor(paged_matrix, name)
        assert torch.equal(loaded, rank1_round_trip(exact, signed=state == 0, block_size=BLOCK))

    # a rank-1 state dict loads into fp32 and block 4-bit optimizers as the values it decodes to
    for other in (
        hf_paged.PagedAdamW(copy.deepcopy(paged_model).parameters(), lr=1e-2),
        hf_paged.PagedAdamW4bit(copy.deepcopy(paged_model).parameters(), lr=1e-2, block_size=BLOCK, min_4bit_size=256),
    ):
        other.load_state_dict(optimizer.state_dict())
        other_matrix = other.param_groups[0]["params"][2]
        values = other.get_state_tensor(other_matrix, "exp_avg_sq")
        expected = optimizer.get_state_tensor(paged_matrix, "exp_avg_sq")
        if isinstance(other, hf_paged.PagedAdamW):
            assert torch.equal(values, expected)
        else:
            assert torch.equal(values, block_round_trip(expected, False, BLOCK))


def test_set_state_tensor_sets_the_statistics_of_the_values():
    model, optimizer = build()
    train(model, optimizer, regression_batches(1))
    matrix = list(model.parameters())[2]
    values = structured(64, 64, signed=False)
    optimizer.set_state_tensor(matrix, "exp_avg_sq", values)
    assert torch.equal(optimizer.get_state_tensor(matrix, "exp_avg_sq"), rank1_round_trip(values, False, BLOCK))


def test_bad_settings_and_state_are_refused_with_clear_errors():
    params = make_mlp().parameters()
    with pytest.raises(ValueError, match="normalization must be one of 'block', 'rank1', got 'rank2'"):
        hf_paged.PagedAdamW4bit(params, normalization="rank2")
    with pytest.raises(ValueError, match="normalization='rank1' is for 4-bit state only"):
        hf_paged.PagedOptimizer.__init__(
            hf_paged.PagedAdamW8bit.__new__(hf_paged.PagedAdamW8bit), [], {}, eight_bit=True, normalization="rank1"
        )
    model, optimizer = build()
    train(model, optimizer, regression_batches(1))
    saved = optimizer.state_dict()
    saved["state"][1]["exp_avg_row_max"] = torch.zeros(3)  # the 64 x 64 matrix (matrices come first)
    with pytest.raises(ValueError, match="'exp_avg_row_max' of parameter 1 must be a floating point tensor of 64"):
        optimizer.load_state_dict(saved)
    one_dim = torch.nn.Parameter(torch.zeros(64 * 64))
    vector_optimizer = hf_paged.PagedAdamW4bit([one_dim], block_size=BLOCK, min_4bit_size=256, normalization="rank1")
    entry = optimizer.state_dict()["state"][1]
    with pytest.raises(ValueError, match="rank-1 normalized, which needs a 2-D parameter"):
        vector_optimizer.load_state_dict(
            {"state": {0: entry}, "param_groups": [vector_optimizer.state_dict()["param_groups"][0]]}
        )


def test_an_out_of_memory_error_in_the_step_is_recovered_bitwise(monkeypatch):
    """Step 2 fails at allocations spread over the step (the statistics pass and the update): it finishes with
    bitwise the result of a run without the error. Copies are seen complete only once waited for, so that the runs
    allocate alike (see tests/test_step_failures.py)."""
    batches = regression_batches(3)
    with simulated_streams(completion="waited"):
        model, optimizer = build(budget=2 * PAGE)
        train(model, optimizer, batches[:1])
        counted = FailingAllocations()
        mark_streaming(optimizer, counted)
        gathered = []
        gather = StepRun.gather_statistics

        def counted_gather(run):
            start = counted.count
            gather(run)
            gathered.append((start, counted.count))

        monkeypatch.setattr(StepRun, "gather_statistics", counted_gather)
        failing_step(model, optimizer, batches[1], counted)
        monkeypatch.undo()
        reference_model, reference = build(budget=2 * PAGE)
        train(reference_model, reference, batches[:2])
        expected = snapshot(reference_model, reference)
        points = sorted({round(x) for x in torch.linspace(counted.in_step + 1, counted.count, 4).tolist()})
        (start, end), *_ = gathered
        assert counted.in_step <= start < end < counted.count
        assert any(start < at <= end for at in points)  # failures in the statistics pass, and in the update
        for at in points:
            model, optimizer = build(budget=2 * PAGE)
            optimizer.oom_retries = 8
            recoveries = []
            optimizer.on_oom_recovery = recoveries.append
            train(model, optimizer, batches[:1])
            failing_step(model, optimizer, batches[1], FailingAllocations({at}))
            assert [r.phase for r in recoveries] == ["optimizer step"], at
            assert_same(snapshot(model, optimizer), expected)


def stepped_matrix(dtype, page_size, compiled=False, steps=2):
    """A 256 x 304 matrix (rank-1 state over several pages, blocks of 64) and small tensors, after ``steps`` steps."""
    torch.manual_seed(0)
    shapes = ((256, 304), (1024 + 37,), (300,), (5,))
    params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in shapes]
    optimizer = hf_paged.PagedAdamW4bit(
        params, page_size=page_size, compiled=compiled, block_size=64, normalization="rank1"
    )
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(dtype)
        optimizer.step()
    assert optimizer._layout[params[0]].kind == "4bit-rank1"
    return params, optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [4 * 2**10, 32 * 2**10])
def test_step_temporaries_fit_the_reserved_workspace(dtype, page_size, monkeypatch):
    """The statistics pass and the update of the PyTorch kernels (normalizers included) stay within the workspace, and
    a step allocates nothing that outlives it (the statistics' buffers are swapped, not reallocated)."""
    monkeypatch.setenv("HF_PAGED_KERNELS", "torch")
    _, optimizer = stepped_matrix(dtype, page_size)
    assert optimizer.paging_stats()["pages_total"] >= 4
    with PeakAllocation() as allocation:
        optimizer.step()
    assert allocation.live == 0
    assert 0 < optimizer.step_workspace <= 4 * page_size
    assert allocation.peak <= optimizer.step_workspace, (allocation.peak / page_size, "pages")


@pytest.mark.skipif(not compile_available(torch.device("cpu")), reason="no C++ compiler for torch.compile")
def test_compiled_updates_follow_the_eager_ones_within_the_workspace(monkeypatch):
    monkeypatch.setenv("HF_PAGED_KERNELS", "torch")
    torch._dynamo.reset()
    page_size = 64 * 2**10
    compiled, optimizer = stepped_matrix(torch.float32, page_size, compiled=True, steps=3)
    assert optimizer.compiled
    eager, _ = stepped_matrix(torch.float32, page_size, steps=3)
    for mine, theirs in zip(compiled, eager):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    peak = allocated_peak(optimizer.step)
    assert 0 < peak <= optimizer.step_workspace, (peak / page_size, "pages")


def test_the_planner_counts_the_statistics_as_optimizer_state():
    """``hf_paged.plan`` traces the statistics pass (on the CPU's kernels and the accelerator's Triton path) and counts
    the statistics in the optimizer state, as a real run holds them."""
    from hf_paged.planner import plan

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512))

    def build(module):
        return hf_paged.PagedAdamW4bit(module.parameters(), compiled=False, normalization="rank1", page_size="64KiB")

    real_model = model()
    optimizer = build(real_model)
    for _ in range(2):
        real_model(torch.randn(8, 512)).square().mean().backward()
        optimizer.step()
    stats = optimizer.paging_stats()
    assert stats["statistics_bytes"] == 2 * 2 * 2 * 1024 * 4  # two matrices, two states, two sets, rows and columns
    steps = sum(state["step"].untyped_storage().nbytes() for state in optimizer.state.values())
    expected = stats["device_bytes"] + stats["host_bytes"] + stats["statistics_bytes"] + steps
    arguments = (model, lambda: torch.randn(8, 512), build)
    loss = {"loss": lambda module, batch: module(batch).square().mean()}
    assert plan(*arguments, **loss).optimizer_state_bytes == expected
    assert plan(*arguments, **loss, device="cuda").optimizer_state_bytes >= expected


def test_a_steps_operator_calls_do_not_grow_with_rank1_tensors(built):
    """With the host kernels' page batches, the statistics pass and the update cost the same operator calls for 4
    and for 16 rank-1 matrices: no call per tensor (zeroing each tensor's next maxima apart took four)."""
    calls = []
    for matrices in (4, 16):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(256, 320)) for _ in range(matrices)]
        optimizer = hf_paged.PagedAdamW4bit(params, block_size=64, normalization="rank1")
        for _ in range(2):
            for param in params:
                param.grad = torch.randn_like(param)
            optimizer.step()
        assert {optimizer._layout[param].kind for param in params} == {"4bit-rank1"}
        with OperatorCalls() as count:
            optimizer.step()
        calls.append(count.calls)
    assert calls[0] == calls[1] <= 12, calls
