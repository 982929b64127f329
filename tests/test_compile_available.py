"""Whether the default path compiles: PyTorch's own Triton check, else eager with one logged line."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.utils._triton

from hf_paged import kernels


@pytest.mark.parametrize(
    "has_triton, capability, expected",
    [(False, (8, 0), False), (True, (6, 1), False), (True, (7, 0), True), (True, (9, 0), True)],
)
def test_compile_available_on_cuda_follows_torch_triton_check(monkeypatch, caplog, has_triton, capability, expected):
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: has_triton)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.delenv("HF_PAGED_COMPILE", raising=False)
    kernels.pytorch._log_eager_fallback.cache_clear()
    cuda = torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING, logger="hf_paged.kernels.pytorch"):
        for _ in range(3):
            assert kernels.compile_available(cuda) is expected
            assert kernels.resolve_compiled(None, cuda, kernels.COMPILE_MIN_ELEMENTS) is expected
    fallbacks = [record for record in caplog.records if record.name == "hf_paged.kernels.pytorch"]
    assert len(fallbacks) == (0 if expected else 1)
    if not expected:
        assert "eagerly" in fallbacks[0].getMessage()
        assert ("6.1" in fallbacks[0].getMessage()) == has_triton


def test_default_compiles_only_a_large_state(monkeypatch):
    """Small states update eagerly by default (no compile stall); large ones compile where a compiler is."""
    import hf_paged

    monkeypatch.delenv("HF_PAGED_COMPILE", raising=False)
    small = hf_paged.PagedAdamW8bit([torch.nn.Parameter(torch.zeros(300_000))])
    large = hf_paged.PagedAdamW8bit([torch.nn.Parameter(torch.zeros(kernels.COMPILE_MIN_ELEMENTS))])
    assert small.compiled is False
    assert large.compiled is kernels.compile_available(torch.device("cpu"))
    assert hf_paged.PagedAdamW8bit(small.param_groups[0]["params"], compiled=True).compiled is True
    monkeypatch.setenv("HF_PAGED_COMPILE", "1")
    assert small.compiled is kernels.compile_available(torch.device("cpu"))
    monkeypatch.setenv("HF_PAGED_COMPILE", "0")
    assert large.compiled is False
