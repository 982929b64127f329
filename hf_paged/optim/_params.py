"""Parameters as the paged optimizers take them: param groups with or without names, checked one by one,
and the elements of a parameter that is not contiguous, read and written a range at a time.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

import torch

from .layout import _PLAIN_TENSORS, local_tensor

PARAMETER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes a parameter may have: the kernels compute in fp32 and write the parameter back in its own dtype."""


def describe_parameter(group_index: int, position: int, names: Sequence[Any] | None) -> str:
    """``"parameter 2 ('fc.weight') of param group 1"``: how error messages name a parameter."""
    name = f" ({names[position]!r})" if names is not None and position < len(names) else ""
    return f"parameter {position}{name} of param group {group_index}"


def normalize_param_group(
    param_group: Any, existing_groups: Sequence[dict[str, Any]], optimizer_name: str
) -> dict[str, Any]:
    """``param_group`` itself, as ``torch.optim`` keeps it (a caller's later edits to it take effect), with ``params``
    made a list of tensors and, for ``(name, tensor)`` pairs, ``param_names`` added, once it is checked.

    Raises TypeError or ValueError naming the group and parameter at fault, as ``torch.optim`` would
    reject them and more: non-tensors, non-leaf tensors, tensors that are not fp32, bf16 or fp16 (complex and
    fp64 included, :func:`check_parameter_dtype`) or not strided, a parameter listed twice or already in another
    group, parameters that share memory (:func:`check_disjoint_parameters`), names given for some parameters only,
    or for some groups only.
    """
    group_index = len(existing_groups)
    if not isinstance(param_group, dict):
        raise TypeError(f"param group {group_index} must be a dict, got {type(param_group).__name__}")
    if "params" not in param_group:
        raise ValueError(f"param group {group_index} has no 'params'")
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError(
            f"param group {group_index}: params must be an ordered collection (a set has no fixed order); use a list"
        )
    else:
        params = list(params)
    named = [isinstance(param, tuple) for param in params]
    if any(named) and not all(named):
        raise ValueError(
            f"param group {group_index} mixes (name, tensor) pairs (parameter {named.index(True)}) and tensors "
            f"(parameter {named.index(False)}); give all parameters with names or all without"
        )
    names = None
    if params and all(named):
        for position, pair in enumerate(params):
            if len(pair) != 2:
                raise ValueError(
                    f"parameter {position} of param group {group_index} must be a (name, tensor) pair, "
                    f"got a tuple of {len(pair)}"
                )
        names = [name for name, _ in params]
        params = [tensor for _, tensor in params]
    elif "param_names" in param_group:
        names = list(param_group["param_names"])
        if len(names) != len(params):
            raise ValueError(f"param group {group_index} has {len(names)} param_names for {len(params)} parameters")
    for index, group in enumerate(existing_groups):
        if ("param_names" in group) != (names is not None):
            raise ValueError(
                f"param group {group_index} is {'with' if names is not None else 'without'} parameter names but "
                f"param group {index} is not: give all param groups with names or all without"
            )
    seen: dict[int, int] = {}
    elsewhere = {id(param): index for index, group in enumerate(existing_groups) for param in group["params"]}
    for position, param in enumerate(params):
        where = describe_parameter(group_index, position, names)
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"{where} must be a tensor, got {type(param).__name__}")
        check_parameter_dtype(param, where, optimizer_name)
        if param.layout is not torch.strided:
            raise TypeError(f"{where} has layout {param.layout}; {optimizer_name} needs strided (dense) parameters")
        if not (param.is_leaf or param.retains_grad):
            raise ValueError(f"{where} is not a leaf tensor; only leaf tensors can be optimized")
        if id(param) in seen:
            raise ValueError(f"{where} is the same tensor as parameter {seen[id(param)]} of that group")
        if id(param) in elsewhere:
            raise ValueError(f"{where} is already in param group {elsewhere[id(param)]}")
        seen[id(param)] = position
    check_disjoint_parameters(params, group_index, names, existing_groups)
    param_group["params"] = params
    if names is not None:
        param_group["param_names"] = names
    return param_group


def check_parameter_dtype(param: torch.Tensor, where: str, optimizer_name: str) -> None:
    """Raise TypeError unless ``param`` is fp32, bf16 or fp16 (:data:`PARAMETER_DTYPES`); ``where`` names it in the
    message (:func:`describe_parameter`). The kernels compute in fp32, so an fp64 parameter would be rounded to fp32
    at every step, even with ``lr=0``."""
    if param.dtype in PARAMETER_DTYPES:
        return
    if param.is_complex():
        raise TypeError(f"{where} is complex ({param.dtype}); {optimizer_name} does not support complex parameters")
    raise TypeError(
        f"{where} has dtype {param.dtype}; {optimizer_name} supports fp32, bf16 and fp16 parameters (allowed: "
        "torch.float32, torch.bfloat16, torch.float16)"
    )


