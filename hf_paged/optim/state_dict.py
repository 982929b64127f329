"""State dicts of the paged optimizers: pages to ``torch.optim``'s layout and back.

A saved state holds, per parameter index, ``step`` and each state's fields as CPU tensors: fp32 values
(``exp_avg``, shaped like the parameter), 8-bit codes shaped like the parameter and one fp32 scale per block
(``exp_avg_codes``, ``exp_avg_scales``), 4-bit codes packed two per byte (``exp_avg_packed_codes``,
``exp_avg_scales``), or rank-1 normalized 4-bit codes (``exp_avg_packed_codes`` with the fp32 row and column maxima
``exp_avg_row_max`` and ``exp_avg_col_max``). A sharded (DTensor) parameter's states are fp32 DTensors placed like
the parameter.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from ..codecs import QUANTIZED_CODECS, Codec, Float32Codec, Rank1Normalized4bitCodec, Rank1Statistics, to_blocks
from ..store import Segment
from .layout import StateLayout, local_tensor

StateEntry = dict[str, torch.Tensor]
"""One parameter's saved state fields by key (``step`` aside)."""


def state_keys(codec: Codec | type[Codec], name: str) -> list[str]:
    """The state dict keys of the page fields of state ``name`` stored by ``codec``: ``exp_avg``, or
    ``exp_avg_codes`` and so on."""
    return [name if not field else f"{name}_{field}" for field in codec.fields]


def statistics_keys(codec: Codec | type[Codec], name: str) -> list[str]:
    """The state dict keys of the rank-1 statistics of state ``name`` (none for a codec without them)."""
    return [f"{name}_{field}" for field in getattr(codec, "statistics_fields", ())]


