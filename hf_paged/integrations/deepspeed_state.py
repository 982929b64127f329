"""DeepSpeed's optimizer state tools for hf-paged client optimizers under ZeRO 1, 2 and 3.

``deepspeed.utils.safe_get_full_optimizer_state``, ``safe_set_full_optimizer_state`` and, under ZeRO-3,
``safe_get_local_optimizer_state`` and ``safe_set_local_optimizer_state`` read and write the client optimizer's
``optimizer.state[partition][name]`` (ZeRO-1 and 2 through views of it that each parameter's fragment mapping
keeps), where a paged optimizer keeps only ``step``: its states live in pages, 8-bit and 4-bit ones as codes and
scales. :func:`enable_deepspeed_state_tools` wraps the methods behind these tools: for the state names of a
:class:`~hf_paged.optim.base.PagedOptimizer` client, the partition's state is decoded to fp32 for the length of
the call (into ``optimizer.state[partition]``, or the fragment mapping), and a call that sets it encodes the
result back into the pages (as a step encodes it). Other clients and keys go to DeepSpeed's methods unchanged.
``import hf_paged`` enables it once DeepSpeed's ZeRO modules load.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..optim.base import PagedOptimizer

_READS = ("get_full_hp_param", "get_local_fp32_param")
"""ZeRO-3 optimizer methods ``(param, optim_state_key)`` that read a state."""
_WRITES = ("set_full_hp_param", "set_local_hp_param")
"""ZeRO-3 optimizer methods ``(value, param, optim_state_key)`` that write a state."""


LINKED_OPTIMIZERS = {
    "deepspeed.runtime.zero.stage_1_and_2": (
        "DeepSpeedZeroOptimizer",
        "bit16_groups",
        "single_partition_of_fp32_groups",
    ),
}
"""DeepSpeed's optimizers that link each parameter to its fragment of a flat fp32 partition (ZeRO-1 and 2; not yet
``BF16_Optimizer``, ZeRO-1 with bf16 parameters): module, class, and the attributes with each group's parameters
and partition."""


def enable_deepspeed_state_tools() -> None:
    """Make the optimizer state tools of DeepSpeed's ZeRO modules that are loaded see the states of paged client
    optimizers (idempotent)."""
    if "deepspeed.runtime.zero.stage3" in sys.modules:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        for name in (*_READS, *_WRITES):
            method = getattr(DeepSpeedZeroOptimizer_Stage3, name)
            if not getattr(method, "_hf_paged_wrapped", False):
                setattr(DeepSpeedZeroOptimizer_Stage3, name, _wrap(method, write_back=name in _WRITES))
    for module, (class_name, params_attribute, partitions_attribute) in LINKED_OPTIMIZERS.items():
        if module in sys.modules:
            owner = getattr(sys.modules[module], class_name)
            link = owner._link_all_hp_params
            if not getattr(link, "_hf_paged_wrapped", False):
                owner._link_all_hp_params = _wrap_link(link, params_attribute, partitions_attribute)


def _wrap(method: Callable[..., Any], *, write_back: bool) -> Callable[..., Any]:
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        param, key = bound.arguments["param"], bound.arguments["optim_state_key"]
        with _decoded_state(self, param, key, write_back=write_back):
            return method(self, *args, **kwargs)

    wrapped._hf_paged_wrapped = True  # type: ignore[attr-defined]
    return wrapped


@contextlib.contextmanager
def _decoded_state(zero_optimizer: Any, param: torch.Tensor, key: str | None, *, write_back: bool) -> Iterator[None]:
    """Within the block, ``client.state[partition][key]`` holds the fp32 state of the flat fp32 partition that
    ``param`` belongs to; with ``write_back`` it is encoded into the client's pages when the block ends without
    an error."""
    client = zero_optimizer.optimizer
    if (
        key is None
        or not param.requires_grad
        or not isinstance(client, PagedOptimizer)
        or key not in client.state_names
    ):
        yield
        return
    group_index = zero_optimizer.grad_position[zero_optimizer.get_param_id(param)][0]
    partition = zero_optimizer.fp32_partitioned_groups_flat[group_index]
    entry = client.state[partition]
    if key in entry:  # a key of the same name that someone else keeps there: leave it to DeepSpeed
        yield
        return
    entry[key] = client.get_state_tensor(partition, key).view(-1)
    try:
        yield
        if write_back:
            client.set_state_tensor(partition, key, entry[key])
    finally:
        del entry[key]


def _wrap_link(link: Callable[..., Any], params_attribute: str, partitions_attribute: str) -> Callable[..., Any]:
    """Wrap a ZeRO-1/2 optimizer's ``_link_all_hp_params``: after it binds ``get_full_hp_param`` and
    ``set_full_hp_param`` to each parameter, those of a paged client's parameters are bound again through
    :func:`_decoded_fragment`."""

    @functools.wraps(link)
    def wrapped(self: Any) -> None:
        link(self)
        client = self.optimizer
        if not isinstance(client, PagedOptimizer):
            return
        for params, partition in zip(getattr(self, params_attribute), getattr(self, partitions_attribute)):
            for param in params:
                param.get_full_hp_param = _through_fragment(param.get_full_hp_param, param, client, partition, 0)
                param.set_full_hp_param = _through_fragment(param.set_full_hp_param, param, client, partition, 1)

    wrapped._hf_paged_wrapped = True  # type: ignore[attr-defined]
    return wrapped


def _through_fragment(
    method: Callable[..., Any], param: torch.Tensor, client: PagedOptimizer, partition: torch.Tensor, key_at: int
) -> Callable[..., Any]:
    """``method``, a parameter's bound ``get_full_hp_param(optim_state_key=None)`` (``key_at`` 0) or
    ``set_full_hp_param(value, optim_state_key=None)`` (``key_at`` 1), run within :func:`_decoded_fragment`."""

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        key = kwargs.get("optim_state_key", args[key_at] if len(args) > key_at else None)
        with _decoded_fragment(param, client, partition, key, write_back=key_at == 1):
            return method(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def _decoded_fragment(
    param: torch.Tensor, client: PagedOptimizer, partition: torch.Tensor, key: str | None, *, write_back: bool
) -> Iterator[None]:
    """Within the block, ``param``'s fragment mapping (ZeRO-1/2) holds its piece of the fp32 state ``key`` of the
    flat partition; with ``write_back`` the partition's state is encoded into the client's pages when the block
    ends without an error. A parameter outside this rank's partition has no mapping: nothing to decode."""
    mapping = getattr(param, "_hp_mapping", None)
    fragments = (mapping.optim_fragment or {}) if mapping is not None else {}
    if mapping is None or key is None or key not in client.state_names or key in fragments:
        yield
        return
    values = client.get_state_tensor(partition, key).view(-1)
    address = mapping.get_hp_fragment_address()
    saved = mapping.optim_fragment
    mapping.optim_fragment = {**fragments, key: values.narrow(0, address.start, address.numel)}
    try:
        yield
        if write_back:
            client.set_state_tensor(partition, key, values)
    finally:
        mapping.optim_fragment = saved
