"""The C++ host kernels (hf_paged/native/host_kernels.cpp) against the eager PyTorch kernels and torch.optim.AdamW.

The extension is built once per process (the first test that needs it; about 25 s on two cores with a cold cache,
then loaded from PyTorch's extension cache). Where it cannot be built the comparisons are skipped; the fallback is
tested without a build.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import decay_groups, deviation, make_mlp, regression_batches, second_moment_midpoints, train

import hf_paged
from hf_paged import native
from hf_paged.codecs import Blockwise4bitCodec, Blockwise8bitCodec
from hf_paged.kernels import HostKernel, SegmentKernel, segment_kernel
from hf_paged.kernels.host import fits_vector_lanes
from hf_paged.kernels.rules import ademamix_scalars, ademamix_update_
from hf_paged.optim.adamw import adamw_scalars, adamw_update_
from hf_paged.optim.lion import lion_update_

CPU = torch.device("cpu")
ADAMW_SCALARS = adamw_scalars({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}, 3)
LION_SCALARS = {"lr": 1e-4, "decay": 1 - 1e-4 * 0.1, "direction_weight": 0.1, "avg_weight": 0.01}
FORMATS = [(Blockwise8bitCodec, 256), (Blockwise8bitCodec, 16), (Blockwise4bitCodec, 128), (Blockwise4bitCodec, 16)]
ADEMAMIX_SCALARS = ademamix_scalars(
    {"lr": 1e-3, "betas": (0.9, 0.999, 0.9999), "alpha": 5.0, "t_alpha": 10, "t_beta3": 10, "eps": 1e-8,
     "weight_decay": 1e-2},
    3,
)  # fmt: skip
RULES = {
    "adamw": (adamw_update_, (True, False), ADAMW_SCALARS),
    "lion": (lion_update_, (True,), LION_SCALARS),
    "ademamix": (ademamix_update_, (True, True, False), ADEMAMIX_SCALARS),
}


@pytest.fixture
def use_native(monkeypatch):
    """``use_native(False)`` sets HF_PAGED_NATIVE=0 (the eager kernels), ``use_native(True)`` HF_PAGED_NATIVE=1."""

    def set_native(enabled: bool) -> None:
        monkeypatch.setenv("HF_PAGED_NATIVE", "1" if enabled else "0")

    return set_native


def random_segment(codecs, blocks: int, generator: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """Encoded states of ``blocks`` blocks spanning eight orders of magnitude, with an all-zero block (index 3)."""
    encoded = []
    for codec in codecs:
        arrays = tuple(torch.empty(n, dtype=dtype) for n, dtype in codec.buffer_specs(blocks * codec.block_size))
        segment = codec.select(arrays, 0, blocks * codec.block_size)
        values = torch.randn(blocks, codec.block_size, generator=generator)
        values = values * torch.logspace(-8, 0, blocks).unsqueeze(1)
        values = values if codec.signed else values.square()
        values[3] = 0
        codec.encode(values, segment)
        encoded.append(segment)
    return encoded


def run_kernel(kernel, param, grads, encoded, scalars):
    param, encoded = param.clone(), [tuple(array.clone() for array in segment) for segment in encoded]
    for grad in grads:
        kernel(param, grad, encoded, scalars)
    return param, encoded


def assert_equal_to_eager(native_result, eager_result) -> None:
    """Parameters, codes and scales bitwise those of the eager kernels: both round every operation alike (IEEE
    square roots, ATen's lerp), on every CPU capability the kernel is built for."""
    (param, encoded), (expected_param, expected_encoded) = native_result, eager_result
    assert torch.equal(param, expected_param), f"{(param != expected_param).sum()} parameter elements differ"
    for segment, expected_segment in zip(encoded, expected_encoded):
        for array, expected in zip(segment, expected_segment):
            assert torch.equal(array, expected), f"{(array != expected).sum()} of {array.numel()} state entries differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codec, block_size", FORMATS)
