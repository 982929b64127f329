"""The step plan (hf_paged/optim/plan.py) must not go stale: whatever changes between steps — a parameter's memory
or strides, a step count written behind the plan's back, budgets, hyperparameters — the steps match
``torch.optim.AdamW`` on the same gradients as they would without a plan kept from the step before."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.optim.executor import StepRun


def twins(name: str = "PagedAdamW", size: int = 16, **options) -> tuple:
    """A paged optimizer and ``torch.optim.AdamW``, each over its own copy of one square parameter."""
    start = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
    paged_param, torch_param = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    paged = getattr(hf_paged, name)([paged_param], lr=1e-2, weight_decay=0.1, compiled=False, **options)
    reference = torch.optim.AdamW([torch_param], lr=1e-2, weight_decay=0.1)
    return paged_param, torch_param, paged, reference


def step_both(paged_param, torch_param, paged, reference, seed: int) -> None:
    grad = torch.randn(paged_param.shape, generator=torch.Generator().manual_seed(seed))
    paged_param.grad, torch_param.grad = grad.clone(), grad.clone()
    paged.step()
    reference.step()


OPTIMIZERS = [("PagedAdamW", {}), ("PagedAdamW8bit", {"min_8bit_size": 1})]


@pytest.mark.parametrize(("name", "options"), OPTIMIZERS, ids=[name for name, _ in OPTIMIZERS])
def test_a_parameter_given_new_strides_on_the_same_memory_is_updated_through_them(name, options):
    """``param.set_`` to a transposed view of its own storage (same storage, offset, dtype and shape): the plan's
    flat view of the old strides would pair each gradient element with the transposed parameter element."""
    paged_param, torch_param, paged, reference = twins(name, **options)
    for seed in range(2):
        step_both(paged_param, torch_param, paged, reference, seed)
    with torch.no_grad():
        for param in (paged_param, torch_param):
            param.set_(param.untyped_storage(), 0, param.shape, (1, param.shape[0]))
    for seed in range(2, 4):
        step_both(paged_param, torch_param, paged, reference, seed)
    tolerance = 1e-6 if name == "PagedAdamW" else 2e-3
    torch.testing.assert_close(paged_param.detach(), torch_param.detach(), rtol=0, atol=tolerance)


@pytest.mark.parametrize("write", ["data_copy", "data_assign", "fill"])
def test_a_step_count_written_between_steps_sets_the_next_bias_correction(write):
    """DeepSpeed's ZeRO restores a base optimizer's state with ``state[p][key].data.copy_(saved)``, which leaves
    the count's version as it was; ``count.data = ...`` gives it new memory. The step after either must read the
    count written, not the one the plan advanced."""
    paged_param, torch_param, paged, reference = twins()
    for seed in range(3):
        step_both(paged_param, torch_param, paged, reference, seed)
    with torch.no_grad():
        for optimizer, param in ((paged, paged_param), (reference, torch_param)):
            count = optimizer.state[param]["step"]
            if write == "data_copy":
                count.data.copy_(torch.tensor(1.0))
            elif write == "data_assign":
                count.data = torch.tensor(1.0)
            else:
                count.fill_(1.0)
    for seed in range(3, 5):
        step_both(paged_param, torch_param, paged, reference, seed)
    assert float(paged.state[paged_param]["step"]) == float(reference.state[torch_param]["step"]) == 3.0
    torch.testing.assert_close(paged_param.detach(), torch_param.detach(), rtol=0, atol=1e-6)


ALL_OPTIMIZERS = ["PagedAdamW", "PagedAdamW8bit", "PagedAdamW4bit", "PagedLion", "PagedLion8bit"]


def stepped_model(name: str, dtype: torch.dtype) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Parameters of several shapes (one in many pages, one a transposed view) and ``name`` after two steps."""
    generator = torch.Generator().manual_seed(2)
    values = [torch.randn(shape, generator=generator) for shape in [(96, 64), (64,), (33, 7), (5, 3, 4)]]
    values.append(torch.randn(40, 24, generator=generator).t())  # not contiguous
    params = [torch.nn.Parameter(value.to(dtype)) for value in values]
    optimizer = getattr(hf_paged, name)(params, lr=1e-2, page_size="4KiB", compiled=False)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(dtype)
        optimizer.step()
    return params, optimizer


def storage_references(storages: list[torch.UntypedStorage]) -> list[int]:
    """The references to each of ``storages`` besides the one the list holds."""
    return [torch._C._storage_Use_Count(storage._cdata) - 1 for storage in storages]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ALL_OPTIMIZERS)
def test_parameters_given_new_memory_leave_no_reference_to_the_old_one(name, dtype):
    """``param.data = param.data.to(...)`` (``model.to``, ``model.half()`` for evaluation) after the last step frees
    the old memory at once: the plan kept between steps holds no view of a parameter."""
    params, optimizer = stepped_model(name, dtype)
    old = [param.untyped_storage() for param in params]
    for param in params:
        param.data = param.data.to(torch.float16)
    assert storage_references(old) == [0] * len(params)
    assert optimizer._plan is not None


@pytest.mark.parametrize("name", ALL_OPTIMIZERS)
def test_a_step_that_raises_leaves_no_reference_to_the_parameters(name, monkeypatch):
    """A step that stops with an error (here after its updates, before it returns) drops its views of the
    parameters too, while the error and its traceback are still held."""
    params, optimizer = stepped_model(name, torch.float32)
    stream = StepRun.stream

    def stream_then_fail(self, pages):
        stream(self, pages)
        raise RuntimeError("stopped after the updates")

    monkeypatch.setattr(StepRun, "stream", stream_then_fail)
    for param in params:
        param.grad = torch.ones_like(param)
    with pytest.raises(RuntimeError, match="stopped after the updates") as raised:
        optimizer.step()
    old = [param.untyped_storage() for param in params]
    for param in params:
        param.data = param.data.to(torch.bfloat16)
    assert storage_references(old) == [0] * len(params)
    assert raised.value is not None


def test_a_gradient_not_contiguous_on_one_step_takes_flat_views_of_the_state():
    """PagedAdamW hands PyTorch's fused AdamW a tensor in one segment as it is, with its state views in its shape
    (kept while the page is resident); a step whose gradient is not contiguous (updated through flat copies) takes
    flat state views, and the step after the shaped ones again: each step matches ``torch.optim.AdamW``."""
    paged_param, torch_param, paged, reference = twins()
    for seed in range(4):
        grad = torch.randn(paged_param.shape, generator=torch.Generator().manual_seed(seed))
        if seed == 2:
            grad = grad.t().contiguous().t()  # the same values, column-major
            assert not grad.is_contiguous()
        paged_param.grad, torch_param.grad = grad.clone(memory_format=torch.preserve_format), grad.clone()
        paged.step()
        reference.step()
        torch.testing.assert_close(paged_param.detach(), torch_param.detach(), rtol=0, atol=1e-6)
