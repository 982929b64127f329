"""The host kernels: ``hf_paged/native/host_kernels.cpp``, a C++ pass over each block of a CPU segment of AdamW's
and Lion's 8-bit and 4-bit state.

Built at first use by :mod:`hf_paged.native`; ``HF_PAGED_NATIVE=0`` turns them off, and where they cannot be
built the PyTorch kernels remain, and the reason is logged once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..codecs import Blockwise4bitCodec, Blockwise8bitCodec, Codec, EncodedSegment
from ..stochastic_rounding import ElementRounding
from .pytorch import SegmentKernel
from .rules import UpdateRule, adamw_update_, lion_update_


class HostKernel:
    """The C++ host kernel of ``hf_paged/native/host_kernels.cpp`` for a rule's CPU segments of 8-bit or 4-bit
    state; segments elsewhere (another device, fp64 tensors) go to ``fallback``, a :class:`SegmentKernel`.

    One pass per block of ``block_size`` elements: the codes and scale of each state are read and decoded, the rule
    runs in fp32 with the eager kernel's formulas, the parameter is written once and the state encoded with the
    block's new largest magnitude as its scale. Results do not depend on the number of threads or on chunking.

    It writes the parameter and the state in place and allocates nothing: every argument is checked before the
    first write, so an error leaves the segment as it was. Segments it hands to ``fallback`` are copied first and
    restored if the fallback fails, so that every call updates its segment whole or not at all.
    """

    writes_after_allocating = True
    """Every allocation of a call comes before its first write (here: none on the CPU), so the optimizer's step
    needs no copy of the segment to undo a failed call."""

    def __init__(self, rule_name: str, codecs: tuple[Codec, ...], fallback: SegmentKernel) -> None:
        self.rule_name = rule_name
        self.codecs = codecs
        self.fallback = fallback
        first = codecs[0]
        self.bits = 8 if isinstance(first, Blockwise8bitCodec) else 4
        self.block_size = first.block_size
        self._scalar_names = _HOST_RULES[rule_name][1]
        self._operator = getattr(torch.ops.hf_paged, f"{rule_name}_blockwise_")

    @property
    def compiled(self) -> bool:
        """Whether the fallback runs compiled, which also sizes the chunks the optimizer hands over."""
        return self.fallback.compiled

    def __call__(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        encoded: Sequence[EncodedSegment],
        scalars: dict,
        rounding: ElementRounding | None = None,
    ) -> None:
        """Update one segment (``param`` and ``grad`` shaped ``(blocks, block_size)``); ``scalars`` as from
        :func:`prepare_scalars`, floats or 0-d fp32 CPU tensors; ``rounding`` rounds a bf16 ``param``
        stochastically."""
        if param.device.type != "cpu" or param.dtype not in _HOST_DTYPES or grad.dtype not in _HOST_DTYPES:
            self._fallback_whole(param, grad, encoded, scalars, rounding)
            return
        arrays = [array for segment in encoded for array in segment]
        values = [float(scalars[name]) for name in self._scalar_names]
        if rounding is None or param.dtype != torch.bfloat16:
            self._operator(param, grad, *arrays, self.bits, self.block_size, *values)
        else:
            self._operator(param, grad, *arrays, self.bits, self.block_size, *values, True, *rounding)

    def allocates_nothing(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether a call on ``param`` and ``grad`` allocates nothing, so that a segment of any length can be
        updated in one call: on the CPU in a dtype the C++ kernel takes (elsewhere the fallback decodes)."""
        return param.device.type == "cpu" and param.dtype in _HOST_DTYPES and grad.dtype in _HOST_DTYPES

    def _fallback_whole(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        encoded: Sequence[EncodedSegment],
        scalars: dict,
        rounding: ElementRounding | None,
    ) -> None:
        """The fallback kernel on a copy of what it writes, put back if it fails (the copies come first)."""
        targets = [param, *(array for segment in encoded for array in segment)]
        saved = [target.clone() for target in targets]
        try:
            self.fallback(param, grad, encoded, scalars, *(() if rounding is None else (rounding,)))
        except BaseException:
            for target, copy_of_target in zip(targets, saved):
                target.copy_(copy_of_target)
            raise


_HOST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_HOST_RULES: dict[str, tuple[tuple[bool, ...], tuple[str, ...]]] = {
    "adamw": (
        (True, False),
        ("decay", "avg_weight", "beta2", "sq_weight", "eps", "step_size", "inv_bias_correction2_sqrt"),
    ),
    "lion": ((True,), ("lr", "decay", "direction_weight", "avg_weight")),
}
"""The rules with a host kernel: the signedness of their states, and their scalars in the operator's order."""


_HOST_RULE_NAMES: dict[UpdateRule, str] = {adamw_update_: "adamw", lion_update_: "lion"}
"""The update rules that have a host kernel, by function."""


def host_rule_name(rule: UpdateRule, codecs: tuple[Codec, ...]) -> str | None:
    """The host kernel's name for ``rule`` on ``codecs`` (``"adamw"`` or ``"lion"``), or ``None`` where it has
    none: a rule other than AdamW's and Lion's, or states that are not all 8-bit or all 4-bit of one block size."""
    name = _HOST_RULE_NAMES.get(rule)
    if name is None or not codecs:
        return None
    kind = type(codecs[0])
    if kind not in (Blockwise8bitCodec, Blockwise4bitCodec) or any(
        type(codec) is not kind or codec.block_size != codecs[0].block_size for codec in codecs
    ):
        return None
    if tuple(codec.signed for codec in codecs) != _HOST_RULES[name][0]:
        return None
    return name
