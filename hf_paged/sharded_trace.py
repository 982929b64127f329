"""What lets the planner trace a sharded training step, rank 0 of N, in this process under fake tensors.

:func:`fake_world` makes the default process group PyTorch's fake backend of ``world_size`` ranks: collectives
return at once and touch no data, so DDP and FSDP2 run as rank 0 of N would, allocating what it allocates (FSDP2's
all-gathered parameters and reduce-scattered gradients, each group's buffers, the prefetch of the next group).
:func:`traceable_engines` adjusts what the engines do on fake tensors without changing what they allocate, and
names the buffers of their collectives (the ``communication`` kind of :data:`hf_paged.planner.KINDS`):

* DDP checks that every rank has the same parameter shapes by reading a tensor's data (fake tensors have none),
  its C++ all-reduce hook needs the tensor a fake collective does not return, and its bucket rebuild at the second
  step reads bucket indices: the check is skipped, a hook that all-reduces the bucket in place (as the C++ one does,
  allocating nothing) replaces it, and the buckets keep the layout of the first step (the same bytes; the rebuild's
  moment of old and new buckets together stays below the backward peak, which holds the buckets and the gradients);
* FSDP2 frees and re-allocates unsharded parameters by resizing their storages, which is no operator: each resize
  goes to the ledger;
* DTensor finds the shape of an operator's output by running it on fake tensors of the global shape (under the
  plan's own fake mode, the first time each kind of call is seen): those tensors are no rank's and are not counted.

Only torch is imported.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn


class Ledger(Protocol):
    """What :func:`traceable_engines` needs of the planner's ledger."""

    def resized(self, storage: torch.UntypedStorage) -> None: ...

    def label(self, tensor: torch.Tensor, kind: str) -> None: ...

    def labelling(self, kind: str) -> contextlib.AbstractContextManager[None]: ...

    def allocating_on_host(self) -> contextlib.AbstractContextManager[None]: ...

    def to_host(self, storage: torch.UntypedStorage) -> None: ...


COMMUNICATION = "communication"


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded_tensor_type(kind: type) -> bool:
    """Whether ``kind`` is DTensor (or a subclass): a tensor whose operators run on its local shard."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(kind, type) and issubclass(kind, dtensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds of a DTensor, else ``tensor`` itself."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        return tensor._local_tensor
    return tensor


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """The default process group is PyTorch's fake backend of ``world_size`` ranks, this process rank 0, inside;
    ``fully_shard`` without a mesh takes one over all of them.

    Raises:
        RuntimeError: torch.distributed is unavailable, or the process already has a default process group (a
            sharded step is planned in a process of its own, not inside a distributed run).
    """
    if not torch.distributed.is_available():
        raise RuntimeError("world_size > 1 or a strategy needs torch.distributed, which this PyTorch build lacks")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # also registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError(
            "world_size/strategy: this process already has a default process group; plan a sharded step in a "
            "process of its own (hf-paged plan --gpus N), not inside a distributed run"
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard import _fully_shard

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))  # outside fake tensors: the mesh reads its ranks' values
        with _patched([(_fully_shard, "_init_default_mesh", lambda *args, **kwargs: mesh)]):
            yield
    finally:
        dist.destroy_process_group()


def _all_reduce_in_place(state, bucket):  # unannotated: DDP refuses a hook annotated otherwise
    """DDP's all-reduce of a gradient bucket, in place, as its C++ hook does (it allocates nothing); the future
    holds the bucket, which a fake collective's future does not."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(buffer)
    return done


class _ReducerKeepingBuckets:
    """A DDP reducer whose buckets keep the layout of the first step (see the module's docstring)."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def _traceable_ddp_init(original: Callable[..., None], ledger: Ledger) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(ddp: nn.Module, *args: Any, **kwargs: Any) -> None:
        with ledger.labelling(COMMUNICATION):
            original(ddp, *args, **kwargs)
        ddp.register_comm_hook(None, _all_reduce_in_place)
        ddp.reducer = _ReducerKeepingBuckets(ddp.reducer)

    return __init__


def _labelled(function: Callable[..., Any], ledger: Ledger) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with ledger.labelling(COMMUNICATION):
            return function(*args, **kwargs)

    return call


def _uncounted(function: Callable[..., Any], ledger: Ledger) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with ledger.allocating_on_host():
            return function(*args, **kwargs)

    return call


def _gradients_to_host(foreach_reduce: Callable[..., Any], ledger: Ledger) -> Callable[..., Any]:
    """FSDP2's reduce-scatter, whose sharded gradients of offloaded parameters go to host memory once reduced: on an
    accelerator each is copied to the host and the reduce-scatter's output freed (on a CPU mesh the copy is none)."""

    @functools.wraps(foreach_reduce)
    def call(fsdp_params: list[Any], *args: Any, **kwargs: Any) -> Any:
        result = foreach_reduce(fsdp_params, *args, **kwargs)
        for fsdp_param in fsdp_params:
            grad = fsdp_param.sharded_param.grad
            if fsdp_param.offload_to_cpu and grad is not None:
                ledger.to_host(local_tensor(grad).untyped_storage())
        return result

    return call