@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_host_kernel_matches_the_eager_kernel(built, rule_name, codec, block_size, dtype):
    rule, signed, scalars = RULES[rule_name]
    codecs = tuple(codec(block_size, is_signed) for is_signed in signed)
    generator = torch.Generator().manual_seed(0)
    blocks = 40
    param = torch.randn(blocks, block_size, generator=generator).to(dtype)
    grads = [torch.randn(blocks, block_size, generator=generator).to(dtype) for _ in range(4)]
    for grad in grads:
        grad[3] = 0
    encoded = random_segment(codecs, blocks, generator)
    kernel = segment_kernel(rule, codecs, False, CPU)
    if not fits_vector_lanes(codecs):
        assert type(kernel) is SegmentKernel
        pytest.skip("4-bit blocks of 16 elements take the PyTorch kernels in the 16-lane build")
    assert isinstance(kernel, HostKernel)
    native_result = run_kernel(kernel, param, grads, encoded, scalars)
    eager_result = run_kernel(SegmentKernel(rule, codecs, False), param, grads, encoded, scalars)
    assert_equal_to_eager(native_result, eager_result)
    zero_scales = [segment[1][3] for segment in native_result[1]]
    assert all(scale == 0 for scale in zero_scales)  # the all-zero block stays all zero, as eagerly


def test_host_kernel_matches_the_eager_kernel_at_the_midpoints_of_the_4bit_second_moment(built):
    codecs = (Blockwise4bitCodec(128, True), Blockwise4bitCodec(128, False))
    grad, lowest, highest = second_moment_midpoints(128)
    scalars = adamw_scalars({"lr": 1e-3, "betas": (0.9, 0.0), "eps": 1e-8, "weight_decay": 0.0}, 1)
    param, numel = torch.zeros_like(grad), grad.numel()
    zeros = [tuple(torch.zeros(n, dtype=dtype) for n, dtype in codec.buffer_specs(numel)) for codec in codecs]
    encoded = [codec.select(arrays, 0, numel) for codec, arrays in zip(codecs, zeros)]
    kernel = segment_kernel(adamw_update_, codecs, False, CPU)
    assert isinstance(kernel, HostKernel)
    native_result = run_kernel(kernel, param, [grad], encoded, scalars)
    eager_result = run_kernel(SegmentKernel(adamw_update_, codecs, False), param, [grad], encoded, scalars)
    assert_equal_to_eager(native_result, eager_result)
    packed, scales = eager_result[1][1]
    codes = torch.cat([packed & 15, packed >> 4], dim=1)
    assert torch.equal(scales, torch.tensor([1.0, 2.0**-20]))
    assert ((codes >= lowest) & (codes <= highest)).all(), codes


def test_the_build_targets_the_cpu_capability(built):
    """The extension is built for the capability PyTorch runs (``ATEN_CPU_CAPABILITY`` chooses it): sixteen lanes
    of AVX-512 code for AVX512, eight of AVX2 code for AVX2, one scalar lane for DEFAULT."""
    capability = torch.backends.cpu.get_cpu_capability()
    assert native.build_name().startswith(f"hf_paged_host_kernels_{capability.lower()}_")
    assert native.build_name(capability) == native.build_name()
    digest = native.build_name().rsplit("_", 1)[1]
    assert native.build_name("DEFAULT") == native.build_name("default") == f"hf_paged_host_kernels_default_{digest}"
    assert torch.ops.hf_paged.vector_lanes() == {"AVX512": 16, "AVX2": 8}.get(capability, 1)


def test_another_version_of_the_source_builds_under_another_name(tmp_path, monkeypatch):
    """Checkouts of other versions sharing the extension cache (a worktree of an older commit) must not load each
    other's build: one without an operator argument of this version would fail at its first call."""
    name = native.build_name()
    other = tmp_path / "host_kernels.cpp"
    other.write_bytes(native.SOURCE.read_bytes() + b"// another version\n")
    monkeypatch.setattr(native, "SOURCE", other)
    assert native.build_name() != name
    assert native.build_name().rsplit("_", 1)[0] == name.rsplit("_", 1)[0]


