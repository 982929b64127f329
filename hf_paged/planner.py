"""The memory planner: one training step of any ``nn.Module`` traced under fake tensors, its peaks per phase.

:func:`plan` builds the model, the optimizer and each batch under ``FakeTensorMode`` (tensors with shapes and
dtypes but no data, so an 8B-parameter model costs no memory) and runs ``steps`` training steps: forward and
backward, then the optimizer step and ``zero_grad(set_to_none=True)``, the order of ``transformers.Trainer``.
A ``TorchDispatchMode`` sees every tensor an operator returns and a ledger follows each storage from then until
Python frees it (a weak reference, so tracing keeps nothing alive). The live bytes of all storages, taken
after every operator, give each phase's peak, exactly as PyTorch's CPU allocator would see it. For the CPU, the
working memory some kernels allocate and free inside one call, which no operator returns (oneDNN's scratch of
matrix products, the flash-attention kernel's buffers, the casts of mixed-dtype operands), is measured by running
each kind of such a call once for real (:class:`_KernelScratch`): it depends on the CPU's instruction set.

A fresh dispatch mode traces each phase: a mode reused across phases is kept by non-reentrant checkpointing
and what it holds stays alive. The optimizer is traced eagerly (``torch.compile`` of fake tensors plans other
temporaries than the compiled kernels allocate); its update kernels run once per kind of call (shapes and dtypes),
and later calls of a kind add the temporaries the first allocated, so that a step of many chunks traces in time
that does not grow with them. State outside ``optimizer.state`` (a paged optimizer's page
buffers, quantization state a caller names through ``extra_state``) is classified explicitly.

Only torch is imported here: models built from configs, adapters and 4-bit weights are built by the callers
(:mod:`hf_paged.cli.plan`).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import device as device_module
from . import kernels
from .device import SyncBackend
from .kernels import HostKernel, SegmentKernel, triton_module
from .native import host_kernels_disabled
from .optim import PagedOptimizer
from .optim.plan import StepPlan
from .sharded_trace import (
    fake_world,
    is_sharded_tensor_type,
    label_parameters_in_use,
    local_tensor,
    offloaded_shards,
    traceable_engines,
)
from .sharding import Strategy, Wrap, default_wrap, strategy_named
from .sizes import format_size, parse_size
from .zero_model import ZeroModel

FORWARD_BACKWARD = "forward_backward"
OPTIMIZER_STEP = "optimizer_step"
PHASES = (FORWARD_BACKWARD, OPTIMIZER_STEP)
"""The phases of a training step, in order."""

KINDS = (
    "frozen_weights",
    "trainable_weights",
    "quantization_state",
    "gradients",
    "optimizer_state",
    "communication",
    "activations",
    "temporaries",
)
"""What the bytes at a peak hold: ``activations`` in forward and backward, ``temporaries`` in the optimizer
step (everything no other kind claims); ``communication`` is the buffers a sharded strategy's collectives use
(DDP's gradient buckets, FSDP2's all-gather and reduce-scatter buffers), zero on one device."""

CUDA_ALLOCATION_ROUNDING = 512
"""Bytes to which PyTorch's CUDA caching allocator rounds every allocation (what ``max_memory_allocated``
counts)."""

CUDA_WORKSPACE_BYTES = 32 * 2**20
"""Device memory a CUDA step holds that no traced operator returns: cuBLAS' workspace for the compute stream,
allocated through PyTorch's allocator at the first matrix product (32 MiB on Hopper GPUs, less on older ones).
The CUDA context itself (a few hundred MiB, outside PyTorch's allocator) is not counted."""


@dataclass(frozen=True)
class PhasePeak:
    """The peak of one phase of one traced step."""

    phase: str
    """``forward_backward`` or ``optimizer_step``."""
    step: int
    """Training step, from 1."""
    peak_bytes: int
    """Highest bytes of live tensors on the device during the phase."""
    by_kind: dict[str, int]
    """The bytes live at the peak by :data:`KINDS` (they add up to ``peak_bytes``)."""


@dataclass
class MemoryPlan:
    """Predicted device memory of training, in bytes, from :func:`plan`."""

    device: str
    """The device planned for (``cpu``, ``cuda``...)."""
    phases: list[PhasePeak]
    """Every phase of every traced step, in order."""
    trainable_params: int
    """Elements of the trainable parameters."""
    total_params: int
    """Elements of all parameters, as stored (a packed 4-bit weight counts its bytes)."""
    seconds: float
    """Wall time the plan took."""
    trainable_shapes: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)
    """Shape and dtype of each tensor the optimizer keeps state for: the trainable parameters (local shards under
    FSDP2), or under ZeRO the rank's flat fp32 partitions of them."""
    paged_state_bytes: int | None = None
    """Bytes of all pages of a paged optimizer's state (on the device or not), as ``device_budget`` counts them;
    ``None`` for other optimizers."""
    optimizer_state_bytes: int = 0
    """Bytes of all the optimizer's state after the last traced step, wherever it lives: the tensors of
    ``optimizer.state`` and every page of a paged optimizer, each allocation as the planned device would hold it."""
    notes: list[str] = field(default_factory=list)
    """What the figures include besides traced tensors (constants added for the device)."""
    world_size: int = 1
    """Ranks the step is spread over; the figures are one rank's."""
    strategy: str | None = None
    """The :data:`hf_paged.sharding.STRATEGIES` name, ``None`` for one device."""

    def peak(self, phase: str) -> PhasePeak:
        """The highest peak of ``phase`` over the traced steps."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(map(repr, PHASES))}, got {phase!r}")
        return max((item for item in self.phases if item.phase == phase), key=lambda item: item.peak_bytes)

    def peak_without_state(self, phase: str) -> int:
        """The highest bytes of ``phase`` besides optimizer state, over the traced steps: what a device budget
        leaves for the rest (the figure :meth:`hf_paged.budget.AutoBudget.expect` takes for forward and backward)."""
        self.peak(phase)  # checks the phase
        return max(item.peak_bytes - item.by_kind["optimizer_state"] for item in self.phases if item.phase == phase)

    @property
    def forward_backward_peak_without_state(self) -> int:
        """Highest bytes live during forward and backward besides optimizer state (what
        :meth:`hf_paged.budget.AutoBudget.expect` takes)."""
        return self.peak_without_state(FORWARD_BACKWARD)

    @property
    def forward_backward_peak(self) -> int:
        """Highest bytes live during forward and backward (optimizer state of earlier steps included)."""
        return self.peak(FORWARD_BACKWARD).peak_bytes

    @property
    def optimizer_step_peak(self) -> int:
        """Highest bytes live during the optimizer step."""
        return self.peak(OPTIMIZER_STEP).peak_bytes

    @property
    def peak_bytes(self) -> int:
        """Highest bytes live at any time of training."""
        return max(self.forward_backward_peak, self.optimizer_step_peak)

    def fits(self, capacity: int | str) -> bool:
        """Whether training fits in ``capacity`` bytes of device memory (or a size string such as ``"24GiB"``)."""
        return self.peak_bytes <= parse_size(capacity, "capacity")


def _device_type(device: str | torch.device) -> str | None:
    """The type of ``device``, ``None`` where it names none."""
    try:
        return torch.device(device).type
    except RuntimeError:
        return None


class _Ledger:
    """Live tensor storages and their bytes, followed through weak references; peaks between marks."""

    def __init__(self, rounding: int) -> None:
        self.rounding = rounding
        self.live_bytes = 0
        self.peak_bytes = 0
        self.page_serials: set[int] = set()
        """Storages a paged optimizer's store allocated (page buffers)."""
        self._on_host = False
        self._pages = False
        self._serial_of: dict[int, int] = {}
        self._bytes_of: dict[int, int] = {}
        self._references: dict[int, weakref.ref] = {}
        self._next_serial = 1
        self._events: list[int] = []
        self._mark_live: set[int] = set()
        self._peak_event = 0
        self.watched_peak = 0
        """The highest live bytes since :meth:`watch`."""
        self.labels: dict[int, str] = {}
        """Serial to the kind a storage was seen holding while it lived (see :meth:`label`)."""
        self._labelling: str | None = None
        self._host_keys: set[int] = set()
        self._host_depth = 0

    def add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._serial_of:
            return
        self._follow(key, storage, on_host=self._on_host or self._host_depth > 0)
        if self._pages:
            self.page_serials.add(self._serial_of[key])

    def _follow(self, key: int, storage: torch.UntypedStorage, on_host: bool) -> None:
        serial = self._next_serial
        self._next_serial += 1
        nbytes = 0 if on_host else math.ceil(storage.nbytes() / self.rounding) * self.rounding
        if on_host:
            self._host_keys.add(key)
        if self._labelling is not None:
            self.labels[serial] = self._labelling
        self._serial_of[key] = serial
        self._bytes_of[serial] = nbytes
        if key not in self._references:
            self._references[key] = weakref.ref(storage, lambda _, key=key: self._drop(key))
        self._events.append(serial)
        self.live_bytes += nbytes
        self.watched_peak = max(self.watched_peak, self.live_bytes)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self._peak_event = len(self._events)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was resized in place (FSDP2 frees and re-allocates unsharded parameters so): its old bytes
        are freed and its new bytes allocated, under a new serial that keeps its label and page status."""
        key = id(storage)
        serial = self._serial_of.get(key)
        if serial is None:
            self.add(storage)
            return
        self._renew(key, storage, serial, on_host=key in self._host_keys)

    def _renew(self, key: int, storage: torch.UntypedStorage, serial: int, on_host: bool) -> None:
        """Free ``serial``'s bytes and follow ``storage`` again under a new serial with its label and page status."""
        label, page = self.labels.get(serial), serial in self.page_serials
        self._events.append(-serial)
        self.live_bytes -= self._bytes_of[serial]
        self._follow(key, storage, on_host=on_host)
        renewed = self._serial_of[key]
        if label is not None:
            self.labels.setdefault(renewed, label)
        if page:
            self.page_serials.add(renewed)

    def to_host(self, storage: torch.UntypedStorage) -> None:
        """``storage`` is in host memory from now on (an offloaded shard, a gradient copied to the host): its device
        bytes are freed; it stays followed, with no bytes on the device."""
        key = id(storage)
        serial = self._serial_of.get(key)
        if serial is None or key in self._host_keys:
            return
        self._renew(key, storage, serial, on_host=True)

    @contextlib.contextmanager
    def in_host_memory(self) -> Iterator[None]:
        """Everything allocated inside is in host memory, page buffers included (an optimizer step offloaded to the
        host): followed but not counted on the device."""
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    def label(self, tensor: torch.Tensor, kind: str) -> None:
        """``tensor``'s storage holds ``kind`` (of :data:`KINDS`) while it lives, unless what the model and the
        optimizer hold at the end of a phase says otherwise: FSDP2's unsharded parameters and gradients, held only
        inside the phase."""
        serial = self.serial(tensor)
        if serial is not None:
            self.labels.setdefault(serial, kind)

    @contextlib.contextmanager
    def labelling(self, kind: str) -> Iterator[None]:
        """New storages hold ``kind`` (see :meth:`label`): the buffers of a sharded strategy's collectives."""
        previous, self._labelling = self._labelling, kind
        try:
            yield
        finally:
            self._labelling = previous

    @contextlib.contextmanager
    def allocating_on_host(self) -> Iterator[None]:
        """New storages are in host memory: followed but not counted on the device."""
        self._on_host = True
        try:
            yield
        finally:
            self._on_host = False

    @contextlib.contextmanager
    def allocating_pages(self, on_host: bool) -> Iterator[None]:
        """New storages are page buffers; ``on_host``: in host memory, followed but not counted on the device."""
        self._pages, self._on_host = True, on_host
        try:
            yield
        finally:
            self._pages, self._on_host = False, False

    def _drop(self, key: int) -> None:
        serial = self._serial_of.pop(key)
        del self._references[key]
        self._host_keys.discard(key)
        self._events.append(-serial)
        self.live_bytes -= self._bytes_of[serial]

    def serial(self, tensor: torch.Tensor) -> int | None:
        """The serial number of ``tensor``'s storage while it lives, ``None`` if the ledger does not follow it."""
        return self._serial_of.get(id(local_tensor(tensor).untyped_storage()))

    def watch(self) -> int:
        """Start watching for the highest live bytes from now (:attr:`watched_peak`); the live bytes now."""
        self.watched_peak = self.live_bytes
        return self.live_bytes

    def transient(self, nbytes: int) -> None:
        """Bytes allocated and freed again at once, as by an operator's temporaries that nothing keeps."""
        serial = self._next_serial
        self._next_serial += 1
        self._bytes_of[serial] = nbytes
        self._events += [serial, -serial]
        if self.live_bytes + nbytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes + nbytes
            self._peak_event = len(self._events) - 1
        self.watched_peak = max(self.watched_peak, self.live_bytes + nbytes)

    def live_serials(self) -> set[int]:
        return set(self._serial_of.values())

    def new_since_mark(self) -> set[int]:
        """The storages live now that the phase created."""
        return self.live_serials().difference(self._mark_live)

    def mark(self) -> None:
        """Start a phase: its peak starts from the bytes live now."""
        self._mark_live = self.live_serials()
        self._events.clear()
        self.peak_bytes = self.live_bytes
        self._peak_event = 0

    def live_at_peak(self) -> dict[int, int]:
        """The storages live at the phase's peak (its first moment at that level): serial to bytes."""
        live = set(self._mark_live)
        for event in self._events[: self._peak_event]:
            if event > 0:
                live.add(event)
            else:
                live.discard(-event)
        return {serial: self._bytes_of[serial] for serial in live}