def pack_param_groups(param_groups: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """``param_groups`` with parameters replaced by their indices, as ``torch.optim`` packs them, and the index
    of each parameter by ``id``."""
    index_of: dict[int, int] = {}
    groups = []
    for group in param_groups:
        packed_group = {key: value for key, value in group.items() if key != "params"}
        packed_group["params"] = [index_of.setdefault(id(param), len(index_of)) for param in group["params"]]
        groups.append(packed_group)
    return groups, index_of


def export_state(layout: StateLayout, state_names: Sequence[str], tensors: Sequence[torch.Tensor]) -> list[StateEntry]:
    """The state fields of ``tensors`` (each with pages) read from their pages, one page in memory at a time."""
    entries: dict[int, StateEntry] = {}
    for tensor in tensors:
        pages = layout[tensor]
        entry = {}
        for name, codec in zip(state_names, layout.formats[pages.kind].codecs):
            for key, length, dtype in zip(
                state_keys(codec, name), codec.field_lengths(pages.numel), codec.field_dtypes()
            ):
                entry[key] = torch.zeros(length, dtype=dtype)
        entries[pages.owner] = entry
    page_list = {id(page): page for tensor in tensors for page, _ in layout[tensor].segments}
    for page in sorted(page_list.values(), key=lambda page: page.index):
        data = layout.store.read(page)
        if data is None:
            continue
        arrays = page.format.arrays(data)
        for segment in page.segments:
            entry = entries.get(segment.owner)
            if entry is None:
                continue
            for name, codec, array in zip(state_names, page.format.codecs, arrays):
                encoded = codec.select(array, segment.offset, segment.length)
                for key, view, offset, length in zip(
                    state_keys(codec, name),
                    encoded,
                    codec.field_offsets(segment.start),
                    codec.field_lengths(segment.length),
                ):
                    entry[key][offset : offset + length] = view.reshape(-1)[:length]
    exported = []
    for tensor in tensors:
        pages = layout[tensor]
        entry = entries[pages.owner]
        for state, (name, codec) in enumerate(zip(state_names, layout.formats[pages.kind].codecs)):
            if codec.saved_like_param:
                key = state_keys(codec, name)[0]
                entry[key] = entry[key].view(pages.shape)
            if pages.statistics is not None:
                rows_key, cols_key = statistics_keys(codec, name)
                entry[rows_key] = pages.statistics.rows[state].to("cpu", copy=True)
                entry[cols_key] = pages.statistics.cols[state].to("cpu", copy=True)
        exported.append(entry)
    return exported


def read_state_values(layout: StateLayout, state_names: Sequence[str], tensor: torch.Tensor, name: str) -> torch.Tensor:
    """State ``name`` of ``tensor`` (which has pages) as fp32 values on the CPU, shaped like the tensor's local
    shape: 8-bit and 4-bit codes decoded as the step decodes them."""
    pages = layout[tensor]
    codec = layout.formats[pages.kind].codecs[list(state_names).index(name)]
    entry = export_state(layout, state_names, [tensor])[0]
    fields = tuple(entry[key].reshape(-1) for key in state_keys(codec, name))
    statistics = saved_statistics(pages.shape, *(entry[key] for key in statistics_keys(codec, name)))
    return SavedState(codec, fields, pages.numel, statistics).values().view(pages.shape)


def write_state_values(
    layout: StateLayout, state_names: Sequence[str], tensor: torch.Tensor, name: str, values: torch.Tensor
) -> None:
    """Replace state ``name`` of ``tensor`` (which has pages) with fp32 ``values`` (as many elements as the
    tensor's local shape), encoded by the tensor's codec; its other states and the other tensors of its pages
    stay as they are. Each page written rests in host memory afterwards."""
    pages = layout[tensor]
    index = list(state_names).index(name)
    source = SavedState(Float32Codec(), (values.detach().to("cpu", torch.float32).reshape(-1),), pages.numel)
    if pages.statistics is not None:
        pages.statistics.set_from(index, source.values())
    for page, segment in pages.segments:
        data = layout.store.read(page)
        if data is None:
            data = tuple(torch.zeros(numel, dtype=dtype) for numel, dtype in page.specs)
        codec = page.format.codecs[index]
        encoded = codec.select(page.format.arrays(data)[index], segment.offset, segment.length)
        source.write(codec, _with_normalizers(encoded, pages.statistics, index, segment, codec), segment)
        layout.store.write(page, data)


def sharded_entry(
    param: torch.Tensor, entry: StateEntry, state_names: Sequence[str], codecs: Sequence[Codec]
) -> StateEntry:
    """The exported state of sharded parameter ``param`` as fp32 DTensors placed like the parameter.

    Encoded (8-bit, 4-bit) state is decoded: its blocks and scales belong to this rank's shard, which a
    checkpoint saved on other shard boundaries could not split. Loading encodes the values again, into
    the same codes and scales when the layout is unchanged (the largest value of a block decodes to
    its scale exactly, and every other value to within rounding of its code).
    """
    shard = local_tensor(param)
    sharded = {}
    for name, codec in zip(state_names, codecs):
        fields = tuple(entry[key].reshape(-1) for key in state_keys(codec, name))
        values = SavedState(codec, fields, shard.numel()).values()
        sharded[name] = _like_shards_of(param, values.view(shard.shape))
    return sharded


def parse_saved_entry(
    param: torch.Tensor,
    saved_id: Any,
    entry: Any,
    block_size: Any,
    state_names: Sequence[str],
    signed_states: Sequence[bool],
    *,
    move_others: bool = True,
) -> tuple[float | None, dict[str, SavedState], dict[Any, Any]]:
    """The step, the states and the other keys of ``entry``, saved state of parameter ``saved_id`` loading into
    ``param``.

    Each state is found in whichever encoding the entry holds it (fp32 values, 8-bit or 4-bit codes with
    ``block_size`` elements a block). An entry with neither ``step`` nor any state (``optimizer.state[param]``
    read before the parameter's first step) has step ``None`` and no states. Other keys (that users or libraries
    keep in ``optimizer.state[param]``) come back as they are, or with ``move_others`` as ``torch.optim`` loads
    them: tensors moved to the parameter's device and dtype. Raises ValueError naming the parameter and key at
    fault (TypeError for an entry that is not a dict).
    """
    load = functools.partial(_like_torch_loads, param) if move_others else _as_it_is
    numel = local_tensor(param).numel()
    if not isinstance(entry, dict):
        raise TypeError(f"state of parameter {saved_id!r} must be a dict, got {type(entry).__name__}")
    if "step" not in entry:
        if any(key in entry for name in state_names for key in _saved_keys(name)):
            raise ValueError(f"state of parameter {saved_id!r} has no 'step'")
        return None, {}, {key: load(value) for key, value in entry.items()}
    step = _saved_step(saved_id, entry["step"])
    states = {}
    shape = local_tensor(param).shape
    for name, signed in zip(state_names, signed_states):
        candidates: list[Codec] = [
            Float32Codec(),
            *(cls(block_size, signed) for cls in QUANTIZED_CODECS.values()),
            Rank1Normalized4bitCodec(block_size, signed),
        ]
        codec = next((c for c in candidates if all(key in entry for key in _codec_keys(c, name))), None)
        if codec is None:
            raise ValueError(
                f"state of parameter {saved_id!r} has neither {name!r}, nor {name + '_codes'!r} and "
                f"{name + '_scales'!r}, nor {name + '_packed_codes'!r} and {name + '_scales'!r}, nor "
                f"{name + '_packed_codes'!r}, {name + '_row_max'!r} and {name + '_col_max'!r} (keys: {sorted(entry)})"
            )
        if not isinstance(codec, Float32Codec) and (
            not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1)
        ):
            raise ValueError(
                f"param group of parameter {saved_id!r} has block_size {block_size!r}, expected a power of two >= 16"
            )
        fields = []
        for key, length, dtype in zip(state_keys(codec, name), codec.field_lengths(numel), codec.field_dtypes()):
            value = entry[key]
            if isinstance(value, torch.Tensor):
                value = local_tensor(value)
            if not isinstance(value, torch.Tensor) or value.numel() != length:
                raise ValueError(
                    f"state {key!r} of parameter {saved_id!r} must be a tensor of {length} elements, got "
                    f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
                )
            if dtype.is_floating_point != value.is_floating_point():
                raise ValueError(f"state {key!r} of parameter {saved_id!r} has dtype {value.dtype}, expected {dtype}")
            if not dtype.is_floating_point and value.dtype != dtype and not _fits(value, dtype):
                limits = torch.iinfo(dtype)
                raise ValueError(
                    f"state {key!r} of parameter {saved_id!r} has codes of dtype {value.dtype} outside "
                    f"{limits.min}..{limits.max}, expected {dtype} codes"
                )
            if codec.saved_like_param and not fields and value.dim() > 1 and value.shape != shape:
                raise ValueError(
                    f"state {key!r} of parameter {saved_id!r} has shape {tuple(value.shape)}, but the parameter "
                    f"loading it has shape {tuple(shape)}: expected that shape or a flat tensor of {length} elements"
                )
            fields.append(value.detach().to("cpu", dtype).reshape(-1))
        statistics = None
        if isinstance(codec, Rank1Normalized4bitCodec):
            if len(shape) != 2:
                raise ValueError(
                    f"state of parameter {saved_id!r} is rank-1 normalized, which needs a 2-D parameter, but the "
                    f"parameter loading it has shape {tuple(shape)}"
                )
            statistics_fields = []
            for key, length in zip(statistics_keys(codec, name), shape):
                value = entry[key]
                if not isinstance(value, torch.Tensor) or value.numel() != length or not value.is_floating_point():
                    raise ValueError(
                        f"state {key!r} of parameter {saved_id!r} must be a floating point tensor of {length} "
                        f"elements (the parameter has shape {tuple(shape)}), got "
                        f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
                    )
                statistics_fields.append(value.detach().to("cpu", torch.float32))
            statistics = saved_statistics(shape, *statistics_fields)
        states[name] = SavedState(codec, tuple(fields), numel, statistics)
    used = {"step", *(key for name, state in states.items() for key in _codec_keys(state.codec, name))}
    others = {key: load(value) for key, value in entry.items() if key not in used}
    return step, states, others


