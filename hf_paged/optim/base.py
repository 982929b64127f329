"""The paged optimizer base: joins an update rule, state codecs and a page store.

Subclasses name their states and their update rule; this class lays parameters' state out in pages,
streams the pages through the device during :meth:`step`, and saves and loads the state in the layout
of ``torch.optim`` (``state`` keyed by parameter index, ``param_groups``) with CPU tensors.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch.optim import Optimizer

from ..budget import AutoBudget
from ..codecs import QUANTIZED_CODECS, Codec, Float32Codec, PageFormat, to_blocks
from ..device import backend_for
from ..kernels import SegmentKernel, UpdateRule, prepare_scalars, resolve_compiled, segment_kernel
from ..sizes import parse_size
from ..store import Page, PageStore, Segment
from ..stores import DeviceBudget, DeviceStores, device_key
from ._params import StridedRange, describe_parameter, flat_elements, normalize_param_group

DEFAULT_PAGE_SIZE = 4 * 2**20
"""Default page size in bytes (see ``benchmarks/optimizer_step.py``)."""

_PAGE_BYTES_PER_CHUNK_ELEMENT = {False: 16, True: 4}
"""A segment is updated in chunks of ``page_size // 16`` elements eagerly and ``page_size // 4`` compiled (whole
blocks), bounding its temporaries; a compiled kernel keeps far fewer, and a larger chunk costs fewer calls."""

_WORKSPACE_BYTES_PER_ELEMENT = {
    (False, "32bit"): 24,
    (False, "8bit"): 32,
    (False, "4bit"): 32,
    (True, "32bit"): 4,
    (True, "8bit"): 8,
    (True, "4bit"): 11,
}
"""Bytes of temporaries per element of a chunk's update, eager or compiled, by page format: the
measured peak (fp32 and bf16 parameters, tests/test_workspace.py) rounded up. A step's workspace is thus two
to three pages, whatever the page and model size."""

WorkItem = tuple[Segment, torch.Tensor, torch.Tensor, float, dict[str, Any]]
"""One segment's update in a step: the segment, its parameter and gradient elements, the step, the group."""

_BETWEEN_STEPS = "hf_paged.optimizer.between_steps"
"""The probe mark an automatic budget sets at the end of each step: the forward/backward phase."""

_LAYOUT_KEYS = ("block_size", "min_8bit_size", "min_4bit_size")
"""Group entries that fix the state layout: saved with the state, never taken from a loaded state dict."""


def check_lr(lr: Any) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        lr = lr.item()
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")


def check_betas(betas: Any) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {beta!r}")


def check_eps(eps: Any) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")


def check_weight_decay(weight_decay: Any) -> None:
    if (
        not isinstance(weight_decay, (int, float))
        or isinstance(weight_decay, bool)
        or not math.isfinite(weight_decay)
        or weight_decay < 0
    ):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")