def check_disjoint_parameters(
    params: Sequence[torch.Tensor],
    group_index: int,
    names: Sequence[Any] | None,
    existing_groups: Sequence[dict[str, Any]],
) -> None:
    """Raise ValueError where a parameter of param group ``group_index`` (``params``, named ``names``) shares an
    element of memory with another of the group or of ``existing_groups`` (views of one tensor, such as
    ``Parameter(base)`` and ``Parameter(base[:10])``): each would be updated from its own state, and the kernels would
    write the shared elements twice. Views of disjoint elements of one tensor are taken.

    Parameters are grouped by storage, and only storages that a new parameter uses are looked at; of an earlier
    contiguous parameter there, only one whose bytes meet a new parameter's. Within one storage, the
    byte ranges are sorted by start and swept: only tensors whose ranges meet are compared
    (:func:`_share_elements`, exact, in memory bounded by :data:`_CHUNK`), and parameters are described only
    for the error."""
    new: dict[tuple[torch.device, int], list[tuple[int, int, torch.Tensor, int, int]]] = {}
    for position, param in enumerate(params):
        _add_extent(new, param, (group_index, position), create=True)
    if not new:
        return
    # An earlier parameter on a storage of a new one has its first element inside that storage's bytes, and one that
    # shares an element with a new one has bytes within a new one's: other parameters are passed over on their
    # data_ptr (and, contiguous, their length), without a storage object or an extent each.
    spans = sorted((pointer, pointer + storage.nbytes()) for storage, pointer in _storages(params))
    starts = [span[0] for span in spans]
    reached = _merged(
        (pointer + start, pointer + end) for (_, pointer), extents in new.items() for start, end, *_ in extents
    )
    reached_starts = [start for start, _ in reached]
    for index, group in enumerate(existing_groups):
        for position, param in enumerate(group["params"]):
            if type(param) in _PLAIN_TENSORS:
                pointer = param.data_ptr()
                span = bisect.bisect_right(starts, pointer) - 1
                if span < 0 or pointer >= spans[span][1]:
                    continue
                if param.is_contiguous():
                    end = pointer + param.numel() * param.element_size()
                    meets = bisect.bisect_left(reached_starts, end) - 1
                    if meets < 0 or reached[meets][1] <= pointer:
                        continue
            _add_extent(new, param, (index, position), create=False)
    for extents in new.values():
        if len(extents) < 2:
            continue
        extents.sort(key=lambda extent: extent[0])
        active: list[tuple[int, int, torch.Tensor, int, int]] = []
        for extent in extents:
            start, _, tensor, index, position = extent
            active = [other for other in active if other[1] > start]
            for _, _, other, other_index, other_position in active:
                if (index == group_index or other_index == group_index) and _share_elements(tensor, other):
                    (index, position), (other_index, other_position) = sorted(
                        [(index, position), (other_index, other_position)]
                    )[::-1]
                    raise ValueError(
                        f"{_describe(index, position, group_index, names, existing_groups)} shares memory with "
                        f"{_describe(other_index, other_position, group_index, names, existing_groups)} (views of one "
                        "tensor); give each parameter its own memory or disjoint elements of a tensor"
                    )
            active.append(extent)


def _merged(ranges) -> list[tuple[int, int]]:
    """``ranges`` (``(start, end)`` byte addresses) as sorted, disjoint ranges covering the same bytes."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _storages(params: Sequence[torch.Tensor]):
    """The storage of each non-empty parameter with memory, with its data pointer."""
    for param in params:
        local = local_tensor(param)
        if local.numel():
            storage = local.untyped_storage()
            if storage.device.type != "meta":
                yield storage, storage.data_ptr()


def _add_extent(by_storage: dict, param: Any, where: tuple[int, int], create: bool) -> None:
    local = local_tensor(param)
    if not local.numel():
        return
    storage = local.untyped_storage()
    key = (local.device, storage.data_ptr())
    extents = by_storage.get(key)
    if extents is None:
        if not create or storage.device.type == "meta":  # meta and fake tensors have no memory
            return
        extents = by_storage[key] = []
    extents.append((*_element_range(local), local, *where))


def _describe(index: int, position: int, group_index: int, names: Sequence[Any] | None, existing_groups) -> str:
    if index == group_index:
        return describe_parameter(index, position, names)
    return describe_parameter(index, position, existing_groups[index].get("param_names"))


def _element_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The first byte of ``tensor``'s storage that it reads and the byte after its last."""
    last = tensor.storage_offset() + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.storage_offset() * tensor.element_size(), (last + 1) * tensor.element_size()


