"""The torch.compile kernels give the eager results within rounding, and keep paging invariance."""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, regression_batches, train
from test_paging import assert_same_result

from hf_paged.kernels import compile_available

pytestmark = pytest.mark.skipif(not compile_available(torch.device("cpu")), reason="no C++ compiler for torch.compile")


def run(name: str, compiled: bool, **paging):
    model = make_mlp()
    optimizer = OPTIMIZERS[name](decay_groups(model), compiled=compiled, **optimizer_kwargs(name, **paging))
    train(model, optimizer, regression_batches(5))
    return model, optimizer


def test_compiled_matches_eager_and_keeps_invariance(optimizer_name):
    eager_model, eager = run(optimizer_name, compiled=False)
    compiled_model, compiled = run(optimizer_name, compiled=True)
    assert compiled.compiled and not eager.compiled
    for param, expected in zip(compiled_model.parameters(), eager_model.parameters()):
        assert ((param - expected).norm() / expected.norm()).item() < 1e-3
    paged_model, paged = run(optimizer_name, compiled=True, device_budget=4096, prefetch=1)
    assert paged.paging_stats()["page_outs"] > 0
    assert_same_result(paged_model, paged, compiled_model, compiled)


def test_changing_scalars_do_not_recompile(optimizer_name):
    """Bias corrections change every step and schedulers change the learning rate: one graph serves them."""
    torch._dynamo.reset()
    model = make_mlp()
    optimizer = OPTIMIZERS[optimizer_name](decay_groups(model), compiled=True, **optimizer_kwargs(optimizer_name))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    frames = []
    for inputs, targets in regression_batches(6):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        scheduler.step()
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert frames[-1] == frames[0]  # zero for the optimizers whose fp32 pages take a multi-tensor kernel


@pytest.mark.slow  # about 13 s of Inductor compiles
def test_kernel_compiled_for_a_short_first_segment_runs_long_ones_in_parallel():
    """Inductor sizes a CPU kernel's parallelism by the segment it compiles for; a short first segment (a bias)
    must not leave the kernel serial for every later segment, however long."""
    from torch._inductor.utils import fresh_cache, run_and_get_code

    from hf_paged.codecs import Float32Codec
    from hf_paged.kernels import SegmentKernel, prepare_scalars
    from hf_paged.optim.adamw import adamw_scalars, adamw_update_

    torch._dynamo.reset()
    kernel = SegmentKernel(adamw_update_, (Float32Codec(), Float32Codec()), compiled=True)
    scalars = prepare_scalars(
        adamw_scalars({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}, 1), True
    )
    short = 300
    param, grad = torch.randn(short, dtype=torch.bfloat16), torch.randn(short, dtype=torch.bfloat16)
    with fresh_cache():
        _, (code, *_) = run_and_get_code(kernel, param, grad, [(torch.zeros(short),), (torch.zeros(short),)], scalars)
    assert "#pragma omp parallel" in code


@pytest.fixture
def fresh_kernels():
    """The process's kernels made anew for a test, and again after it (a kernel that fell back stays eager)."""
    from hf_paged import kernels

    kernels._segment_kernel.cache_clear()
    yield kernels
    kernels._segment_kernel.cache_clear()


