"""DeepSpeed's optimizer state tools for hf-paged client optimizers under ZeRO 1, 2 and 3.

``deepspeed.utils.safe_get_full_optimizer_state``, ``safe_set_full_optimizer_state`` and, under ZeRO-3,
``safe_get_local_optimizer_state`` and ``safe_set_local_optimizer_state`` read and write the client optimizer's
``optimizer.state[partition][name]`` (ZeRO-1 and 2 through views of it that each parameter's fragment mapping
keeps), where a paged optimizer keeps only ``step``: its states live in pages, 8-bit and 4-bit ones as codes and
scales. :func:`enable_deepspeed_state_tools` wraps the methods behind these tools: for the state names of a
:class:`~hf_paged.optim.base.PagedOptimizer` client, the partition's state is decoded to fp32 for the length of
the call (into ``optimizer.state[partition]``, or the fragment mapping), and a call that sets it encodes the
result back into the pages (as a step encodes it). Other clients and keys go to DeepSpeed's methods unchanged.

DeepSpeed's universal checkpoints take the same path for the optimizer's moments: ``ds_to_universal`` reads
``exp_avg`` and ``exp_avg_sq`` from each rank's saved client state, and ``load_universal`` writes the moments of
the new partitions into ``optimizer.state[partition]``. So a paged client's state that a ZeRO optimizer saves holds
its states as fp32 values, decoded from 8-bit and 4-bit codes and scales (as FSDP2's sharded state dicts do); a
checkpoint loaded on the same number of ranks encodes them again into the same codes and scales. After a universal
load, the fp32 moments DeepSpeed placed in ``optimizer.state[partition]`` are encoded into the client's pages for
the new partitions, and only ``step`` stays there.

ZeRO-3 steps its flat fp32 partition one sub-group (``sub_group_size`` elements) at a time, each listed alone in the
client's param group: a paged client steps them as tensors that take turns
(:meth:`~hf_paged.optim.base.PagedOptimizer.tensors_in_turn`), each with its own state.

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
from ..optim.state_dict import pack_param_groups, parse_saved_entry

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
    "deepspeed.runtime.bf16_optimizer": ("BF16_Optimizer", "bf16_groups", "fp32_groups_flat_partition"),
}
"""DeepSpeed's optimizers that link each parameter to its fragment of a flat fp32 partition (ZeRO-1 and 2, and
``BF16_Optimizer``, ZeRO-1 with bf16 parameters): module, class, and the attributes with each group's parameters
and partition."""

ZERO_OPTIMIZERS = {
    **{module: class_name for module, (class_name, _, _) in LINKED_OPTIMIZERS.items()},
    "deepspeed.runtime.zero.stage3": "DeepSpeedZeroOptimizer_Stage3",
}
"""DeepSpeed's optimizers whose checkpoints save their client's ``state_dict()`` and load universal checkpoints:
module and class."""


def enable_deepspeed_state_tools() -> None:
    """Make the optimizer state tools of DeepSpeed's ZeRO modules that are loaded see the states of paged client
    optimizers (idempotent)."""
    if "deepspeed.runtime.zero.stage3" in sys.modules:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        for name in (*_READS, *_WRITES):
            method = getattr(DeepSpeedZeroOptimizer_Stage3, name)
            if not getattr(method, "_hf_paged_wrapped", False):
                setattr(DeepSpeedZeroOptimizer_Stage3, name, _wrap(method, write_back=name in _WRITES))
        sub_group_step = DeepSpeedZeroOptimizer_Stage3._optimizer_step
        if not getattr(sub_group_step, "_hf_paged_wrapped", False):
            DeepSpeedZeroOptimizer_Stage3._optimizer_step = _in_turn(sub_group_step)
    for module, (class_name, params_attribute, partitions_attribute) in LINKED_OPTIMIZERS.items():
        if module in sys.modules:
            owner = getattr(sys.modules[module], class_name)
            link = owner._link_all_hp_params
            if not getattr(link, "_hf_paged_wrapped", False):
                owner._link_all_hp_params = _wrap_link(link, params_attribute, partitions_attribute)
    for module, class_name in ZERO_OPTIMIZERS.items():
        if module in sys.modules:
            owner = getattr(sys.modules[module], class_name)
            if not getattr(owner.state_dict, "_hf_paged_wrapped", False):
                owner.state_dict = _wrap_state_dict(owner.state_dict)
            if not getattr(owner._load_universal_checkpoint, "_hf_paged_wrapped", False):
                owner._load_universal_checkpoint = _wrap_universal_load(owner._load_universal_checkpoint)


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


def _in_turn(sub_group_step: Callable[..., Any]) -> Callable[..., Any]:
    """ZeRO-3's step of one sub-group, with its paged clients' tensors taking turns."""

    @functools.wraps(sub_group_step)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        client = self.optimizer
        with client.tensors_in_turn() if isinstance(client, PagedOptimizer) else contextlib.nullcontext():
            return sub_group_step(self, *args, **kwargs)

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


def _wrap_state_dict(state_dict: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a ZeRO optimizer's ``state_dict``: a paged client's state it holds has fp32 states
    (:func:`_decode_saved_states`)."""

    @functools.wraps(state_dict)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        client = self.optimizer
        if not isinstance(client, PagedOptimizer):
            return state_dict(self, *args, **kwargs)
        handle = client.register_state_dict_post_hook(_decode_saved_states)
        try:
            return state_dict(self, *args, **kwargs)
        finally:
            handle.remove()

    wrapped._hf_paged_wrapped = True  # type: ignore[attr-defined]
    return wrapped


