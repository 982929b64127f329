"""What replaying a step of a ``DistributedDataParallel`` model on every rank needs, after one rank ran out of memory.

In a synchronized micro-batch (outside ``no_sync``) DDP's reducer all-reduces the gradients in buckets, launched in
order as backward hands it each parameter's gradient; the other ranks wait in each all-reduce until this rank joins it.
After an error, :class:`DDPReplay` finds which parameters' gradients this rank had not handed over yet (from the
reducer's own record) and hands the reducer zero gradients for them through a backward of their own, so that the
reducer launches exactly the all-reduces this rank owes, waits for them and ends its iteration as after any backward;
no process group is aborted or created (gloo cannot abort a collective a peer never joins, and DDP, accelerate and the
Trainer hold the group). Every rank then drops the step's gradients and replays it from the same DDP state: no buffer
broadcast in the replay's first forward (the buffers a replay restores were taken after the step's broadcast), and,
when the error came in the iteration whose gradient order DDP rebuilds its buckets from, that order recorded again by
the replay, so the buckets, and with them the order in which the ranks' gradients are summed, are those of a run
without the error. Collectives that the model runs itself (``SyncBatchNorm``'s, a tensor-parallel layer's) are not
DDP's: a rank cannot complete them, and a model with them is not replayed (:func:`collectives_obstacle`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

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


_SYNC_BATCH_NORM = "SyncBatchNorm all-reduces its batch statistics in forward and their gradients in backward"
"""Why a ``SyncBatchNorm`` is a module with collectives of its own (``replay_obstacle``'s place for the others)."""


def collectives_obstacle(model: torch.nn.Module) -> str | None:
    """Why collectives that ``model``'s own modules run keep a rank from completing what it owes after an error (it
    completes DDP's gradient all-reduces only), or ``None``: the first module that is a ``SyncBatchNorm`` or has a
    ``replay_obstacle`` attribute, a sentence that a module running collectives (tensor-parallel or MoE layers) sets
    to say which."""
    for name, module in model.named_modules():
        sync_batch_norm = isinstance(module, torch.nn.SyncBatchNorm)
        why = _SYNC_BATCH_NORM if sync_batch_norm else getattr(module, "replay_obstacle", None)
        if why:
            return (
                f"the model's module {name or '(the model)'!r} ({type(module).__name__}) runs collectives of its own "
                f"({why}), which the other ranks may wait in and which a rank that failed cannot complete: it "
                "completes DDP's gradient all-reduces only."
            )
    return None


def graph_reference(tensor: torch.Tensor) -> weakref.ref:
    """A weak reference that lives while the graph behind ``tensor`` does: to its ``grad_fn`` where that node is a
    Python object (DDP's ``_DDPSink``, which wraps a forward's outputs under ``find_unused_parameters``), which anything
    computed from ``tensor`` keeps (a loss derived from the output, the output itself gone); else to ``tensor``."""
    try:
        return weakref.ref(tensor.grad_fn)
    except TypeError:  # a node of ATen's, or none
        return weakref.ref(tensor)


def tensors_in(output: object) -> list[torch.Tensor]:
    """The tensors in a forward's ``output``: itself, or inside tuples, lists and dictionaries (a ``ModelOutput``)."""
    if isinstance(output, torch.Tensor):
        return [output]
    found: list[torch.Tensor] = []
    for value in output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (dict, list, tuple)):
            found += tensors_in(value)
    return found


def accumulated_parameters(roots: Iterable[Any]) -> set[int]:
    """The ids of the leaf tensors whose gradient accumulator the autograd graph from the nodes ``roots`` reaches (its
    structure outlives a backward that failed part way)."""
    seen: set[object] = set()
    queue = list(roots)
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


_PRE_FORWARD = DistributedDataParallel._pre_forward.__code__
_POST_FORWARD = DistributedDataParallel._post_forward.__code__
_MODULE_FORWARD = DistributedDataParallel._run_ddp_forward.__code__