class _Recompiles(logging.Handler):
    """The recompiles Dynamo logs (``TORCH_LOGS=recompiles``) while in use, by the function recompiled."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.functions: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Recompiling function "):
            self.functions.append(message.split()[2])

    def __enter__(self):
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(self)
        return self

    def __exit__(self, *exc_info) -> None:
        logging.getLogger("torch._dynamo.guards.__recompiles").removeHandler(self)
        torch._logging.set_logs()


def fp32_segment(elements: int = 512):
    """A segment's parameter, gradient and fp32 state of two states, and AdamW's scalars, as a kernel takes them."""
    from hf_paged.kernels import prepare_scalars
    from hf_paged.optim.adamw import adamw_scalars

    generator = torch.Generator().manual_seed(0)
    param, grad = torch.randn(elements, generator=generator), torch.randn(elements, generator=generator)
    encoded = [(torch.zeros(elements),), (torch.zeros(elements),)]
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    return param, grad, encoded, prepare_scalars(adamw_scalars(group, 1), True)


def test_a_second_rule_does_not_recompile_the_first_rules_kernel(fresh_kernels, monkeypatch):
    """Each rule and codec compiles a function of its own: a second rule in the process adds no entry to the first's
    (before, one function served all and recompiled on the guard ``___check_obj_id(self.rule.__code__)``)."""
    monkeypatch.setenv("HF_PAGED_NATIVE", "0")  # CPU pages of fp32 state take the PyTorch kernels
    from hf_paged.codecs import Float32Codec
    from hf_paged.optim.adamw import adamw_update_
    from hf_paged.optim.lion import lion_update_

    cpu = torch.device("cpu")
    adamw = fresh_kernels.segment_kernel(adamw_update_, (Float32Codec(), Float32Codec()), True, cpu)
    lion = fresh_kernels.segment_kernel(lion_update_, (Float32Codec(),), True, cpu)
    param, grad, encoded, scalars = fp32_segment()
    lion_scalars = {name: scalars["step_size"] for name in ("lr", "decay", "direction_weight", "avg_weight")}
    with _Recompiles() as recompiles:
        adamw(param, grad, encoded, scalars)
        lion(param, grad, encoded[:1], lion_scalars)
        adamw(param, grad, encoded, scalars)
        lion(param, grad, encoded[:1], lion_scalars)
    assert recompiles.functions == []
    assert adamw.compiled and lion.compiled


def test_a_compilation_that_fails_falls_back_to_eager_logs_once_and_sizes_chunks_eagerly(
    fresh_kernels, caplog, monkeypatch
):
    """Past Dynamo's recompile limit (0 here, so the first compilation fails) the kernel updates eagerly, says so
    once, and the optimizer's chunks and workspace are the eager kernel's; the results are the eager run's."""
    monkeypatch.setenv("HF_PAGED_NATIVE", "0")  # CPU pages of fp32 state take the PyTorch kernels
    import hf_paged

    def run(compiled: bool):
        model = make_mlp()
        optimizer = hf_paged.PagedLion(decay_groups(model), compiled=compiled, **optimizer_kwargs("PagedLion"))
        train(model, optimizer, regression_batches(3))
        return model, optimizer

    eager_model, eager = run(compiled=False)
    with (
        torch._dynamo.config.patch(recompile_limit=0),
        caplog.at_level(logging.WARNING, logger="hf_paged.kernels.pytorch"),
    ):
        model, optimizer = run(compiled=True)
    fallbacks = [record for record in caplog.records if record.name == "hf_paged.kernels.pytorch"]
    assert len(fallbacks) == 1 and "update eagerly from now on" in fallbacks[0].getMessage()
    assert "lion_update_" in fallbacks[0].getMessage() and "recompile limit" in fallbacks[0].getMessage()
    for param, expected in zip(model.parameters(), eager_model.parameters(), strict=True):
        assert torch.equal(param, expected)
    assert optimizer.compiled and optimizer.step_workspace == eager.step_workspace


