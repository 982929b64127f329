"""DeepSpeed ZeRO-2 and ZeRO-3, modelled inside the planner's trace (DeepSpeed itself cannot run on fake tensors).

The planner traces the model's forward and backward (its activations and temporaries) and the client optimizer's step
as it does on one device; :class:`ZeroModel` allocates, under the same trace and at the moments DeepSpeed 0.19 does,
the buffers DeepSpeed's ZeRO optimizers keep (``deepspeed/runtime/zero/stage_1_and_2.py`` and ``stage3.py``), so that
each phase's peak holds them:

* ZeRO-2: each param group's trainable weights in one flat buffer, padded to a multiple of ``2 * world_size``
  elements, the parameters views of it; this rank's fp32 master partition (a copy, even of fp32 weights), which the
  client optimizer steps in place of the parameters, so that its state is that of one flat partition; the reduce
  bucket of ``reduce_bucket_size`` elements from the first gradient of a backward to its end, each gradient copied
  into it and freed; from the first reduction, this rank's gradient partition (the whole gradient of each parameter
  that begins in the partition), which the step flattens into an fp32 gradient per group, freed once the last
  group's is;
* ZeRO-3: every parameter rests as this rank's partition (the trainable ones in one flat buffer per sub-group) and is
  gathered whole (on one rank, as a view of its partition, which is all of it) while its module runs, in forward and in
  backward (a module recomputed by gradient checkpointing keeps them until its backward ends); those of at most
  ``param_persistence_threshold`` elements are gathered for good at the end of the first step; the fp32 master
  partitions (a copy), the gradient partitions and the reduce bucket are allocated when the engine is built and live
  throughout. After the first forward and backward (DeepSpeed has then recorded the order of the modules), a module
  gathers ahead the parameters of the next ones (``stage3_prefetch_bucket_size`` elements), and its parameters stay
  gathered from its forward to its backward when the modules in between gather fewer than ``stage3_max_reuse_distance``
  elements; the prefetch stops where ``stage3_max_live_parameters`` elements are gathered. The step goes by DeepSpeed's
  sub-groups (``sub_group_size``), each with its own fp32 master partition and flattened fp32 gradient. While the model
  runs, ``torch.nn.functional.linear`` is DeepSpeed's ``LinearFunctionForZeroStage3`` (``memory_efficient_linear``),
  which saves every linear layer's input for backward, a frozen layer's too (LoRA's base layers, a frozen output layer);
* optimizer offload: the fp32 partitions, the gradient partitions and the client optimizer's state and step are in
  host memory (planned for an accelerator), ZeRO-2's with its staging buffers (one on the device, of the largest
  parameter), each fp32 partition with an fp32 gradient of its own for the whole run (ZeRO-3's
  ``initialize_optimizer_states``), which its step takes in place of flattening one; parameter offload (ZeRO-3): the partitions too, copied to the device while gathered.

Collectives move nothing; the figures are rank 0's (the partitions are padded to the same size), but for ZeRO-2's
gradient partition, which differs between ranks by the parameters across its ends: the largest rank's is planned, so
that the plan holds on every rank. Planned for the CPU, ZeRO-2's all-gather of the
weights at the end of a step holds a copy of them, as gloo's does; ZeRO-3's gathers of many parameters at once (the
persistent ones at the end of a step, a prefetch) are not given gloo's copies, which depend on how far its threads got
(see the README). LoRA's frozen weights are partitioned and gathered as the trainable ones, and so are QLoRA's 4-bit
weights whatever their storage (uint8 too); DeepSpeed releases a gathered parameter by making ``param.data`` an empty
tensor, which for a 4-bit weight frees nothing while bitsandbytes' ``MatMul4Bit`` keeps a view of it in
``ctx.tensors`` (a plain attribute, which backward does not free): each 4-bit weight stays whole from its forward until
its graph goes, so the model releases them so too. The planner keeps the last micro-batch's loss and inputs (and so
that graph) through the step, which DeepSpeed's engine takes inside accelerate's backward.

Only torch is imported.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

REDUCE_BUCKET_SIZE = 500_000_000
"""DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements)."""

PREFETCH_BUCKET_SIZE = 50_000_000
"""DeepSpeed's default ``stage3_prefetch_bucket_size`` (elements)."""