_CHUNK = 1 << 18
"""Element offsets :func:`_share_elements` looks at a time: int64 tensors of 2 MiB, a few at once."""


def _share_elements(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether two non-empty tensors of one storage share an element: their byte ranges meet and, where one is not
    contiguous, an element of one is an element of the other (of one element size; of two, meeting ranges count).

    Exact, without materializing the span: the offsets are first compared modulo the gcd of the strides (two
    interleaved views, as ``base[:, ::2]`` and ``base[:, 1::2]``, differ there); then the elements of one that lie
    in the range of the other are listed ``_CHUNK`` at a time and looked up in the other. The lookup is arithmetic
    where the other's dims nest (each stride past the extent of the smaller ones: any slice, transpose or view of a
    dense tensor); for two tensors that both overlap themselves (``as_strided``, ``unfold``), chunks of each are
    compared with ``torch.isin``, in time quadratic in the elements of the window but memory still bounded."""
    (start, end), (other_start, other_end) = _element_range(tensor), _element_range(other)
    if end <= other_start or other_end <= start:
        return False
    if (tensor.is_contiguous() and other.is_contiguous()) or tensor.element_size() != other.element_size():
        return True
    size = tensor.element_size()
    low, high = max(start, other_start) // size, min(end, other_end) // size
    dims, other_dims = _dims(tensor), _dims(other)
    divisor = 0
    for _, stride in dims + other_dims:
        divisor = math.gcd(divisor, stride)
    if divisor and (tensor.storage_offset() - other.storage_offset()) % divisor:
        return False
    nested, other_nested = _nests(dims), _nests(other_dims)
    if other_nested and (not nested or tensor.numel() <= other.numel()):
        listed, (looked_up, looked_up_dims) = (tensor, dims), (other, other_dims)
    elif nested:
        listed, (looked_up, looked_up_dims) = (other, other_dims), (tensor, dims)
    else:
        return any(
            bool(torch.isin(chunk, other_chunk).any())
            for chunk in _offsets(tensor.storage_offset(), dims, low, high)
            for other_chunk in _offsets(other.storage_offset(), other_dims, low, high)
        )
    return any(
        bool(_contains(looked_up.storage_offset(), looked_up_dims, chunk).any())
        for chunk in _offsets(listed[0].storage_offset(), listed[1], low, high)
    )


def _dims(tensor: torch.Tensor) -> list[tuple[int, int]]:
    """``(size, stride)`` of the dims that list distinct elements (size above 1, stride not 0), largest stride first."""
    return sorted(
        ((size, abs(stride)) for size, stride in zip(tensor.shape, tensor.stride()) if size > 1 and stride),
        key=lambda dim: -dim[1],
    )


def _nests(dims: list[tuple[int, int]]) -> bool:
    """Whether each stride is past the extent of the smaller ones: every element has one index, found greedily."""
    extent = 0
    for size, stride in reversed(dims):
        if stride <= extent:
            return False
        extent += (size - 1) * stride
    return True


def _contains(offset: int, dims: list[tuple[int, int]], offsets: torch.Tensor) -> torch.Tensor:
    """Which of ``offsets`` are elements of the tensor at ``offset`` with nesting ``dims`` (:func:`_nests`)."""
    rest = offsets - offset
    inside = rest >= 0
    for size, stride in dims:
        rest -= torch.div(rest, stride, rounding_mode="floor").clamp_(0, size - 1) * stride
    return inside & (rest == 0)


def _offsets(offset: int, dims: list[tuple[int, int]], low: int, high: int):
    """The element offsets in ``[low, high)`` of the tensor at ``offset`` with ``dims``, at most about ``_CHUNK``
    a time (possibly repeated where dims overlap): dims are walked largest stride first, skipping indices whose
    sub-block misses the window, and the trailing dims that fit a chunk are listed at once."""
    inner, block = len(dims), torch.zeros(1, dtype=torch.int64)
    while inner and dims[inner - 1][0] * block.numel() <= _CHUNK:
        inner -= 1
        size, stride = dims[inner]
        block = (torch.arange(size, dtype=torch.int64) * stride)[:, None].add(block[None, :]).view(-1)
    extents = [0] * (len(dims) + 1)
    for k in range(len(dims) - 1, -1, -1):
        extents[k] = extents[k + 1] + (dims[k][0] - 1) * dims[k][1]

    def walk(k: int, base: int):
        if k == inner:
            yield from _filtered(base + block, low, high)
            return
        size, stride = dims[k]
        first = max(0, -((base + extents[k + 1] - low) // stride))  # the first index whose sub-block reaches low
        last = min(size - 1, (high - 1 - base) // stride)
        if k + 1 < inner:
            for index in range(first, last + 1):
                yield from walk(k + 1, base + index * stride)
            return
        batch = max(1, _CHUNK // block.numel())  # the dim just above the block: several indices at once
        for index in range(first, last + 1, batch):
            indices = torch.arange(index, min(index + batch, last + 1), dtype=torch.int64)
            yield from _filtered((base + indices * stride)[:, None].add(block[None, :]).view(-1), low, high)

    yield from walk(0, offset)


def _filtered(offsets: torch.Tensor, low: int, high: int):
    offsets = offsets[(offsets >= low) & (offsets < high)]
    if offsets.numel():
        yield offsets


_REFUSED_OPTIONS = {
    "maximize": "{} minimizes the loss (allowed: maximize=False; negate the loss to maximize it)",
    "amsgrad": "{} has no AMSGrad variant (allowed: amsgrad=False)",
    "capturable": "{}'s step moves pages between host and device, which a CUDA graph cannot capture (allowed: "
    "capturable=False)",
    "differentiable": "{}'s step is not followed by autograd (allowed: differentiable=False)",
}
"""``torch.optim`` options the paged optimizers refuse when true, and why (of the optimizer named in ``{}``)."""


def check_update_rule_options(group: dict[str, Any], optimizer_name: str) -> None:
    """Raise ValueError for a ``torch.optim`` option of ``group`` that changes the step, which the paged optimizers
    do not have: ``maximize=True``, ``amsgrad=True``, ``decoupled_weight_decay=False`` with weight decay
    (``torch.optim.Adam``'s decay, added to the gradient), ``capturable=True`` (a CUDA graph of the step) or
    ``differentiable=True`` (a step autograd follows). Such groups come in torch state dicts."""
    for key, reason in _REFUSED_OPTIONS.items():
        if group.get(key, False):
            raise ValueError(f"{key}={group[key]!r} is not supported: {reason.format(optimizer_name)}")
    if not group.get("decoupled_weight_decay", True) and group.get("weight_decay", 0.0):
        raise ValueError(
            f"decoupled_weight_decay={group['decoupled_weight_decay']!r} with weight_decay={group['weight_decay']!r} "
            f"is not supported: {optimizer_name}'s weight decay is decoupled, as torch.optim.AdamW's, not added to "
            "the gradient as torch.optim.Adam's (allowed: decoupled_weight_decay=True, or weight_decay=0)"
        )


def flat_elements(tensor: torch.Tensor) -> torch.Tensor | StridedElements:
    """``tensor``'s elements in row-major order: a flat view, or for a non-contiguous tensor a sliceable stand-in."""
    return tensor.view(-1) if tensor.is_contiguous() else StridedElements(tensor)


class StridedElements:
    """The row-major elements of a non-contiguous tensor; ``elements[start:end]`` is a :class:`StridedRange`."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __getitem__(self, key: slice) -> StridedRange:
        return StridedRange(self.tensor, key.start, key.stop)


class StridedRange:
    """Elements ``start`` to ``end`` (row-major) of a non-contiguous tensor, as a few strided views of it.

    :meth:`gather` copies them into a new contiguous tensor (the range's size: a page's share of one
    parameter at most) and :meth:`scatter` writes such a tensor back.
    """

    def __init__(self, tensor: torch.Tensor, start: int, end: int) -> None:
        self.numel = end - start
        self.views: list[torch.Tensor] = []
        _collect_views(tensor, start, end, self.views)

    def gather(self) -> torch.Tensor:
        if len(self.views) == 1:
            return self.views[0].contiguous().view(-1)
        return torch.cat([view.reshape(-1) for view in self.views])

    def scatter(self, values: torch.Tensor) -> None:
        offset = 0
        for view in self.views:
            view.copy_(values[offset : offset + view.numel()].view(view.shape))
            offset += view.numel()


def _collect_views(tensor: torch.Tensor, start: int, end: int, views: list[torch.Tensor]) -> None:
    """Append views of ``tensor`` whose row-major elements, one after another, are its elements ``start:end``."""
    if start >= end:
        return
    if start == 0 and end == tensor.numel():
        views.append(tensor)
        return
    if tensor.dim() == 1:
        views.append(tensor[start:end])
        return
    row = tensor.numel() // tensor.shape[0]
    first, last = start // row, (end - 1) // row
    if first == last:
        _collect_views(tensor[first], start - first * row, end - first * row, views)
        return
    if start % row:
        _collect_views(tensor[first], start % row, row, views)
        first += 1
    whole_rows_end = end // row
    if whole_rows_end > first:
        views.append(tensor[first:whole_rows_end])
    if end % row:
        _collect_views(tensor[whole_rows_end], 0, end % row, views)