@pytest.mark.parametrize("where", ["source", "torch"])
def test_another_path_of_the_source_or_of_torch_builds_under_another_name(tmp_path, monkeypatch, where):
    """The build's commands name the source's path and PyTorch's headers: a second checkout or a second virtual
    environment sharing the extension cache builds a folder of its own, instead of rebuilding the other's in turn."""
    name = native.build_name()
    if where == "source":
        other = tmp_path / "host_kernels.cpp"
        other.write_bytes(native.SOURCE.read_bytes())
        monkeypatch.setattr(native, "SOURCE", other)
    else:
        monkeypatch.setattr(torch, "__file__", str(tmp_path / "venv" / "torch" / "__init__.py"))
    assert native.build_name() != name
    assert native.build_name().rsplit("_", 1)[0] == name.rsplit("_", 1)[0]
    monkeypatch.undo()
    assert native.build_name() == name


def test_a_build_killed_on_the_way_does_not_make_later_processes_wait(built, tmp_path):
    """A process killed while it built the extension leaves PyTorch's ``lock`` file in the build folder; every
    later process waited for it forever (a CI run hung at its first optimizer step until its 90 minutes ran out).
    The next process removes it, with a warning, and loads the build."""
    cache = tmp_path / "extensions"
    directory = cache / native.build_directory().relative_to(native.build_directory().parents[1])
    shutil.copytree(native.build_directory(), directory)  # the build itself is cached: loading it takes a second
    (directory / "lock").touch()
    script = (
        "import logging, torch; logging.basicConfig();"
        "from hf_paged import native; assert native.build_failure() is None; torch.ops.hf_paged.vector_lanes()"
    )
    environment = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "HF_PAGED_NATIVE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, env=environment, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert f"removing {directory / 'lock'}, left by a build of the host kernels that did not finish" in done.stderr
    assert not (directory / "lock").exists()


def test_host_kernel_takes_compiled_scalars(built):
    """With ``compiled=True`` the scalars are 0-d fp32 tensors: the same values, the same result."""
    codecs = (Blockwise8bitCodec(64, True), Blockwise8bitCodec(64, False))
    generator = torch.Generator().manual_seed(2)
    param, grads = torch.randn(8, 64, generator=generator), [torch.randn(8, 64, generator=generator)]
    encoded = random_segment(codecs, 8, generator)
    tensors = {name: torch.tensor(value, dtype=torch.float32) for name, value in ADAMW_SCALARS.items()}
    first = run_kernel(segment_kernel(adamw_update_, codecs, True, CPU), param, grads, encoded, tensors)
    second = run_kernel(segment_kernel(adamw_update_, codecs, False, CPU), param, grads, encoded, ADAMW_SCALARS)
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for x, y in zip(first[1], second[1]) for a, b in zip(x, y))


@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_host_kernel_is_independent_of_threads_and_chunks(built, rule_name):
    rule, signed, scalars = RULES[rule_name]
    codecs = tuple(Blockwise4bitCodec(64, is_signed) for is_signed in signed)
    generator = torch.Generator().manual_seed(1)
    blocks = 1024  # enough blocks for several threads
    param = torch.randn(blocks, 64, generator=generator, dtype=torch.float32).to(torch.bfloat16)
    grads = [torch.randn(blocks, 64, generator=generator).to(torch.bfloat16) for _ in range(2)]
    encoded = random_segment(codecs, blocks, generator)
    kernel = segment_kernel(rule, codecs, False, CPU)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = run_kernel(kernel, param, grads, encoded, scalars)
    finally:
        torch.set_num_threads(threads)
    torch.set_num_threads(max(threads, 2))
    try:
        many = run_kernel(kernel, param, grads, encoded, scalars)
    finally:
        torch.set_num_threads(threads)
    chunked_param = param.clone()
    chunked = [tuple(array.clone() for array in segment) for segment in encoded]
    for grad in grads:
        for rows in (slice(0, 100), slice(100, 101), slice(101, blocks)):
            kernel(chunked_param[rows], grad[rows], [(codes[rows], scales[rows]) for codes, scales in chunked], scalars)
    for result in (many, (chunked_param, chunked)):
        assert torch.equal(result[0], one_thread[0])
        for segment, expected in zip(result[1], one_thread[1]):
            assert all(torch.equal(a, b) for a, b in zip(segment, expected))