def _copies_to_device(all_gather_inputs: property) -> property:
    """FSDP2's all-gather inputs, where an offloaded shard in host memory is copied to the accelerator first (on a CPU
    mesh the copy is none, so it is made here)."""

    def inputs(fsdp_param: Any) -> list[torch.Tensor]:
        tensors = all_gather_inputs.fget(fsdp_param)
        if not fsdp_param.offload_to_cpu:
            return tensors
        host = fsdp_param._sharded_param_data.untyped_storage()
        return [tensor.clone() if tensor.untyped_storage() is host else tensor for tensor in tensors]

    return property(inputs)


def offloaded_shards(model: nn.Module) -> list[torch.Tensor]:
    """The shards of FSDP2's parameters that rest in host memory (CPU offload)."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    return [
        fsdp_param._sharded_param_data
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
        for fsdp_param in group.fsdp_params
        if fsdp_param.offload_to_cpu
    ]


def _resize_followed(original: Callable[..., Any], ledger: Ledger) -> Callable[..., Any]:
    @functools.wraps(original)
    def resize_(storage: torch.UntypedStorage, nbytes: int) -> Any:
        result = original(storage, nbytes)
        ledger.resized(storage)
        return result

    return resize_


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in reversed(originals):
            setattr(owner, name, value)


@contextlib.contextmanager
def traceable_engines(ledger: Ledger, offload_to_host: bool = False) -> Iterator[None]:
    """DDP and FSDP2 run on fake tensors inside and their collectives' buffers are labelled ``communication``; storage
    resizes go to ``ledger`` (see the module's docstring). With ``offload_to_host`` (planning CPU offload for an
    accelerator), FSDP2 copies offloaded shards to the device before each all-gather and reduced gradients go to host
    memory, as on an accelerator."""
    patches: list[tuple[Any, str, Any]] = [
        (torch.UntypedStorage, "resize_", _resize_followed(torch.UntypedStorage.resize_, ledger))
    ]
    if torch.distributed.is_available():
        import torch.nn.parallel.distributed as ddp_module
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        propagate = ShardingPropagator._propagate_tensor_meta_non_cached
        patches += [
            (ShardingPropagator, "_propagate_tensor_meta_non_cached", _uncounted(propagate, ledger)),
            (ddp_module, "_verify_param_shape_across_processes", lambda *args, **kwargs: None),
            (
                ddp_module.DistributedDataParallel,
                "__init__",
                _traceable_ddp_init(ddp_module.DistributedDataParallel.__init__, ledger),
            ),
            (_fsdp_param_group, "foreach_all_gather", _labelled(_fsdp_param_group.foreach_all_gather, ledger)),
        ]
        foreach_reduce = _labelled(_fsdp_param_group.foreach_reduce, ledger)
        if offload_to_host:
            from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

            foreach_reduce = _gradients_to_host(foreach_reduce, ledger)
            patches.append((FSDPParam, "all_gather_inputs", _copies_to_device(FSDPParam.all_gather_inputs)))
        patches.append((_fsdp_param_group, "foreach_reduce", foreach_reduce))
    with _patched(patches):
        yield


def label_parameters_in_use(model: nn.Module, ledger: Ledger) -> list[Any]:
    """Label what each module's parameters hold when it runs (FSDP2's unsharded parameters, gathered only while
    their group runs) as weights, and each gradient autograd accumulates into them as gradients; the hook handles,
    to remove when the trace ends."""
    hooked: set[int] = set()
    handles: list[Any] = []

    def gradient_accumulated(param: torch.Tensor) -> None:
        if param.grad is not None:
            ledger.label(local_tensor(param.grad), "gradients")

    def before_forward(module: nn.Module, args: Any) -> None:
        for param in module._parameters.values():
            if param is None or is_sharded_tensor_type(type(param)):
                continue
            ledger.label(param, "trainable_weights" if param.requires_grad else "frozen_weights")
            if param.requires_grad and id(param) not in hooked:
                hooked.add(id(param))
                handles.append(param.register_post_accumulate_grad_hook(gradient_accumulated))

    for module in model.modules():
        handles.append(module.register_forward_pre_hook(before_forward))
    return handles
