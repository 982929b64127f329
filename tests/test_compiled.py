"""The torch.compile kernels give the eager results within rounding, and keep paging invariance."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import compile_available
from conftest import OPTIMIZERS, decay_groups, make_mlp, optimizer_kwargs, regression_batches, train
from test_paging import assert_same_result

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