def test_host_kernel_allocates_nothing(built):
    codecs = (Blockwise8bitCodec(256, True), Blockwise8bitCodec(256, False))
    generator = torch.Generator().manual_seed(3)
    param, grad = torch.randn(512, 256, generator=generator), torch.randn(512, 256, generator=generator)
    encoded = random_segment(codecs, 512, generator)
    kernel = segment_kernel(adamw_update_, codecs, False, CPU)
    kernel(param, grad, encoded, ADAMW_SCALARS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        kernel(param, grad, encoded, ADAMW_SCALARS)
    allocations = [e for e in profile.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0]
    assert allocations == []


def test_a_cpu_segment_takes_one_host_kernel_call_however_long(built, monkeypatch):
    """The host kernels allocate nothing, so the step hands them each segment's whole blocks at once (in a page
    batch: one table row); the chunks that bound the PyTorch kernels' temporaries would only add calls."""
    calls: list[int] = []
    update, update_batch = HostKernel.__call__, HostKernel.update_batch

    def counted(self, param, grad, encoded, scalars):
        calls.append(param.numel())
        update(self, param, grad, encoded, scalars)

    def counted_batch(self, batch):
        calls.extend(batch.table[:, 2].tolist())
        update_batch(self, batch)

    monkeypatch.setattr(HostKernel, "__call__", counted)
    monkeypatch.setattr(HostKernel, "update_batch", counted_batch)
    param = torch.nn.Parameter(torch.randn(256, 1024))
    param.grad = torch.randn(256, 1024)
    optimizer = hf_paged.PagedAdamW8bit([param], page_size=2**20, block_size=256, compiled=False)
    optimizer.step()
    assert calls == [param.numel()]
    ((page, _),) = optimizer._layout[param].segments
    page_format = page.format
    assert optimizer._chunk_elements(page_format, False) < param.numel()  # the eager kernels would take chunks
    assert (
        HostKernel(  # elsewhere, or in a dtype the C++ kernel does not take, the fallback decodes into temporaries
            "adamw", page_format.codecs, SegmentKernel(adamw_update_, page_format.codecs, False)
        ).allocates_nothing(param.double(), param.grad.double())
        is False
    )


def test_bad_arguments_raise_before_any_write(built):
    codecs = (Blockwise8bitCodec(64, True), Blockwise8bitCodec(64, False))
    generator = torch.Generator().manual_seed(4)
    param, grad = torch.randn(4, 64, generator=generator), torch.randn(4, 64, generator=generator)
    encoded = random_segment(codecs, 4, generator)
    short_scales = [encoded[0], (encoded[1][0], encoded[1][1][:3])]
    before = param.clone(), [tuple(array.clone() for array in segment) for segment in encoded]
    kernel = segment_kernel(adamw_update_, codecs, False, CPU)
    with pytest.raises(RuntimeError, match="scales must be a contiguous CPU fp32 tensor of 4 elements"):
        kernel(param, grad, short_scales, ADAMW_SCALARS)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(param, grad.t().contiguous().t(), encoded, ADAMW_SCALARS)
    assert torch.equal(param, before[0])
    assert all(torch.equal(a, b) for x, y in zip(encoded, before[1]) for a, b in zip(x, y))


def fit(name: str, dtype: torch.dtype, steps: int = 20) -> tuple[torch.nn.Module, hf_paged.PagedOptimizer]:
    """The MLP trained on the regression task with blocks of 128: its biases and 3x64 weight end in partial blocks."""
    model = make_mlp(dtype=dtype)
    lr = 1e-3 if "Lion" in name else 1e-2
    size_key = "min_8bit_size" if "8bit" in name else "min_4bit_size"
    optimizer = getattr(hf_paged, name)(decay_groups(model), lr=lr, block_size=128, page_size=4096, **{size_key: 64})
    train(model, optimizer, regression_batches(steps, dtype=dtype))
    return model, optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["PagedAdamW8bit", "PagedAdamW4bit", "PagedLion8bit"])