PARAM_PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's default ``stage3_param_persistence_threshold`` (elements): parameters of at most this many elements stay
whole after the first step."""

SUB_GROUP_SIZE = 1_000_000_000
"""DeepSpeed's default ``sub_group_size`` (elements): ZeRO-3 steps a rank's partition of a param group in sub-groups of
about this many elements."""

MAX_LIVE_PARAMETERS = 1_000_000_000
"""DeepSpeed's default ``stage3_max_live_parameters`` (elements): the prefetch stops where this many are gathered."""

MAX_REUSE_DISTANCE = 1_000_000_000
"""DeepSpeed's default ``stage3_max_reuse_distance`` (elements): a parameter used again within this many elements of
gathered parameters is not released."""

ALIGNMENT = 2
"""ZeRO-2 pads each group's flat buffer to a multiple of this many elements per rank (DeepSpeed's
``nccl_start_alignment_factor``)."""


@dataclass(frozen=True)
class ZeroSettings:
    """The DeepSpeed ``zero_optimization`` settings the model depends on, DeepSpeed's defaults unless given."""

    reduce_bucket_size: int = REDUCE_BUCKET_SIZE
    """Elements of the gradient reduce bucket."""
    param_persistence_threshold: int = PARAM_PERSISTENCE_THRESHOLD
    """ZeRO-3: parameters of at most this many elements stay whole on every rank after the first step."""
    prefetch_bucket_size: int = PREFETCH_BUCKET_SIZE
    """ZeRO-3: after the first forward and backward, each module gathers ahead this many elements of the next ones'
    parameters."""
    sub_group_size: int = SUB_GROUP_SIZE
    """ZeRO-3: a param group's partition is stepped in sub-groups of parameters whose partitions reach this many
    elements, each with its own fp32 master partition and fp32 gradient."""
    max_live_parameters: int = MAX_LIVE_PARAMETERS
    """ZeRO-3: the prefetch gathers ahead while fewer elements than this are gathered."""
    max_reuse_distance: int = MAX_REUSE_DISTANCE
    """ZeRO-3: after the first forward and backward, a module's parameters stay gathered from its forward to its
    backward when the parameters of the modules in between (those after it, in forward and in backward) are fewer
    elements."""
    memory_efficient_linear: bool = True
    """ZeRO-3: ``torch.nn.functional.linear`` is DeepSpeed's, which saves every linear layer's input for backward."""

    def __post_init__(self) -> None:
        if not isinstance(self.memory_efficient_linear, bool):
            raise TypeError(f"memory_efficient_linear must be True or False, got {self.memory_efficient_linear!r}")
        for name in (
            "reduce_bucket_size",
            "param_persistence_threshold",
            "prefetch_bucket_size",
            "sub_group_size",
            "max_live_parameters",
            "max_reuse_distance",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (elements), got {value!r}")


class _LinearSavingInput(torch.autograd.Function):
    """DeepSpeed's ``LinearFunctionForZeroStage3`` (``deepspeed/runtime/zero/linear.py``), which ZeRO-3 puts in place of
    ``torch.nn.functional.linear``: it saves the input and the weight for backward whether the weight trains or not
    (torch's linear saves the input only for the weight's gradient, so a frozen layer's input is saved here alone)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        ctx.save_for_backward(input, weight, bias)
        if input.dim() == 2 and bias is not None:
            return torch.addmm(bias, input, weight.t())
        output = input.matmul(weight.t())
        if bias is not None:
            output += bias
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        dim = grad_output.dim()
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            if dim > 2:
                flat_output = grad_output.reshape(-1, grad_output.shape[-1])
                grad_weight = flat_output.t().matmul(input.reshape(-1, input.shape[-1]))
            elif dim == 1:
                grad_weight = grad_output.unsqueeze(-1) * input.unsqueeze(0)
            else:
                grad_weight = grad_output.t().matmul(input)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(list(range(dim - 1))) if dim > 1 else grad_output
        return grad_input, grad_weight, grad_bias


def _zero3_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSpeed's ``zero3_linear_wrap``: ``torch.nn.functional.linear`` through :class:`_LinearSavingInput`."""
    return _LinearSavingInput.apply(input, weight, bias)


class Ledger(Protocol):
    """What :class:`ZeroModel` needs of the planner's ledger."""

    def labelling(self, kind: str) -> contextlib.AbstractContextManager[None]: ...

    def allocating_on_host(self) -> contextlib.AbstractContextManager[None]: ...

    def resized(self, storage: torch.UntypedStorage) -> None: ...


def zero2_gradient_partitions(numels: list[int], partition: int, world_size: int) -> list[int]:
    """Elements of each rank's ZeRO-2 gradient partition of one param group whose parameters have ``numels`` elements
    (in their order in the group's flat buffer), ``partition`` elements of the buffer a rank: the whole gradient of
    every parameter with an element in the rank's part, as DeepSpeed's ``get_partition_info`` takes them (a parameter
    across either end of a part counts in full on both ranks)."""
    totals = [0] * world_size
    if partition == 0:
        return totals
    offset = 0
    for numel in numels:
        first = offset // partition
        last = (offset + numel - 1) // partition if numel else first
        for rank in range(first, min(last, world_size - 1) + 1):
            totals[rank] += numel
        offset += numel
    return totals


class ZeroModel:
    """Rank 0's ZeRO buffers for ``model`` and ``optimizer`` (built on the model's parameters, as the Trainer builds its
    client optimizer) over ``world_size`` ranks; see the module's docstring.

    Args:
        stage: 2 or 3.
        offload_optimizer: fp32 partitions, gradient partitions and the optimizer state in host memory.
        offload_parameters: ZeRO-3's parameter partitions in host memory.
        host_apart: host memory is apart from the device (what is offloaded is not the device's).
        gloo_copies: ZeRO-2's all-gather of the weights at the end of a step allocates a copy of its output while in
            flight, as gloo's does (on the CPU; NCCL's writes into its output).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        world_size: int,
        stage: int,
        settings: ZeroSettings,
        ledger: Ledger,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        host_apart: bool = False,
        gloo_copies: bool = False,
    ) -> None:
        if stage not in (2, 3):
            raise ValueError(f"stage must be 2 or 3, got {stage!r}")
        self.world_size = world_size
        self.stage = stage
        self.settings = settings
        self.ledger = ledger
        self.optimizer = optimizer
        self._offload_optimizer = offload_optimizer
        self._gloo_copies = gloo_copies
        self._optimizer_on_host = offload_optimizer and host_apart
        self._parameters_on_host = offload_parameters and host_apart
        self._gathers_in_place = world_size == 1 and not self._parameters_on_host
        """ZeRO-3 on one rank: a parameter's partition is the whole of it, and DeepSpeed gathers it as a view of that
        partition (``NoGatherHandle``), which allocates nothing."""
        self.groups = [[param for param in group["params"] if param.requires_grad] for group in optimizer.param_groups]
        self.master: list[torch.Tensor] = []
        """The fp32 master partition of each param group (ZeRO-3: of each sub-group), which the client steps."""
        self._bucket: torch.Tensor | None = None
        self._bucket_elements = 0
        self._gradient_partition: torch.Tensor | None = None
        self._hooks: list[Any] = []
        self._flats: list[torch.Tensor] = []
        """Buffers held for the whole run: ZeRO-3's 16-bit partitions, ZeRO-2's offload staging buffers."""
        self._group_of: list[int] = []
        """The optimizer's param group of each of :attr:`master`."""
        if stage == 2:
            self._build_stage2()
        else:
            self._build_stage3(model)
        for index, group in enumerate(optimizer.param_groups):
            group["params"] = [master for master, owner in zip(self.master, self._group_of) if owner == index]

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """While the model runs under ZeRO-3 (``memory_efficient_linear``), ``torch.nn.functional.linear`` is
        DeepSpeed's (:class:`_LinearSavingInput`), as DeepSpeed's engine leaves it."""
        if self.stage != 3 or not self.settings.memory_efficient_linear:
            yield
            return
        original = torch.nn.functional.linear
        torch.nn.functional.linear = _zero3_linear
        try:
            yield
        finally:
            torch.nn.functional.linear = original

    @contextlib.contextmanager
    def _on(self, host: bool, kind: str) -> Iterator[None]:
        with self.ledger.labelling(kind), self.ledger.allocating_on_host() if host else contextlib.nullcontext():
            yield

    def partition_elements(self, group: list[torch.Tensor]) -> int:
        """Elements of this rank's partition of ``group`` (ZeRO-2: of its padded flat buffer; ZeRO-3: the partitions of
        its parameters, each padded to a multiple of the ranks)."""
        if self.stage == 2:
            alignment = ALIGNMENT * self.world_size
            return math.ceil(sum(param.numel() for param in group) / alignment) * alignment // self.world_size
        return sum(math.ceil(param.numel() / self.world_size) for param in group)

    def _build_stage2(self) -> None:
        for index, group in enumerate(self.groups):
            if not group:
                self.master.append(torch.empty(0))
                self._group_of.append(index)
                continue
            size = self.partition_elements(group) * self.world_size
            with torch.no_grad(), self._on(False, "trainable_weights"):
                flat = torch.empty(size, dtype=group[0].dtype)
                offset = 0
                for param in group:
                    flat.narrow(0, offset, param.numel()).copy_(param.reshape(-1))
                    param.data = flat.narrow(0, offset, param.numel()).view_as(param)
                    offset += param.numel()
            with torch.no_grad(), self._on(self._optimizer_on_host, "trainable_weights"):
                part = flat.narrow(0, 0, size // self.world_size).clone().to(torch.float32)
            self.master.append(part.requires_grad_(True))
            self._group_of.append(index)
            if self._offload_optimizer:
                with self._on(self._optimizer_on_host, "trainable_weights"):
                    self._flats.append(torch.empty(part.numel(), dtype=flat.dtype))
                with self._on(self._optimizer_on_host, "gradients"):
                    part.grad = torch.zeros(part.numel(), dtype=torch.float32)
            for param in group:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._stage2_gradient))
        if self._offload_optimizer:
            largest = max((param.numel() for group in self.groups for param in group), default=0)
            dtype = next((group[0].dtype for group in self.groups if group), torch.float32)
            with self._on(self._optimizer_on_host, "gradients"):
                self._flats.append(torch.zeros(largest, dtype=dtype))
            with self._on(False, "gradients"):
                self._flats.append(torch.zeros(largest, dtype=dtype))

    def _stage2_gradient(self, param: torch.Tensor) -> None:
        """A gradient is ready: the bucket is allocated at a backward's first; the gradient is copied into it and
        freed; when the bucket is full, or the backward ends, it is reduced into this rank's gradient partition
        (allocated at the first reduction)."""
        if self._bucket is None:
            with self._on(False, "communication"):
                self._bucket = torch.empty(self.settings.reduce_bucket_size, dtype=param.dtype)
            self._bucket_elements = 0
        if self._bucket_elements + param.numel() > self.settings.reduce_bucket_size:
            self._reduce(param.dtype)
        self._bucket_elements += param.numel()
        param.grad = None

    def _gradients_in_partition(self) -> int:
        """Elements of ZeRO-2's gradient partition on the rank where it is largest (DeepSpeed's
        ``grads_in_partition``), so that the plan holds on every rank: see :func:`zero2_gradient_partitions`."""
        per_rank = [0] * self.world_size
        for group in self.groups:
            numels = [param.numel() for param in group]
            for rank, elements in enumerate(
                zero2_gradient_partitions(numels, self.partition_elements(group), self.world_size)
            ):
                per_rank[rank] += elements
        return max(per_rank)

    def _reduce(self, dtype: torch.dtype) -> None:
        """The bucket is reduced: this rank's gradients go to its gradient partition, allocated at the first (with
        optimizer offload, to the fp32 gradients of the master partitions)."""
        if self._gradient_partition is None and not self._offload_optimizer:
            elements = self._gradients_in_partition()
            with self._on(self._optimizer_on_host, "gradients"):
                self._gradient_partition = torch.empty(elements, dtype=dtype)
        self._bucket_elements = 0

    def _build_stage3(self, model: nn.Module) -> None:
        self._model = model
        trainable = [param for group in self.groups for param in group]
        frozen = [p for p in model.parameters() if not p.requires_grad]
        self._partitioned = {id(param) for param in (*trainable, *frozen)}
        self._swapped = {id(param): param.shape for param in frozen if getattr(param, "bnb_quantized", False)}
        """4-bit weights (bitsandbytes' packed ones, of any storage dtype), released as DeepSpeed's ``free_param`` releases
        every parameter: ``param.data`` becomes an empty tensor, and the gathered tensor lives while anything else holds
        it (bitsandbytes' ``MatMul4Bit`` keeps a view of it in ``ctx.tensors``, a plain attribute, while its graph
        lives: under DeepSpeed until after the engine's step, which runs while the Trainer holds the loss)."""
        threshold = self.settings.param_persistence_threshold
        self._persistent = {id(param) for param in (*trainable, *frozen) if param.numel() <= threshold}
        self._persisting = False
        self._available = sum(param.numel() for param in (*trainable, *frozen))
        """Elements of the parameters gathered whole (all, until they are released below)."""
        self._order: list[nn.Module] = []
        """Modules with partitioned parameters in the order the first forward ran them."""
        self._distance: dict[int, int] = {}
        """After the first forward and backward: elements gathered between a module's forward and its backward."""
        self._trace: list[nn.Module] = []
        """Modules with partitioned parameters in the order the first forward and backward ran them."""
        self._position = -1
        """Where the forward and backward under way is in :attr:`_trace`."""
        self._next = 0
        """The next position of :attr:`_trace` to gather ahead."""
        self._prefetched_for: dict[int, int] = {}
        """Parameter to the position it was gathered ahead for."""
        self._frozen_in_backward: list[nn.Parameter] = []
        """The frozen parameters of the module whose backward runs."""
        with torch.no_grad(), self._on(self._parameters_on_host, "frozen_weights"):
            self._frozen_partitions = [
                torch.empty(math.ceil(p.numel() / self.world_size), dtype=p.dtype) for p in frozen
            ]
        for param in (*trainable, *frozen):
            self._release(param)
            if self._gathers_in_place:
                self.ledger.to_host(param.untyped_storage())
        for index, group in enumerate(self.groups):
            for sub_group in self._sub_groups(group):
                with torch.no_grad(), self._on(self._parameters_on_host, "trainable_weights"):
                    flat = torch.empty(self.partition_elements(sub_group), dtype=sub_group[0].dtype)
                with torch.no_grad(), self._on(self._optimizer_on_host, "trainable_weights"):
                    master = flat.to(torch.float32).clone()
                self._flats.append(flat)
                self.master.append(master.requires_grad_(True))
                self._group_of.append(index)
                if self._offload_optimizer:
                    with self._on(self._optimizer_on_host, "gradients"):
                        master.grad = torch.zeros(master.numel(), dtype=torch.float32)
        dtype = next((group[0].dtype for group in self.groups if group), torch.float32)
        with self._on(False, "communication"):
            self._bucket = torch.empty(self.settings.reduce_bucket_size, dtype=dtype)
        elements = sum(self.partition_elements(group) for group in self.groups)
        with self._on(self._optimizer_on_host, "gradients"):
            self._gradient_partition = torch.zeros(elements, dtype=dtype)
        for module in model.modules():
            if self._own(module):
                self._hooks.append(module.register_forward_pre_hook(self._gather_for_forward))
                self._hooks.append(module.register_forward_hook(self._release_after_forward))
        for param in trainable:
            self._hooks.append(param.register_post_accumulate_grad_hook(self._stage3_gradient))

    def _sub_groups(self, group: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """DeepSpeed's sub-groups of ``group``: parameters in order until their partitions reach ``sub_group_size``
        elements."""
        sub_groups: list[list[torch.Tensor]] = []
        current: list[torch.Tensor] = []
        for param in group:
            current.append(param)
            if self.partition_elements(current) >= self.settings.sub_group_size:
                sub_groups.append(current)
                current = []
        return sub_groups + ([current] if current else [])

    def _own(self, module: nn.Module) -> list[nn.Parameter]:
        return [param for param in module.parameters(recurse=False) if id(param) in self._partitioned]

    def _gather(self, param: torch.Tensor) -> None:
        """Allocate ``param``'s whole tensor again (its storage, which autograd's saved tensors share); on one rank, a
        view of its partition (followed, not counted)."""
        storage = param.untyped_storage()
        if storage.nbytes() == 0:
            if id(param) in self._swapped:
                with self._on(self._gathers_in_place, "frozen_weights"):
                    param.data = torch.empty(self._swapped[id(param)], dtype=param.dtype)
            else:
                storage.resize_(param.numel() * param.element_size())
                self.ledger.resized(storage)
            self._available += self._elements(param)

    def _release(self, param: torch.Tensor, after_use: bool = False) -> None:
        """Free ``param``'s whole tensor (its storage, also for the tensors autograd saved); ``after_use``: unless it
        persists (a small parameter, after the first step)."""
        storage = param.untyped_storage()
        if storage.nbytes() and not (after_use and self._persisting and id(param) in self._persistent):
            self._available -= self._elements(param)
            if id(param) in self._swapped:
                param.data = torch.empty(0, dtype=param.dtype)
            else:
                storage.resize_(0)
                self.ledger.resized(storage)

    def _elements(self, param: torch.Tensor) -> int:
        """``param``'s elements, whole (a released 4-bit weight's tensor is empty)."""
        shape = self._swapped.get(id(param))
        return param.numel() if shape is None else math.prod(shape)

    def _fetch(self, module: nn.Module) -> None:
        """``module`` runs (forward, or backward when the gradient of its output arrives): its parameters are gathered;
        the first forward and backward record the order of the modules; later ones gather ahead, as DeepSpeed's
        prefetch does, the parameters of the next modules in that order that are not gathered, until at least
        ``prefetch_bucket_size`` elements are gathered ahead, or ``max_live_parameters`` elements in all; a parameter
        of a module passed so, gathered or not, is not released before that module's use."""
        if not self._distance:
            self._trace.append(module)
            if all(module is not seen for seen in self._order):
                self._order.append(module)
        else:
            self._position += 1
            self._next = max(self._next, self._position + 1)
        for param in self._own(module):
            self._gather(param)
        ahead = 0
        limit = min(self.settings.prefetch_bucket_size, self.settings.max_live_parameters - self._available)
        while self._distance and self._next < len(self._trace) and ahead < limit:
            for param in self._own(self._trace[self._next]):
                if param.untyped_storage().nbytes() == 0:
                    self._gather(param)
                    ahead += self._elements(param)
                self._prefetched_for[id(param)] = max(self._prefetched_for.get(id(param), -1), self._next)
            self._next += 1

    def _gather_for_forward(self, module: nn.Module, args: Any) -> None:
        self._fetch(module)

    def _release_used(self, params: list[nn.Parameter]) -> None:
        """Release ``params`` after their module ran, but those gathered ahead for a later use."""
        for param in params:
            if self._prefetched_for.get(id(param), -1) <= self._position:
                self._release(param, after_use=True)

    def _release_after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Release the module's gathered parameters, unless it is used again soon (see :class:`ZeroSettings`) or it runs
        again inside backward (gradient checkpointing's recomputation: they are released after its backward); gather
        them again when the gradient of its output arrives."""
        recomputed = torch._C._current_graph_task_id() != -1
        if (
            not recomputed
            and self._distance.get(id(module), self.settings.max_reuse_distance) >= self.settings.max_reuse_distance
        ):
            self._release_used(self._own(module))
        outputs = [output] if isinstance(output, torch.Tensor) else list(output) if isinstance(output, tuple) else []
        for tensor in outputs:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad, module=module: self._fetch_for_backward(module))
                break

    def _fetch_for_backward(self, module: nn.Module) -> None:
        """``module``'s backward begins: the previous module's backward has ended, so its frozen parameters are released
        (trainable ones are released after their gradients)."""
        self._release_used(self._frozen_in_backward)
        self._fetch(module)
        self._frozen_in_backward = [param for param in self._own(module) if not param.requires_grad]

    def _stage3_gradient(self, param: torch.Tensor) -> None:
        """A gradient is ready: copied into the bucket, reduced into this rank's gradient partition and freed; the
        parameter is released."""
        param.grad = None
        self._release_used([param])

    def after_backward(self) -> None:
        """The end of a backward: ZeRO-2 frees its bucket (the gradient partition stays for the step); ZeRO-3's first
        has recorded the order of the modules, from which the reuse distances follow."""
        if self.stage == 2 and self._bucket is not None:
            self._reduce(self._bucket.dtype)
            self._bucket = None
        if self.stage == 3:
            self._release_used(self._frozen_in_backward)
            self._frozen_in_backward = []
            if not self._distance:
                elements = [sum(self._elements(param) for param in self._own(module)) for module in self._order]
                for index, module in enumerate(self._order):
                    self._distance[id(module)] = 2 * sum(elements[index + 1 :])
            self._position, self._next = -1, 0
            self._prefetched_for = {}

    def step(self) -> None:
        """The ZeRO optimizer's step: (ZeRO-3) every parameter released; for each group, its fp32 gradient flattened
        from the gradient partition (with optimizer offload, the fp32 gradient it keeps), the client's step on the
        master partition, the gradient freed; (ZeRO-2) the gradient partition freed before the last group's client
        step (DeepSpeed drops each group's views of it once flattened; the groups' views share one buffer) and the
        weights all-gathered, (ZeRO-3) the small parameters gathered for good."""
        if self.stage == 3:
            self._persisting = False
            for param in self._model.parameters():
                if id(param) in self._partitioned:
                    self._release(param)
        groups = self.optimizer.param_groups
        listed = [group["params"] for group in groups]
        stepped = [(master, index) for master, index in zip(self.master, self._group_of) if master.numel()]
        try:
            for position, (master, index) in enumerate(stepped):
                if self._offload_optimizer:
                    self._client_step(index, master)
                    continue
                assert self._gradient_partition is not None
                with self._on(self._optimizer_on_host, "gradients"):
                    flat = torch.empty(master.numel(), dtype=self._gradient_partition.dtype)
                    grad = flat.to(torch.float32)
                    del flat
                if self.stage == 2 and position == len(stepped) - 1:
                    self._gradient_partition = None  # the last group's views of it are gone: freed
                master.grad = grad
                self._client_step(index, master)
                master.grad = None
                del grad
        finally:
            self.optimizer.param_groups = groups
            for group, params in zip(groups, listed):
                group["params"] = params
        if self.stage == 2:
            self._gradient_partition = None
            for group in self.groups if self._gloo_copies else ():
                if group:
                    copy = torch.empty(self.partition_elements(group) * self.world_size, dtype=group[0].dtype)
                    del copy
        else:
            self._persisting = True
            for param in self._model.parameters():
                if id(param) in self._persistent:
                    self._gather(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine's ``zero_grad``: the model's gradients, not those the offloaded master partitions keep."""
        for group in self.groups:
            for param in group:
                param.grad = None

    def _client_step(self, index: int, master: torch.Tensor) -> None:
        """The client optimizer's step on ``master`` alone, as DeepSpeed calls it: ZeRO-2 narrows ``param_groups`` to
        group ``index``; ZeRO-3 lists ``master`` in group ``index`` and nothing in the others, a paged client's
        tensors taking turns (its sub-groups' masters at one position, as hf-paged's DeepSpeed integration has it)."""
        if self.stage == 2:
            groups = self.optimizer.param_groups
            self.optimizer.param_groups = [groups[index]]
            try:
                self.optimizer.step()
            finally:
                self.optimizer.param_groups = groups
            return
        for position, group in enumerate(self.optimizer.param_groups):
            group["params"] = [master] if position == index else []
        with getattr(self.optimizer, "tensors_in_turn", contextlib.nullcontext)():
            self.optimizer.step()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