class DDPReplay:
    """Follows a DDP model's micro-batches so that a step one rank left part way can be replayed on every rank.

    Call :meth:`start_window` at each step, :meth:`begin_micro_batch` before each micro-batch; after an error,
    :meth:`note_failure` while the error's traceback still holds the micro-batch's frames and graph, then for a
    synchronized micro-batch :meth:`complete_collectives` (on the rank that failed), :meth:`prepare_replay` and the
    replay (each earlier micro-batch inside :meth:`replaying`) on every rank. :meth:`close` removes the hooks.

    What the reducer was handed in the micro-batch running is read from its own record (the time each parameter's
    gradient reached it, ``reducer.get_backward_stats()``), taken before the micro-batch and compared after the error,
    so no hook runs per parameter; DDP's ``_pre_forward`` and ``_post_forward``, which its forward calls through the
    instance, are wrapped on the instance to note when each ends (a module hook would cost the model's forward the
    slow path of ``nn.Module.__call__``, about 12 us on this CPU). With ``find_unused_parameters=True`` (the Trainer's
    default without gradient checkpointing) DDP also counts the parameters its forward's graph does not reach as handed
    over at the first gradient; the forward's outputs' graph is followed by weak references (:func:`graph_reference`:
    it lives while the loss computed from them does), and after an error the parameters it reaches tell which ones
    those are.

    Args:
        model: the DDP model the micro-batches run.
    """

    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model
        self.obstacle = settings_obstacle(model)
        """Why this model's settings keep a rank from completing its all-reduces after an error (``None``: nothing)."""
        self.collectives_obstacle = collectives_obstacle(model.module)
        """Why the model's own collectives keep any replay from being exact, on every rank or on one (``None``: none)."""
        self.parameters = reducer_parameters(model)
        self._device = self.parameters[0].device if self.parameters else torch.device("cpu")
        self._stats_before: list[int] = []
        self._forward_ended = False
        self._outputs: list[weakref.ref] = []
        self._failed_where = ""
        self._owed: list[torch.nn.Parameter] | None = None
        self._on_buffers_broadcast: Callable[[], None] | None = None
        self._wrapped = {name: vars(model).get(name) for name in ("_pre_forward", "_post_forward")}
        pre_forward, post_forward = model._pre_forward, model._post_forward

        def pre_forward_then_note(*args: Any, **kwargs: Any) -> Any:
            moved = pre_forward(*args, **kwargs)  # DDP's collectives before the model: bucket rebuild, buffers
            if self._on_buffers_broadcast is not None:
                on_broadcast, self._on_buffers_broadcast = self._on_buffers_broadcast, None
                on_broadcast()
            return moved

        def post_forward_then_note(output: Any) -> Any:
            output = post_forward(output)
            self._forward_ended = True
            if model.find_unused_parameters:  # the loss, say, which backward's caller holds until an error is handled
                self._outputs = [graph_reference(tensor) for tensor in tensors_in(output) if tensor.requires_grad]
            return output

        model._pre_forward = pre_forward_then_note
        model._post_forward = post_forward_then_note

    @property
    def synchronizes(self) -> bool:
        """Whether the micro-batch about to run all-reduces its gradients (it is outside ``no_sync``)."""
        return torch.is_grad_enabled() and self.model.require_backward_grad_sync

    @property
    def phase(self) -> str:
        """Where the micro-batch that failed was: ``"forward"`` (the model's) or ``"backward"`` (after DDP's forward
        returned: the loss, or backward)."""
        return "backward" if self._forward_ended else "forward"

    @property
    def gradients_handed_over(self) -> int:
        """Parameters whose gradient the micro-batch that failed had handed to the reducer."""
        return len(self.parameters) - len(self._owed or ())

    def start_window(self, on_buffers_broadcast: Callable[[], None]) -> None:
        """Begin a step: ``on_buffers_broadcast`` runs once, when DDP's work before the step's first forward (its
        broadcast of rank 0's buffers) is done, to take the buffers a replay restores."""
        self._on_buffers_broadcast = on_buffers_broadcast

    def begin_micro_batch(self, synchronizes: bool) -> None:
        """Before each micro-batch; for one that all-reduces gradients, take the reducer's record to compare with."""
        self._forward_ended = False
        self._outputs = []
        if synchronizes:
            self._stats_before = self.model.reducer.get_backward_stats()

    def note_failure(self, error: BaseException, synchronized: bool) -> None:
        """Right after ``error`` in the micro-batch running, while its traceback still holds the frames and the
        forward's graph: where it came, and for a ``synchronized`` micro-batch which parameters' gradients this rank
        still owes the reducer (``None`` where it cannot tell)."""
        codes = set()
        frame = error.__traceback__
        while frame is not None:
            codes.add(frame.tb_frame.f_code)
            frame = frame.tb_next
        if codes & {_PRE_FORWARD, _POST_FORWARD}:
            self._failed_where = "ddp"
        elif _MODULE_FORWARD in codes or self._forward_ended:
            self._failed_where = "model"
        else:
            self._failed_where = "before"
        self._owed = self._owed_parameters() if synchronized and self._failed_where == "model" else None

    def _owed_parameters(self) -> list[torch.nn.Parameter] | None:
        if not self._forward_ended:
            return list(self.parameters)  # the reducer was not told to expect any gradient yet
        now = self.model.reducer.get_backward_stats()
        pending = [
            parameter for parameter, before, after in zip(self.parameters, self._stats_before, now) if before == after
        ]
        if not self.model.find_unused_parameters:
            return pending
        found = (reference() for reference in self._outputs)
        roots = [item.grad_fn if isinstance(item, torch.Tensor) else item for item in found if item is not None]
        roots = [node for node in roots if node is not None]
        if not roots:
            return None
        reached = accumulated_parameters(roots)
        return [parameter for parameter in pending if id(parameter) in reached]

    def obstacle_to_replay(self, synchronized: bool) -> str | None:
        """Why the micro-batch that just failed cannot be replayed (``synchronized``: on every rank), or ``None``."""
        if self._failed_where == "ddp":
            return (
                "the error came in DDP's own work around the model's forward (rebuilding its gradient buckets, "
                "broadcasting rank 0's buffers), collectives this rank cannot complete."
            )
        if self._failed_where == "before":
            return (
                "the error came before DDP's forward ran, whose broadcast of rank 0's buffers the other ranks may "
                "already wait in."
            )
        if self.collectives_obstacle is not None:
            return self.collectives_obstacle
        if not synchronized:
            return None
        if self.obstacle is not None:
            return self.obstacle
        if self._owed is None:
            return (
                "DDP runs with find_unused_parameters=True and nothing held the forward's graph at the error, so this "
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
        if self._device.type != "cpu":
            torch.get_device_module(self._device.type).synchronize(self._device)

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
        """Give DDP its own ``_pre_forward`` and ``_post_forward`` back (idempotent)."""
        for name, own in self._wrapped.items():
            if own is None:
                vars(self.model).pop(name, None)
            else:
                setattr(self.model, name, own)
        self._wrapped = {}