def test_optimizer_with_host_kernels_tracks_the_eager_one(built, use_native, name, dtype):
    """Partial last blocks (through the padded copies of the step), weight decay groups, 20 steps: bitwise the
    eager kernels' parameters and state."""
    use_native(False)
    reference, reference_optimizer = fit(name, dtype)
    use_native(True)
    model, optimizer = fit(name, dtype)
    codec = Blockwise8bitCodec if "8bit" in name else Blockwise4bitCodec
    codecs = tuple(codec(128, is_signed) for is_signed in RULES["lion" if "Lion" in name else "adamw"][1])
    assert isinstance(segment_kernel(optimizer.update_rule(), codecs, False, CPU), HostKernel)
    assert deviation(model, reference) == 0
    saved, expected = optimizer.state_dict()["state"], reference_optimizer.state_dict()["state"]
    for index in expected:
        for key, value in expected[index].items():
            assert torch.equal(saved[index][key], value), (index, key)


@pytest.mark.parametrize("name", ["PagedAdamW8bit", "PagedAdamW4bit"])
def test_distance_from_adamw_is_that_of_the_eager_kernel(built, use_native, name):
    """Against fp32 torch.optim.AdamW on the same task: the host kernel deviates no more than the eager kernel
    (within 1%), so the fidelity figures of tests/test_8bit.py and tests/test_4bit.py carry over."""
    reference = make_mlp()
    train(reference, torch.optim.AdamW(decay_groups(reference), lr=1e-2), regression_batches(60))
    use_native(False)
    eager_model, _ = fit(name, torch.float32, steps=60)
    use_native(True)
    native_model, _ = fit(name, torch.float32, steps=60)
    assert deviation(native_model, reference) <= 1.01 * deviation(eager_model, reference)
    assert deviation(native_model, reference) > 0


def test_environment_switch(monkeypatch):
    codecs = (Blockwise8bitCodec(64, True), Blockwise8bitCodec(64, False))
    monkeypatch.setenv("HF_PAGED_NATIVE", "0")
    assert type(segment_kernel(adamw_update_, codecs, False, CPU)) is SegmentKernel
    monkeypatch.setenv("HF_PAGED_NATIVE", "maybe")
    with pytest.raises(ValueError, match="HF_PAGED_NATIVE='maybe' is not allowed"):
        segment_kernel(adamw_update_, codecs, False, CPU)
    monkeypatch.setenv("HF_PAGED_NATIVE", "1")
    from hf_paged.codecs import Float32Codec

    assert type(segment_kernel(adamw_update_, (Float32Codec(), Float32Codec()), False, CPU)) is HostKernel


def test_pages_on_another_device_never_build_or_ask_for_the_host_kernels(monkeypatch):
    """A GPU run takes the PyTorch kernels for its pages without building the C++ extension, even where
    HF_PAGED_NATIVE=1 would make a failed build an error."""

    def no_build() -> str:
        raise AssertionError("the host kernels were asked for")

    monkeypatch.setattr(native, "build_failure", no_build)
    monkeypatch.setenv("HF_PAGED_NATIVE", "1")
    codecs = (Blockwise8bitCodec(64, True), Blockwise8bitCodec(64, False))
    for device in ("cuda", "xpu", "meta"):
        assert type(segment_kernel(adamw_update_, codecs, False, torch.device(device))) is SegmentKernel


