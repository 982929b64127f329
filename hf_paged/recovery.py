"""Recovery from an out-of-memory error in forward or backward: give the optimizer state back, replay exactly.

A ``torch.OutOfMemoryError`` raised in the forward or backward of a micro-batch (or a failed allocation that a
device library reports as a ``RuntimeError``, see :func:`is_out_of_memory`) leaves the step half done:
some parameters' gradients of that micro-batch may already be accumulated, and with gradient accumulation
the earlier micro-batches of the step have contributed theirs. :class:`OOMRecovery` runs each micro-batch of
a step and, on such an error, moves all optimizer state to host memory, frees the device's cached memory,
drops the gradients and replays the step's micro-batches from their recorded random number generator
states, so the gradients come out bitwise as without the error. Per micro-batch it keeps a reference to its
arguments and a copy of the generator states (a few KiB); it never copies gradients.

With a ``DistributedDataParallel`` model, an error in a micro-batch whose gradients the ranks all-reduce is replayed on
every rank: the rank that failed publishes a :class:`~hf_paged.replay_requests.ReplayRequest` in the job's store and
completes the all-reduces it owes (:class:`~hf_paged.ddp_replay.DDPReplay`); each rank reads the requests once its own
all-reduces of the micro-batch completed, and all drop the step's gradients and replay its micro-batches.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import random
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .ddp_replay import DDPReplay
from .memory import MemoryProbe, probe_for
from .replay_requests import ReplayRequest, ReplayRequests, next_window
from .sizes import format_size

logger = logging.getLogger(__name__)

_WINDOW_MARK = "hf_paged.recovery.window"
"""The probe mark at the start of each step's micro-batches (automatic budgets only)."""

ADVICE = (
    "To fit, lower the batch size per device (raising gradient accumulation keeps the effective batch), "
    "shorten the sequences (max_length), turn on gradient checkpointing, or lower the optimizer's "
    "device_budget (a smaller size, or 'auto' with the device's capacity)."
)


_ALLOCATION_FAILURES = (
    "out of memory",  # the CUDA runtime's cudaErrorMemoryAllocation, HIP's, MPS's and XPU's wording
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUSOLVER_STATUS_ALLOC_FAILED",
    "CUSPARSE_STATUS_ALLOC_FAILED",
    "CUFFT_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
)
"""How device libraries word a failed allocation that PyTorch raises as a ``RuntimeError``, not as
``torch.OutOfMemoryError`` (a library handle or workspace that found no memory)."""

_DEVICE_NAMED = re.compile(r"\b(?:GPU|XPU|device) (\d+)\b")
"""How an allocator's out-of-memory message names its device: "GPU 1 has a total capacity of ..." (CUDA and ROCm
from torch 2.1, "(GPU 1; ..." before), XPU's likewise."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a failed device allocation: ``torch.OutOfMemoryError``, or a ``RuntimeError`` in the
    wording a device library reports one with."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    message = str(error)
    return isinstance(error, RuntimeError) and any(wording in message for wording in _ALLOCATION_FAILURES)


def not_recovered_reason(error: BaseException) -> str | None:
    """Why hf-paged raised an out-of-memory ``error`` again instead of recovering from it (a sentence), or ``None``."""
    return getattr(error, "_hf_paged_not_recovered", None)


def device_out_of_memory(error: BaseException, devices: Iterable[str]) -> str | None:
    """The one of ``devices`` (``"cuda:1"``) whose index the out-of-memory ``error``'s message names, else ``None``."""
    named = {int(index) for index in _DEVICE_NAMED.findall(str(error))}
    matches = [device for device in devices if torch.device(device).index in named]
    return matches[0] if len(matches) == 1 else None


