"""DeepSpeed's optimizer state tools for hf-paged client optimizers under ZeRO-3.

``deepspeed.utils.safe_get_full_optimizer_state``, ``safe_set_full_optimizer_state``,
``safe_get_local_optimizer_state`` and ``safe_set_local_optimizer_state`` read and write
``optimizer.state[partition][name]`` of the client optimizer, where a paged optimizer keeps only ``step`` (its
states live in pages, 8-bit and 4-bit ones as codes and scales). :func:`enable_deepspeed_state_tools` wraps the
ZeRO-3 optimizer's methods behind them: for the state names of a :class:`~hf_paged.optim.base.PagedOptimizer`
client, the partition's state is decoded to fp32 into ``optimizer.state[partition]`` for the length of the call,
and a call that sets it encodes the result back into the pages (as a step encodes it). Other clients and keys go
to DeepSpeed's methods unchanged. ``import hf_paged`` enables it once DeepSpeed's ZeRO-3 module loads.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..optim.base import PagedOptimizer

_READS = ("get_full_hp_param", "get_local_fp32_param")
"""ZeRO-3 optimizer methods ``(param, optim_state_key)`` that read a state."""
_WRITES = ("set_full_hp_param", "set_local_hp_param")
"""ZeRO-3 optimizer methods ``(value, param, optim_state_key)`` that write a state."""


def enable_deepspeed_state_tools() -> None:
    """Make DeepSpeed's ZeRO-3 optimizer state tools see the states of paged client optimizers (idempotent)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    for name in (*_READS, *_WRITES):
        method = getattr(DeepSpeedZeroOptimizer_Stage3, name)
        if not getattr(method, "_hf_paged_wrapped", False):
            setattr(DeepSpeedZeroOptimizer_Stage3, name, _wrap(method, write_back=name in _WRITES))


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
