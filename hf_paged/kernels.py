"""Per-segment update kernels: decode the state, apply an update rule in fp32, encode, write the parameter.

The composition is plain PyTorch, so it runs eagerly on every device. With ``compiled=True`` it is
handed to :func:`torch.compile`, which fuses decode, update and encode into one kernel per segment
shape family (segment lengths and the per-step scalars do not cause recompiles). Each rule, page format and
device gets a compiled function of its own, so that only dtypes and block counts add entries to its cache, far
below Dynamo's recompile limit; where compilation fails all the same, the kernel updates eagerly from then on,
which is logged once.

CPU segments of AdamW's and Lion's 8-bit and 4-bit states take a hand-written C++ kernel instead
(:class:`HostKernel`, built at first use by :mod:`hf_paged.native`), whether ``compiled`` is set or not: one pass
over each block, the eager kernel's arithmetic. ``HF_PAGED_NATIVE=0`` turns it off; where it cannot be built, the
kernels above remain, and the reason is logged once.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import types
from collections.abc import Callable, Sequence

import torch

from .codecs import Blockwise4bitCodec, Blockwise8bitCodec, Codec, EncodedSegment
from .native import host_kernels_enabled
from .stochastic_rounding import ElementRounding, round_into_bf16_

logger = logging.getLogger(__name__)

UpdateRule = Callable[..., None]
"""An update rule: ``rule(param, grad, *states, **scalars)`` updating fp32 tensors in place."""


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

    Each device gets a function with a code object of its own (:func:`_update_function`): Dynamo keeps compiled
    entries and counts recompiles per code object, and one function shared by every rule, format and device
    would recompile for each of them and, past the recompile limit, run eagerly without a word. Where
    compilation fails all the same, the kernel logs it once and updates eagerly from then on (:attr:`compiled`
    turns ``False``, so the optimizer's chunks and workspace follow).
    """

    def __init__(self, rule: UpdateRule, codecs: tuple[Codec, ...], compiled: bool) -> None:
        self.rule = rule
        self.codecs = codecs
        self.compiled = compiled
        """Whether calls run compiled: as made, until a compilation fails."""
        self._compiled_updates: dict[torch.device, Callable[..., None]] = {}

    def _compiled_update(self, device: torch.device) -> Callable[..., None]:
        """The compiled update of this kernel's segments on ``device`` (compiled at its first call)."""
        update = self._compiled_updates.get(device)
        if update is None:
            name = "_".join(["update", self.rule.__name__, *(type(codec).__name__ for codec in self.codecs)])
            function = _update_function(self.rule, self.codecs, f"{name}_{str(device).replace(':', '')}")
            update = torch.compile(function, fullgraph=True, options=_INDUCTOR_OPTIONS)
            self._compiled_updates[device] = update
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
                self._compiled_update(param.device)(param, grad, encoded, scalars, compiled_rounding)
                return
            except _compile_failures() as error:
                self._fall_back(error)
        floats = {name: float(value) for name, value in scalars.items()}
        update_segment(self.rule, self.codecs, param, grad, encoded, floats, rounding)


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


@functools.cache
def _host_rule_names() -> dict[UpdateRule, str]:
    """The update rules that have a host kernel, by function (imported here: the rules live above this layer)."""
    from .optim.adamw import adamw_update_
    from .optim.lion import lion_update_

    return {adamw_update_: "adamw", lion_update_: "lion"}


def host_rule_name(rule: UpdateRule, codecs: tuple[Codec, ...]) -> str | None:
    """The host kernel's name for ``rule`` on ``codecs`` (``"adamw"`` or ``"lion"``), or ``None`` where it has
    none: a rule other than AdamW's and Lion's, or states that are not all 8-bit or all 4-bit of one block size."""
    name = _host_rule_names().get(rule)
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


def segment_kernel(
    rule: UpdateRule, codecs: tuple[Codec, ...], compiled: bool, device: torch.device
) -> SegmentKernel | HostKernel:
    """The kernel of ``rule`` for ``codecs`` on pages of ``device``, made once per process.

    For CPU pages of AdamW's and Lion's 8-bit and 4-bit states it is a :class:`HostKernel` while the host kernels
    are enabled (``HF_PAGED_NATIVE``, read at each call; see :mod:`hf_paged.native`), whatever ``compiled`` says:
    CPU segments take the C++ kernel, others the :class:`SegmentKernel` that ``compiled`` chooses. Otherwise (pages
    on another device, which never build the host kernels, or where they cannot be built) the
    :class:`SegmentKernel`.
    """
    native = device.type == "cpu" and host_rule_name(rule, codecs) is not None and host_kernels_enabled()
    return _segment_kernel(rule, codecs, compiled, native)


@functools.cache
def _segment_kernel(
    rule: UpdateRule, codecs: tuple[Codec, ...], compiled: bool, native: bool
) -> SegmentKernel | HostKernel:
    if not native:
        return SegmentKernel(rule, codecs, compiled)
    return HostKernel(host_rule_name(rule, codecs), codecs, _segment_kernel(rule, codecs, compiled, False))


def runs_compiled(rule: UpdateRule, codecs: tuple[Codec, ...]) -> bool:
    """Whether the compiled PyTorch kernel of ``rule`` for ``codecs`` still compiles in this process: ``False`` once
    its compilation failed (it then updates eagerly, with an eager kernel's chunks and temporaries)."""
    return _segment_kernel(rule, codecs, True, False).compiled
