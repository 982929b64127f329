"""What replaying a step of a ``DistributedDataParallel`` model on every rank needs, after one rank ran out of memory.

In a synchronized micro-batch (outside ``no_sync``) DDP's reducer all-reduces the gradients in buckets, launched in
order as backward hands it each parameter's gradient; the other ranks wait in each all-reduce until this rank joins it.
:class:`DDPReplay` follows which parameters' gradients this rank handed over in the micro-batch running (a hook on each
parameter's gradient accumulator, next to DDP's own). After an error it hands the reducer zero gradients for the
others through a backward of their own, so that the reducer launches exactly the all-reduces this rank owes, waits for
them and ends its iteration as after any backward; no process group is aborted or created (gloo cannot abort a
collective a peer never joins, and DDP, accelerate and the Trainer hold the group). Every rank then drops the step's
gradients and replays it from the same DDP state: no buffer broadcast in the replay's first forward (the buffers a
replay restores were taken after the step's broadcast), and, when the error came in the iteration whose gradient order
DDP rebuilds its buckets from, that order recorded again by the replay, so the buckets, and with them the order in which
the ranks' gradients are summed, are those of a run without the error.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

_STATELESS_COMM_HOOKS = (
    default_hooks.allreduce_hook,
    default_hooks.fp16_compress_hook,
    default_hooks.bf16_compress_hook,
)
"""Communication hooks that keep nothing between iterations, so that a replayed iteration runs as the first did."""


def reducer_parameters(model: DistributedDataParallel) -> list[torch.nn.Parameter]:
    """The parameters whose gradients DDP's reducer all-reduces, in its order: those that require a gradient, less
    the ignored ones, each once."""
    seen: set[torch.Tensor] = set()
    parameters = []
    for module_name, module in model.module.named_modules():
        for name, parameter in module.named_parameters(recurse=False):
            ignored = f"{module_name}.{name}" in model.parameters_to_ignore
            if parameter.requires_grad and not ignored and parameter not in seen:
                seen.add(parameter)
                parameters.append(parameter)
    return parameters


def settings_obstacle(model: DistributedDataParallel) -> str | None:
    """Why a DDP model's settings keep a rank from completing the all-reduces it owes after an error, or ``None``."""
    if model.static_graph:
        return (
            "DDP runs with static_graph=True, which counts each parameter's gradient hooks from the first iteration "
            "on, and a rank cannot complete an iteration it left part way. Train without static_graph to have the "
            "step replayed."
        )
    if model._delay_all_reduce_all_params or model._use_python_reducer:
        return (
            "DDP delays its all-reduces to the end of backward (delay_all_reduce_named_params or its Python reducer)."
        )
    for hook, _ in model._comm_hooks:
        if hook not in _STATELESS_COMM_HOOKS:
            return (
                f"DDP runs the communication hook {getattr(hook, '__qualname__', hook)!r}, whose state (PowerSGD's "
                "error feedback, for one) a replay would not restore."
            )
    if any(getattr(module, "sparse", False) for module in model.module.modules()):
        return "the model has an embedding with sparse gradients, which DDP all-reduces apart."
    return None


