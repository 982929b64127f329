"""Cases shared by the Triton kernel tests, on the CPU under the interpreter (``tests/test_triton_kernels.py``) and on
CUDA (``tests/test_gpu_triton.py``): the rules, state formats and scalars, and the optimizers run whole. Imports no Triton, so that either test
module controls how Triton is imported (random pages and the reference update are
:func:`hf_paged.codecs.random_page_buffers` and :func:`hf_paged.kernels.pytorch.update_in_buffers`)."""

from __future__ import annotations

import torch

from hf_paged.codecs import Blockwise4bitCodec, Blockwise8bitCodec, Float32Codec
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


CASES = {
    "PagedAdamW8bit": {},
    "PagedAdamW4bit": {"dtype": torch.bfloat16},
    "PagedLion8bit": {},
    "PagedAdamW": {"dtype": torch.bfloat16, "bf16_stochastic_round": True, "stochastic_round_seed": 5},
    "PagedLion": {"dtype": torch.bfloat16},
}
"""Per optimizer: the parameters' dtype and extra arguments (PagedAdamW on fp32 parameters takes torch's fused AdamW,
so it runs on bf16 parameters, where its fp32 state takes the Triton kernel)."""