def test_missing_ninja_falls_back_with_one_logged_reason(monkeypatch, caplog):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="hf_paged.native"):
        reason = native.build_failure.__wrapped__()
    assert "ninja" in reason
    assert [record.getMessage() for record in caplog.records] == [
        f"hf_paged: host kernels unavailable ({reason}); CPU pages keep PyTorch's kernels"
    ]


def test_missing_compiler_falls_back(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-hf-paged")
    assert "no C++ compiler" in native.build_failure.__wrapped__()


def test_required_but_unavailable_raises(monkeypatch):
    monkeypatch.setenv("HF_PAGED_NATIVE", "1")
    monkeypatch.setattr(native, "build_failure", lambda: "no C++ compiler ('c++') on PATH")
    with pytest.raises(RuntimeError, match="HF_PAGED_NATIVE=1, but hf_paged's host kernels could not be built"):
        native.host_kernels_enabled()
    monkeypatch.setenv("HF_PAGED_NATIVE", "")
    assert native.host_kernels_enabled() is False


def test_segments_the_host_kernel_hands_on_are_updated_whole_or_not_at_all(built):
    """fp64 segments go to the PyTorch kernel: the same result as it gives, and a failure part way undone."""
    codecs = (Blockwise8bitCodec(64, True), Blockwise8bitCodec(64, False))
    generator = torch.Generator().manual_seed(5)
    param = torch.randn(4, 64, generator=generator, dtype=torch.float64)
    grad = torch.randn(4, 64, generator=generator, dtype=torch.float64)
    encoded = random_segment(codecs, 4, generator)
    kernel = segment_kernel(adamw_update_, codecs, False, CPU)
    assert kernel.writes_after_allocating
    result = run_kernel(kernel, param, [grad], encoded, ADAMW_SCALARS)
    expected = run_kernel(SegmentKernel(adamw_update_, codecs, False), param, [grad], encoded, ADAMW_SCALARS)
    assert torch.equal(result[0], expected[0])

    def fails_after_writing(param, grad, encoded, scalars):
        param.add_(1.0)
        encoded[0][0].zero_()
        raise torch.OutOfMemoryError("injected")

    host = HostKernel("adamw", codecs, SegmentKernel(adamw_update_, codecs, False))
    host.fallback = fails_after_writing
    before = param.clone(), [tuple(array.clone() for array in segment) for segment in encoded]
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        host(param, grad, encoded, ADAMW_SCALARS)
    assert torch.equal(param, before[0])
    assert all(torch.equal(a, b) for x, y in zip(encoded, before[1]) for a, b in zip(x, y))


def test_4bit_blocks_narrower_than_two_vectors_are_refused_before_any_write(built):
    """4-bit codes are packed by half-blocks, which the vector code takes a vector at a time: a 4-bit block of fewer
    than two vectors' elements is a clear error (the optimizer gives such blocks to the PyTorch kernels), and it
    changes nothing."""
    lanes = torch.ops.hf_paged.vector_lanes()
    if lanes < 16:
        pytest.skip(f"{lanes}-lane build: every 4-bit block size from 16 fits")
    _, signed, _ = RULES["adamw"]
    codecs = tuple(Blockwise4bitCodec(16, is_signed) for is_signed in signed)
    assert not fits_vector_lanes(codecs) and fits_vector_lanes(tuple(Blockwise4bitCodec(32, s) for s in signed))
    param, grad = torch.randn(4, 16), torch.randn(4, 16)
    encoded = random_segment(codecs, 4, torch.Generator().manual_seed(0))
    before = param.clone()
    arrays = [array for segment in encoded for array in segment]
    with pytest.raises(RuntimeError, match="4-bit blocks must be of at least 32 elements"):
        torch.ops.hf_paged.adamw_segment_(param, grad, arrays, 4, 16, [0.5] * 7)
    assert torch.equal(param, before)