def tensors_in(output: object) -> Iterator[torch.Tensor]:
    """The tensors in a forward's ``output``: itself, or inside tuples, lists and dictionaries (a ``ModelOutput``)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, dict):
        for value in output.values():
            yield from tensors_in(value)
    elif isinstance(output, (list, tuple)):
        for value in output:
            yield from tensors_in(value)


def accumulated_parameters(roots: Iterable[torch.Tensor]) -> set[int]:
    """The ids of the leaf tensors whose gradient accumulator the autograd graph behind ``roots`` reaches (its
    structure outlives a backward that failed part way)."""
    seen: set[object] = set()
    queue = [tensor.grad_fn for tensor in roots if tensor.grad_fn is not None]
    reached: set[int] = set()
    while queue:
        node = queue.pop()
        for following, _ in node.next_functions:
            if following is None or following in seen:
                continue
            seen.add(following)
            leaf = getattr(following, "variable", None)
            if leaf is not None:
                reached.add(id(leaf))
            queue.append(following)
    return reached


class DDPReplay:
    """Follows a DDP model's micro-batches so that a step one rank left part way can be replayed on every rank.

    Call :meth:`start_window` at each step, :meth:`begin_micro_batch` before each micro-batch; after an error in a
    synchronized micro-batch, :meth:`note_failure` while the error's traceback still holds the micro-batch's graph,
    :meth:`complete_collectives` (on the rank that failed), then :meth:`prepare_replay` and the replay (each earlier
    micro-batch inside :meth:`replaying`) on every rank. :meth:`close` removes the hooks.

    With ``find_unused_parameters=True`` (the Trainer's default without gradient checkpointing) DDP counts the
    parameters its forward's graph does not reach as handed over at the first gradient; the forward's outputs are
    followed by weak references, and after an error the parameters their graph reaches tell which ones those are.

    Args:
        model: the DDP model the micro-batches run.
    """

    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model
        self.obstacle = settings_obstacle(model)
        """Why this model's settings keep a rank from completing its all-reduces after an error (``None``: nothing)."""
        self.parameters = reducer_parameters(model)
        self._handed_over = bytearray(len(self.parameters))
        self._module_started = False
        self._forward_ended = False
        self._outputs: list[weakref.ref] = []
        self._owed: list[torch.nn.Parameter] | None = None
        self._on_module_start: Callable[[], None] | None = None
        self._handles = [
            torch.autograd.graph.get_gradient_edge(parameter).node.register_hook(self._accumulated_hook(index))
            for index, parameter in enumerate(self.parameters)
        ]
        self._handles.append(model.module.register_forward_pre_hook(self._module_starts))
        self._handles.append(model.register_forward_hook(self._forward_ends))

    @property
    def synchronizes(self) -> bool:
        """Whether the micro-batch about to run all-reduces its gradients (it is outside ``no_sync``)."""
        return torch.is_grad_enabled() and self.model.require_backward_grad_sync

    @property
    def phase(self) -> str:
        """Where the micro-batch running is: ``"forward"`` until DDP's forward returned, then ``"backward"``."""
        return "backward" if self._forward_ended else "forward"

    @property
    def gradients_handed_over(self) -> int:
        """Parameters whose gradient the micro-batch running handed to the reducer."""
        return sum(self._handed_over)

    def start_window(self, on_buffers_broadcast: Callable[[], None]) -> None:
        """Begin a step: ``on_buffers_broadcast`` runs once, when the model's first forward of the step begins (after
        DDP's broadcast of rank 0's buffers), to take the buffers a replay restores."""
        self._on_module_start = on_buffers_broadcast

    def begin_micro_batch(self) -> None:
        """Forget what the last micro-batch handed over."""
        self._handed_over = bytearray(len(self.parameters))
        self._module_started = self._forward_ended = False
        self._outputs = []
        self._owed = None

    def note_failure(self) -> None:
        """Right after an error in the micro-batch running, while its traceback still holds the forward's graph: take
        the parameters whose gradients this rank still owes the reducer (``None`` where it cannot tell)."""
        pending = [parameter for index, parameter in enumerate(self.parameters) if not self._handed_over[index]]
        if not self._forward_ended or not self.model.find_unused_parameters:
            self._owed = pending
            return
        roots = [tensor for tensor in (reference() for reference in self._outputs) if tensor is not None]
        if not roots:
            self._owed = None
            return
        reached = accumulated_parameters(roots)
        self._owed = [parameter for parameter in pending if id(parameter) in reached]

    def obstacle_to_replay(self, synchronized: bool) -> str | None:
        """Why the micro-batch that just failed cannot be replayed (``synchronized``: on every rank), or ``None``."""
        if not self._module_started:
            return (
                "the error came in DDP's own work before the model's forward (rebuilding its gradient buckets or "
                "broadcasting rank 0's buffers, both collectives), which this rank cannot complete."
            )
        if not synchronized:
            return None
        if self.obstacle is not None:
            return self.obstacle
        if self._owed is None:
            return (
                "DDP runs with find_unused_parameters=True and the forward's outputs were gone at the error, so this "
                "rank could not tell which gradients it still owes the all-reduces."
            )
        if self._forward_ended and not self._owed:
            return (
                "the error came after this rank had handed every gradient to the all-reduces, so the other ranks may "
                "already have gone on to the optimizer step."
            )
        return None

    def complete_collectives(self) -> None:
        """On the rank whose synchronized micro-batch failed (after :meth:`note_failure`): hand the reducer a zero
        gradient for each parameter it still waits for (their gradients grow by zero), so that it launches the
        all-reduces this rank owes, waits for them and ends the iteration (the gradients then hold the other ranks'
        sums, to be dropped)."""
        owed = [parameter.view_as(parameter) for parameter in self._owed]  # reach each accumulator through a graph
        if not self._forward_ended:
            self.model.reducer.prepare_for_backward(owed)  # what DDP's forward would have done: every one is used
        zeros = [torch.zeros((), dtype=view.dtype, device=view.device).expand_as(view) for view in owed]
        torch.autograd.backward(owed, zeros)

    def wait_for_reductions(self) -> None:
        """Make the host wait until the all-reduces launched so far have completed (on an accelerator, DDP only makes
        the stream wait): only then does the job's store hold every replay request of the step's attempt."""
        device = self.parameters[0].device if self.parameters else torch.device("cpu")
        if device.type != "cpu":
            torch.get_device_module(device.type).synchronize(device)

    def prepare_replay(self) -> None:
        """On every rank, once its all-reduces of the failed attempt completed: let the replay's first forward skip
        DDP's broadcast of buffers (the buffers restored are those the step's broadcast gave), and where DDP has not
        rebuilt its buckets yet, drop the gradient order the failed attempt recorded, so that the replay records it
        again and the buckets become those of a run without the error."""
        rebuilds = self.model.static_graph or not self.model.find_unused_parameters  # as DDP's reducer decides
        if rebuilds and not self.model._has_rebuilt_buckets:
            self.model.reducer._reset_state()
        self.model.require_forward_param_sync = False

    def prepare_local_replay(self) -> None:
        """Before replaying micro-batches inside ``no_sync`` on this rank alone: no broadcast of buffers in the
        replay's first forward (the other ranks run none)."""
        self.model.require_forward_param_sync = False

    @contextlib.contextmanager
    def replaying(self, synchronizes: bool) -> Iterator[None]:
        """Run an earlier micro-batch of the step as it first ran: synchronized or inside ``no_sync``."""
        before = self.model.require_backward_grad_sync
        self.model.require_backward_grad_sync = synchronizes
        try:
            yield
        finally:
            self.model.require_backward_grad_sync = before

    def close(self) -> None:
        """Remove the hooks (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # Hooks ------------------------------------------------------------------------------------------------

    def _accumulated_hook(self, index: int) -> Callable[..., None]:
        def accumulated(grad_inputs: tuple, grad_outputs: tuple) -> None:
            self._handed_over[index] = 1

        return accumulated

    def _module_starts(self, module: torch.nn.Module, args: tuple) -> None:
        self._module_started = True
        if self._on_module_start is not None:
            on_start, self._on_module_start = self._on_module_start, None
            on_start()

    def _forward_ends(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        self._forward_ended = True
        if self.model.find_unused_parameters:
            self._outputs = [weakref.ref(tensor) for tensor in tensors_in(output) if tensor.requires_grad]