def test_a_kernel_compiles_once_per_dtype_whatever_views_of_a_parameter_it_takes(fresh_kernels, monkeypatch):
    """Views of a parameter (which require grad) at any storage offset and padded copies (which do not), of fp32 and
    bf16 parameters: each dtype compiles once and never again, and the compiled update writes the parameter.
    (Before, one function served every dtype and recompiled on ``tensor 'param' requires_grad mismatch`` and
    ``2 <= param.storage_offset()``, until Dynamo's recompile limit left it eager.)"""
    monkeypatch.setenv("HF_PAGED_NATIVE", "0")  # CPU pages of 8-bit state take the PyTorch kernels
    from hf_paged.codecs import Blockwise8bitCodec
    from hf_paged.kernels import prepare_scalars
    from hf_paged.kernels.pytorch import update_segment
    from hf_paged.optim.lion import lion_update_

    torch._dynamo.reset()
    codec = Blockwise8bitCodec(64, True)
    kernel = fresh_kernels.segment_kernel(lion_update_, (codec,), True, torch.device("cpu"))
    scalars = {"lr": 1e-3, "decay": 1.0, "direction_weight": 0.1, "avg_weight": 0.01}
    compiled_scalars = prepare_scalars(scalars, True)
    generator = torch.Generator().manual_seed(0)

    def copied(arrays: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(array.clone() for array in arrays)

    with _Recompiles() as recompiles, torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            param = torch.nn.Parameter(torch.randn(8 * 64, generator=generator).to(dtype))
            grad = torch.randn(8 * 64, generator=generator).to(dtype)
            codes, scales = torch.zeros(8 * 64, dtype=torch.int8), torch.zeros(8)
            for first, blocks in ((3, 2), (0, 4), (5, 3)):
                elements = slice(first * 64, (first + blocks) * 64)
                view, grad_view = param[elements].view(blocks, 64), grad[elements].view(blocks, 64)
                state = codec.select((codes, scales), first * 64, blocks * 64)
                expected = view.clone()
                update_segment(lion_update_, (codec,), expected, grad_view, [copied(state)], scalars)
                kernel(view.clone(), grad_view, [copied(state)], compiled_scalars)  # a copy, as of a partial block
                kernel(view, grad_view, [state], compiled_scalars)
                torch.testing.assert_close(view, expected)
    assert recompiles.functions == []
    assert kernel.compiled


_ALL_VARIANTS_SCRIPT = """
import json, logging, sys
import torch
sys.path.insert(0, "tests")
from conftest import OPTIMIZERS, decay_groups, optimizer_kwargs, regression_batches, train

class Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []
    def emit(self, record):
        self.messages.append(record.getMessage())

recompiles, fallbacks = Messages(), Messages()
torch._logging.set_logs(recompiles=True)
logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(recompiles)
logging.getLogger("hf_paged.kernels.pytorch").addHandler(fallbacks)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for name, optimizer_class in OPTIMIZERS.items():
        torch.manual_seed(0)
        # weights of 2000 and 300 elements: partial last blocks (padded copies), one-block tails, segments on pages
        model = torch.nn.Sequential(torch.nn.Linear(20, 100), torch.nn.GELU(), torch.nn.Linear(100, 3)).to(dtype)
        optimizer = optimizer_class(decay_groups(model), compiled=True, **optimizer_kwargs(name))
        train(model, optimizer, regression_batches(2, dtype=dtype))
recompiled = [message.split()[2] for message in recompiles.messages if message.startswith("Recompiling function ")]
print(json.dumps({"recompiled": recompiled, "fallbacks": fallbacks.messages}))
"""


@pytest.mark.slow
def test_every_optimizer_and_dtype_in_one_process_compiles_each_function_once():
    """The five optimizers on fp32, bf16 and fp16 parameters in one fresh process, with the PyTorch kernels: no
    function reaches Dynamo's recompile limit or falls back to eager, and each recompiles at most once (for a call of
    one block). About 100 s on a 2-core CPU with a cold Inductor cache. (Before: the 8-bit AdamW function reached the
    limit, ``last reason: tensor 'param' requires_grad mismatch`` or a storage offset's guard.)"""
    environment = {**os.environ, "HF_PAGED_NATIVE": "0", "HF_PAGED_COMPILE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _ALL_VARIANTS_SCRIPT], capture_output=True, text=True, env=environment, check=True
    )
    assert "recompile_limit" not in result.stderr, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["fallbacks"] == []
    counts = collections.Counter(report["recompiled"])
    assert counts and max(counts.values()) == 1, counts


def _train_around(name: str, compiled_part: str | None):
    """Three steps of a training step calling ``optimizer.step()``, with ``compiled_part`` (``"training step"`` or
    ``"optimizer step"``) through ``torch.compile``, or none."""
    model = make_mlp()
    optimizer = OPTIMIZERS[name](decay_groups(model), compiled=False, **optimizer_kwargs(name))
    step = torch.compile(optimizer.step) if compiled_part == "optimizer step" else optimizer.step

    def train_step(inputs, targets):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        step()
        optimizer.zero_grad()
        return loss

    run = torch.compile(train_step) if compiled_part == "training step" else train_step
    for inputs, targets in regression_batches(3):
        run(inputs, targets)
    return model, optimizer


@pytest.mark.parametrize("name", ["PagedAdamW", "PagedAdamW8bit"])
@pytest.mark.parametrize("compiled_part", ["training step", "optimizer step"])
def test_a_compiled_training_step_around_the_optimizer_runs_its_step_as_eager(name, compiled_part):
    """``torch.compile`` of a training step that calls ``optimizer.step()`` (or of ``optimizer.step`` alone, torch's
    recipe for compiled optimizers): the step runs between graphs, as outside them. Before, Dynamo traced into it and
    failed on fp32 state's fused AdamW (every model has fp32 state: tensors below ``min_8bit_size``)."""
    torch._dynamo.reset()
    eager_model, eager = _train_around(name, None)
    compiled_model, compiled = _train_around(name, compiled_part)
    assert compiled.paging_stats()["pages_total"] == eager.paging_stats()["pages_total"] > 0
    for param, expected in zip(compiled_model.parameters(), eager_model.parameters()):
        assert ((param - expected).norm() / expected.norm()).item() < 1e-5