def _saved_step(saved_id: Any, value: Any) -> float:
    """The step saved for parameter ``saved_id``: a whole number >= 0, given as a number or a one-element tensor."""
    one_number = isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex()
    step = float(value) if one_number or (isinstance(value, numbers.Real) and not isinstance(value, bool)) else None
    if step is None or not math.isfinite(step) or step < 0 or step != int(step):
        if isinstance(value, torch.Tensor):
            found = f"{step:g}" if step is not None else f"a tensor of shape {tuple(value.shape)}"
        else:
            found = repr(value)
        raise ValueError(
            f"state of parameter {saved_id!r} has step {found}, expected a whole number >= 0 (a number or a "
            "one-element tensor)"
        )
    return step


def _fits(codes: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether integer ``codes`` all lie within the range of integer ``dtype``."""
    if codes.numel() == 0:
        return True
    limits = torch.iinfo(dtype)
    return bool(codes.min() >= limits.min) and bool(codes.max() <= limits.max)


def _codec_keys(codec: Codec, name: str) -> list[str]:
    """Every key of state ``name`` saved by ``codec``: its page fields and statistics."""
    return [*state_keys(codec, name), *statistics_keys(codec, name)]


def _saved_keys(name: str) -> list[str]:
    """Every key that state ``name`` may be saved under, whatever its encoding."""
    codecs = (Float32Codec, *QUANTIZED_CODECS.values(), Rank1Normalized4bitCodec)
    return [key for codec in codecs for key in _codec_keys(codec, name)]


def _as_it_is(value: Any) -> Any:
    return value


def _like_torch_loads(param: torch.Tensor, value: Any) -> Any:
    """``value`` of a parameter's state as ``torch.optim``'s ``load_state_dict`` loads it: tensors (in dicts,
    lists and tuples too) on ``param``'s device in its dtype, anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype=param.dtype, device=param.device)
    if isinstance(value, dict):
        return {key: _like_torch_loads(param, item) for key, item in value.items()}
    if isinstance(value, list):
        return [_like_torch_loads(param, item) for item in value]
    if isinstance(value, tuple):
        return tuple(_like_torch_loads(param, item) for item in value)
    return value


def import_state(
    layout: StateLayout, state_names: Sequence[str], sources: dict[torch.Tensor, dict[str, SavedState]]
) -> None:
    """Write the pages of the tensors of ``sources`` (each with new pages of its own) from their saved states."""
    for tensor, saved in sources.items():
        statistics = layout[tensor].statistics
        if statistics is not None:
            codecs = layout.formats[layout[tensor].kind].codecs
            for index, (name, codec) in enumerate(zip(state_names, codecs)):
                saved[name].statistics_into(statistics, index, codec)
    pages = {id(page): page for tensor in sources for page, _ in layout[tensor].segments}
    for page in sorted(pages.values(), key=lambda page: page.index):
        data = tuple(torch.zeros(numel, dtype=dtype) for numel, dtype in page.specs)
        arrays = page.format.arrays(data)
        for segment in page.segments:
            tensor = layout.tensor_of(segment)
            saved, statistics = sources[tensor], layout[tensor].statistics
            for index, (name, codec, array) in enumerate(zip(state_names, page.format.codecs, arrays)):
                encoded = codec.select(array, segment.offset, segment.length)
                saved[name].write(codec, _with_normalizers(encoded, statistics, index, segment, codec), segment)
        layout.store.write(page, data)


def _with_normalizers(
    encoded: tuple[torch.Tensor, ...], statistics: Rank1Statistics | None, state: int, segment: Segment, codec: Codec
) -> tuple[torch.Tensor | None, ...]:
    """A segment's page views of state ``state``, with the normalizers to encode it by appended for a rank-1
    normalized state (its ``statistics``): the codec encodes with ``encoded[2]``."""
    if statistics is None:
        return encoded
    padded = -(-segment.length // codec.alignment) * codec.alignment
    normalizers = statistics.normalizers(state, segment.start, segment.length, padded)
    return (*encoded, None, normalizers.view(-1, codec.alignment))


def saved_statistics(
    shape: torch.Size | tuple[int, ...], rows: torch.Tensor | None = None, cols: torch.Tensor | None = None
) -> Rank1Statistics | None:
    """The rank-1 statistics of one saved state of a tensor of ``shape``, ``None`` without them."""
    if rows is None:
        return None
    statistics = Rank1Statistics(tuple(shape), 1)
    statistics.rows[0], statistics.cols[0] = rows.reshape(-1), cols.reshape(-1)
    return statistics


def _like_shards_of(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """CPU tensor ``local`` (shaped like this rank's shard of DTensor ``param``) as a DTensor placed like ``param``.

    The local tensor stays on the CPU, as FSDP2's CPU offload keeps its sharded parameters on a device
    mesh: ``DTensor.from_local`` would copy it to the mesh's device. ``torch.distributed.checkpoint`` reads
    and writes such local tensors where they are, and gathers them through the mesh's device one at a time.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(param.shape, param.stride(), local.dtype)
    spec = DTensorSpec(param.device_mesh, tuple(param.placements), tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)


class SavedState:
    """One saved state tensor of a parameter, in the encoding it was saved in."""

    def __init__(
        self,
        codec: Codec,
        fields: tuple[torch.Tensor, ...],
        numel: int,
        statistics: Rank1Statistics | None = None,
    ) -> None:
        self.codec = codec
        self.fields = fields
        self.numel = numel
        self.statistics = statistics
        """The rank-1 statistics of a rank-1 normalized state (one state's, on the CPU)."""
        self._values: torch.Tensor | None = None

    def values(self) -> torch.Tensor:
        """The state as fp32 values (decoded once)."""
        if self._values is None:
            padded = -(-self.numel // self.codec.alignment) * self.codec.alignment
            fields = [
                torch.cat([field, field.new_zeros(length - field.numel())]) if length > field.numel() else field
                for field, length in zip(self.fields, self.codec.field_lengths(padded))
            ]
            encoded = self.codec.select(tuple(fields), 0, padded)
            if self.statistics is not None:
                (encoded,) = self.statistics.attach([encoded], 0, self.numel, self.codec.alignment, gathering=True)
            self._values = self.codec.decode(encoded).reshape(-1)[: self.numel]
        return self._values

    def statistics_into(self, statistics: Rank1Statistics, state: int, codec: Codec) -> None:
        """Set state ``state`` of a tensor's rank-1 ``statistics``, whose pages take codes of ``codec``: the saved
        statistics where the saved codes are of ``codec`` (they are copied as they are), else those of the values."""
        if self.statistics is not None and codec == self.codec:
            statistics.rows[state].copy_(self.statistics.rows[0])
            statistics.cols[state].copy_(self.statistics.cols[0])
        else:
            statistics.set_from(state, self.values())

    def write(self, codec: Codec, encoded: tuple[torch.Tensor, ...], segment: Segment) -> None:
        """Write this state's elements of ``segment`` into its page views, encoded by ``codec``."""
        if codec == self.codec:
            for field, view, offset, length in zip(
                self.fields, encoded, codec.field_offsets(segment.start), codec.field_lengths(segment.length)
            ):
                view.reshape(-1)[:length].copy_(field[offset : offset + length])
        else:
            values = self.values()[segment.start : segment.start + segment.length]
            codec.encode(to_blocks(values, codec.alignment), encoded)
