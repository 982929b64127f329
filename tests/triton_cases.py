"""Cases shared by the Triton kernel tests, on the CPU under the interpreter (``tests/test_triton_kernels.py``) and on
CUDA (``tests/test_gpu_triton.py``): the rules and state formats, random pages as training leaves them, and the
reference update. Imports no Triton, so that either test module controls how Triton is imported."""

from __future__ import annotations

import torch

from hf_paged.codecs import Blockwise4bitCodec, Blockwise8bitCodec, Float32Codec, PageFormat, to_blocks
from hf_paged.kernels.pytorch import update_segment
from hf_paged.kernels.rules import adamw_scalars, adamw_update_, lion_update_

BLOCK = 64
"""Elements per block of the 8-bit and 4-bit codecs."""
RULES = {"adamw": (adamw_update_, (True, False)), "lion": (lion_update_, (True,))}
"""Each rule with the signedness of its states."""
FORMATS = ("8bit", "4bit", "fp32")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ADAMW_GROUP = {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1, "eps": 1e-8}
LION_SCALARS = {"lr": 1e-3, "decay": 0.9999, "direction_weight": 0.1, "avg_weight": 0.01}


def codecs_of(rule_name: str, state_format: str) -> tuple:
    """The codecs of the rule's states in ``state_format``."""
    _, signedness = RULES[rule_name]
    if state_format == "fp32":
        return tuple(Float32Codec() for _ in signedness)
    codec = Blockwise8bitCodec if state_format == "8bit" else Blockwise4bitCodec
    return tuple(codec(BLOCK, signed) for signed in signedness)


def scalars_of(rule_name: str, step: int = 3) -> dict[str, float]:
    """The rule's scalars at optimizer step ``step``."""
    return adamw_scalars(ADAMW_GROUP, step) if rule_name == "adamw" else dict(LION_SCALARS)


def random_page(page_format: PageFormat, capacity: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A page's buffers (CPU) holding a state as training leaves it: codes of every value, scales over orders of
    magnitude, the first block all zero (codes and scale 0)."""
    buffers = []
    for numel, dtype in page_format.buffer_specs(capacity):
        if dtype == torch.float32:
            buffer = torch.rand(numel, generator=generator) * 10.0 ** torch.randint(
                -6, 1, (numel,), generator=generator
            )
        else:
            low, high = (-127, 128) if dtype == torch.int8 else (0, 256)
            buffer = torch.randint(low, high, (numel,), generator=generator, dtype=dtype)
        if page_format.alignment > 1:
            buffer[: numel * BLOCK // capacity] = 0
        buffers.append(buffer)
    return buffers


def reference_update(rule, codecs, param, grad, buffers, offset, scalars, rounding=None) -> None:
    """The optimizer's per-segment path with the eager PyTorch kernels, on ``param``'s device: whole blocks in
    place, a partial last block through zero-padded copies."""
    page_format = PageFormat(codecs)
    arrays = page_format.arrays(tuple(buffers))
    alignment = page_format.alignment
    body = param.numel() - param.numel() % alignment
    for begin, end in ((0, body), (body, param.numel())):
        if end == begin:
            continue
        encoded = [codec.select(array, offset + begin, end - begin) for codec, array in zip(codecs, arrays)]
        padded = to_blocks(param[begin:end], alignment)
        chunk_rounding = None if rounding is None else rounding._replace(start=rounding.start + begin)
        update_segment(rule, codecs, padded, to_blocks(grad[begin:end], alignment), encoded, scalars, chunk_rounding)
        param[begin:end].copy_(padded.reshape(-1)[: end - begin])
