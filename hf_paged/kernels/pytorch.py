"""The PyTorch kernels: decode a segment's state, apply an update rule in fp32, encode, write the parameter.

The composition is plain PyTorch, so it runs eagerly on every device. With ``compiled=True`` it is
handed to :func:`torch.compile`, which fuses decode, update and encode into one kernel per segment
shape family (segment lengths and the per-step scalars do not cause recompiles). Each rule, page format, device
and pair of parameter and gradient dtypes gets a compiled function of its own, so that only one-block calls and
stochastic rounding add entries to its cache, far below Dynamo's recompile limit; where compilation fails all the
same, the kernel updates eagerly from then on, which is logged once.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import types
from collections.abc import Callable, Sequence

import torch

from ..codecs import Codec, EncodedSegment, PageFormat, Rank1Statistics, to_blocks
from ..stochastic_rounding import ElementRounding, round_into_bf16_
from .rules import UpdateRule

logger = logging.getLogger(__name__)


def update_segment(
    rule: UpdateRule,
    codecs: Sequence[Codec],
    param: torch.Tensor,
    grad: torch.Tensor,
    encoded: Sequence[EncodedSegment],
    scalars: dict[str, float],
    rounding: ElementRounding | None = None,
) -> None:
    """Update one segment: ``param`` and ``grad`` are its elements, shaped as the codecs see them.

    With ``rounding``, a bf16 ``param`` takes its new value rounded stochastically (see
    :mod:`hf_paged.stochastic_rounding`); other dtypes ignore it.
    """
    param32 = param.float()
    states = [codec.decode(segment) for codec, segment in zip(codecs, encoded)]
    rule(param32, grad.float(), *states, **scalars)
    scales = [codec.block_scales(state) for codec, state in zip(codecs, states)]
    for codec, state, block_scales, segment in zip(codecs, states, scales, encoded):
        codec.encode(state, segment, block_scales)
    if rounding is not None and param.dtype == torch.bfloat16:
        del states, scales  # free the decoded state before the rounding's temporaries
        round_into_bf16_(param, param32, rounding)
    elif param32 is not param:
        param.copy_(param32)
    if param.dtype == torch.bfloat16:  # NaN as 0x7FC0, as the host and Triton kernels write it (ATen: 0xFFFF)
        param.view(torch.int16).masked_fill_(param32.isnan(), 0x7FC0)


def update_in_buffers(
    rule: UpdateRule,
    codecs: Sequence[Codec],
    param: torch.Tensor,
    grad: torch.Tensor,
    buffers: Sequence[torch.Tensor],
    offset: int,
    scalars: dict[str, float],
    rounding: ElementRounding | None = None,
    statistics: Rank1Statistics | None = None,
    first: int = 0,
) -> None:
    """Update a segment of any length, flat ``param`` and ``grad``, whose state starts at element ``offset`` of a
    page's ``buffers``, as the optimizer's per-segment path does with the eager kernel: whole blocks in place, a
    partial last block through zero-padded copies. The reference the batch kernels are checked against. A rank-1
    normalized state takes its tensor's ``statistics`` and the segment's first element in the tensor, ``first``."""
    page_format = PageFormat(tuple(codecs))
    arrays = page_format.arrays(tuple(buffers))
    alignment = page_format.alignment
    body = param.numel() - param.numel() % alignment
    for begin, end in ((0, body), (body, param.numel())):
        if end == begin:
            continue
        encoded = [codec.select(array, offset + begin, end - begin) for codec, array in zip(codecs, arrays)]
        if statistics is not None:
            encoded = statistics.attach(encoded, first + begin, end - begin, alignment)
        padded = to_blocks(param[begin:end], alignment)
        part_rounding = None if rounding is None else rounding._replace(start=rounding.start + begin)
        update_segment(rule, codecs, padded, to_blocks(grad[begin:end], alignment), encoded, scalars, part_rounding)
        param[begin:end].copy_(padded.reshape(-1)[: end - begin])


def gather_in_buffers(
    moments: UpdateRule,
    codecs: Sequence[Codec],
    grad: torch.Tensor,
    buffers: Sequence[torch.Tensor],
    offset: int,
    scalars: dict[str, float],
    statistics: Rank1Statistics,
    first: int,
) -> None:
    """Take into ``statistics``' next maxima the new state of a rank-1 normalized segment (flat gradient ``grad``,
    its state from element ``offset`` of a page's ``buffers``, its first element ``first`` of the tensor), advanced by
    ``moments`` as the optimizer's statistics pass does: the reference of the batch kernels' ``gather_batch``."""
    page_format = PageFormat(tuple(codecs))
    arrays = page_format.arrays(tuple(buffers))
    encoded = [codec.select(array, offset, grad.numel()) for codec, array in zip(codecs, arrays)]
    encoded = statistics.attach(encoded, first, grad.numel(), page_format.alignment, gathering=True)
    states = [codec.decode(segment) for codec, segment in zip(codecs, encoded)]
    moments(to_blocks(grad, page_format.alignment).float(), *states, **scalars)
    for state, values in enumerate(states):
        statistics.observe(state, first, values)


def update_or_undo(
    kernel: Callable[..., None],
    param: torch.Tensor,
    grad: torch.Tensor,
    encoded: Sequence[EncodedSegment],
    scalars: dict,
    rounding: ElementRounding | None = None,
) -> None:
    """Run ``kernel`` on one segment so that it updates ``param`` and the ``encoded`` state whole or not at all: what
    it writes is copied first (every allocation of this function comes before the kernel's first write) and copied
    back if it raises, which allocates nothing. ``rounding`` is passed on only when given. Of each encoded segment,
    only the page's arrays are written (the buffers its codec has): arrays appended after them (a rank-1 state's
    normalizers) are read only, and not copied."""
    codecs = getattr(kernel, "codecs", None)
    written = [None] * len(encoded) if codecs is None else [len(codec.buffer_specs(0)) for codec in codecs]
    targets = [param, *(array for segment, count in zip(encoded, written) for array in segment[:count])]
    saved = [target.clone() for target in targets]
    try:
        kernel(param, grad, encoded, scalars, *(() if rounding is None else (rounding,)))
    except BaseException:
        for target, copy_of_target in zip(targets, saved):
            target.copy_(copy_of_target)
        raise


def compile_available(device: torch.device) -> bool:
    """Whether :func:`torch.compile` can build kernels for ``device`` on this machine.

    On CUDA and XPU that takes a Triton that PyTorch finds usable (``torch.utils._triton.has_triton``)
    and, on CUDA, a device of compute capability 7.0 or more, as Inductor requires; otherwise the step
    runs eagerly, which is logged once.
    """
    if device.type == "cpu":
        return _cpu_compiler_found(os.environ.get("CXX", "c++"))
    if device.type in ("cuda", "xpu"):
        reason = _triton_unusable(device)
        if reason is not None:
            _log_eager_fallback(device.type, reason)
        return reason is None
    return False


@functools.cache
def _cpu_compiler_found(cxx: str) -> bool:
    """Whether Inductor finds a C++ compiler for CPU kernels (looked up once per process and ``CXX``)."""
    return shutil.which(cxx) is not None or shutil.which("gcc") is not None


def _triton_unusable(device: torch.device) -> str | None:
    """Why Inductor cannot generate Triton kernels for ``device``, or ``None`` where it can."""
    from torch.utils._triton import has_triton

    if not has_triton():
        return "PyTorch finds no usable Triton"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 7:
            return f"Triton needs CUDA compute capability 7.0 or more, this device has {major}.{minor}"
    return None


@functools.cache
def _log_eager_fallback(device_type: str, reason: str) -> None:
    logger.warning("hf_paged: torch.compile is not available on %s (%s); updating eagerly", device_type, reason)


COMPILE_MIN_ELEMENTS = 2**21
"""Parameter elements from which the default setting compiles: below, a compile (10 to 20 s on a CPU, cold
cache) costs more than eager updates save over a short run, and the first step would stall for it."""


def resolve_compiled(compiled: bool | None, device: torch.device, param_elements: int) -> bool:
    """The ``compiled`` setting in force for an optimizer of parameters with ``param_elements`` elements (local
    elements: a rank's shards), whatever number of state tensors each element has.

    The argument when given; else ``HF_PAGED_COMPILE`` (``1`` compiles where a compiler is available,
    ``0`` never does); else compile where a compiler is available and the parameters have at least
    :data:`COMPILE_MIN_ELEMENTS` elements.
    """
    if compiled is not None:
        return compiled
    setting = os.environ.get("HF_PAGED_COMPILE", "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting not in ("", "1", "true", "yes", "on"):
        raise ValueError(f"HF_PAGED_COMPILE={setting!r} is not allowed: use 0 or 1")
    if not setting and param_elements < COMPILE_MIN_ELEMENTS:
        return False
    return compile_available(device)


_INDUCTOR_OPTIONS = {"cpp.dynamic_threads": True}
"""Inductor settings of the segment kernels. A CPU kernel is otherwise parallel or not by the size of the first
segment it was compiled for (a dynamic length has no other hint): compiled for a small parameter, it would
update every later segment, however long, on one thread. With dynamic threads OpenMP decides at each call."""


@functools.cache
def _compile_failures() -> tuple[type[Exception], ...]:
    """What a compiled function raises when Dynamo or Inductor cannot compile it (a graph break under
    ``fullgraph=True``, the recompile limit, a compiler error), before it runs any of its code."""
    from torch._dynamo import exc

    names = ("TorchDynamoException", "FailOnRecompileLimitHit")
    return tuple(getattr(exc, name) for name in names if hasattr(exc, name))


class SegmentKernel:
    """:func:`update_segment` for one rule and one page format's codecs, eager or through ``torch.compile``.

    Compiled, the leading dimension of every tensor (elements, or blocks) is dynamic and the block dimension
    static, so one kernel serves every segment length of the format (each call marks it, whatever Dynamo's
    settings and caches). The scalars (learning rate, bias corrections) enter as 0-d fp32 CPU tensors made
    once per step by :func:`prepare_scalars`, since torch.compile would specialize on float values and
    recompile at every step.

    Each device and pair of parameter and gradient dtypes gets a function with a code object of its own
    (:func:`_update_function`): Dynamo keeps compiled entries and counts recompiles per code object, and one function
    shared by every rule, format, device and dtype would recompile for each of them and, past the recompile limit, run
    eagerly. Every tensor enters detached and at storage offset 0 (:func:`_as_compiled_input`), so that a view of a
    parameter (which requires grad) and a padded copy (which does not) share an entry, and so do segments anywhere in
    a page: a function's entries are then its calls of one block (Dynamo specializes a dimension of size 1) and its
    other calls, each with and without stochastic rounding. Where compilation fails all the same, the kernel logs it
    once and updates eagerly from then on (:attr:`compiled` turns ``False``, so the optimizer's chunks and workspace
    follow).
    """

    def __init__(self, rule: UpdateRule, codecs: tuple[Codec, ...], compiled: bool) -> None:
        self.rule = rule
        self.codecs = codecs
        self.compiled = compiled
        """Whether calls run compiled: as made, until a compilation fails."""
        self._compiled_updates: dict[tuple[torch.device, torch.dtype, torch.dtype], Callable[..., None]] = {}

    def _compiled_update(self, param: torch.Tensor, grad: torch.Tensor) -> Callable[..., None]:
        """The compiled update of this kernel's segments on ``param``'s device with ``param``'s and ``grad``'s dtypes
        (compiled at its first call)."""
        key = (param.device, param.dtype, grad.dtype)
        update = self._compiled_updates.get(key)
        if update is None:
            parts = ["update", self.rule.__name__, *(type(codec).__name__ for codec in self.codecs)]
            parts += [str(param.device).replace(":", ""), str(param.dtype)[6:], str(grad.dtype)[6:]]
            function = _update_function(self.rule, self.codecs, "_".join(parts))
            update = torch.compile(function, fullgraph=True, options=_INDUCTOR_OPTIONS)
            self._compiled_updates[key] = update
        return update

    def _fall_back(self, error: Exception) -> None:
        """Update eagerly from now on, and say why."""
        self.compiled = False
        if type(error).__name__ == "FailOnRecompileLimitHit":
            reason = "it reached Dynamo's recompile limit, torch._dynamo.config.recompile_limit"
        else:
            reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        logger.warning(
            "hf_paged: torch.compile failed for the %s update of %s state (%s); its pages update eagerly from now on",
            self.rule.__name__,
            ", ".join(type(codec).__name__ for codec in self.codecs),
            reason,
        )

    def allocates_nothing(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether a call on ``param`` and ``grad`` allocates nothing, so that a segment of any length can be
        updated in one call: never, since the PyTorch kernels decode the state into temporaries."""
        return False

    def __call__(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        encoded: Sequence[EncodedSegment],
        scalars: dict,
        rounding: ElementRounding | None = None,
    ) -> None:
        """Update one segment; ``scalars`` come from :func:`prepare_scalars` (0-d CPU tensors or floats);
        ``rounding`` (ints) rounds a bf16 ``param`` stochastically."""
        if self.compiled:
            param, grad = _as_compiled_input(param), _as_compiled_input(grad)
            encoded = [tuple(_as_compiled_input(array) for array in segment) for segment in encoded]
            for tensor in (param, grad, *(array for segment in encoded for array in segment)):
                if tensor.shape[0] > 1:
                    torch._dynamo.mark_dynamic(tensor, 0)
            # 0-d tensors: the keys and start change at every step and chunk, and must not cause recompiles.
            compiled_rounding = (
                None
                if rounding is None or param.dtype != torch.bfloat16
                else ElementRounding(*(torch.tensor(value, dtype=torch.int64) for value in rounding))
            )
            try:
                self._compiled_update(param, grad)(param, grad, encoded, scalars, compiled_rounding)
                return
            except _compile_failures() as error:
                self._fall_back(error)
        floats = {name: float(value) for name, value in scalars.items()}
        update_segment(self.rule, self.codecs, param, grad, encoded, floats, rounding)


def _as_compiled_input(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as a compiled kernel takes them: detached, and at storage offset 0 of a storage that
    starts at its first element and keeps ``tensor``'s memory alive (writes reach ``tensor``).

    Dynamo guards on ``requires_grad``, and makes the storage offset of a tensor with a dynamic size a symbol
    specialized to 0 or 1 or guarded to be at least 2; offsets that change between calls (segments anywhere in a
    page, a parameter's view and its padded copy) would each add an entry, up to the recompile limit."""
    if tensor.storage_offset() == 0:
        return tensor.detach()
    storage = tensor.untyped_storage()[tensor.storage_offset() * tensor.element_size() :]
    return tensor.new_empty(0).set_(storage, 0, tensor.shape, tensor.stride())


def _update_function(rule: UpdateRule, codecs: tuple[Codec, ...], name: str) -> Callable[..., None]:
    """:func:`update_segment` of ``rule`` and ``codecs`` as a new function named ``name`` with a code object of its
    own, which Dynamo compiles and caches apart from every other."""

    def update(
        param: torch.Tensor,
        grad: torch.Tensor,
        encoded: Sequence[EncodedSegment],
        scalars: dict,
        rounding: ElementRounding | None,
    ) -> None:
        update_segment(rule, codecs, param, grad, encoded, scalars, rounding)

    code = update.__code__.replace(co_name=name)
    return types.FunctionType(code, update.__globals__, name, None, update.__closure__)


def prepare_scalars(scalars: dict[str, float], compiled: bool) -> dict[str, float | torch.Tensor]:
    """A rule's scalars as its kernels take them: floats eagerly, 0-d fp32 CPU tensors compiled.

    Either way a scalar enters the fp32 update as the same fp32 value, so eager and compiled kernels compute
    with the same constants.
    """
    if not compiled:
        return scalars
    return {name: torch.tensor(value, dtype=torch.float32, device="cpu") for name, value in scalars.items()}