class PlanningError(RuntimeError):
    """A training step the planner cannot trace under fake tensors; the message names the operator and what to do."""


class OptimizerPlanningError(PlanningError):
    """An optimizer step the planner cannot trace: the optimizer reads the values of tensors."""


def _data_dependent_message(error: DynamicOutputShapeException | DataDependentOutputException) -> str:
    what = "shape" if isinstance(error, DynamicOutputShapeException) else "value"
    return (
        f"cannot plan the step: the {what} that {error.func} returns depends on the values in tensors, which fake "
        "tensors do not have (a mixture-of-experts layer that loops over the experts its tokens chose, indexing with "
        "a boolean mask, .item(), .tolist() or an if on a tensor in the model or the loss). Plan a model whose shapes "
        "follow from shapes alone: transformers' mixture-of-experts models with experts_implementation='grouped_mm' "
        "(their default) or 'batched_mm', which run every token's chosen experts in one call, so their memory does "
        "not depend on the routing"
    )


@contextlib.contextmanager
def _optimizer_reads_values(what: str) -> Iterator[None]:
    """Within the block (the optimizer's construction or step, ``what``), what cannot be traced is an
    :class:`OptimizerPlanningError`."""
    try:
        yield
    except PlanningError:
        raise OptimizerPlanningError(
            f"cannot plan the optimizer: {what} reads the values of tensors, which fake tensors do not have "
            "(bitsandbytes' 8-bit optimizers do). Plan with an optimizer that follows from shapes alone: hf-paged's "
            "(hf_paged_adamw_8bit keeps 8-bit state too) or torch.optim's"
        ) from None


