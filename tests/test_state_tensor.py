"""``PagedOptimizer.get_state_tensor`` and ``set_state_tensor``: one state of one tensor as fp32 values, decoded
from its pages and encoded back (what DeepSpeed's state tools use; see ``tests/test_deepspeed_state_tools.py``)."""

from __future__ import annotations

import pytest
import torch

from hf_paged.codecs import QUANTIZED_CODECS, to_blocks
from hf_paged.optim import PagedAdamW, PagedAdamW4bit, PagedAdamW8bit

QUANTIZED = {PagedAdamW8bit: (8, "min_8bit_size"), PagedAdamW4bit: (4, "min_4bit_size")}
BLOCK = 64


def trained(cls, budget=None, steps=3):
    """``cls`` over two parameters (one quantized, one small 32-bit one) after ``steps`` steps, pages of 4 KiB. The
    quantized one's rows span whole blocks, so that a 4-bit optimizer keeps its state in 4-bit codes."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 300)), torch.nn.Parameter(torch.randn(5))]
    options = {} if cls is PagedAdamW else {"block_size": BLOCK, QUANTIZED[cls][1]: 256}
    optimizer = cls(params, lr=1e-2, page_size="4KiB", device_budget=budget, **options)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    return optimizer, params


def codec_of(cls, name):
    bits = QUANTIZED[cls][0]
    return QUANTIZED_CODECS[bits](BLOCK, name == "exp_avg")


def decoded(cls, entry, name, numel):
    """State ``name`` of a saved entry, decoded by the codec (fp32 entries as they are)."""
    if name in entry:
        return entry[name].reshape(-1)
    codec = codec_of(cls, name)
    padded = -(-numel // BLOCK) * BLOCK
    fields = [entry[f"{name}_{field}"].reshape(-1) for field in codec.fields]
    fields = [torch.cat([f, f.new_zeros(n - f.numel())]) for f, n in zip(fields, codec.field_lengths(padded))]
    return codec.decode(codec.select(tuple(fields), 0, padded)).reshape(-1)[:numel]


def encoded(cls, name, values):
    """``values`` encoded by the codec (the last block padded with zeros): the fields a saved entry holds."""
    codec = codec_of(cls, name)
    padded = -(-values.numel() // BLOCK) * BLOCK
    fields = tuple(torch.zeros(n, dtype=d) for n, d in zip(codec.field_lengths(padded), codec.field_dtypes()))
    codec.encode(to_blocks(values.reshape(-1).clone(), codec.alignment), codec.select(fields, 0, padded))
    return tuple(field[:length] for field, length in zip(fields, codec.field_lengths(values.numel())))


@pytest.mark.parametrize("cls", [PagedAdamW, PagedAdamW8bit, PagedAdamW4bit])
@pytest.mark.parametrize("name", ["exp_avg", "exp_avg_sq"])
def test_get_state_tensor_is_the_saved_state_decoded(cls, name):
    optimizer, params = trained(cls)
    saved = optimizer.state_dict()["state"]
    for index, param in enumerate(params):
        values = optimizer.get_state_tensor(param, name)
        assert values.dtype == torch.float32 and values.shape == param.shape and values.device.type == "cpu"
        assert torch.equal(values.reshape(-1), decoded(cls, saved[index], name, param.numel()))


@pytest.mark.parametrize("cls", [PagedAdamW8bit, PagedAdamW4bit])
@pytest.mark.parametrize("budget", [None, "4KiB"])
def test_set_state_tensor_saves_the_codecs_encoding_and_leaves_the_rest(cls, budget):
    """The quantized parameter's ``exp_avg`` set to new values: the saved codes and scales are the codec's
    encoding of them; ``exp_avg_sq`` and the other parameter's state are unchanged, under any budget."""
    optimizer, params = trained(cls, budget)
    before = optimizer.state_dict()["state"]
    values = torch.randn(params[0].shape)
    optimizer.set_state_tensor(params[0], "exp_avg", values)
    after = optimizer.state_dict()["state"]
    codec = codec_of(cls, "exp_avg")
    for field, expected in zip(codec.fields, encoded(cls, "exp_avg", values)):
        assert torch.equal(after[0][f"exp_avg_{field}"].reshape(-1), expected)
    for index, entry in before.items():
        for key, value in entry.items():
            if not (index == 0 and key.startswith("exp_avg_") and not key.startswith("exp_avg_sq")):
                assert torch.equal(after[index][key], value), (index, key)


def test_set_state_tensor_steps_on_as_torch_adamw_with_the_same_state():
    """32-bit state set through ``set_state_tensor`` and in ``torch.optim.AdamW``'s state: the next steps agree."""
    optimizer, params = trained(PagedAdamW, budget="4KiB")
    reference_params = [torch.nn.Parameter(param.detach().clone()) for param in params]
    reference = torch.optim.AdamW(reference_params, lr=1e-2)
    reference.load_state_dict({**optimizer.state_dict(), "param_groups": reference.state_dict()["param_groups"]})
    torch.manual_seed(1)
    for param, reference_param in zip(params, reference_params):
        for name in ("exp_avg", "exp_avg_sq"):
            values = torch.rand(param.shape)
            optimizer.set_state_tensor(param, name, values)
            reference.state[reference_param][name] = values.clone()
    for _ in range(2):
        for param, reference_param in zip(params, reference_params):
            param.grad = torch.randn_like(param)
            reference_param.grad = param.grad.clone()
        optimizer.step()
        reference.step()
    for param, reference_param in zip(params, reference_params):
        torch.testing.assert_close(param, reference_param, rtol=1e-6, atol=1e-7)


def test_bad_arguments_name_what_is_allowed():
    optimizer, params = trained(PagedAdamW8bit)
    before = optimizer.state_dict()["state"]
    with pytest.raises(KeyError, match="no state 'momentum'.*exp_avg"):
        optimizer.get_state_tensor(params[0], "momentum")
    with pytest.raises(KeyError, match="first step"):
        optimizer.get_state_tensor(torch.zeros(3), "exp_avg")
    with pytest.raises(ValueError, match="value must be a tensor of 2100 elements, got \\(5,\\)"):
        optimizer.set_state_tensor(params[0], "exp_avg", torch.zeros(5))
    after = optimizer.state_dict()["state"]
    assert all(torch.equal(before[i][k], after[i][k]) for i in before for k in before[i])