def _decode_saved_states(client: PagedOptimizer, saved: dict[str, Any]) -> None:
    """State dict post hook: each state of ``client``'s ``saved`` state dict as fp32 values shaped like its tensor
    (``exp_avg``), in place of its 8-bit or 4-bit codes and scales, as DeepSpeed's checkpoint tools read it."""
    _, index_of = pack_param_groups(client.param_groups)
    listed = {index_of[id(param)]: (param, group) for group in client.param_groups for param in group["params"]}
    for index, entry in saved["state"].items():
        if index not in listed or not isinstance(entry, dict) or "step" not in entry:
            continue
        param, group = listed[index]
        block_size = group.get("block_size", client.defaults.get("block_size"))
        _, states, others = parse_saved_entry(
            param, index, entry, block_size, client.state_names, client.signed_states, move_others=False
        )
        values = {name: state.values().view(param.shape) for name, state in states.items()}
        saved["state"][index] = {"step": entry["step"], **values, **others}


def _wrap_universal_load(load: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a ZeRO optimizer's ``_load_universal_checkpoint``: the fp32 states it leaves in a paged client's
    ``optimizer.state[partition]`` are encoded into the client's pages (:func:`_encode_loaded_states`)."""

    @functools.wraps(load)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = load(self, *args, **kwargs)
        if isinstance(self.optimizer, PagedOptimizer):
            _encode_loaded_states(self)
        return result

    wrapped._hf_paged_wrapped = True  # type: ignore[attr-defined]
    return wrapped


def _encode_loaded_states(zero_optimizer: Any) -> None:
    """Load the step and fp32 states that a universal checkpoint load put in the paged client's
    ``optimizer.state[partition]`` through the client's ``load_state_dict`` (new pages, 8-bit and 4-bit state
    encoded), and drop the copies DeepSpeed keeps in the parameters' fragment mappings (ZeRO-1 and 2)."""
    client = zero_optimizer.optimizer
    listed = any(group["params"] for group in client.param_groups)
    if not listed:  # ZeRO-3 lists its partitions in the client's groups only around its calls
        zero_optimizer._set_fp32_optimizer_param_groups()
    try:
        groups, index_of = pack_param_groups(client.param_groups)
        state = {
            index_of[id(tensor)]: dict(entry)
            for tensor, entry in client.state.items()
            if isinstance(tensor, torch.Tensor)
            and id(tensor) in index_of
            and any(n in entry for n in client.state_names)
        }
        client.load_state_dict({"state": state, "param_groups": groups})
    finally:
        if not listed:
            zero_optimizer._clear_fp32_optimizer_param_groups()
    for name in ("bit16_groups", "bf16_groups"):
        for params in getattr(zero_optimizer, name, ()):
            for param in params:
                mapping = getattr(param, "_hp_mapping", None)
                if mapping is not None and mapping.optim_fragment:
                    mapping.optim_fragment = {
                        key: value for key, value in mapping.optim_fragment.items() if key not in client.state_names
                    }