def _qualified_name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _grouped_mm_output(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The output of ``aten._grouped_mm`` as the CPU and CUDA kernels allocate it: in ``out_dtype`` or the inputs'
    dtype, each row padded to 16 bytes (``bias`` does not change it). PyTorch's fake kernel takes only bfloat16
    inputs, where the CPU kernel multiplies float32 as well (transformers' mixture-of-experts models in float32)."""
    dtype = out_dtype or mat_a.dtype
    if mat_a.dim() == 2 and mat_b.dim() == 2:  # the groups split the inner dimension: one output per group
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif mat_a.dim() == 2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif mat_b.dim() == 2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    alignment = 16 // dtype.itemsize
    padded = -(-size[-1] // alignment) * alignment
    stride = [size[1] * padded, padded, 1] if len(size) == 3 else [padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


SCRATCH_MEASURE_LIMIT = 256 * 2**20
"""Largest bytes of operands and outputs of a CPU operator call whose working memory a plan measures."""

_SCRATCH_OPERATORS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.baddbmm.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    }
)
"""Operators whose CPU kernels allocate working memory through PyTorch's allocator: oneDNN's scratchpads of matrix
products (fp32 accumulators and packed operands, which depend on the CPU's instruction set) and the flash-attention
kernel's per-thread buffers."""


def _real_zeros(tensor: torch.Tensor) -> torch.Tensor:
    """A real tensor of zeros with ``tensor``'s shape, strides and dtype."""
    reach = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    length = 0 if tensor.numel() == 0 else reach + 1
    return torch.zeros(length, dtype=tensor.dtype).as_strided(tensor.shape, tensor.stride())


@contextlib.contextmanager
def _standard_error_discarded() -> Iterator[None]:
    """The process's standard error (file descriptor 2) goes nowhere inside: kineto writes a line each time a
    profiler starts or stops, at a level only ``KINETO_LOG_LEVEL`` set before its first use would hide."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def allocations_inside(events: Iterable[tuple]) -> Iterator[tuple]:
    """The allocator's events of a profile, in order, each ending ``(address, size)`` (size negative for a free),
    without the frees of blocks allocated before the profile: the profiler reports those where an earlier profile saw
    them allocated (garbage of earlier work collected during this one). A block allocated at an address the profile
    still holds was freed where the profiler did not see it (a thread it does not follow, such as a gloo worker
    dropping a collective's buffer): its free is inserted before the new block."""
    held: dict[int, int] = {}
    for event in events:
        address, size = event[-2:]
        if size > 0:
            if address in held:
                yield (*event[:-2], address, -held[address])
            held[address] = size
        elif address in held:
            del held[address]
        else:
            continue
        yield event


def _allocated_then_freed(events: list[tuple[int, int]]) -> int:
    """Highest bytes held above what remains, over a call's ``(address, size)`` allocator events in order."""
    live = peak = 0
    for _, size in allocations_inside(events):
        live += size
        peak = max(peak, live)
    return peak - live


class _KernelScratch:
    """The working memory CPU kernels allocate and free inside one operator call, which no operator returns and fake
    tensors therefore do not show: oneDNN's scratchpads of matrix products, the flash-attention kernel's per-thread
    buffers, and the copies to the common dtype that an operator of mixed floating dtypes makes of its inputs on
    the CPU (a bfloat16 tensor times a float32 one). How much depends on the CPU's instruction set and thread
    count, so each kind of call (shapes, strides, dtypes) runs once for real on zeros under ``torch.profiler``, and
    its allocations that the call frees count as allocated and freed at once in the plan."""

    def __init__(self) -> None:
        self._bytes: dict[tuple, int] = {}
        self.unmeasured = 0
        """Calls not measured: over :data:`SCRATCH_MEASURE_LIMIT`, refused on zeros, or while a profiler runs."""

    @staticmethod
    def holds_scratch(func: Any, tensors: list[torch.Tensor]) -> bool:
        """Whether a CPU call of ``func`` on ``tensors`` may allocate memory it frees before returning."""
        if func in _SCRATCH_OPERATORS:
            return True
        if getattr(func, "namespace", None) != "aten":
            return False
        return len({tensor.dtype for tensor in tensors if tensor.is_floating_point() and tensor.dim() > 0}) > 1

    def nbytes(self, func: Any, args: tuple, kwargs: dict, output: Any) -> int:
        """Bytes of working memory of the call ``func(*args, **kwargs)`` that returned ``output`` (fake tensors)."""
        tensors = [item for item in tree_flatten((args, kwargs))[0] if isinstance(item, torch.Tensor)]
        if not self.holds_scratch(func, tensors):
            return 0
        key = (func, _signature(args), _signature(kwargs), torch.get_num_threads())
        if key not in self._bytes:
            outputs = [item for item in tree_flatten(output)[0] if isinstance(item, torch.Tensor)]
            operands = sum(tensor.untyped_storage().nbytes() for tensor in [*tensors, *outputs])
            measured = None
            if operands <= SCRATCH_MEASURE_LIMIT and not torch.autograd.profiler._is_profiler_enabled:
                measured = self._measure(func, args, kwargs)
            if measured is None:
                self.unmeasured += 1
                return 0
            self._bytes[key] = measured
        return self._bytes[key]

    @staticmethod
    def _measure(func: Any, args: tuple, kwargs: dict) -> int | None:
        """The call's working memory, run on zeros under the profiler; ``None`` if it refuses zeros."""
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_map

        with _disable_current_modes():
            real_args, real_kwargs = tree_map(
                lambda item: _real_zeros(item) if isinstance(item, torch.Tensor) else item, (args, kwargs)
            )
            generator = torch.default_generator.get_state()
            profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            collecting = gc.isenabled()
            gc.disable()  # no garbage of earlier work is freed inside
            with _standard_error_discarded():
                profiler.start()
            try:
                output = func(*real_args, **real_kwargs)  # held until the profiler stops: what stays is no scratch
            except RuntimeError:  # a value zeros do not satisfy (a check of the data)
                return None
            finally:
                with _standard_error_discarded():
                    profiler.stop()
                if collecting:
                    gc.enable()
                torch.default_generator.set_state(generator)
            del output
        allocations = []
        pending = list(profiler.profiler.kineto_results.experimental_event_tree())
        while pending:
            event = pending.pop()
            if event.typed[0] == _EventType.Allocation:
                allocations.append((event.start_time_ns, event.typed[1].ptr, event.typed[1].alloc_size))
            pending.extend(event.children)
        return _allocated_then_freed([(address, size) for _, address, size in sorted(allocations)])


class _StorageTracker(TorchDispatchMode):
    """Adds the storage of every tensor an operator returns to a ledger (holds no tensor itself), and the working
    memory that CPU kernels free before they return, where a :class:`_KernelScratch` is given.

    An operator on sharded tensors (DTensor) is left to DTensor first, so that the operators on the local shards it
    runs come here one by one; the tensors of DTensor's sharding propagation, made under a fake mode of its own for
    global shapes, are not the plan's and are left out."""

    def __init__(self, ledger: _Ledger, mode: FakeTensorMode, scratch: _KernelScratch | None = None) -> None:
        super().__init__()
        self._ledger = ledger
        self._mode = mode
        self._scratch = scratch

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(is_sharded_tensor_type(kind) for kind in types):
            return NotImplemented
        if active_fake_mode() is not self._mode:  # DTensor's sharding propagation, on global shapes
            return func(*args, **kwargs)
        try:
            if func is torch.ops.aten._grouped_mm.default:
                output = _grouped_mm_output(*args, **kwargs)
            else:
                output = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException) as error:
            raise PlanningError(_data_dependent_message(error)) from None
        for item in tree_flatten(output)[0]:
            if isinstance(item, torch.Tensor) and getattr(item, "fake_mode", self._mode) is self._mode:
                self._ledger.add(item.untyped_storage())
        if self._scratch is not None:
            scratch = self._scratch.nbytes(func, args, kwargs, output)
            if scratch:
                self._ledger.transient(scratch)
        return output


def _signature(value: Any) -> Any:
    """What an argument of a kernel call is to the memory the call allocates: a tensor's shape, strides, dtype and
    device (not its place in its storage, nor its values, which fake tensors do not have), a number's type, other
    values themselves."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype, value.device.type)
    if isinstance(value, (bool, str, type(None))):
        return value
    if isinstance(value, (int, float)):
        return type(value)
    if isinstance(value, Mapping):
        return tuple((key, _signature(item)) for key, item in value.items())
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_signature(item) for item in value))
    return type(value)


class _KernelCalls:
    """The update kernels of a traced optimizer step, each kind of call traced once.

    A kernel updates its parameter and state in place: what it allocates is temporaries, freed when it returns, and
    how many bytes they reach depends on the kernel and the shapes, strides and dtypes of its arguments alone. The
    first call of each such signature runs under the tracer and its highest live bytes above those at its start are
    kept; a later call of the same signature adds those bytes to the ledger as allocated and freed at once instead
    of running. A step of many chunks of few shapes then traces a few kernel calls, not one per chunk. A call that
    leaves bytes allocated is traced every time."""

    def __init__(self, ledger: _Ledger) -> None:
        self._ledger = ledger
        self._transient: dict[tuple, int] = {}
        self._depth = 0
        self.traced = 0
        """Kernel calls that ran under the tracer."""
        self.replayed = 0
        """Kernel calls whose temporaries were added without running them."""

    def _wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(kernel: Any, *args: Any, **kwargs: Any) -> Any:
            if self._depth:  # a kernel that hands its call to another (a host kernel's fallback): traced as one
                return method(kernel, *args, **kwargs)
            key = (kernel, method, _signature(args), _signature(kwargs))
            nbytes = self._transient.get(key)
            if nbytes is not None:
                self._ledger.transient(nbytes)
                self.replayed += 1
                return None
            before = self._ledger.watch()
            self._depth += 1
            try:
                result = method(kernel, *args, **kwargs)
            finally:
                self._depth -= 1
            self.traced += 1
            if result is None and self._ledger.live_bytes == before:
                self._transient[key] = self._ledger.watched_peak - before
            return result

        return call

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Kernel calls go through this object: the per-segment calls of every kernel family, and their batch
        calls (``update_batch``) where they have them."""
        methods = [
            (kind, name) for kind in _kernel_classes() for name in ("__call__", "update_batch") if name in vars(kind)
        ]
        originals = [getattr(kind, name) for kind, name in methods]
        for (kind, name), original in zip(methods, originals):
            setattr(kind, name, self._wrap(original))
        try:
            yield
        finally:
            for (kind, name), original in zip(methods, originals):
                setattr(kind, name, original)


def _kernel_classes() -> tuple[type, ...]:
    """The kernel classes whose calls a trace sees: the PyTorch and host kernels, and the Triton kernels where
    Triton imports."""
    triton_kernels = triton_module()
    return (SegmentKernel, HostKernel) + (() if triton_kernels is None else (triton_kernels.TritonKernel,))


@contextlib.contextmanager
def _accelerator_kernels(ledger: _Ledger) -> Iterator[str]:
    """The pages of a plan for an accelerator, fake tensors on the CPU, take the kernels a step there takes; yields
    their family.

    Where Triton imports, the Triton kernels (:func:`~hf_paged.kernels.kernel_family`'s choice on CUDA and XPU),
    whose launches do nothing here (:func:`~hf_paged.kernels.stubbed_triton_kernels`): a launch allocates nothing
    besides the tables of its page batch. The step plan keeps each batch's segment table in host memory (not
    counted) and the executor copies it, with the scalars, to the device for each launch (counted). Without Triton
    (or with ``HF_PAGED_KERNELS=torch``), the PyTorch kernels, with their chunks' temporaries. Never the host
    kernels: they update only pages in host memory."""
    batch_table = StepPlan.batch_table

    def batch_table_in_host_memory(*args: Any, **kwargs: Any) -> Any:
        with ledger.allocating_on_host():
            return batch_table(*args, **kwargs)

    with host_kernels_disabled(), kernels.stubbed_triton_kernels() as triton:
        if not triton:
            yield "torch"
            return
        StepPlan.batch_table = batch_table_in_host_memory
        try:
            yield "triton"
        finally:
            StepPlan.batch_table = batch_table


def _do_nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _takes_any_segment_whole(kernel: Any, param: torch.Tensor, grad: torch.Tensor) -> bool:
    return True


@contextlib.contextmanager
def _idle_kernels() -> Iterator[None]:
    """Update kernels that do nothing and say they allocate nothing, so that the optimizer hands each of them a
    segment whole, in one call, without undo copies: a step that leaves its state as a real one does, without the
    kernels' temporaries."""
    replacements = {"__call__": _do_nothing, "update_batch": _do_nothing}
    patches: list[tuple[type, str, Any]] = []
    for kind in _kernel_classes():
        patches += [(kind, name, value) for name, value in replacements.items() if name in vars(kind)]
        patches += [(kind, "allocates_nothing", _takes_any_segment_whole), (kind, "writes_after_allocating", True)]
    missing = object()
    originals = [vars(kind).get(name, missing) for kind, name, _ in patches]
    for kind, name, value in patches:
        setattr(kind, name, value)
    try:
        yield
    finally:
        for (kind, name, _), original in zip(patches, originals):
            if original is missing:
                delattr(kind, name)
            else:
                setattr(kind, name, original)


class _PlanningBackend(SyncBackend):
    """The page store backend while planning: its buffers are optimizer state, and host buffers take no device
    memory unless the device is the host."""

    def __init__(self, device: torch.device, ledger: _Ledger, host_is_device: bool) -> None:
        super().__init__(device)
        self._ledger = ledger
        self._host_is_device = host_is_device

    def empty_host(self, specs: Any) -> Any:
        with self._ledger.allocating_pages(on_host=not self._host_is_device):
            return super().empty_host(specs)

    def empty_device(self, specs: Any) -> Any:
        with self._ledger.allocating_pages(on_host=False):
            return super().empty_device(specs)


@contextlib.contextmanager
def _page_backend(ledger: _Ledger, host_is_device: bool) -> Iterator[None]:
    """Paged optimizers built inside get page stores with the :class:`_PlanningBackend`."""
    previous = device_module._backend_factory
    device_module._backend_factory = lambda device: _PlanningBackend(device, ledger, host_is_device)
    try:
        yield
    finally:
        device_module._backend_factory = previous


@contextlib.contextmanager
def _host_rng_states_counted(ledger: _Ledger) -> Iterator[None]:
    """The CPU generator's states that ``torch.get_rng_state`` returns are counted (activation checkpointing saves
    one, about 5 KiB, per checkpointed call); they are made without an operator, so no dispatch mode sees them."""
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        ledger.add(state.untyped_storage())
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def _apply_to_fake_tensors(
    module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
) -> nn.Module:
    """``nn.Module._apply`` for fake tensors (what ``to``, ``half``, ``bfloat16``, ``float``... call): a parameter
    that ``fn`` changes takes the new tensor through ``param.data`` and stays the same object, so weights tied
    between modules stay one tensor and references to it stay valid. Torch swaps fake parameters instead, which
    fails (``Couldn't swap Linear.weight``) because the fake mode holds weak references to them."""
    if recurse:
        for child in module.children():
            child._apply(fn)
    for param in module._parameters.values():
        if param is None:
            continue
        with torch.no_grad():
            converted = fn(param)
            if converted is not param:
                param.data = converted
            if param.grad is not None:
                grad = fn(param.grad)
                if grad is not param.grad:
                    param.grad.data = grad
    for key, buffer in module._buffers.items():
        if buffer is not None:
            module._buffers[key] = fn(buffer)
    return module


@contextlib.contextmanager
def _fake_module_conversions() -> Iterator[None]:
    """``nn.Module.to``, ``half``, ``bfloat16``, ``float``... work on fake parameters while the model is built (see
    :func:`_apply_to_fake_tensors`)."""
    original = nn.Module._apply
    nn.Module._apply = _apply_to_fake_tensors
    try:
        yield
    finally:
        nn.Module._apply = original


def _fake_mode() -> FakeTensorMode:
    """The mode of a plan. Every fake tensor keeps its mode in its ``__dict__``, which ``copy.deepcopy`` of a module
    (peft's ``modules_to_save``) would copy too, giving the copies a mode of their own that the plan's refuses
    (``Mixing fake modes NYI``): a deep copy keeps this one."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    mode.__deepcopy__ = lambda memo: mode
    return mode


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of one batch: ``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple or list, else
    ``model(batch)``; the output's ``loss`` (Hugging Face models), else the output itself if it is a scalar."""
    if isinstance(batch, Mapping):
        output = model(**batch)
    elif isinstance(batch, (tuple, list)):
        output = model(*batch)
    else:
        output = model(batch)
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None:
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            "loss: the model's output has no scalar loss (no 'loss' attribute or key and not a one-element tensor); "
            "pass loss=callable(model, batch) returning one"
        )
    return loss


def _check_callable(name: str, value: Any) -> None:
    if isinstance(value, (nn.Module, torch.optim.Optimizer)):
        raise TypeError(
            f"{name} must be a callable that builds it under fake tensors (e.g. a lambda), "
            f"not a built {type(value).__name__}"
        )
    if not callable(value):
        raise TypeError(f"{name} must be a callable, got {type(value).__name__}")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, a DTensor as its local shard."""
    for item in tree_flatten(value)[0]:
        if isinstance(item, torch.Tensor):
            yield local_tensor(item)


def _paged_state_bytes(optimizer: torch.optim.Optimizer) -> int | None:
    if not isinstance(optimizer, PagedOptimizer):
        return None
    return sum(page.nbytes for page in optimizer._store.pages)


def _statistics(optimizer: PagedOptimizer) -> list[torch.Tensor]:
    """The rank-1 statistics of ``optimizer``'s tensors whose state is rank-1 normalized."""
    return [
        tensor
        for pages in optimizer._layout.values()
        if pages.statistics is not None
        for tensor in pages.statistics.batch_entry()
    ]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, rounding: int) -> int:
    """Bytes of the tensors of ``optimizer.state``, of every page (one block of its buffers, as a backend allocates
    it: :attr:`~hf_paged.store.Page.nbytes`) and of rank-1 statistics, each rounded up to ``rounding``."""
    storages = {id(tensor.untyped_storage()): tensor for tensor in _tensors(list(optimizer.state.values()))}
    sizes = [tensor.untyped_storage().nbytes() for tensor in storages.values()]
    if isinstance(optimizer, PagedOptimizer):
        sizes += [page.nbytes for page in optimizer._store.pages]
        sizes += [tensor.untyped_storage().nbytes() for tensor in _statistics(optimizer)]
    return sum(math.ceil(size / rounding) * rounding for size in sizes)


