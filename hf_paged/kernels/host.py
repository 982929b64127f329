"""The host kernels: ``hf_paged/native/host_kernels.cpp``, a C++ pass over each block of a CPU segment of AdamW's,
Lion's and AdEMAMix's 8-bit and 4-bit state, or over the elements of their fp32 state; per segment, or for every
segment of a page batch at once (:class:`~hf_paged.kernels.batch.PageBatch`). AdamW's rank-1 normalized 4-bit state
takes page batches only (and its statistics pass, :meth:`HostKernel.gather_batch`); its single segments go to the
fallback.

Built at first use by :mod:`hf_paged.native`; ``HF_PAGED_NATIVE=0`` turns them off, and where they cannot be
built the PyTorch kernels remain, and the reason is logged once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..codecs import (
    Blockwise4bitCodec,
    Blockwise8bitCodec,
    Codec,
    EncodedSegment,
    Float32Codec,
    Rank1Normalized4bitCodec,
)
from ..stochastic_rounding import ElementRounding
from .batch import PageBatch
from .pytorch import SegmentKernel, update_or_undo
from .rules import ADEMAMIX_SCALAR_NAMES, UpdateRule, adamw_update_, ademamix_update_, lion_update_


class HostKernel:
    """The C++ host kernel of ``hf_paged/native/host_kernels.cpp`` for a rule's CPU segments of 8-bit, 4-bit or fp32
    state; segments elsewhere (another device) go to ``fallback``, a :class:`SegmentKernel`.

    One pass per block of ``block_size`` elements: the codes and scale of each state are read and decoded, the rule
    runs in fp32 with the eager kernel's formulas, the parameter is written once and the state encoded with the
    block's new largest magnitude as its scale (fp32 state: one pass over the elements, the state updated in place).
    Results are bitwise the eager kernel's, and do not depend on the number of threads, on chunking or on batching.

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
        self.bits = _STATE_BITS[type(first)]
        """Bits per element of the state: 8, 4, or 32 (fp32 state)."""
        self.block_size = first.alignment
        """Elements per block of the state (1 for fp32 state)."""
        self.scalar_names = _HOST_RULES[rule_name][1]
        """The rule's scalars in the operator's order: the columns of a :class:`PageBatch`'s ``scalars``."""
        self.rank1 = isinstance(first, Rank1Normalized4bitCodec)
        """Whether the state is rank-1 normalized (AdamW only): batches take its statistics, segments the fallback."""
        self._operator = getattr(torch.ops.hf_paged, f"{rule_name}_segment_")
        self._batch_operator = getattr(torch.ops.hf_paged, f"{rule_name}_{'rank1_' if self.rank1 else ''}batch_")

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
        """Update one segment (``param`` and ``grad`` shaped ``(blocks, block_size)``, flat for fp32 state, and
        contiguous); ``scalars`` as from
        :func:`prepare_scalars`, floats or 0-d fp32 CPU tensors; ``rounding`` rounds a bf16 ``param``
        stochastically. Segments of rank-1 state (``encoded`` with their normalizers) go to the fallback."""
        if (
            self.rank1
            or param.device.type != "cpu"
            or param.dtype not in _HOST_DTYPES
            or grad.dtype not in _HOST_DTYPES
        ):
            update_or_undo(self.fallback, param, grad, encoded, scalars, rounding)
            return
        arrays = [array for segment in encoded for array in segment]
        values = [float(scalars[name]) for name in self.scalar_names]
        rounding_arguments = () if rounding is None or param.dtype != torch.bfloat16 else (True, *rounding)
        self._operator(param, grad, arrays, self.bits, self.block_size, values, *rounding_arguments)

    def takes_batch(self, device: torch.device, param_dtype: torch.dtype, grad_dtype: torch.dtype) -> bool:
        """Whether :meth:`update_batch` takes segments of ``param_dtype`` parameters with ``grad_dtype`` gradients on
        pages of ``device``: on the CPU, fp32, bf16 or fp16 (others take the per-segment path and its fallback).

        PagedAdamW's fp32 parameters with fp32 state take PyTorch's fused AdamW before any kernel
        (:meth:`~hf_paged.optim.adamw.PagedAdamW.update_pages_fast`): this kernel would take them too, with the
        eager kernel's results rather than the fused kernel's."""
        return device.type == "cpu" and param_dtype in _HOST_DTYPES and grad_dtype in _HOST_DTYPES

    def table_device(self, device: torch.device) -> torch.device:
        """Where a :class:`PageBatch`'s table, scalars and rounding keys live for pages of ``device``: the CPU."""
        return _CPU

    def update_batch(self, batch: PageBatch) -> None:
        """Update every segment of ``batch`` (CPU pages of this kernel's format, each parameter and gradient one
        :meth:`takes_batch` accepts) in one call of the C++ batch operator, bitwise as one call per segment would.

        The operator checks every argument (dtypes, lengths, table entries within bounds, segments that overlap,
        the rank-1 statistics' lengths) before its first write and allocates nothing after it: on an error, a
        RuntimeError naming the argument, nothing has changed. Rank-1 state is decoded with the batch's current
        statistics and encoded with its next ones."""
        buffers = [buffer for page in batch.buffers for buffer in page]
        if self.rank1:
            self._batch_operator(
                batch.params,
                batch.grads,
                buffers,
                batch.table,
                batch.scalars,
                batch.rounding,
                _flat_statistics(batch),
                self.block_size,
            )
            return
        self._batch_operator(
            batch.params, batch.grads, buffers, batch.table, batch.scalars, batch.rounding, self.bits, self.block_size
        )

    def gather_batch(self, batch: PageBatch) -> None:
        """Raise the next row and column maxima of ``batch.statistics`` (rank-1 state only) to the magnitudes of the
        state the step computes for every segment of ``batch``: each element decoded with the current statistics and
        advanced as :func:`~hf_paged.kernels.rules.adamw_moments_` advances it (a NaN counts as 0, an infinity as
        the largest fp32 value). Writes nothing else; checks every argument first, as :meth:`update_batch`."""
        if not self.rank1:
            raise TypeError(f"HostKernel.gather_batch: {type(self.codecs[0]).__name__} state has no statistics")
        torch.ops.hf_paged.adamw_rank1_gather_(
            batch.params,
            batch.grads,
            [buffer for page in batch.buffers for buffer in page],
            batch.table,
            batch.scalars,
            _flat_statistics(batch),
            self.block_size,
        )

    def allocates_nothing(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether a call on ``param`` and ``grad`` allocates nothing, so that a segment of any length can be
        updated in one call: on the CPU in a dtype the C++ kernel takes (elsewhere, and for rank-1 state, the
        fallback decodes)."""
        return (
            not self.rank1 and param.device.type == "cpu" and param.dtype in _HOST_DTYPES and grad.dtype in _HOST_DTYPES
        )


def _flat_statistics(batch: PageBatch) -> list[torch.Tensor]:
    """A rank-1 batch's statistics as the C++ operators take them: each tensor's 8 maxima, tensor after tensor."""
    if batch.statistics is None:
        raise ValueError("PageBatch: rank-1 normalized state needs statistics, got None")
    return [maxima for entry in batch.statistics for maxima in entry]


_HOST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_CPU = torch.device("cpu")

_STATE_BITS: dict[type, int] = {
    Blockwise8bitCodec: 8,
    Blockwise4bitCodec: 4,
    Rank1Normalized4bitCodec: 4,
    Float32Codec: 32,
}
"""Bits per element of each state codec the host kernels take."""

_HOST_RULES: dict[str, tuple[tuple[bool, ...], tuple[str, ...]]] = {
    "adamw": (
        (True, False),
        ("decay", "avg_weight", "beta2", "sq_weight", "eps", "step_size", "inv_bias_correction2_sqrt"),
    ),
    "lion": ((True,), ("lr", "decay", "direction_weight", "avg_weight")),
    "ademamix": ((True, True, False), ADEMAMIX_SCALAR_NAMES),
}
"""The rules with a host kernel: the signedness of their states, and their scalars in the operator's order."""


_HOST_RULE_NAMES: dict[UpdateRule, str] = {adamw_update_: "adamw", lion_update_: "lion", ademamix_update_: "ademamix"}
"""The update rules that have a host kernel, by function."""


def host_rule_name(rule: UpdateRule, codecs: tuple[Codec, ...]) -> str | None:
    """The host kernel's name for ``rule`` on ``codecs`` (``"adamw"``, ``"lion"`` or ``"ademamix"``), or ``None`` where
    it has none: a rule other than AdamW's, Lion's and AdEMAMix's, states that are not all 8-bit, all 4-bit, all
    rank-1 normalized 4-bit (of one block size; AdamW only) or all fp32."""
    name = _HOST_RULE_NAMES.get(rule)
    if name is None or not codecs:
        return None
    kind = type(codecs[0])
    if kind is Rank1Normalized4bitCodec and name != "adamw":
        return None
    if kind not in _STATE_BITS or any(
        type(codec) is not kind or codec.alignment != codecs[0].alignment for codec in codecs
    ):
        return None
    signed = _HOST_RULES[name][0]
    if kind is Float32Codec:
        return name if len(codecs) == len(signed) else None
    if tuple(codec.signed for codec in codecs) != signed:
        return None
    return name


def fits_vector_lanes(codecs: tuple[Codec, ...]) -> bool:
    """Whether the built host kernels' vector code takes ``codecs``' blocks: 4-bit codes are packed by half-blocks,
    which it takes a vector at a time (16 lanes in the AVX-512 build: 4-bit blocks of 16 elements take the PyTorch
    kernels there; so do rank-1 normalized 4-bit blocks). Call once the host kernels are built."""
    if not codecs or not isinstance(codecs[0], (Blockwise4bitCodec, Rank1Normalized4bitCodec)):
        return True
    return codecs[0].block_size // 2 % _vector_lanes() == 0


@functools.cache
def _vector_lanes() -> int:
    """The fp32 lanes of the loaded host kernels' vector code (one build per process)."""
    return torch.ops.hf_paged.vector_lanes()
