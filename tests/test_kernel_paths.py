"""On the CPU: a pinned kernel path (tests/kernel_paths.py, as the ``gpu`` tests pin theirs) is the path every update
of a step takes, and the recorder sees it: without the pin, the step would take another family's kernels and the
recorder would say so."""

from __future__ import annotations

import pytest
import torch
from conftest import decay_groups, make_mlp, optimizer_kwargs, regression_batches, train
from kernel_paths import pin_kernel_path, record_kernel_paths
from test_compiled import fresh_kernels  # noqa: F401 (a fixture)

import hf_paged
from hf_paged import kernels, native


@pytest.mark.parametrize("path", ["eager", "compiled", "native", "triton"])
def test_a_pinned_kernel_path_is_the_path_a_step_takes(monkeypatch, fresh_kernels, path):  # noqa: F811
    if path == "native" and native.build_failure() is not None:
        pytest.skip("the host kernels cannot be built here")
    if path == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the kernels' module is first imported, and at launches
        triton_kernels = kernels.triton_module()
        if triton_kernels is None or not triton_kernels.INTERPRETED:
            pytest.skip("the Triton kernels run on the CPU only under Triton's interpreter")
    if path == "compiled":  # the compiled path without the compiler's minutes: torch.compile hands the function back
        monkeypatch.setattr(torch, "compile", lambda function, **options: function)
    compiled = pin_kernel_path(monkeypatch, path)
    paths = record_kernel_paths(monkeypatch)
    model = make_mlp(dtype=torch.bfloat16)
    kwargs = optimizer_kwargs("PagedAdamW8bit", device_budget=2 * 4096, compiled=compiled)
    optimizer = hf_paged.PagedAdamW8bit(decay_groups(model), **kwargs)
    train(model, optimizer, regression_batches(2, dtype=torch.bfloat16))
    assert set(paths) == {path} and paths[path] > 0, paths


def test_without_a_pin_the_recorder_sees_the_default_path(monkeypatch):
    """The CPU's default, the host kernels, where they build: a test that named another path and forgot its pin would
    see it here."""
    if native.build_failure() is not None:
        pytest.skip("the host kernels cannot be built here")
    monkeypatch.delenv("HF_PAGED_KERNELS", raising=False)
    paths = record_kernel_paths(monkeypatch)
    model = make_mlp(dtype=torch.bfloat16)
    optimizer = hf_paged.PagedAdamW8bit(decay_groups(model), **optimizer_kwargs("PagedAdamW8bit", compiled=True))
    train(model, optimizer, regression_batches(1, dtype=torch.bfloat16))
    assert "native" in paths and "compiled" not in paths, paths