@dataclass
class Recovery:
    """One recovery: the step (if known), where it failed (``phase``; in forward/backward, the micro-batch, from
    0) and what was done (bytes)."""

    step: int | None
    micro_batch: int | None
    micro_batches_replayed: int
    attempt: int
    state_bytes_evicted: int
    other_bytes: int
    """Bytes allocated on the device that ran out of memory (the one its error names, else the first), besides the
    optimizer state there."""
    error: RuntimeError
    """The error recovered from; for a replay another rank asked for, one with that rank's error."""
    phase: str = "forward/backward"
    """``"forward/backward"`` (the step's micro-batches were replayed) or ``"optimizer step"`` (the pages left
    were updated under a smaller budget, see :attr:`~hf_paged.optim.base.PagedOptimizer.oom_retries`)."""
    failed_ranks: tuple[int, ...] = ()
    """The global ranks that ran out of memory where the step was replayed on every rank (``()``: on this process
    alone)."""


class _BufferSnapshot:
    """The buffers of a model as they were when a step's window opened (BatchNorm's running statistics and
    ``num_batches_tracked``, quantization observers, spectral norm's vectors: what forward may change), to
    put back before a replay. Copies on the buffers' own devices; a model's buffers are usually small."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._saved = [
            (module, name, buffer.detach().clone())
            for module in model.modules()
            for name, buffer in module._buffers.items()
            if buffer is not None
        ]

    @torch.no_grad()
    def restore(self) -> None:
        for module, name, saved in self._saved:
            current = module._buffers.get(name)
            if current is not None and current.shape == saved.shape and current.dtype == saved.dtype:
                current.copy_(saved)
            else:
                module._buffers[name] = saved.clone()  # forward replaced the buffer: put the old one back


@dataclass
class _MicroBatch:
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict[str, Any]
    rng_state: dict[str, Any]
    index: int
    """Its place in the step (from 0)."""
    synchronizes: bool
    """Whether it all-reduces gradients with the other ranks (a DDP micro-batch outside ``no_sync``)."""


class _ReplayRequested(Exception):
    """Raised out of a synchronized micro-batch after which the job's store holds requests to replay the step."""

    def __init__(self, requests: list[ReplayRequest]) -> None:
        super().__init__("replay requested")
        self.requests = requests


def paged_optimizer_of(optimizer: Any) -> Any:
    """The hf-paged optimizer ``optimizer`` is or wraps (at ``.optimizer``, as accelerate does).

    Raises:
        TypeError: no hf-paged optimizer is found.
    """
    found = optimizer
    while found is not None and not hasattr(found, "paging_stats"):
        found = getattr(found, "optimizer", None)
    if found is None:
        raise TypeError(f"optimizer must be an hf-paged optimizer or wrap one, got {type(optimizer).__name__}")
    return found


def check_retries(retries: Any) -> None:
    """Raise a ``ValueError`` unless ``retries`` (recoveries allowed per step) is an integer >= 0."""
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise ValueError(f"retries must be an integer >= 0, got {retries!r}")


def check_callable(name: str, value: Any) -> None:
    """Raise a ``TypeError`` unless ``value`` (the argument ``name``) is callable or ``None``."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")


def _rng_state(device_types: Iterable[str]) -> dict[str, Any]:
    """The state of every generator a micro-batch may draw from: PyTorch's CPU generator, the generators of the
    accelerator kinds ``device_types``, Python's ``random`` and, where it is loaded, NumPy's global generator."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    for kind in device_types:
        module = torch.get_device_module(kind)
        get_all = getattr(module, "get_rng_state_all", None)
        state[kind] = get_all() if get_all is not None else module.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    for kind, value in state.items():
        if kind == "cpu":
            torch.set_rng_state(value)
        elif kind == "random":
            random.setstate(value)
        elif kind == "numpy":
            sys.modules["numpy"].random.set_state(value)
        elif isinstance(value, list):
            torch.get_device_module(kind).set_rng_state_all(value)
        else:
            torch.get_device_module(kind).set_rng_state(value)


def empty_device_cache(device: torch.device) -> None:
    """Collect garbage and return the allocator's cached blocks of ``device``'s kind to the driver."""
    gc.collect()
    if device.type != "cpu":
        empty_cache = getattr(torch.get_device_module(device.type), "empty_cache", None)
        if empty_cache is not None:
            empty_cache()