class _Classifier:
    """Names the kind of each storage the ledger follows, from what the model and optimizer hold now."""

    def __init__(self, ledger: _Ledger) -> None:
        self._ledger = ledger
        self._optimizer_state: set[int] = set()
        self._step_tables: set[int] = set()
        self._extra: dict[int, str] = {}

    def _serials(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        serials = (self._ledger.serial(tensor) for tensor in tensors)
        return {serial for serial in serials if serial is not None}

    def kinds(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: Mapping[str, Iterable[torch.Tensor]],
        after_step: bool,
    ) -> dict[int, str]:
        """Serial to kind of the storages held now; page buffers and rank-1 statistics are always optimizer state.
        After a step, what is new and held by nothing else is optimizer state (scalars a ``torch.optim`` optimizer
        keeps), except for a paged optimizer, whose state is its pages, statistics and ``optimizer.state``: what else
        its step keeps (the tables its launches keep on the device for the next step) is step temporaries."""
        for kind, tensors in extra.items():
            for serial in self._serials(tensors):
                self._extra.setdefault(serial, kind)
        params = list(model.parameters())
        weights = {
            "frozen_weights": self._serials([*[p for p in params if not p.requires_grad], *model.buffers()]),
            "trainable_weights": self._serials(p for p in params if p.requires_grad),
            "gradients": self._serials(p.grad for p in params if p.grad is not None),
        }
        state = self._serials(_tensors(list(optimizer.state.values()))) | self._ledger.page_serials
        if isinstance(optimizer, PagedOptimizer):
            state |= self._serials(_statistics(optimizer))
        self._optimizer_state |= state
        kinds: dict[int, str] = {}
        for kind in ("optimizer_state", "gradients", "trainable_weights", "frozen_weights"):
            serials = self._optimizer_state if kind == "optimizer_state" else weights[kind]
            kinds.update(dict.fromkeys(serials, kind))
        kinds.update(dict.fromkeys(self._step_tables, "temporaries"))
        kinds.update(self._extra)
        if after_step:
            kept = self._ledger.new_since_mark().difference(kinds, self._ledger.labels)
            if isinstance(optimizer, PagedOptimizer):
                self._step_tables |= kept
                kinds.update(dict.fromkeys(kept, "temporaries"))
            else:
                self._optimizer_state |= kept
                kinds.update(dict.fromkeys(kept, "optimizer_state"))
        return kinds


def _wrapped(
    model: nn.Module, wrap: Wrap, optimizer: torch.optim.Optimizer, ledger: _Ledger, replaced_on_host: bool
) -> nn.Module:
    """``wrap(model)``, then each parameter the engine replaced (FSDP2's sharded ones) takes the place of the one of
    the same name in the optimizer's param groups, as accelerate does for an optimizer the Trainer built first. A
    replaced parameter that something still holds counts as weights (an optimizer that keeps the tensors it was given
    until its first step keeps the whole unsharded weights until then); with ``replaced_on_host`` it is in host memory
    (the Trainer leaves a model FSDP2 shards where it was built, and ``fully_shard`` copies the shards to the
    accelerator)."""
    originals = dict(model.named_parameters())
    for param in originals.values():
        ledger.label(param, "trainable_weights" if param.requires_grad else "frozen_weights")
    names = {id(param): name for name, param in originals.items()}
    trained = wrap(model)
    current = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [current.get(names.get(id(param), ""), param) for param in group["params"]]
    for name, param in originals.items() if replaced_on_host else ():
        if current.get(name) is not param:
            ledger.to_host(param.untyped_storage())
    return trained


def plan(
    model: Callable[[], nn.Module],
    batch: Callable[[], Any],
    optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    loss: Callable[[nn.Module, Any], torch.Tensor] = default_loss,
    steps: int = 2,
    accumulation: int = 1,
    device: str | torch.device = "cpu",
    extra_state: Callable[[nn.Module], Mapping[str, Iterable[torch.Tensor]]] | None = None,
    step_temporaries: bool = True,
    world_size: int = 1,
    strategy: str | Strategy | None = None,
    wrap: Wrap | None = None,
    host_memory_apart: bool = False,
) -> MemoryPlan:
    """Predict the device memory of training, in bytes, by tracing ``steps`` training steps under fake tensors.

    Args:
        model: builds the model (called under ``FakeTensorMode``: its weights take no memory). It may convert
            dtypes (``to``, ``half``, ``bfloat16``...: tied weights stay tied) and deep-copy modules.
        batch: makes one batch (called at each step, under the same mode), e.g. a dict of ``input_ids`` and
            ``labels``.
        optimizer: builds the optimizer of the model's trainable parameters. Traced eagerly: build it
            without ``torch.compile`` (``compiled=False`` for hf-paged optimizers).
        loss: the loss of one batch, see :func:`default_loss`.
        accumulation: forward and backward passes per step (gradient accumulation: later ones run beside the
            gradients of the first).
        steps: training steps traced; from the second on, forward and backward run beside the optimizer state
            the first step created.
        device: the device to predict for. The trace runs on fake CPU tensors; for ``cuda`` every allocation
            is rounded as PyTorch's allocator rounds it, :data:`CUDA_WORKSPACE_BYTES` are added to each peak,
            host buffers of paged optimizers do not count and their pages take the Triton kernels where Triton
            imports (one launch per page batch, no temporaries but its tables), else the PyTorch kernels (with
            their chunks' temporaries), never the host kernels.
        extra_state: names tensors of the model that are neither parameters nor buffers (for example the
            quantization state of 4-bit weights), by kind of :data:`KINDS`.
        step_temporaries: ``False`` traces the optimizer step for the state it leaves only: hf-paged's update
            kernels do nothing and take each segment in one call, so :attr:`MemoryPlan.optimizer_state_bytes` and
            :attr:`MemoryPlan.paged_state_bytes` are exact, and faster to trace, but the optimizer step's peak
            leaves out the kernels' temporaries.
        world_size: ranks the step is spread over (with a ``strategy``).
        strategy: one of :data:`hf_paged.sharding.STRATEGIES` (``ddp``, ``fsdp2``, ``fsdp2_offload``...): the step
            is traced as rank 0 of ``world_size`` would run it, in a fake process group of that many ranks in this
            process (see :mod:`hf_paged.sharded_trace`), and the peaks are rank 0's (no rank holds more; under ZeRO-2,
            whose gradient partition differs between ranks, with the largest rank's). DeepSpeed
            ZeRO (``zero2``, ``zero3``...) cannot be traced: the model's forward and backward and the optimizer's step
            on rank 0's flat fp32 partitions are, and ZeRO's partitions, buckets and gathers are modelled in the same
            trace (see :mod:`hf_paged.zero_model`).
        wrap: wraps the built model for the strategy (DDP or FSDP2), in the fake world; by default
            :func:`hf_paged.sharding.default_wrap`. As under the Trainer, the optimizer is built first, on the
            model's parameters, and each parameter the wrap replaces (FSDP2's sharded ones) takes the place of the one
            of the same name in its param groups, as accelerate does.
        host_memory_apart: with ``device="cpu"``, the CPU stands in for an accelerator whose memory is apart from
            host memory (as the tests' allocator that counts and caps CPU memory but a paged optimizer's host pages):
            the host pages of a paged optimizer are not counted. On an accelerator host memory is always apart.

    Returns:
        the :class:`MemoryPlan`: each phase's peak and what it holds.

    Raises:
        PlanningError: an operator of the step returns a shape or value that depends on the values in tensors
            (routing that loops over the chosen experts, ``.item()``...), which fake tensors do not have.
    """
    started = time.perf_counter()
    for name, value in (("model", model), ("batch", batch), ("optimizer", optimizer), ("loss", loss)):
        _check_callable(name, value)
    if extra_state is not None:
        _check_callable("extra_state", extra_state)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"accumulation must be an integer >= 1, got {accumulation!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    for name, value in (("step_temporaries", step_temporaries), ("host_memory_apart", host_memory_apart)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if not isinstance(device, (str, torch.device)) or _device_type(device) not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or a CUDA device ('cuda', 'cuda:1' or a torch.device), got {device!r}")
    if strategy is None and (world_size > 1 or wrap is not None):
        raise ValueError("world_size > 1 and wrap need a strategy (one of hf_paged.sharding.STRATEGIES)")
    sharding = None if strategy is None else strategy_named(strategy)
    modelled = sharding is not None and sharding.engine == "zero"
    if wrap is not None and modelled:
        raise ValueError(f"wrap: strategy {sharding.name} is DeepSpeed ZeRO, which is modelled, not wrapped")
    if wrap is not None:
        _check_callable("wrap", wrap)
    elif sharding is not None:
        wrap = default_wrap(sharding)
    target = torch.device(device)
    on_cuda = target.type == "cuda"
    # what a strategy offloads is in host memory, beside the device unless the device is the host
    offloads_parameters = sharding is not None and sharding.offload_parameters and target.type != "cpu"
    offloads_step = sharding is not None and sharding.offload_optimizer and target.type != "cpu"
    ledger = _Ledger(rounding=CUDA_ALLOCATION_ROUNDING if on_cuda else 1)
    added = CUDA_WORKSPACE_BYTES if on_cuda else 0
    classifier = _Classifier(ledger)
    kernel_calls = _KernelCalls(ledger)
    scratch = _KernelScratch() if target.type == "cpu" else None
    phases: list[PhasePeak] = []
    with (
        contextlib.nullcontext() if sharding is None or modelled else fake_world(world_size),
        _fake_mode() as mode,
        contextlib.nullcontext() if sharding is None or modelled else traceable_engines(ledger, offloads_parameters),
        _page_backend(ledger, host_is_device=target.type == "cpu" and not host_memory_apart),
        contextlib.nullcontext("native") if target.type == "cpu" else _accelerator_kernels(ledger) as family,
        # host memory, so on the device only when the device is the host
        _host_rng_states_counted(ledger) if target.type == "cpu" else contextlib.nullcontext(),
        warnings.catch_warnings(),
    ):
        # a pointer comparison of fake tensors (all at 0) decides only whether to copy, never what is allocated
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with _StorageTracker(ledger, mode):
            with _fake_module_conversions():
                built = model()
            if not isinstance(built, nn.Module):
                raise TypeError(f"model must build an nn.Module, got {type(built).__name__}")
            built.train()
            with _optimizer_reads_values("building it"):
                built_optimizer = optimizer(built)
            if not isinstance(built_optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer must build a torch.optim.Optimizer, got {type(built_optimizer).__name__}")
            trained = built if wrap is None else _wrapped(built, wrap, built_optimizer, ledger, target.type != "cpu")
            zero = None
            if modelled:
                zero = ZeroModel(
                    built,
                    built_optimizer,
                    world_size,
                    sharding.zero_stage,
                    sharding.zero,
                    ledger,
                    offload_optimizer=sharding.offload_optimizer,
                    offload_parameters=sharding.offload_parameters,
                    host_apart=target.type != "cpu",
                    gloo_copies=target.type == "cpu",
                )
        for shard in offloaded_shards(built) if offloads_parameters else ():
            ledger.to_host(shard.untyped_storage())
        hooks = [] if sharding is None else label_parameters_in_use(built, ledger)
        extra = dict(extra_state(built)) if extra_state is not None else {}
        unknown = set(extra).difference(KINDS)
        if unknown:
            raise ValueError(f"extra_state: kinds must be among {', '.join(KINDS)}, got {', '.join(sorted(unknown))}")
        for tensors in extra.values():
            for tensor in tensors:
                ledger.add(tensor.untyped_storage())
        in_backward: list[Any] = []
        """Under DeepSpeed, the last micro-batch's loss and inputs: its engine steps inside accelerate's backward, while
        the Trainer's training step holds them (the loss's graph keeps its leaves, such as the embeddings' output that
        peft makes require a gradient for checkpointing, with their gradients)."""
        for step in range(1, steps + 1):
            for phase in PHASES:
                ledger.mark()
                held_before = classifier.kinds(built, built_optimizer, extra, after_step=False)
                with _StorageTracker(ledger, mode, scratch), zero.running() if zero else contextlib.nullcontext():
                    if phase == FORWARD_BACKWARD:
                        for _ in range(accumulation):
                            inputs = batch()
                            value = loss(trained, inputs)
                            value.backward()
                            if zero is not None:
                                zero.after_backward()
                                in_backward[:] = (value, inputs)
                            del value, inputs
                    else:
                        with (
                            kernel_calls.installed() if step_temporaries else _idle_kernels(),
                            ledger.in_host_memory() if offloads_step else contextlib.nullcontext(),
                            _optimizer_reads_values(f"the step of {_qualified_name(type(built_optimizer))}"),
                        ):
                            if zero is not None:
                                zero.step()
                            else:
                                built_optimizer.step()
                        (zero or built_optimizer).zero_grad(set_to_none=True)
                        in_backward.clear()
                at_peak = ledger.live_at_peak()
                held_after = classifier.kinds(built, built_optimizer, extra, phase == OPTIMIZER_STEP)
                kinds = {
                    **ledger.labels,
                    **held_before,
                    **held_after,
                }  # what it held in the phase, unless held at an end
                other = "activations" if phase == FORWARD_BACKWARD else "temporaries"
                by_kind = dict.fromkeys(KINDS, 0)
                for serial, nbytes in at_peak.items():
                    by_kind[kinds.get(serial, other)] += nbytes
                by_kind["temporaries"] += added
                phases.append(PhasePeak(phase, step, ledger.peak_bytes + added, by_kind))
        for handle in hooks:
            handle.remove()
        if zero is not None:
            zero.remove_hooks()
        params = list(built.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        total = sum(p.numel() for p in params)
        paged_state = _paged_state_bytes(built_optimizer)
        state = optimizer_state_bytes(built_optimizer, ledger.rounding)
        held = [p for group in built_optimizer.param_groups for p in group["params"]]
        shapes = [(tuple(local_tensor(p).shape), p.dtype) for p in held]
    notes = [f"includes {format_size(CUDA_WORKSPACE_BYTES)} of cuBLAS workspace"] if on_cuda else []
    if family == "triton":
        notes.append("paged optimizer steps traced with the Triton kernels, one launch per page batch")
    if scratch is not None and scratch.unmeasured:
        notes.append(
            f"leaves out the CPU kernels' working memory of {scratch.unmeasured} operator calls (over "
            f"{format_size(SCRATCH_MEASURE_LIMIT)} of operands, refused on zeros, or planned while a profiler ran)"
        )
    return MemoryPlan(
        device=str(target),
        phases=phases,
        trainable_params=trainable,
        total_params=total,
        seconds=time.perf_counter() - started,
        trainable_shapes=shapes,
        paged_state_bytes=paged_state,
        optimizer_state_bytes=state,
        notes=notes,
        world_size=world_size,
        strategy=None if sharding is None else sharding.name,
    )