def _check_int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding this process's elements: a DTensor's local shard, else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class PagedOptimizer(Optimizer):
    """A ``torch.optim.Optimizer`` whose state lives in pages under a device budget.

    Subclasses set :attr:`state_names` (the rule's state tensors, in the rule's argument order),
    :attr:`signed_states` (whether each may be negative, which picks its 8-bit map), :meth:`update_rule`
    and :meth:`rule_scalars`, and validate their hyperparameters in :meth:`check_group`.

    Args:
        params: parameters or param groups, as for any ``torch.optim.Optimizer``.
        defaults: the subclass's hyperparameter defaults.
        page_size: bytes of one page, an integer or a string such as ``"4MiB"``.
        device_budget: the most bytes of optimizer state on each device at any time (at least one page);
            ``None`` for no limit; ``"auto"`` or an :class:`~hf_paged.budget.AutoBudget` to follow measured
            memory: after each step the state is evicted down to what the coming forward/backward leaves
            free, and a step uses what the step leaves free. A dict of device (``"cuda:1"`` or a
            ``torch.device``) to any of these sets each device's own (devices it does not name: no limit);
            ``"auto"`` measures each device apart.
        prefetch: pages copied to the device ahead of the page being updated.
        eight_bit: store tensors of ``min_8bit_size`` or more elements in blockwise 8-bit codes.
        block_size: elements per quantization block (8-bit or 4-bit state), a power of two from 16 to 4096.
        min_8bit_size: tensors with fewer elements keep 32-bit state.
        four_bit: store tensors of ``min_4bit_size`` or more elements in blockwise 4-bit codes instead.
        min_4bit_size: tensors with fewer elements keep 32-bit state (4-bit state).
        compiled: fuse each segment's decode-update-encode with ``torch.compile``; ``None`` chooses by the
            ``HF_PAGED_COMPILE`` environment variable, else compiles states of 2**21 elements or more where a
            compiler is available (see :func:`~hf_paged.kernels.resolve_compiled`).
    """

    state_names: ClassVar[tuple[str, ...]]
    signed_states: ClassVar[tuple[bool, ...]]

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        page_size: int | str = DEFAULT_PAGE_SIZE,
        device_budget: int | str | AutoBudget | dict | None = None,
        prefetch: int = 2,
        eight_bit: bool = False,
        block_size: int = 256,
        min_8bit_size: int = 4096,
        four_bit: bool = False,
        min_4bit_size: int = 4096,
        compiled: bool | None = None,
    ) -> None:
        if isinstance(defaults.get("betas"), list):
            defaults = {**defaults, "betas": tuple(defaults["betas"])}
        self.page_size = parse_size(page_size, "page_size")
        self.prefetch = _check_int("prefetch", prefetch, 0)
        if eight_bit and four_bit:
            raise ValueError("eight_bit and four_bit cannot both be set")
        self.eight_bit = eight_bit
        self.state_bits = 8 if eight_bit else 4 if four_bit else 32
        if self.state_bits != 32:
            _check_int("block_size", block_size, 16)
            if block_size & (block_size - 1) or block_size > 4096:
                raise ValueError(f"block_size must be a power of two from 16 to 4096, got {block_size}")
            min_name, min_size = ("min_8bit_size", min_8bit_size) if eight_bit else ("min_4bit_size", min_4bit_size)
            _check_int(min_name, min_size, 0)
            defaults = {**defaults, "block_size": block_size, min_name: min_size}
        self._formats = self._page_formats(block_size)
        for page_format in self._formats.values():
            if page_format.capacity_for(self.page_size) == 0:
                one_block = page_format.nbytes(page_format.alignment)
                raise ValueError(
                    f"page_size={self.page_size} bytes is smaller than one block of state ({one_block} bytes)"
                )
        if self.state_bits != 32 and self.page_size % block_size:
            raise ValueError(f"page_size={self.page_size} must be a multiple of block_size={block_size}")
        if compiled is not None and not isinstance(compiled, bool):
            raise TypeError(f"compiled must be True, False or None, got {compiled!r}")
        self._compiled_setting = compiled
        self._store = DeviceStores(self._new_store)
        self._params: list[torch.Tensor] = []
        self._param_segments: list[list[tuple[Page, Segment]]] = []
        self._param_codecs: list[str] = []
        self._budget = DeviceBudget.parse(device_budget, "device_budget", self.page_size)
        self._auto_budgets: dict[str, AutoBudget] = {}
        self.check_group(defaults)
        super().__init__(params, defaults)

    # Layout -------------------------------------------------------------------------------------------

    def _page_formats(self, block_size: int) -> dict[str, PageFormat]:
        formats = {"32bit": PageFormat(tuple(Float32Codec() for _ in self.state_names))}
        if self.state_bits != 32:
            codec = QUANTIZED_CODECS[self.state_bits]
            codecs = tuple(codec(block_size, signed) for signed in self.signed_states)
            formats[f"{self.state_bits}bit"] = PageFormat(codecs)
        return formats

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (tensors or ``(name, tensor)`` pairs) and lay out pages for its parameters' state."""
        param_group = normalize_param_group(param_group, self.param_groups, type(self).__name__)
        params = param_group["params"]
        for position, param in enumerate(params):
            if param.device.type == "meta":
                where = describe_parameter(len(self.param_groups), position, param_group.get("param_names"))
                raise ValueError(
                    f"{where} is on the meta device: {type(self).__name__} needs parameters with data; materialize "
                    "the model first (to_empty() and load its weights)"
                )
        try:
            self.check_group({**self.defaults, **param_group})
        except ValueError as error:
            raise ValueError(f"param group {len(self.param_groups)}: {error}") from None
        new_devices = {self._state_device(param) for param in params}.difference(self._store.stores)
        self._budget.resolve([*self._store.stores, *sorted(new_devices)])  # raises before anything changes
        super().add_param_group(param_group)
        self._layout(self.param_groups[-1]["params"], self.param_groups[-1])

    def _state_device(self, param: torch.Tensor) -> str:
        """The device that holds the state of ``param``: its own (tests give parameters pseudo devices)."""
        return device_key(local_tensor(param).device)

    def _new_store(self, device: str) -> PageStore:
        """The page store of ``device``, under its budget."""
        budget = self._budget.resolve([device])[device]
        store = PageStore(
            backend_for(torch.device(device)), None if isinstance(budget, AutoBudget) else budget, self.prefetch
        )
        if isinstance(budget, AutoBudget):
            self._auto_budgets[device] = budget
            self._bind_auto_budget(device)
        return store

    def _layout(self, params: Sequence[torch.Tensor], group: dict[str, Any]) -> None:
        """Pack the state of ``params`` into new pages, one open page per device and format, the last trimmed."""
        open_pages: dict[tuple[str, str], Page] = {}
        used: dict[int, int] = {}
        for param in params:
            numel = local_tensor(param).numel()
            # From the whole parameter's size (a DTensor's numel), so that every rank picks the same codec.
            bits = self.state_bits
            kind = f"{bits}bit" if bits != 32 and param.numel() >= group[f"min_{bits}bit_size"] else "32bit"
            page_format = self._formats[kind]
            device = self._state_device(param)
            segments = []
            start = 0
            while start < numel:
                page = open_pages.get((device, kind))
                if page is None or used[page.index] == page.capacity:
                    capacity = page_format.capacity_for(self.page_size)
                    page = self._store.add_page(page_format, capacity, device)
                    open_pages[device, kind] = page
                    used[page.index] = 0
                length = min(numel - start, page.capacity - used[page.index])
                segment = Segment(len(self._params), start, length, used[page.index])
                page.segments.append(segment)
                segments.append((page, segment))
                used[page.index] += -(-length // page_format.alignment) * page_format.alignment
                start += length
            self._params.append(param)
            self._param_segments.append(segments)
            self._param_codecs.append(kind)
        for page in open_pages.values():
            page.capacity = used[page.index]

    # Subclass interface -------------------------------------------------------------------------------

    def check_group(self, group: dict[str, Any]) -> None:
        """Raise ValueError for a bad hyperparameter of ``group``."""
        raise NotImplementedError

    @staticmethod
    def update_rule() -> UpdateRule:
        """The update rule: ``rule(param, grad, *states, **scalars)`` on fp32 tensors."""
        raise NotImplementedError

    def rule_scalars(self, group: dict[str, Any], step: float) -> dict[str, float]:
        """The rule's scalar arguments for a parameter of ``group`` at ``step`` (1 for the first update)."""
        raise NotImplementedError

    def update_pages_fast(
        self, batch: list[tuple[Page, list[WorkItem]]], step_tensors: dict[tuple[torch.device, float], torch.Tensor]
    ) -> list[tuple[Page, list[WorkItem]]]:
        """Update whole pages of a batch with a multi-tensor kernel where the subclass has one; return the
        pages left to the segment kernel.

        ``step_tensors`` holds each step count of this step as a 0-d fp32 tensor on each parameter device,
        made before the page loop, for kernels that read the step on the device.
        """
        return batch

    # Step ---------------------------------------------------------------------------------------------

    @property
    def compiled(self) -> bool:
        """Whether segment updates run through ``torch.compile`` (see :func:`~hf_paged.kernels.resolve_compiled`)."""
        device = self._params[0].device if self._params else torch.device("cpu")
        state_elements = sum(page.capacity for page in self._store.pages)
        return resolve_compiled(self._compiled_setting, device, state_elements)

    def _gradients(self) -> list[tuple[int, torch.Tensor, dict[str, Any]]]:
        """The parameters with gradients, with their flat local gradients; validates before any update."""
        work = []
        index = 0
        for group_index, group in enumerate(self.param_groups):
            for position, param in enumerate(group["params"]):
                if param.grad is not None:
                    grad = param.grad
                    if grad.is_sparse:
                        raise RuntimeError(
                            f"{describe_parameter(group_index, position, group.get('param_names'))} has a sparse "
                            f"gradient; {type(self).__name__} does not support sparse gradients"
                        )
                    if grad.shape != param.shape or grad.device != param.device:
                        raise RuntimeError(
                            f"{describe_parameter(group_index, position, group.get('param_names'))} has a gradient "
                            f"of shape {tuple(grad.shape)} on {grad.device}, expected shape {tuple(param.shape)} "
                            f"on {param.device}"
                        )
                    work.append((index, flat_elements(local_tensor(grad)), group))
                index += 1
        return work

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step over the pages of the parameters that have gradients."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._gradients()
        if not work:
            return loss
        compiled = self.compiled
        by_page: dict[int, list[WorkItem]] = defaultdict(list)
        step_devices: set[tuple[torch.device, float]] = set()
        states = [self.state[self._params[index]] for index, _, _ in work]
        for state in states:
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
        step_counts = [state["step"] for state in states]
        torch._foreach_add_(step_counts, 1.0)
        for (index, grad, group), step_count in zip(work, step_counts):
            param = self._params[index]
            step = step_count.item()
            local = local_tensor(param)
            flat_param = flat_elements(local.detach())
            for page, segment in self._param_segments[index]:
                end = segment.start + segment.length
                by_page[page.index].append(
                    (segment, flat_param[segment.start : end], grad[segment.start : end], step, group)
                )
            step_devices.add((local.device, step))
        pages = [self._store.pages[i] for i in sorted(by_page)]
        if self._auto_budgets:
            self._begin_auto_step()
        # Made once per step: a tensor built from a number on a device per page would wait for a host copy.
        step_tensors = {key: torch.full((), key[1], dtype=torch.float32, device=key[0]) for key in step_devices}
        scalars_cache: dict[tuple[int, float], dict[str, float | torch.Tensor]] = {}
        for batch in self._store.stream(pages):
            gathered = [(page, *_gathered(by_page[page.index])) for page in batch]
            for page, items in self.update_pages_fast([(page, items) for page, items, _ in gathered], step_tensors):
                kernel = segment_kernel(self.update_rule(), page.format.codecs, compiled)
                arrays = page.format.arrays(page.device)
                for segment, param_slice, grad_slice, step, group in items:
                    key = (id(group), step)
                    if key not in scalars_cache:
                        scalars_cache[key] = prepare_scalars(self.rule_scalars(group, step), compiled)
                    self._update_segment(kernel, page, arrays, segment, param_slice, grad_slice, scalars_cache[key])
            for _, _, strided_params in gathered:
                for strided, values in strided_params:
                    strided.scatter(values)
        if self._auto_budgets:
            self.prepare_forward()
            for auto in self._auto_budgets.values():
                auto.probe.mark(_BETWEEN_STEPS)
        return loss

    # Saving and loading -------------------------------------------------------------------------------

    def _state_keys(self, codec: Codec, name: str) -> list[str]:
        return [name if not field else f"{name}_{field}" for field in codec.fields]

    def state_dict(self) -> dict[str, Any]:
        """The state in ``torch.optim``'s layout, all tensors on the CPU.

        Each parameter's entry holds ``step`` (a tensor) and, per state, its fp32 values (``exp_avg``) or,
        for 8-bit state, its codes shaped like the parameter and one fp32 scale per block
        (``exp_avg_codes``, ``exp_avg_scales``), for 4-bit state its codes packed two per byte (flat, one
        byte per two elements of whole blocks) and one fp32 scale per block (``exp_avg_packed_codes``,
        ``exp_avg_scales``). For a sharded (DTensor) parameter every state is exported as fp32 values in a
        DTensor placed like the parameter, so ``torch.distributed.checkpoint`` saves each rank's shard and
        reshards it (see :meth:`_sharded_entry`).
        Keys of :attr:`state` that are not parameters pass through as they are. The state dict pre and post
        hooks run as in ``torch.optim``.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self._state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` without its hooks."""
        packed, param_indices = _packed(self.param_groups, self.state)
        exported = self._export_state(sorted(param_indices))
        for index, entry in exported.items():
            if local_tensor(self._params[index]) is not self._params[index]:
                exported[index] = self._sharded_entry(index, entry)
        packed["state"] = {
            index: {"step": entry["step"].detach().to("cpu", torch.float32, copy=True), **exported[index]}
            if index in exported
            else entry
            for index, entry in packed["state"].items()
        }
        return packed

    def _export_state(self, indices: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        """Gather the state of parameters ``indices`` from their pages, one page in memory at a time."""
        exported: dict[int, dict[str, torch.Tensor]] = {}
        for index in indices:
            numel = local_tensor(self._params[index]).numel()
            entry = {}
            for name, codec in zip(self.state_names, self._formats[self._param_codecs[index]].codecs):
                for key, length, dtype in zip(
                    self._state_keys(codec, name), codec.field_lengths(numel), codec.field_dtypes()
                ):
                    entry[key] = torch.zeros(length, dtype=dtype)
            exported[index] = entry
        page_indices = sorted({page.index for i in indices for page, _ in self._param_segments[i]})
        for page in (self._store.pages[i] for i in page_indices):
            data = self._store.read(page)
            if data is None:
                continue
            arrays = page.format.arrays(data)
            for segment in page.segments:
                entry = exported.get(segment.param_index)
                if entry is None:
                    continue
                for name, codec, array in zip(self.state_names, page.format.codecs, arrays):
                    encoded = codec.select(array, segment.offset, segment.length)
                    for key, view, offset, length in zip(
                        self._state_keys(codec, name),
                        encoded,
                        codec.field_offsets(segment.start),
                        codec.field_lengths(segment.length),
                    ):
                        entry[key][offset : offset + length] = view.reshape(-1)[:length]
        for index, entry in exported.items():
            shape = local_tensor(self._params[index]).shape
            codecs = self._formats[self._param_codecs[index]].codecs
            for name, codec in zip(self.state_names, codecs):
                if codec.saved_like_param:
                    key = self._state_keys(codec, name)[0]
                    entry[key] = entry[key].view(shape)
        return exported

    def _sharded_entry(self, index: int, entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The exported state of sharded parameter ``index`` as fp32 DTensors placed like the parameter.

        Encoded (8-bit) state is decoded: its blocks and scales belong to this rank's shard, which a
        checkpoint saved on other shard boundaries could not split. Loading encodes the values again, into
        the same codes and scales when the layout is unchanged (the largest value of a block decodes to
        its scale exactly, and every other value to within rounding of its code).
        """
        param = self._params[index]
        shard = local_tensor(param)
        sharded = {}
        for name, codec in zip(self.state_names, self._formats[self._param_codecs[index]].codecs):
            fields = tuple(entry[key].reshape(-1) for key in self._state_keys(codec, name))
            values = _SavedState(codec, fields, shard.numel()).values()
            sharded[name] = _like_shards_of(param, values.view(shard.shape))
        return sharded

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of ``torch.optim`` (fp32 moments are quantized for 8-bit state).

        Everything is checked before anything changes: a bad state dict leaves the optimizer as it was.
        Keys of ``state`` that are not parameter indices are kept as they are; ``param_names`` are taken
        from the saved groups where they have them. The load state dict pre hooks (which may replace the
        state dict) and post hooks run as in ``torch.optim``.
        """
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`load_state_dict` without its hooks."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must be a dict with 'state' and 'param_groups'")
        if not isinstance(state_dict["param_groups"], (list, tuple)) or not isinstance(state_dict["state"], dict):
            raise TypeError("state_dict['param_groups'] must be a list and state_dict['state'] a dict")
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups, this optimizer has {len(self.param_groups)}"
            )
        saved_to_index: dict[Any, tuple[int, dict[str, Any]]] = {}
        index = 0
        new_groups = []
        for position, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if not isinstance(saved, dict) or "params" not in saved:
                raise ValueError(f"param group {position} of state_dict is not a dict with 'params'")
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param group {position} of state_dict has {len(saved['params'])} parameters, "
                    f"this optimizer's has {len(group['params'])}"
                )
            for saved_id in saved["params"]:
                saved_to_index[saved_id] = (index, saved)
                index += 1
            merged = {**group, **{key: value for key, value in saved.items() if key not in ("params", *_LAYOUT_KEYS)}}
            try:
                self.check_group(merged)
            except ValueError as error:
                raise ValueError(f"param group {position} of state_dict: {error}") from None
            new_groups.append(merged)
        sources = {}
        other_state = {}
        for saved_id, entry in state_dict["state"].items():
            if saved_id not in saved_to_index and not isinstance(saved_id, int):
                other_state[saved_id] = entry
                continue
            if saved_id not in saved_to_index:
                raise ValueError(f"state_dict has state for parameter {saved_id!r}, which no param group lists")
            index, saved_group = saved_to_index[saved_id]
            sources[index] = self._parse_saved_entry(index, saved_id, entry, saved_group)
        self.param_groups = new_groups
        self.state = defaultdict(dict)
        for index, (step, _) in sources.items():
            self.state[self._params[index]] = {"step": torch.tensor(step, dtype=torch.float32)}
        self.state.update(other_state)
        self._import_state({index: states for index, (_, states) in sources.items()})

    def _parse_saved_entry(
        self, index: int, saved_id: Any, entry: dict[str, Any], saved_group: dict[str, Any]
    ) -> tuple[float, dict[str, _SavedState]]:
        numel = local_tensor(self._params[index]).numel()
        if not isinstance(entry, dict) or "step" not in entry:
            raise ValueError(f"state of parameter {saved_id!r} has no 'step'")
        step = float(entry["step"])
        if not math.isfinite(step) or step < 0 or step != int(step):
            raise ValueError(f"state of parameter {saved_id!r} has step {step}, expected a whole number >= 0")
        block_size = saved_group.get("block_size", self.defaults.get("block_size", 256))
        states = {}
        for name, signed in zip(self.state_names, self.signed_states):
            candidates: list[Codec] = [Float32Codec(), *(cls(block_size, signed) for cls in QUANTIZED_CODECS.values())]
            codec = next((c for c in candidates if all(key in entry for key in self._state_keys(c, name))), None)
            if codec is None:
                raise ValueError(
                    f"state of parameter {saved_id!r} has neither {name!r}, nor {name + '_codes'!r} and "
                    f"{name + '_scales'!r}, nor {name + '_packed_codes'!r} and {name + '_scales'!r} "
                    f"(keys: {sorted(entry)})"
                )
            if not isinstance(codec, Float32Codec) and (
                not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1)
            ):
                raise ValueError(
                    f"param group of parameter {saved_id!r} has block_size {block_size!r}, expected a power of two >= 16"
                )
            fields = []
            for key, length, dtype in zip(
                self._state_keys(codec, name), codec.field_lengths(numel), codec.field_dtypes()
            ):
                value = entry[key]
                if isinstance(value, torch.Tensor):
                    value = local_tensor(value)
                if not isinstance(value, torch.Tensor) or value.numel() != length:
                    raise ValueError(
                        f"state {key!r} of parameter {saved_id!r} must be a tensor of {length} elements, got "
                        f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
                    )
                if dtype.is_floating_point != value.is_floating_point():
                    raise ValueError(
                        f"state {key!r} of parameter {saved_id!r} has dtype {value.dtype}, expected {dtype}"
                    )
                fields.append(value.detach().to("cpu", dtype).reshape(-1))
            states[name] = _SavedState(codec, tuple(fields), numel)
        return step, states

    def _import_state(self, sources: dict[int, dict[str, _SavedState]]) -> None:
        """Rewrite every page from ``sources`` (parameters without an entry get zero state)."""
        for page in self._store.pages:
            segments = [segment for segment in page.segments if segment.param_index in sources]
            if not segments:
                self._store.write(page, None)
                continue
            data = tuple(torch.zeros(numel, dtype=dtype) for numel, dtype in page.specs)
            arrays = page.format.arrays(data)
            for segment in segments:
                for name, codec, array in zip(self.state_names, page.format.codecs, arrays):
                    encoded = codec.select(array, segment.offset, segment.length)
                    sources[segment.param_index][name].write(codec, encoded, segment)
            self._store.write(page, data)

    def _update_segment(
        self,
        kernel: SegmentKernel,
        page: Page,
        arrays: list[tuple[torch.Tensor, ...]],
        segment: Segment,
        param: torch.Tensor,
        grad: torch.Tensor,
        scalars: dict[str, float | torch.Tensor],
    ) -> None:
        """Run ``kernel`` on a segment: its whole blocks in place, chunk by chunk; a partial last block through
        padded copies."""
        codecs = page.format.codecs
        alignment = page.format.alignment
        chunk = self._chunk_elements(page.format, kernel.compiled)
        body = segment.length - segment.length % alignment
        for start in range(0, body, chunk):
            end = min(start + chunk, body)
            encoded = [codec.select(array, segment.offset + start, end - start) for codec, array in zip(codecs, arrays)]
            param_chunk, grad_chunk = to_blocks(param[start:end], alignment), to_blocks(grad[start:end], alignment)
            kernel(param_chunk, grad_chunk, encoded, scalars)
        if body < segment.length:
            tail = segment.length - body
            encoded = [codec.select(array, segment.offset + body, tail) for codec, array in zip(codecs, arrays)]
            padded = to_blocks(param[body:], alignment)
            kernel(padded, to_blocks(grad[body:], alignment), encoded, scalars)
            param[body:].copy_(padded.view(-1)[:tail])

    def _chunk_elements(self, page_format: PageFormat, compiled: bool) -> int:
        """Elements of a segment updated by one kernel call: ``page_size // 16`` eagerly, ``page_size // 4``
        compiled, in whole blocks."""
        alignment = page_format.alignment
        divisor = _PAGE_BYTES_PER_CHUNK_ELEMENT[compiled]
        return max(alignment, self.page_size // divisor // alignment * alignment)

    @property
    def step_workspace(self) -> int:
        """Bytes of temporaries a step may hold on the device besides the state (a chunk's decoded state)."""
        workspaces = []
        compiled = self.compiled
        for kind, page_format in self._formats.items():
            per_element = _WORKSPACE_BYTES_PER_ELEMENT[compiled, kind]
            padded_tail = 3 * page_format.alignment * 4  # a partial last block's padded parameter, gradient, zeros
            workspaces.append(per_element * self._chunk_elements(page_format, compiled) + padded_tail)
        return max(workspaces)

    # Copying and pickling -------------------------------------------------------------------------------

    _REBUILT_ATTRIBUTES: ClassVar[tuple[str, ...]] = (
        "_store",
        "_auto_budgets",
        "_params",
        "_param_segments",
        "_param_codecs",
    )
    """Attributes that hold the page store and the layout: rebuilt from the param groups, never copied."""

    def __getstate__(self) -> dict[str, Any]:
        """The settings, the param groups and the state as :meth:`state_dict` holds it (CPU tensors).

        The page store, its device buffers and the backend's streams are not copied: :meth:`__setstate__`
        lays the state out again in new pages. As with ``torch.optim``, hooks are not copied, nor are
        instance attributes that stand in for methods (the ``step`` an LR scheduler wraps).
        """
        hooks = [name for name in vars(self) if name.startswith("_optimizer_") and name.endswith("_hooks")]
        patched = [name for name in vars(self) if callable(getattr(type(self), name, None))]
        left_out = {*self._REBUILT_ATTRIBUTES, *hooks, *patched, "param_groups", "state"}
        saved = {key: value for key, value in vars(self).items() if key not in left_out}
        saved["param_groups"] = [dict(group) for group in self.param_groups]
        saved["_saved_state"] = self._state_dict()
        return saved

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild a copy or an unpickled optimizer from :meth:`__getstate__`: new pages, the same state."""
        if "_saved_state" not in state:
            super().__setstate__(state)
            return
        state = dict(state)
        saved_state = state.pop("_saved_state")
        param_groups = state.pop("param_groups")
        had_differentiable = "differentiable" in state["defaults"]
        super().__setstate__({**state, "state": defaultdict(dict), "param_groups": []})
        if not had_differentiable:
            self.defaults.pop("differentiable", None)
        self._store, self._auto_budgets = DeviceStores(self._new_store), {}
        self._params, self._param_segments, self._param_codecs = [], [], []
        for group in param_groups:
            self.add_param_group(group)
        self._load_state_dict(saved_state)

    # Budget ---------------------------------------------------------------------------------------------

    @property
    def device_budget(self) -> int | None:
        """The budget in bytes of optimizer state on the devices now (their sum), ``None`` for no limit."""
        return self._store.device_budget

    @property
    def device_budgets(self) -> dict[str, int | None]:
        """The budget in bytes of each device now, ``None`` for no limit."""
        return {device: store.device_budget for device, store in self._store.stores.items()}

    @property
    def auto_budget(self) -> AutoBudget | None:
        """The automatic budget, if the budget is ``"auto"`` (of the first device, see :attr:`auto_budgets`)."""
        return next(iter(self._auto_budgets.values()), None)

    @property
    def auto_budgets(self) -> dict[str, AutoBudget]:
        """The automatic budget of each device that has one."""
        return dict(self._auto_budgets)

    def set_device_budget(self, budget: int | str | AutoBudget | dict | None) -> None:
        """Set the device budget (bytes, a string such as ``"512MiB"``, ``"auto"``; ``None``: no limit) of
        every device, or a dict of device to budget (devices it does not name: no limit).

        A fixed budget takes effect at once, evicting down to it; an automatic one at the next step.
        """
        parsed = DeviceBudget.parse(budget, "budget", self.page_size)
        resolved = parsed.resolve(list(self._store.stores))
        self._budget, self._auto_budgets = parsed, {}
        for device, device_budget in resolved.items():
            if isinstance(device_budget, AutoBudget):
                self._auto_budgets[device] = device_budget
                self._bind_auto_budget(device)
            else:
                self._store.stores[device].set_budget(device_budget)

    def prepare_forward(self) -> int:
        """Evict down to the automatic budgets for the coming forward/backward; return the device bytes freed.

        The optimizer does this at the end of each step; call it again (as ``MemorySpikeCallback`` does
        at each step's start) when memory may have changed since. Does nothing with a fixed budget.
        """
        freed = 0
        for device, auto in self._auto_budgets.items():
            budget = auto.resting_budget()
            if budget is not None:
                store = self._store.stores[device]
                before = store.device_bytes
                store.set_budget(budget)
                freed += before - store.device_bytes
        return freed

    def _bind_auto_budget(self, device: str) -> None:
        """Measure ``device``; its first forward/backward is measured from now."""
        auto = self._auto_budgets[device]
        auto.bind(torch.device(device))
        auto.probe.mark(_BETWEEN_STEPS)

    def _begin_auto_step(self) -> None:
        """Record each device's forward/backward peak just ended and give the step what it leaves free."""
        for device, auto in self._auto_budgets.items():
            store = self._store.stores[device]
            peak = auto.probe.exact_peak(_BETWEEN_STEPS)
            auto.observe(None if peak is None else peak - store.device_bytes)
            store.set_budget(auto.step_budget(store.device_bytes, self.step_workspace, minimum=store.max_page_bytes))

    def evict(self, nbytes: int | str | None = None) -> int:
        """Write state back to host memory until at least ``nbytes`` of the devices are freed (``None``: all).

        Returns the device bytes freed. The next :meth:`step` brings the pages back.
        """
        return self._store.evict(None if nbytes is None else parse_size(nbytes, "nbytes"))

    def paging_stats(self) -> dict[str, Any]:
        """Page counts, bytes (on the devices, in host memory, moved each way) and copy stall seconds.

        The figures are totals over the devices; ``"devices"`` has the same figures for each device.
        """
        stats = _store_stats(self._store)
        stats["device_budget"] = self.device_budget
        stats["page_size"] = self.page_size
        stats["devices"] = {device: _store_stats(store) for device, store in self._store.stores.items()}
        return stats


def _store_stats(store: PageStore | DeviceStores) -> dict[str, int | float | None]:
    """The paging figures of one store, or the totals of a store per device."""
    stats = store.stats
    return {
        "pages_total": len(store.pages),
        "pages_resident": store.pages_resident(),
        "device_bytes": store.device_bytes,
        "host_bytes": store.host_bytes,
        "bytes_to_device": stats.bytes_to_device,
        "bytes_to_host": stats.bytes_to_host,
        "page_ins": stats.page_ins,
        "page_outs": stats.page_outs,
        "stall_seconds": stats.stall_seconds,
        "device_budget": store.device_budget,
    }


def _packed(param_groups: list[dict[str, Any]], state: dict[Any, Any]) -> tuple[dict[str, Any], list[int]]:
    """``param_groups`` with parameters replaced by their indices, and ``state`` keyed by those indices (other
    keys as they are), as ``torch.optim`` packs them; and the indices of the parameters that have state."""
    index_of: dict[int, int] = {}
    groups = []
    for group in param_groups:
        packed_group = {key: value for key, value in group.items() if key != "params"}
        packed_group["params"] = [index_of.setdefault(id(param), len(index_of)) for param in group["params"]]
        groups.append(packed_group)
    packed_state = {}
    param_indices = []
    for key, entry in state.items():
        if isinstance(key, torch.Tensor):
            key = index_of[id(key)]
            param_indices.append(key)
        packed_state[key] = entry
    return {"state": packed_state, "param_groups": groups}, param_indices


def _gathered(items: list[tuple]) -> tuple[list[tuple], list[tuple[StridedRange, torch.Tensor]]]:
    """A page's work items with the ranges of non-contiguous parameters and gradients copied to contiguous
    tensors, and the parameters' copies to write back after the update."""
    gathered, write_back = [], []
    for segment, param_slice, grad_slice, *rest in items:
        if isinstance(param_slice, StridedRange):
            strided, param_slice = param_slice, param_slice.gather()
            write_back.append((strided, param_slice))
        if isinstance(grad_slice, StridedRange):
            grad_slice = grad_slice.gather()
        gathered.append((segment, param_slice, grad_slice, *rest))
    return gathered, write_back


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


class _SavedState:
    """One saved state tensor of a parameter, in the encoding it was saved in."""

    def __init__(self, codec: Codec, fields: tuple[torch.Tensor, ...], numel: int) -> None:
        self.codec = codec
        self.fields = fields
        self.numel = numel
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
            self._values = self.codec.decode(encoded).reshape(-1)[: self.numel]
        return self._values

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