SHARDED_PARAMETERS_OBSTACLE = (
    "the model's parameters are DTensors (FSDP2 or tensor parallelism), which their engine gathers or splits in hooks "
    "of forward and backward: an error part way leaves that state mid-step (FSDP2 leaves its parameters gathered, so "
    "that a replay trained copies the optimizer no longer updates) and, across processes, collectives the other ranks "
    "wait in; only DDP and models without DTensor parameters replay such a step."
)
"""Why a step of a model whose parameters are DTensors is not replayed, in any number of processes."""


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a parameter FSDP2 or tensor parallelism shards)."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


class OOMRecovery:
    """Run the micro-batches of optimizer steps, recovering from out-of-memory errors in forward/backward.

    Call :meth:`start_window` (or enter :meth:`window`) before the first micro-batch of each step, with the
    gradients cleared (``zero_grad()``), and :meth:`run` for each micro-batch. On a
    ``torch.OutOfMemoryError`` it evicts all optimizer state to host memory, frees cached device memory,
    resets the gradients (of the optimizer's parameters and of every trainable one of ``model``) to ``None`` and
    replays the step's micro-batches so far, each from its recorded generator state; an automatic budget is told that the step needed at least the whole device. After
    ``retries`` failures within one step the error is raised again with a note on what was tried, what the
    memory held and what to change.

    Under several processes, a micro-batch of a ``DistributedDataParallel`` ``model`` inside ``no_sync`` is replayed on
    its rank alone; an error in one that all-reduces gradients makes every rank replay the step (every rank must then
    open the same windows, in the same order, and pass the same ``retries``). Other engines run collectives a replay
    cannot complete: ``replay_obstacle`` says so.

    It also covers the optimizer's step: it sets the optimizer's ``oom_retries`` to ``retries`` and reports the
    step's recoveries (``phase="optimizer step"``) to ``on_recovery`` and in :attr:`recoveries` too.

    Args:
        optimizer: an hf-paged optimizer, or a wrapper of one at ``.optimizer``.
        retries: out-of-memory errors this process recovers from per step; 0 runs the micro-batches unprotected.
        on_recovery: called with a :class:`Recovery` after each recovery, before the replay (on every rank for a
            replay on every rank).
        model: the model the micro-batches run (the ``DistributedDataParallel`` one where it is); its buffers (which
            forward may change, as BatchNorm's running statistics) are copied when each window opens (under DDP
            after its broadcast of rank 0's) and put back before a replay, so the replayed micro-batches count once;
            a replay drops the gradients of all its parameters that require one, those another optimizer holds too.
            ``None``: buffers are not restored, and only the optimizer's parameters' gradients are dropped.
        replay_obstacle: asked at each failure why a replay would not be exact here (a sentence, such as "the other
            ranks wait in the model's collectives"), or ``None`` where it would; with a sentence the error is raised
            with it as a note. ``None``: nothing keeps a replay from being exact.

    Raises:
        ValueError: ``retries`` is not an integer >= 0.
        TypeError: ``optimizer`` is not an hf-paged optimizer nor wraps one, ``on_recovery`` or ``replay_obstacle``
            is not callable, or ``model`` is not a ``torch.nn.Module`` (each may be ``None``).
    """

    def __init__(
        self,
        optimizer: Any,
        retries: int = 2,
        on_recovery: Callable[[Recovery], None] | None = None,
        model: torch.nn.Module | None = None,
        replay_obstacle: Callable[[], str | None] | None = None,
    ) -> None:
        check_retries(retries)
        check_callable("on_recovery", on_recovery)
        check_callable("replay_obstacle", replay_obstacle)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        self.optimizer = paged_optimizer_of(optimizer)
        self.retries = retries
        self.on_recovery = on_recovery
        self.optimizer.oom_retries = retries
        self.optimizer.on_oom_recovery = self._recovered_in_step
        self.model = model
        self._module = model.module if isinstance(model, DistributedDataParallel) else model
        """The model DDP wraps, or ``model``: its parameters and buffers (the wrapper has none of its own)."""
        self.replay_obstacle = replay_obstacle
        self._buffers: _BufferSnapshot | None = None
        self._model_params: list[torch.Tensor] = []
        """The model's parameters when a window last opened (rebuilt only where they changed)."""
        self._model_param_ids: list[int] = []
        self.recoveries = 0
        self.step: int | None = None
        params = self._params()
        self._device = params[0].device if params else torch.device("cpu")
        self._micro_batches: list[_MicroBatch] = []
        self._running: _MicroBatch | None = None
        self._failures = 0
        """This process's out-of-memory errors in the step (what ``retries`` limits)."""
        self._replays = 0
        """Replays of the step so far, this process's own and those other ranks asked for."""
        self._grads_at_start = False
        self._accelerators: set[str] = set()
        self._marked: set[MemoryProbe] = set()
        """The probes whose window mark is set (those of the automatic budgets when the window opened)."""
        self._open = False
        self._ddp = DDPReplay(model) if isinstance(model, DistributedDataParallel) and retries > 0 else None
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._requests = ReplayRequests() if self._ddp is not None and several else None
        self._rank = dist.get_rank() if several else 0
        self._window: int | None = None
        self._attempt = 0
        """Replays of the step on every rank so far: the requests of the next are under this number."""

    def _params(self) -> list[torch.Tensor]:
        """The tensors that the optimizer's param groups hold now (engines swap them after construction)."""
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    def _trained(self) -> list[torch.Tensor]:
        """The tensors whose gradients a micro-batch accumulates: the optimizer's parameters and every parameter of
        the model that requires a gradient (another optimizer may hold some; a replay must drop theirs too)."""
        params = {param: None for param in self._params()}
        if self._module is not None:
            params.update((param, None) for param in self._module.parameters() if param.requires_grad)
        return list(params)

    def _current_model_params(self) -> list[torch.Tensor]:
        """The model's parameters now, as a list made again only where they changed since the last window.

        A window pays one walk of the modules (the parameters can be replaced with no notice, as accelerate's
        ``set_module_tensor_to_device`` writes ``_parameters`` directly; the accelerator kinds read from them paid
        that walk before) and a comparison of the parameters' ids in C; no dict nor set of tensors is built (a
        tensor's hash is Python code), that is left to a replay (:meth:`_trained`)."""
        if self._module is None:
            return self._model_params
        params = list(self._module.parameters())
        ids = list(map(id, params))  # the cached list holds its tensors, so no id is reused while it lives
        if ids != self._model_param_ids:
            self._model_params, self._model_param_ids = params, ids
        return self._model_params

    def _accelerator_kinds(self, model_params: list[torch.Tensor]) -> set[str]:
        """The accelerator kinds that the optimizer's parameters and the model (``model_params``) live on (a model
        with ``device_map`` offload may start on the CPU and run dropout on CUDA)."""
        return {tensor.device.type for tensor in (*self._params(), *model_params)} - {"cpu", "meta"}

    def start_window(self, step: int | None = None) -> None:
        """Begin a new optimizer step (``step`` only labels messages): forget the last step's micro-batches."""
        self.step = step
        self._open = True
        self._micro_batches.clear()
        self._failures = self._replays = self._attempt = 0
        model_params = self._current_model_params()
        # the tensors of _trained(), unmerged: the optimizer's parameters and the model's that require a gradient
        self._grads_at_start = any(param.grad is not None for param in self._params()) or any(
            param.grad is not None and param.requires_grad for param in model_params
        )
        self._accelerators = self._accelerator_kinds(model_params)
        taken_after_broadcast = self._ddp is not None  # by the DDP hook as the window's first forward begins
        keeps_buffers = self.model is not None and self.retries > 0 and not taken_after_broadcast
        self._buffers = _BufferSnapshot(self._module) if keeps_buffers else None
        self._marked = {auto.probe for auto in self.optimizer.auto_budgets.values()} if self.retries > 0 else set()
        for probe in self._marked:
            probe.mark(_WINDOW_MARK)
        if self._ddp is not None:
            self._ddp.start_window(self.snapshot_buffers)
        self._window = next_window() if self._requests is not None else None

    def snapshot_buffers(self) -> None:
        """Take the model's buffers again as a replay is to restore them (an engine that changes them before the
        window's first forward runs, as DDP's broadcast of rank 0's, calls it then)."""
        if self.model is not None and self.retries > 0:
            self._buffers = _BufferSnapshot(self._module)

    @contextlib.contextmanager
    def window(self, step: int | None = None) -> Iterator[OOMRecovery]:
        """Context for the micro-batches of one step; on leaving, their arguments are released."""
        self.start_window(step)
        try:
            yield self
        finally:
            self._micro_batches.clear()
            self._buffers = None
            self._open = False

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one micro-batch's forward and backward, ``fn(*args, **kwargs)``, and return its result."""
        if not self.retries:
            return fn(*args, **kwargs)
        if not self._open:
            raise RuntimeError("OOMRecovery.run needs a step: call start_window() or enter window() before it")
        synchronizes = self._ddp is not None and self._ddp.synchronizes
        current = _MicroBatch(fn, args, kwargs, _rng_state(self._accelerators), len(self._micro_batches), synchronizes)
        self._micro_batches.append(current)
        replay = False
        while True:
            requests: list[ReplayRequest] | None = None
            try:
                if replay:
                    self._replay_earlier()
                return self._execute(current)
            except _ReplayRequested as requested:
                requests = requested.requests
            except RuntimeError as caught:  # torch.OutOfMemoryError is one
                if not is_out_of_memory(caught):
                    raise
                error = caught
            replay = True
            if requests is not None:
                self._replay_on_every_rank(requests)
            else:
                self._recover(error)
                del error

    def close(self) -> None:
        """Remove what the recovery installed in a DDP model (idempotent)."""
        if self._ddp is not None:
            self._ddp.close()

    # Internals ------------------------------------------------------------------------------------------

    def _recovered_in_step(self, recovery: Recovery) -> None:
        """Count and report a recovery within the optimizer's step."""
        recovery.step = self.step
        self.recoveries += 1
        if self.on_recovery is not None:
            self.on_recovery(recovery)

    def _execute(self, micro_batch: _MicroBatch) -> Any:
        """Run ``micro_batch``; after one that all-reduced gradients with other ranks, raise :class:`_ReplayRequested`
        where a rank asked to replay the step."""
        if self._ddp is None:
            return micro_batch.fn(*micro_batch.args, **micro_batch.kwargs)
        self._running = micro_batch
        self._ddp.begin_micro_batch(micro_batch.synchronizes)
        result = micro_batch.fn(*micro_batch.args, **micro_batch.kwargs)
        if micro_batch.synchronizes and self._requests is not None:
            self._ddp.wait_for_reductions()
            requests = self._requests.read(self._window, self._attempt)
            if requests:
                raise _ReplayRequested(requests)
        return result

    def _replay_earlier(self) -> None:
        for micro_batch in self._micro_batches[:-1]:
            _set_rng_state(micro_batch.rng_state)
            if self._ddp is None:
                self._execute(micro_batch)
                continue
            with self._ddp.replaying(micro_batch.synchronizes):
                self._execute(micro_batch)
        _set_rng_state(self._micro_batches[-1].rng_state)

    def _recover(self, error: RuntimeError) -> None:
        """Free the failed attempt's memory and make room, then prepare the replay on this rank or on every rank; or
        raise ``error`` with a note."""
        stats = self.optimizer.paging_stats()
        device = self._device_out_of_memory(error, list(stats["devices"]))
        device_stats = stats["devices"].get(str(device), {"device_bytes": 0, "host_bytes": 0})
        other_bytes = max(0, probe_for(device).allocated() - device_stats["device_bytes"])
        failed = self._running if self._ddp is not None else self._micro_batches[-1]
        if self._ddp is not None:
            self._ddp.note_failure(error, failed.synchronizes)  # reads the frames and graph the traceback still holds
        traceback.clear_frames(error.__traceback__)  # the failed attempt's activations and graph
        self._failures += 1
        synchronized = failed.synchronizes
        if self._failures > self.retries:
            reason = (
                f"it ran out of memory in forward/backward {self._failures} times in this step, more than the "
                f"{self.retries} recoveries allowed (oom_retries)."
            )
            self._give_up(error, reason, self._explain(device, device_stats, other_bytes))
        obstacle = self._obstacle(synchronized)
        if obstacle is not None:
            self._give_up(error, obstacle, f"hf-paged could not recover: {obstacle}")
        self._learn(str(device))
        evicted = self.optimizer.evict()
        empty_device_cache(self._device)
        if synchronized:
            self._ask_every_rank_to_replay(error, failed, evicted)
            return
        for param in self._trained():
            param.grad = None
        if self._buffers is not None:
            self._buffers.restore()
        if self._ddp is not None:
            self._ddp.prepare_local_replay()
        self.recoveries += 1
        self._replays += 1
        recovery = Recovery(
            step=self.step,
            micro_batch=failed.index,
            micro_batches_replayed=len(self._micro_batches),
            attempt=self._replays,
            state_bytes_evicted=evicted,
            other_bytes=other_bytes,
            error=error,
        )
        step = f"step {self.step}" if self.step is not None else "a step"
        logger.warning(
            "hf-paged: out of memory in forward/backward of %s (micro-batch %d); moved %s of optimizer state to "
            "the host, freed cached memory, replaying %d micro-batch(es) (retry %d of %d)",
            step,
            recovery.micro_batch + 1,
            format_size(evicted),
            recovery.micro_batches_replayed,
            self._failures,
            self.retries,
        )
        if self.on_recovery is not None:
            self.on_recovery(recovery)

    def _obstacle(self, synchronized: bool) -> str | None:
        """Why the micro-batch that failed cannot be replayed exactly (``synchronized``: on every rank), or ``None``."""
        if self._grads_at_start:
            return (
                "gradients were present before the step's first micro-batch, so a replay cannot restore them without "
                "a copy; clear them with zero_grad(set_to_none=True)."
            )
        if any(is_dtensor(param) for param in self._trained()):
            return SHARDED_PARAMETERS_OBSTACLE
        if self.replay_obstacle is not None:
            obstacle = self.replay_obstacle()
            if obstacle is not None:
                return obstacle
        return self._ddp.obstacle_to_replay(synchronized) if self._ddp is not None else None

    def _give_up(self, error: RuntimeError, reason: str, note: str) -> NoReturn:
        """Raise ``error`` with ``note``, keeping ``reason`` (a sentence) for :func:`not_recovered_reason`."""
        self._micro_batches.clear()
        error._hf_paged_not_recovered = reason
        error.add_note(note)
        raise error

    def _ask_every_rank_to_replay(self, error: RuntimeError, failed: _MicroBatch, evicted: int) -> None:
        """After an error in a micro-batch whose gradients the ranks all-reduce: publish a request to replay the step,
        complete the all-reduces this rank owes (the other ranks wait in them), read every rank's requests and
        prepare the replay."""
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        request = ReplayRequest(
            rank=self._rank,
            step=self.step,
            phase=self._ddp.phase,
            micro_batch=failed.index,
            micro_batches=len(self._micro_batches),
            error=f"{type(error).__name__}: {first_line}"[:300],
            state_bytes_moved=evicted,
            gradients_reduced=self._ddp.gradients_handed_over,
            gradients=len(self._ddp.parameters),
            retry=self._failures,
            retries=self.retries,
        )
        if self._requests is not None:
            self._requests.publish(self._window, self._attempt, request)  # before the peers can leave the all-reduces
        self._ddp.complete_collectives()
        self._ddp.wait_for_reductions()
        requests = self._requests.read(self._window, self._attempt) if self._requests is not None else [request]
        self._replay_on_every_rank(requests, evicted, error)

    def _replay_on_every_rank(
        self, requests: list[ReplayRequest], evicted: int = 0, error: RuntimeError | None = None
    ) -> None:
        """Once this rank's all-reduces of the failed attempt completed: drop the step's gradients, put back the
        buffers and DDP's state as the step began, and report the replay that follows."""
        self._ddp.prepare_replay()
        for param in {*self._trained(), *self._ddp.parameters}:
            param.grad = None
        if self._buffers is not None:
            self._buffers.restore()
        self._attempt += 1
        self._replays += 1
        self.recoveries += 1
        first = requests[0]
        recovery = Recovery(
            step=self.step,
            micro_batch=first.micro_batch,
            micro_batches_replayed=len(self._micro_batches),
            attempt=self._replays,
            state_bytes_evicted=evicted,
            other_bytes=0,
            error=error if error is not None else torch.OutOfMemoryError(f"rank {first.rank}: {first.error}"),
            failed_ranks=tuple(sorted({request.rank for request in requests})),
        )
        logger.warning(
            "hf-paged: %s. Every rank drops the step's gradients and replays its %d micro-batch(es).",
            "; ".join(request.describe() for request in requests),
            recovery.micro_batches_replayed,
        )
        if self.on_recovery is not None:
            self.on_recovery(recovery)

    def _device_out_of_memory(self, error: RuntimeError, devices: list[str]) -> torch.device:
        """The device that ran out of memory: the one of the optimizer's ``devices`` that ``error`` names; else, with
        automatic budgets, the one whose peak since the window opened came closest to its capacity; else the device
        of the first parameter."""
        named = device_out_of_memory(error, devices)
        if named is not None:
            return torch.device(named)
        autos = self.optimizer.auto_budgets
        marked = {device: auto for device, auto in autos.items() if auto.probe in self._marked}
        if len(marked) > 1:
            fullest = max(marked, key=lambda device: marked[device].probe.peak(_WINDOW_MARK) / marked[device].capacity)
            return torch.device(fullest)
        return torch.device(next(iter(autos))) if autos else self._device

    def _learn(self, device: str) -> None:
        """Tell ``device``'s automatic budget that the failed attempt needed at least its capacity besides the
        optimizer state there (of every optimizer measuring it)."""
        auto = self.optimizer.auto_budgets.get(device)
        if auto is None:
            return
        peak = auto.probe.peak(_WINDOW_MARK) if auto.probe in self._marked else auto.probe.allocated()
        auto.observe(max(peak, auto.capacity) - auto.state_bytes())

    def _explain(self, device: torch.device, stats: dict[str, Any], other_bytes: int) -> str:
        step = f"step {self.step}" if self.step is not None else "one step"
        return (
            f"hf-paged: out of memory in forward/backward of {step} {self._failures} times in a row. After each of "
            f"the first {self.retries} it moved all optimizer state to host memory, freed the cached device "
            f"memory and replayed the step's micro-batches. At the last failure the optimizer state held "
            f"{format_size(stats['device_bytes'])} on {device} ({format_size(stats['host_bytes'])} on the "
            f"host) and the rest of training {format_size(other_bytes)} (of {format_size(probe_for(device).capacity)} "
            f"capacity). {ADVICE}"
        )


def recover_oom(
    fn: Callable[[Any], Any],
    micro_batches: Iterable[Any],
    optimizer: Any,
    *,
    retries: int = 2,
    model: torch.nn.Module | None = None,
) -> list[Any]:
    """Run ``fn(micro_batch)`` (forward and backward) for each micro-batch of one optimizer step, recovering
    from out-of-memory errors as :class:`OOMRecovery` does (``model``: whose buffers a replay restores); return
    the results. Clear the gradients first. The optimizer's step that follows recovers ``retries`` times too.
    """
    recovery = OOMRecovery(optimizer, retries=retries, model=model)
    try:
        with recovery.window():
            return [recovery.run(fn, micro_batch) for micro_batch in micro_batches]
    finally:
        recovery.close()
