"""The paged optimizer base: joins an update rule, state codecs and a page store.

Subclasses name their states and their update rule; this class lays parameters' state out in pages,
streams the pages through the device during :meth:`step`, and saves and loads the state in the layout
of ``torch.optim`` (``state`` keyed by parameter index, ``param_groups``) with CPU tensors.
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch.optim import Optimizer

from ..budget import AutoBudget
from ..codecs import QUANTIZED_CODECS, Float32Codec, PageFormat, Rank1Normalized4bitCodec, rank1_eligible
from ..device import backend_for
from ..kernels import UpdateRule, resolve_compiled, runs_compiled, segment_kernel
from ..recovery import Recovery
from ..sizes import parse_size
from ..stochastic_rounding import ROUNDING_BYTES_PER_ELEMENT, ROUNDING_SLICE_ELEMENTS
from ..store import Page, PageStore
from ..stores import DeviceBudget, DeviceStores
from ._params import (
    PARAMETER_DTYPES,
    check_parameter_dtype,
    check_update_rule_options,
    describe_parameter,
    normalize_param_group,
)
from .executor import StateViews, WorkItem, run_step
from .layout import StateLayout, local_tensor, state_device
from .plan import StepParts, StepPlan
from .state_dict import (
    export_state,
    import_state,
    pack_param_groups,
    parse_saved_entry,
    read_state_values,
    sharded_entry,
    write_state_values,
)
from .state_format import (
    FP32,
    STATE_FORMAT,
    check_modules,
    check_state_format,
    ordered_param_groups,
    rows_shorter_than_block,
)

DEFAULT_PAGE_SIZE = 4 * 2**20
"""Default page size in bytes (see ``benchmarks/optimizer_step.py``)."""

_PAGE_BYTES_PER_CHUNK_ELEMENT = {False: 16, True: 8}
"""A segment is updated in chunks of ``page_size // 16`` elements eagerly and ``page_size // 8`` compiled (whole
blocks), bounding its temporaries; a compiled kernel keeps fewer, and a larger chunk costs fewer calls."""

_WORKSPACE_BYTES_PER_ELEMENT = {
    (False, "32bit"): 31,
    (False, "8bit"): 33,
    (False, "4bit"): 36,
    (True, "32bit"): 11,
    (True, "8bit"): 11,
    (True, "4bit"): 16,
    (False, "4bit-rank1"): 52,
    (True, "4bit-rank1"): 32,
}
"""Bytes of temporaries per element of a chunk's update, eager or compiled, by page format: the
measured peak (fp32 and bf16 parameters, tests/test_workspace.py and tests/test_rank1.py) rounded up. They include the
copy of what a chunk's update writes (its parameter elements and encoded state), taken so that a failed update can be
undone, and for rank-1 state each chunk's normalizers. A step's workspace is thus two to three pages (rank-1 state
updated eagerly: three to four), whatever the page and model size."""

NORMALIZATIONS = ("block", "rank1")
"""What 4-bit codes may be normalized by (``normalization``), the default first."""

SHORT_ROWS_FORMATS = ("8bit", "4bit")
"""The state formats a 4-bit optimizer may keep tensors whose rows are shorter than a block in (``short_rows``), the
default first."""

_BETWEEN_STEPS = "hf_paged.optimizer.between_steps"
"""The probe mark automatic budgets set at the end of each step: the forward/backward phase. Every optimizer on a
device shares it, so the first to step after a forward/backward measures it; their predictions are pooled."""

_LAYOUT_KEYS = ("block_size", "min_8bit_size", "min_4bit_size", "normalization", "short_rows", STATE_FORMAT)
"""Group entries that fix the state layout: saved with the state, never taken from a loaded state dict."""


def real_number(value: Any) -> float | None:
    """``value`` as a float where ``torch.optim.AdamW`` takes it as a number: a Python or NumPy real (not a bool), or
    a one-element tensor of a real dtype (a learning-rate scheduler may write either); else ``None``."""
    if isinstance(value, torch.Tensor):
        real = value.numel() == 1 and not value.dtype.is_complex and value.dtype != torch.bool
        return float(value) if real else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def check_lr(lr: Any) -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    value = real_number(lr)
    if value is None or not math.isfinite(value) or value < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")


def betas_sequence(betas: Any) -> Any:
    """``betas`` as a list where ``torch.optim.AdamW`` takes it as a sequence of numbers: a 1-D tensor or array, whose
    elements it reads as 0-d tensors or scalars; else ``betas`` as it is."""
    if not isinstance(betas, (tuple, list)) and getattr(betas, "ndim", None) == 1:
        return list(betas)
    return betas


def check_betas(betas: Any) -> None:
    """What ``torch.optim.AdamW`` accepts: two numbers in [0, 1), as a tuple or list or a 1-D tensor or array."""
    betas = betas_sequence(betas)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        value = real_number(beta)
        if value is None or not 0.0 <= value < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {beta!r}")


def check_eps(eps: Any) -> None:
    """What ``torch.optim.AdamW`` accepts: a number >= 0 (0 and infinity included)."""
    value = real_number(eps)
    if value is None or not value >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")


def check_weight_decay(weight_decay: Any) -> None:
    value = real_number(weight_decay)
    if value is None or not math.isfinite(value) or value < 0:
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")


_UNCHECKED_ENTRIES = ("params", "param_names")
"""Param group entries that are not options: a step does not compare them with those last checked."""

_ABSENT = object()
"""An option a param group does not have."""


def _options_of(group: dict[str, Any]) -> dict[str, Any]:
    """The options of ``group`` as :func:`_options_hold` compares them later: a list copied (it may change in
    place), any other value as it is."""
    return {
        key: list(value) if isinstance(value, list) else value
        for key, value in group.items()
        if key not in _UNCHECKED_ENTRIES
    }


def _options_hold(options: dict[str, Any], group: dict[str, Any]) -> bool:
    """Whether ``group`` has the ``options`` checked before (see :func:`_options_of`), no more and no others."""
    compared = 0
    for key, value in group.items():
        if key in _UNCHECKED_ENTRIES:
            continue
        old = options.get(key, _ABSENT)
        if old is not value and not _same_value(old, value):
            return False
        compared += 1
    return compared == len(options)


def _same_value(old: Any, new: Any) -> bool:
    """Whether an option's value ``new`` is the ``old`` one checked: the same object, an equal bool, number or
    string, or a list or tuple of such. A tensor is the same only as the same object: comparing values would read a
    device tensor, and so wait for the device."""
    if old is new:
        return True
    if type(old) is not type(new):
        return False
    if isinstance(old, (tuple, list)):
        return len(old) == len(new) and all(map(_same_value, old, new))
    return isinstance(old, (int, float, str)) and old == new


def _check_int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _with_four_bit_choice(
    defaults: dict[str, Any], name: str, value: str, allowed: tuple[str, ...], state_bits: int
) -> dict[str, Any]:
    """``defaults`` with the 4-bit state setting ``name`` (``normalization``, ``short_rows``) added where ``value`` is
    not its default, ``allowed[0]``; ValueError for a value not in ``allowed``, or another than the default without
    4-bit state."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    if value == allowed[0]:
        return defaults
    if state_bits != 4:
        raise ValueError(f"{name}={value!r} is for 4-bit state only (four_bit=True)")
    return {**defaults, name: value}


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
        four_bit: store tensors of ``min_4bit_size`` or more elements in blockwise 4-bit codes instead, but those
            whose rows are shorter than a block (LoRA's ``B``) in ``short_rows`` codes where a group names no format.
        min_4bit_size: tensors with fewer elements keep 32-bit state (4-bit state).
        normalization: what 4-bit codes are normalized by: ``"block"``, one fp32 scale per block; ``"rank1"``, for
            2-D tensors whose statistics cost no more than block scales (see
            :func:`~hf_paged.codecs.rank1_eligible`), each element by the smaller of its row's and its column's
            largest magnitude (:class:`~hf_paged.codecs.Rank1Normalized4bitCodec`), other tensors by blocks. A step
            then reads the pages of rank-1 tensors twice: once to gather the new state's statistics, once to update.
        short_rows: the 4-bit state format of tensors whose rows are shorter than a block
            (:func:`~hf_paged.optim.state_format.rows_shorter_than_block`): ``"8bit"``, blockwise 8-bit codes with
            blocks of ``block_size`` where a page holds such a block (else 4-bit), or ``"4bit"``.
        compiled: fuse each segment's decode-update-encode with ``torch.compile``; ``None`` chooses by the
            ``HF_PAGED_COMPILE`` environment variable, else compiles parameters of 2**21 elements or more where a
            compiler is available (see :func:`~hf_paged.kernels.resolve_compiled`).
        fp32_state_modules: modules whose parameters keep fp32 state whatever their size, as if their group named
            ``"state_format": "fp32"``. The param groups stay as given (``state_dict()``'s groups are those of
            ``torch.optim.AdamW`` on the same groups); a tensor an engine swaps in at such a parameter's position
            before its first step (accelerate's FSDP2 shards) keeps fp32 state too.

    A param group may name its tensors' state format, ``"state_format"``: ``"fp32"``, or the optimizer's quantized
    format (``"8bit"``, ``"4bit"``) for tensors of any size and shape; unnamed, a tensor's size (and for 4-bit state,
    its rows' length) chooses.
    """

    state_names: ClassVar[tuple[str, ...]]
    signed_states: ClassVar[tuple[bool, ...]]

    oom_retries: int = 2
    """Recoveries from out-of-memory errors allowed within one :meth:`step` (0: the error is raised at once).
    :class:`~hf_paged.recovery.OOMRecovery` and ``MemorySpikeCallback(oom_retries=...)`` set it to theirs."""
    on_oom_recovery: Callable[[Recovery], None] | None = None
    """Called with a :class:`~hf_paged.recovery.Recovery` (``phase="optimizer step"``) after each recovery within
    :meth:`step`; not copied with the optimizer."""
    _tensors_take_turns: bool = False
    """Whether the param groups' tensors take turns (:meth:`tensors_in_turn`)."""

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
        normalization: str = "block",
        short_rows: str = "8bit",
        compiled: bool | None = None,
        fp32_state_modules: Iterable[torch.nn.Module] = (),
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
        defaults = _with_four_bit_choice(defaults, "normalization", normalization, NORMALIZATIONS, self.state_bits)
        defaults = _with_four_bit_choice(defaults, "short_rows", short_rows, SHORT_ROWS_FORMATS, self.state_bits)
        self.normalization, self.short_rows = normalization, short_rows
        self._formats = self._page_formats(block_size)
        for page_format in self._formats.values():
            if page_format.capacity_for(self.page_size) == 0:
                one_block = page_format.nbytes(page_format.split_alignment)
                raise ValueError(
                    f"page_size={self.page_size} bytes is smaller than one block of state ({one_block} bytes)"
                )
        if self.state_bits != 32 and self.page_size % block_size:
            raise ValueError(f"page_size={self.page_size} must be a multiple of block_size={block_size}")
        if compiled is not None and not isinstance(compiled, bool):
            raise TypeError(f"compiled must be True, False or None, got {compiled!r}")
        self._compiled_setting = compiled
        self._store = DeviceStores(self._new_store)
        self._layout = StateLayout(self._store, self._formats, self.page_size, self._state_device)
        self._plan: StepPlan | None = None
        """The plan of the last step, reused while the layout and the tensors with gradients stay; ``None`` once
        the layout changes."""
        self._store.add_observer(_views_forgetter(weakref.ref(self)), ("page_out", "written"))
        self._stepped_params: dict[int, tuple[dict[str, Any], list[torch.Tensor], int]] = {}
        """By ``id``: each group given to the optimizer, the tensors it listed at its last step (or when given), and
        its position then, for :meth:`_check_replacements`."""
        self._checked_options: list[dict[str, Any]] = []
        """By position: each param group's options (its entries but ``params`` and ``param_names``) as
        :meth:`add_param_group` or a step last checked them, for :meth:`_check_group_options`."""
        self._budget = DeviceBudget.parse(device_budget, "device_budget", self.page_size)
        self._auto_budgets: dict[str, AutoBudget] = {}
        self.check_group(defaults)
        fp32_state_modules = check_modules(fp32_state_modules, "fp32_state_modules")
        self._fp32_tensors: dict[int, weakref.ref[torch.Tensor]] = {}
        """By ``id``: the tensors that keep fp32 state whatever their group names (``fp32_state_modules``' parameters),
        held weakly, so that a tensor an engine swapped out is freed."""
        if fp32_state_modules:
            params = ordered_param_groups(params)
        super().__init__(params, defaults)
        self._keep_fp32(param for module in fp32_state_modules for param in module.parameters())

    # Layout -------------------------------------------------------------------------------------------

    def _page_formats(self, block_size: int) -> dict[str, PageFormat]:
        def quantized(codec_class: type) -> PageFormat:
            return PageFormat(tuple(codec_class(block_size, signed) for signed in self.signed_states))

        formats = {"32bit": PageFormat(tuple(Float32Codec() for _ in self.state_names))}
        if self.state_bits != 32:
            formats[f"{self.state_bits}bit"] = quantized(QUANTIZED_CODECS[self.state_bits])
        if self.state_bits == 4 and self.short_rows == "8bit":
            short_rows = quantized(QUANTIZED_CODECS[8])
            if short_rows.capacity_for(self.page_size):  # else tensors with short rows keep 4-bit state too
                formats["8bit"] = short_rows
        if self.normalization == "rank1":
            formats["4bit-rank1"] = quantized(Rank1Normalized4bitCodec)
        return formats

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (tensors or ``(name, tensor)`` pairs); its tensors get pages at their first step."""
        param_group = normalize_param_group(param_group, self.param_groups, type(self).__name__)
        params = param_group["params"]
        for position, param in enumerate(params):
            if param.device.type == "meta":
                where = describe_parameter(len(self.param_groups), position, param_group.get("param_names"))
                raise ValueError(
                    f"{where} is on the meta device: {type(self).__name__} needs parameters with data; materialize "
                    "the model first (to_empty() and load its weights)"
                )
        self._check_options(param_group, len(self.param_groups))
        new_devices = {self._state_device(param) for param in params}.difference(self._store.stores)
        self._budget.resolve([*self._store.stores, *sorted(new_devices)])  # raises before anything changes
        super().add_param_group(param_group)
        added = self.param_groups[-1]
        self._stepped_params[id(added)] = (added, list(added["params"]), len(self.param_groups) - 1)
        self._checked_options.append(_options_of(added))
        for device in sorted(new_devices):
            self._store.store_for(device)  # an automatic budget measures from now

    def _check_options(self, group: dict[str, Any], position: int) -> None:
        """Raise ValueError, naming the param group at ``position``, for an option of ``group`` this optimizer does not
        take: an update rule option, a state format, a layout key or a hyperparameter."""
        name = type(self).__name__
        try:
            check_update_rule_options(group, name)
            check_state_format(group, self.state_bits, name)
            self._check_layout_keys(group)
            self.check_group({**self.defaults, **group})
        except ValueError as error:
            raise ValueError(f"param group {position}: {error}") from None

    def _check_group_options(self) -> None:
        """Check the options of each param group that changed since they were last checked (set in place, as
        ``group["maximize"] = True``, or the group replaced) as :meth:`add_param_group` checks them, with the same
        errors; where a group's layout keys changed (its ``state_format``, its smallest quantized tensor), drop the
        step plan, so that the step gives its tensors their group's format. A step where nothing changed compares
        each group's entries with those last checked, and does no work per tensor and reads no tensor (a tensor
        ``lr`` the same object, as a scheduler updates it in place, is not read again)."""
        checked, groups = self._checked_options, self.param_groups
        if len(checked) == len(groups) and all(map(_options_hold, checked, groups)):
            return
        now = []
        for position, group in enumerate(groups):
            options = checked[position] if position < len(checked) else None
            if options is None or not _options_hold(options, group):
                self._check_options(group, position)
                if options is None or not all(
                    _same_value(options.get(key, _ABSENT), group.get(key, _ABSENT)) for key in _LAYOUT_KEYS
                ):
                    self._plan = None
                options = _options_of(group)
            now.append(options)
        self._checked_options = now

    def _check_layout_keys(self, group: dict[str, Any]) -> None:
        """Raise ValueError where ``group`` sets a quantized state's ``block_size``, ``normalization`` or ``short_rows``
        other than the optimizer's (they fix the page formats of all its quantized state), or a smallest quantized
        tensor (``min_8bit_size``, ``min_4bit_size``: a group's own) that is not an integer >= 0. An fp32 optimizer
        has no such state and ignores them (a group copied from a quantized optimizer's carries them)."""
        if self.state_bits == 32:
            return
        optimizer_wide = (
            ("block_size", self.defaults["block_size"]),
            ("normalization", self.normalization),
            ("short_rows", self.short_rows),
        )
        for key, value in optimizer_wide:
            if key in group and group[key] != value:
                raise ValueError(
                    f"{key}={group[key]!r} differs from the optimizer's {key}={value!r}: one page format holds all "
                    f"its {self.state_bits}-bit state; give {key} to the optimizer, or use another optimizer"
                )
        min_size = f"min_{self.state_bits}bit_size"
        if min_size in group:
            _check_int(min_size, group[min_size], 0)

    def _state_device(self, param: torch.Tensor) -> str:
        """The device that holds the state of ``param``: its own (tests give parameters pseudo devices)."""
        return state_device(param)

    def _new_store(self, device: str) -> PageStore:
        """The page store of ``device``, under its budget (an automatic budget a copy carried over, or its own)."""
        budget = self._auto_budgets.get(device)
        if budget is None:
            budget = self._budget.resolve([device])[device]
        store = PageStore(
            backend_for(torch.device(device)), None if isinstance(budget, AutoBudget) else budget, self.prefetch
        )
        if isinstance(budget, AutoBudget):
            self._auto_budgets[device] = budget
            self._bind_auto_budget(device)
        return store

    def _listed_ids(self) -> set[int]:
        """The ids of the tensors that the param groups list now."""
        return {id(param) for group in self.param_groups for param in group["params"]}

    def _keep_fp32(self, tensors: Iterable[torch.Tensor]) -> None:
        """Keep the state of ``tensors`` in fp32 whatever their groups name."""
        for tensor in tensors:
            self._fp32_tensors[id(tensor)] = weakref.ref(tensor)

    def _keeps_fp32(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s state is kept in fp32 whatever its group names."""
        kept = self._fp32_tensors.get(id(param))
        return kept is not None and kept() is param

    def _fp32_swaps(self, groups: Iterable[dict[str, Any]]) -> list[torch.Tensor]:
        """The tensors of ``groups`` without state swapped in, one for one, at the position of a tensor that keeps fp32
        state and is gone from the param groups (accelerate's FSDP2 shards replace a group's parameters before the
        first step; DeepSpeed's flat partitions, one for a whole group, do not follow; tensors listed in another order
        were not swapped)."""
        listed = self._listed_ids()
        swapped = []
        for group in groups:
            recorded = self._stepped_params.get(id(group))
            if recorded is None or recorded[0] is not group or len(recorded[1]) != len(group["params"]):
                continue
            swapped += [
                new
                for old, new in zip(recorded[1], group["params"])
                if new is not old and id(old) not in listed and new not in self._layout and self._keeps_fp32(old)
            ]
        return swapped

    def _follow_fp32_swaps(self, groups: Iterable[dict[str, Any]]) -> None:
        """Keep fp32 state for each tensor of ``groups`` swapped in at the position of one that keeps it
        (:meth:`_fp32_swaps`)."""
        self._keep_fp32(self._fp32_swaps(groups))

    def _state_format(self, param: torch.Tensor, group: dict[str, Any]) -> str:
        """The name of the page format of ``param``'s state: fp32 for a tensor kept so (``fp32_state_modules``), else
        the one its group names (``"state_format"``), else quantized from ``min_8bit_size`` (or ``min_4bit_size``)
        elements of the whole parameter (a DTensor's numel and shape, so that every rank picks the same): 4-bit
        state in 8-bit codes where the tensor's rows are shorter than a block (:func:`rows_shorter_than_block`) and the
        optimizer has that format (``short_rows="8bit"``, and a page holds a block of 8-bit state)."""
        bits = self.state_bits
        named = FP32 if self._keeps_fp32(param) else group.get(STATE_FORMAT)
        if bits == 32 or named == FP32 or (named is None and param.numel() < group[f"min_{bits}bit_size"]):
            return "32bit"
        if (
            self.normalization == "rank1"
            and local_tensor(param) is param
            and rank1_eligible(param.shape, group["block_size"])
        ):
            return "4bit-rank1"
        short_rows = bits == 4 and rows_shorter_than_block(param.shape, group["block_size"])
        if short_rows and named is None and "8bit" in self._formats:
            return "8bit"
        return f"{bits}bit"

    def lay_out(self) -> None:
        """Give every tensor of the param groups that has no pages yet its pages now, as its first step would, without
        updating anything: what a planning tool counts the state of (on fake tensors, nothing is allocated)."""
        self._place(
            [(param, group) for group in self.param_groups for param in group["params"] if param not in self._layout]
        )

    def _place(self, params: Sequence[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """Lay out pages for the state of ``(param, group)`` pairs, the parameters of each group packed together
        (a page mixes groups only once a tensor moves to another group of its state's format: it keeps its pages;
        :meth:`_follow_group_formats` gives one moved into another format new pages)."""
        if self._fp32_tensors:
            self._follow_fp32_swaps({id(group): group for _, group in params}.values())
        by_group: dict[int, list[tuple[torch.Tensor, str]]] = defaultdict(list)
        for param, group in params:
            by_group[id(group)].append((param, self._state_format(param, group)))
        self._plan = None
        for tensors in by_group.values():
            self._layout.place(tensors)

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

    @staticmethod
    def moments_rule() -> UpdateRule:
        """The states' part of the update rule, ``moments(grad, *states, **scalars)`` on fp32 tensors, the same
        operations as :meth:`update_rule`'s: what a step computes first for rank-1 normalized state."""
        raise NotImplementedError

    def takes_pages_fast(self, page: Page, dtypes: set[tuple[torch.dtype, torch.dtype]]) -> bool:
        """Whether :meth:`update_pages_fast` may update ``page``, whose tensors have these (parameter, gradient)
        ``dtypes``: only such pages get work items (views of each segment's elements) before the other kernels. A
        function of the page's format and device and of ``dtypes`` alone (a step asks once for each)."""
        return False

    def update_pages_fast(
        self,
        batch: list[tuple[Page, list[WorkItem]]],
        step_tensors: dict[tuple[torch.device, float], torch.Tensor],
        finished: Callable[[list[WorkItem]], None],
        state_views: StateViews,
    ) -> list[tuple[Page, list[WorkItem]]]:
        """Update whole pages of a batch with a multi-tensor kernel where the subclass has one; return the
        pages left to the other kernels.

        ``step_tensors`` holds each step count of this step as a 0-d fp32 tensor on each parameter device,
        made before the page loop, for kernels that read the step on the device; ``state_views(page, segment)``
        gives a segment's state views (one encoded segment per codec), kept between steps; a work item's parameter
        and gradient are flat views of its segment, or, for a contiguous tensor in one segment, the tensors as they
        are (any shape), or, for a contiguous tensor cut between pages at whole rows, the segment's rows (a split
        along the first dimension), whose fp32 state views then come in the same shape. Each kernel call must update its
        work items whole or not at all (allocate nothing after its first write), and be followed by
        ``finished(items)`` before the next call: an error in a later call then leaves a step whose progress is
        known, that an out-of-memory recovery finishes without updating an item twice.
        """
        return batch

    # Step ---------------------------------------------------------------------------------------------

    @property
    def compiled(self) -> bool:
        """Whether segment updates run through ``torch.compile`` (see :func:`~hf_paged.kernels.resolve_compiled`),
        chosen by the local elements of the tensors that have pages or are in the param groups."""
        tensors = {param: None for group in self.param_groups for param in group["params"]}
        elements = self._layout.tensor_elements
        elements += sum(local_tensor(param).numel() for param in tensors if param not in self._layout)
        first = next(iter(tensors), next(iter(self._layout), None))
        device = torch.device("cpu") if first is None else local_tensor(first).device
        return resolve_compiled(self._compiled_setting, device, elements)

    def _gradients(self) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
        """The parameters of the param groups now that have gradients, with their local gradients and their
        groups; checks them all before any update."""
        work = []
        listed = self._listed_ids()
        for group_index, group in enumerate(self.param_groups):
            self._check_replacements(group_index, group, listed)
            for position, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                grad, local = local_tensor(param.grad), local_tensor(param)
                if local.dtype not in PARAMETER_DTYPES:  # its data replaced since the group was checked
                    where = describe_parameter(group_index, position, group.get("param_names"))
                    check_parameter_dtype(local, where, type(self).__name__)
                if param.grad.is_sparse:
                    where = describe_parameter(group_index, position, group.get("param_names"))
                    raise RuntimeError(
                        f"{where} has a sparse gradient; {type(self).__name__} does not support sparse gradients"
                    )
                if param.grad.shape != param.shape or grad.shape != local.shape or grad.device != local.device:
                    where = describe_parameter(group_index, position, group.get("param_names"))
                    raise RuntimeError(
                        f"{where} has a gradient of shape {tuple(param.grad.shape)} on {param.grad.device}, expected "
                        f"shape {tuple(param.shape)} on {param.device}"
                    )
                pages = self._layout.get(param)
                if pages is not None and (local.shape != pages.shape or self._state_device(param) != pages.device):
                    where = describe_parameter(group_index, position, group.get("param_names"))
                    raise RuntimeError(
                        f"{where} has shape {tuple(local.shape)} on {self._state_device(param)}, but its state was "
                        f"laid out for shape {tuple(pages.shape)} on {pages.device}: a tensor with optimizer state "
                        "cannot change shape or device (save the state dict and load it after the change)"
                    )
                work.append((param, grad, group))
        return work

    @contextlib.contextmanager
    def tensors_in_turn(self) -> Iterator[None]:
        """Within the block, the param groups' tensors take turns: a new tensor where one with state stood at the
        last step is a tensor of its own, with state of its own, whatever its shape; the one it follows keeps its
        state while anything holds it. DeepSpeed ZeRO-3 steps its flat fp32 partition so, one sub-group
        (``sub_group_size`` elements) at a time in the same param group (hf-paged enables this for it).

        >>> with optimizer.tensors_in_turn():
        ...     optimizer.step()
        """
        previous, self._tensors_take_turns = self._tensors_take_turns, True
        try:
            yield
        finally:
            self._tensors_take_turns = previous

    def _check_replacements(self, group_index: int, group: dict[str, Any], listed: set[int]) -> None:
        """Raise if, since ``group``'s last step, a tensor with state was replaced at its position by a new tensor
        of another shape: its state cannot follow it, and a fresh start would be a silent loss (unless tensors take
        turns: :meth:`tensors_in_turn`). A tensor still in a param group (the ids of ``listed``) was not replaced,
        only moved. A group dict the optimizer was never given (``param_groups`` assigned a new list) is checked
        against the groups that stood at its position and are gone from ``param_groups``."""
        if self._tensors_take_turns:
            return
        stepped = self._stepped_params.get(id(group))
        if stepped is not None and stepped[0] is group:
            replaced = [stepped[1]]
        else:
            listed_groups = {id(listed_group) for listed_group in self.param_groups}
            replaced = [
                tensors
                for old_group, tensors, position in self._stepped_params.values()
                if position == group_index and id(old_group) not in listed_groups
            ]
        for tensors in replaced:
            for position, (old, new) in enumerate(zip(tensors, group["params"])):
                if old is new or id(old) in listed or old not in self._layout or new in self._layout:
                    continue
                laid_out = self._layout[old].shape
                if local_tensor(new).shape != laid_out:
                    where = describe_parameter(group_index, position, group.get("param_names"))
                    raise RuntimeError(
                        f"{where} is a new tensor of shape {tuple(local_tensor(new).shape)} in place of one whose "
                        f"state has shape {tuple(laid_out)}: state cannot follow a tensor into another shape. Swap "
                        "tensors before the first step (as accelerate's FSDP2 preparation does), or save the state "
                        "dict and load it after the swap"
                    )

    def _record_stepped(self) -> None:
        """Remember the tensors and position of each group that lists any, for :meth:`_check_replacements`. A group
        dict new at its position has replaced the groups gone from there: they are forgotten, so that their tensors,
        once nothing else holds them, are freed."""
        listed = {id(group) for group in self.param_groups}
        for position, group in enumerate(self.param_groups):
            if not group["params"]:
                continue
            recorded = self._stepped_params.get(id(group))
            if recorded is None or recorded[0] is not group:
                for key, (_, _, old_position) in list(self._stepped_params.items()):
                    if old_position == position and key not in listed:
                        del self._stepped_params[key]
            self._stepped_params[id(group)] = (group, list(group["params"]), position)

    def _free_dropped_tensors(self) -> None:
        """Forget the tensors that are away from the param groups and that nothing outside the optimizer holds, and
        free their pages.

        A tensor away from the groups keeps its state while anything else holds it (ZeRO-3's partitions between
        steps, a tensor swapped back later): it may come back, as in ``torch.optim``. One that nothing else holds
        cannot come back, and its pages would hold memory for good (an engine or user swapping tensors at every
        step). The optimizer holds the tensors away only weakly for a moment: those that die then were held by
        nothing else, and their state and pages go (a page shared with a tensor kept keeps its buffers).
        """
        listed = self._listed_ids()
        away = [tensor for tensor in self._layout if id(tensor) not in listed]
        if not away:
            return
        self._plan = None
        held = {id(tensor): _HeldWeakly(tensor) for tensor in away}
        state = [(held.get(id(key), key), entry) for key, entry in self.state.items()]
        detached = [(held[id(tensor)], self._layout.detach(tensor)) for tensor in away]
        self.state.clear()
        del away
        for key, entry in state:
            if isinstance(key, _HeldWeakly):
                key = key()
                if key is None:
                    continue
            self.state[key] = entry
        dead = []
        for reference, pages in detached:
            tensor = reference()
            if tensor is None:
                dead.append(pages)
            else:
                self._layout.attach(tensor, pages)
        self._layout.free(dead)

    @torch._disable_dynamo
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step over the pages of the parameters that have gradients.

        Works on the tensors that the param groups hold now: a tensor's first step lays out its pages. Each chunk
        of a segment is updated whole or not at all, and a parameter's step count advances once all of it is
        updated. An out-of-memory error part way is recovered (:attr:`oom_retries` times): the state goes back to
        the host, cached memory is freed and the pages left are updated under a smaller budget, down to one page
        at a time, with bitwise the result of a step without the error. In a function that ``torch.compile``
        compiles (a training step around the optimizer) the step runs as it does outside, between two graphs: it
        moves pages and keeps its plan on the host, which a graph cannot hold (``compiled=True`` compiles its
        kernels).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._forget_reset_state()
        work = self._gradients()
        if not work:
            return loss
        self._check_group_options()
        new = [(param, group) for param, _, group in work if param not in self._layout]
        if new:
            self._place(new)
        params, grads, groups = (list(column) for column in zip(*work))
        if self._plan is None or not self._plan.holds_for(params, groups):
            self._follow_group_formats(zip(params, groups))
            self._plan = StepPlan(self._layout, params, groups, self._step_parts())
        budgets = {device: store.device_budget for device, store in self._store.stores.items()}
        if self._auto_budgets:
            self._begin_auto_step()
        try:
            run_step(
                self._plan,
                grads,
                [self.state[param] for param in params],
                self.compiled,
                self.oom_retries,
                self.on_oom_recovery,
            )
        finally:
            # after a step that raised too: a loop that goes on gets its budgets back, the forward's where automatic
            for device, budget in budgets.items():
                store = self._store.stores[device]
                if device not in self._auto_budgets and store.device_budget != budget:
                    store.set_budget(budget)
            if self._auto_budgets:
                self._end_auto_step()
        self._record_stepped()
        self._free_dropped_tensors()
        return loss

    def _forget_reset_state(self) -> None:
        """Free the pages of each tensor whose entry of :attr:`state` is gone or has no step: its state was reset (the
        entry deleted or emptied, or :attr:`state` replaced), so its next step is a first step from zero moments, as in
        ``torch.optim``."""
        reset = [tensor for tensor in self._layout if "step" not in self.state.get(tensor, ())]
        if reset:
            self._plan = None
            self._layout.free([self._layout.detach(tensor) for tensor in reset])

    def _follow_group_formats(self, params: Iterable[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """Give each tensor whose state is in another format than its group's (a tensor moved with its state into a
        group that names another ``state_format``, or sets another smallest quantized tensor) pages of its group's
        format, its state values carried over as a state dict loaded into that group carries them."""
        moved = [
            (param, group) for param, group in params if self._layout[param].kind != self._state_format(param, group)
        ]
        for param, group in moved:
            values = {name: self.get_state_tensor(param, name) for name in self.state_names}
            self._plan = None
            self._layout.free([self._layout.detach(param)])
            self._place([(param, group)])
            for name, value in values.items():
                self.set_state_tensor(param, name, value)

    def _step_parts(self) -> StepParts:
        """What a step plan takes from this optimizer (see :class:`~hf_paged.optim.plan.StepParts`)."""
        return StepParts(
            stores=self._store,
            kernel=self._kernel_for,
            rule_scalars=self.rule_scalars,
            moments_rule=self.moments_rule() if self.normalization == "rank1" else None,
            chunk_elements=self._chunk_elements,
            takes_pages_fast=self.takes_pages_fast,
            update_pages_fast=self.update_pages_fast,
        )

    def _kernel_for(self, page_format: PageFormat, device: torch.device, compiled: bool) -> Any:
        """The kernel that updates pages of ``page_format`` on ``device`` (see
        :func:`~hf_paged.kernels.segment_kernel`)."""
        return segment_kernel(self.update_rule(), page_format.codecs, compiled, device)

    # Saving and loading -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The state in ``torch.optim``'s layout, all tensors on the CPU.

        Parameters are numbered as the param groups hold them now; each one that has state has an entry with
        ``step`` (a tensor) and its states' fields (see :mod:`hf_paged.optim.state_dict`). The state of tensors
        that are away from the param groups now is kept, not saved. Keys of :attr:`state` that are not
        tensors pass through as they are. The state dict pre and post hooks run as in ``torch.optim``.
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
        self._forget_reset_state()
        groups, index_of = pack_param_groups(self.param_groups)
        with_pages = [
            key for key in self.state if isinstance(key, torch.Tensor) and id(key) in index_of and key in self._layout
        ]
        exported = dict(zip(map(id, with_pages), export_state(self._layout, self.state_names, with_pages)))
        state = {}
        for key, entry in self.state.items():
            if not isinstance(key, torch.Tensor):
                state[key] = entry
            elif id(key) in index_of:
                if id(key) in exported:
                    fields = exported[id(key)]
                    if local_tensor(key) is not key:
                        fields = sharded_entry(
                            key, fields, self.state_names, self._layout.formats[self._layout[key].kind].codecs
                        )
                    others = {name: value for name, value in entry.items() if name != "step" and name not in fields}
                    entry = {"step": entry["step"].detach().to("cpu", torch.float32, copy=True), **fields, **others}
                state[index_of[id(key)]] = entry
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of ``torch.optim`` (fp32 moments are quantized for 8-bit state).

        Saved parameters are matched to the tensors that the param groups hold now, by position; the state
        replaces all state the optimizer had, as in ``torch.optim``, in new pages. Everything is checked before
        anything changes: a bad state dict leaves the optimizer as it was. Keys of ``state`` that are not
        parameter indices are kept as they are; ``param_names`` are taken from the saved groups where they
        have them. The load state dict pre hooks (which may replace the state dict) and post hooks run as in
        ``torch.optim``.
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

    def _load_state_dict(self, state_dict: dict[str, Any], *, copying: bool = False) -> None:
        """:meth:`load_state_dict` without its hooks; ``copying`` (a copy's state) keeps the tensors of keys besides
        the step and the states where they are, as a copy of a ``torch.optim`` optimizer does."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must be a dict with 'state' and 'param_groups'")
        if not isinstance(state_dict["param_groups"], (list, tuple)) or not isinstance(state_dict["state"], dict):
            raise TypeError("state_dict['param_groups'] must be a list and state_dict['state'] a dict")
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups, this optimizer has {len(self.param_groups)}"
            )
        param_of: dict[Any, tuple[torch.Tensor, dict[str, Any]]] = {}
        new_groups = []
        for position, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if not isinstance(saved, dict) or "params" not in saved:
                raise ValueError(f"param group {position} of state_dict is not a dict with 'params'")
            if not isinstance(saved["params"], (list, tuple)):
                raise TypeError(
                    f"param group {position} of state_dict: params must be a list of parameter ids, got "
                    f"{type(saved['params']).__name__}"
                )
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param group {position} of state_dict has {len(saved['params'])} parameters, "
                    f"this optimizer's has {len(group['params'])}"
                )
            merged = {**group, **{key: value for key, value in saved.items() if key not in ("params", *_LAYOUT_KEYS)}}
            try:
                check_update_rule_options(merged, type(self).__name__)
                self.check_group(merged)
            except ValueError as error:
                raise ValueError(f"param group {position} of state_dict: {error}") from None
            new_groups.append(merged)
            for saved_id, param in zip(saved["params"], group["params"]):
                param_of[saved_id] = (param, saved)
        entries, sources, other_state = {}, {}, {}
        for saved_id, entry in state_dict["state"].items():
            if saved_id not in param_of and not isinstance(saved_id, int):
                other_state[saved_id] = entry
                continue
            if saved_id not in param_of:
                raise ValueError(f"state_dict has state for parameter {saved_id!r}, which no param group lists")
            param, saved_group = param_of[saved_id]
            block_size = saved_group.get("block_size", self.defaults.get("block_size", 256))
            step, states, others = parse_saved_entry(
                param, saved_id, entry, block_size, self.state_names, self.signed_states, move_others=not copying
            )
            entries[param] = others if step is None else {"step": torch.tensor(step, dtype=torch.float32), **others}
            if step is not None:
                sources[param] = states
        self.param_groups = new_groups
        self.state = defaultdict(dict)
        self.state.update(entries)
        self.state.update(other_state)
        self._plan = None
        self._layout.clear()
        self._stepped_params = {id(group): (group, list(group["params"]), i) for i, group in enumerate(new_groups)}
        group_of = {param: group for group in self.param_groups for param in group["params"]}
        self._place([(param, group_of[param]) for param in sources])
        import_state(self._layout, self.state_names, sources)

    def _chunk_elements(self, page_format: PageFormat, compiled: bool) -> int:
        """Elements of a segment updated by one kernel call: ``page_size // 16`` eagerly, ``page_size // 8``
        compiled, a multiple of the chunk alignment (whole blocks, every view 16-byte aligned)."""
        alignment = page_format.chunk_alignment
        divisor = _PAGE_BYTES_PER_CHUNK_ELEMENT[compiled]
        return max(alignment, self.page_size // divisor // alignment * alignment)

    @property
    def step_workspace(self) -> int:
        """Bytes of temporaries a step may hold on the device besides the state (a chunk's decoded state), for the
        kernels that run: eager ones where compilation is off or failed."""
        workspaces = []
        setting = self.compiled
        rounds = any(group.get("bf16_stochastic_round", False) for group in self.param_groups)
        for kind, page_format in self._formats.items():
            compiled = setting and runs_compiled(self.update_rule(), page_format.codecs)
            per_element = _WORKSPACE_BYTES_PER_ELEMENT[compiled, kind]
            padded_tail = 3 * page_format.alignment * 4  # a partial last block's padded parameter, gradient, zeros
            chunk = self._chunk_elements(page_format, compiled)
            scale_copies = sum(4 * -(-chunk // codec.alignment) for codec in page_format.codecs if codec.alignment > 1)
            # stochastic rounding of bf16 parameters hashes a slice of a chunk at a time
            rounding = ROUNDING_BYTES_PER_ELEMENT * min(chunk, ROUNDING_SLICE_ELEMENTS) if rounds else 0
            workspaces.append(per_element * chunk + padded_tail + scale_copies + rounding)
        return max(workspaces)

    # Copying and pickling -------------------------------------------------------------------------------

    _REBUILT_ATTRIBUTES: ClassVar[tuple[str, ...]] = (
        "_store",
        "_auto_budgets",
        "_layout",
        "_plan",
        "_stepped_params",
        "_checked_options",
        "_fp32_tensors",
    )
    """Attributes that hold the page store and the layout: rebuilt from the param groups, never copied."""

    def __getstate__(self) -> dict[str, Any]:
        """The settings, the param groups and the state as :meth:`state_dict` holds it (CPU tensors), with that of
        the tensors away from the param groups.

        The page store, its device buffers and the backend's streams are not copied: :meth:`__setstate__`
        lays the state out again in new pages. As with ``torch.optim``, hooks are not copied, nor are
        instance attributes that stand in for methods (the ``step`` an LR scheduler wraps).
        """
        hooks = [name for name in vars(self) if name.startswith("_optimizer_") and name.endswith("_hooks")]
        patched = [name for name in vars(self) if callable(getattr(type(self), name, None))]
        left_out = {*self._REBUILT_ATTRIBUTES, *hooks, *patched, "on_oom_recovery", "param_groups", "state"}
        saved = {key: value for key, value in vars(self).items() if key not in left_out}
        saved["param_groups"] = [dict(group) for group in self.param_groups]
        saved["_saved_state"] = self._state_dict()
        saved["_saved_away_state"] = self._away_state()
        saved["_saved_auto_budgets"] = dict(self._auto_budgets)  # settings and measured peaks, not the probe
        swapped = {id(param) for param in self._fp32_swaps(self.param_groups)}
        saved["_saved_fp32_tensors"] = [
            param
            for group in self.param_groups
            for param in group["params"]
            if self._keeps_fp32(param) or id(param) in swapped
        ]
        return saved

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild a copy or an unpickled optimizer from :meth:`__getstate__`: new pages, the same state."""
        if "_saved_state" not in state:
            super().__setstate__(state)
            return
        state = dict(state)
        saved_state = state.pop("_saved_state")
        away_state = state.pop("_saved_away_state", [])
        auto_budgets = state.pop("_saved_auto_budgets", {})
        fp32_tensors = state.pop("_saved_fp32_tensors", [])
        param_groups = state.pop("param_groups")
        had_differentiable = "differentiable" in state["defaults"]
        super().__setstate__({**state, "state": defaultdict(dict), "param_groups": []})
        if not had_differentiable:
            self.defaults.pop("differentiable", None)
        self._store, self._auto_budgets = DeviceStores(self._new_store), auto_budgets
        self._layout = StateLayout(self._store, self._formats, self.page_size, self._state_device)
        self._plan = None
        self._store.add_observer(_views_forgetter(weakref.ref(self)), ("page_out", "written"))
        self._stepped_params = {}
        self._checked_options = []
        self._fp32_tensors = {}
        self._keep_fp32(fp32_tensors)
        for group in param_groups:
            self.add_param_group(group)
        self._load_state_dict(saved_state, copying=True)
        self._load_away_state(away_state)

    def _away_state(self) -> list[tuple[torch.Tensor, str, dict[str, Any]]]:
        """Each tensor with state that is away from the param groups now, with the name of its page format and its
        entry of :attr:`state` with its states' fields, which :meth:`state_dict` leaves out and a copy keeps."""
        listed = self._listed_ids()
        away = [tensor for tensor in self._layout if id(tensor) not in listed]
        fields = export_state(self._layout, self.state_names, away)
        return [
            (tensor, self._layout[tensor].kind, {**self.state[tensor], **entry}) for tensor, entry in zip(away, fields)
        ]

    def _load_away_state(self, away_state: list[tuple[torch.Tensor, str, dict[str, Any]]]) -> None:
        """Give each tensor of ``away_state`` (:meth:`_away_state`) pages of its format holding its saved state."""
        block_size = self.defaults.get("block_size", 256)
        sources = {}
        for tensor, kind, entry in away_state:
            step, states, others = parse_saved_entry(
                tensor, "away", entry, block_size, self.state_names, self.signed_states, move_others=False
            )
            self.state[tensor] = {"step": torch.tensor(step, dtype=torch.float32), **others}
            self._layout.place([(tensor, kind)])
            sources[tensor] = states
        import_state(self._layout, self.state_names, sources)

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
        kept = {id(device_budget) for device_budget in resolved.values()}
        for auto in self._auto_budgets.values():
            if id(auto) not in kept:
                auto.unbind()
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
        auto.bind(torch.device(device), state=lambda: self._state_bytes_on(device), owner=self)
        if auto.alone():  # another optimizer measuring the device keeps its phase (a copy must not reset it)
            auto.probe.mark(_BETWEEN_STEPS)

    def _state_bytes_on(self, device: str) -> tuple[int, int]:
        """This optimizer's state on ``device``: bytes there now, and bytes of all its pages."""
        store = self._store.stores.get(device)
        return (0, 0) if store is None else (store.device_bytes, sum(page.nbytes for page in store.pages))

    def _begin_auto_step(self) -> None:
        """Record each device's forward/backward peak just ended and give the step what it leaves free."""
        for device, auto in self._auto_budgets.items():
            store = self._store.stores[device]
            peak = auto.probe.exact_peak(_BETWEEN_STEPS)
            auto.observe(None if peak is None else peak - auto.state_bytes())
            store.set_budget(auto.step_budget(store.device_bytes, self.step_workspace, minimum=store.max_page_bytes))

    def _end_auto_step(self) -> None:
        """Evict down to each device's budget for the coming forward/backward, and measure its peak from now."""
        self.prepare_forward()
        for auto in self._auto_budgets.values():
            auto.probe.mark(_BETWEEN_STEPS)

    def evict(self, nbytes: int | str | None = None) -> int:
        """Write state back to host memory until at least ``nbytes`` of the devices are freed (``None``: all).

        Returns the device bytes freed. The next :meth:`step` brings the pages back.
        """
        return self._store.evict(None if nbytes is None else parse_size(nbytes, "nbytes"))

    def paging_stats(self) -> dict[str, Any]:
        """Page counts, bytes (on the devices, in host memory, moved each way) and copy stall seconds, and
        ``statistics_bytes``: the rank-1 statistics beside the pages (on the tensors' devices, not paged).

        The figures are totals over the devices; ``"devices"`` has the same page figures for each device.
        """
        stats = _store_stats(self._store)
        stats["statistics_bytes"] = sum(
            tensor.numel() * tensor.element_size()
            for tensor_pages in self._layout.values()
            if tensor_pages.statistics is not None
            for tensor in tensor_pages.statistics.batch_entry()
        )
        stats["device_budget"] = self.device_budget
        stats["page_size"] = self.page_size
        stats["devices"] = {device: _store_stats(store) for device, store in self._store.stores.items()}
        return stats

    def get_state_tensor(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """State ``name`` of ``param`` (e.g. ``"exp_avg"``) as fp32 values, a new CPU tensor shaped like its local
        tensor: 8-bit and 4-bit codes decoded. Raises KeyError for a parameter without state yet."""
        self._check_state_tensor(param, name)
        return read_state_values(self._layout, self.state_names, param, name)

    def set_state_tensor(self, param: torch.Tensor, name: str, value: torch.Tensor) -> None:
        """Replace state ``name`` of ``param`` with ``value`` (as many elements as its local tensor), encoded as
        the state is stored: 8-bit and 4-bit state as the codec encodes it in a step."""
        self._check_state_tensor(param, name)
        numel = self._layout[param].numel
        if not isinstance(value, torch.Tensor) or value.numel() != numel:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"value must be a tensor of {numel} elements, got {got}")
        write_state_values(self._layout, self.state_names, param, name, value)

    def _check_state_tensor(self, param: torch.Tensor, name: str) -> None:
        if name not in self.state_names:
            raise KeyError(f"{type(self).__name__} has no state {name!r}; its states are {list(self.state_names)}")
        if param not in self._layout or "step" not in self.state.get(param, ()):
            raise KeyError(f"the tensor has no {name!r} state: {type(self).__name__} gives it state at its first step")


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


def _views_forgetter(optimizer: weakref.ref[PagedOptimizer]) -> Callable[[str, Page], None]:
    """A page store observer that drops the plan's views of a page's device buffers when they leave the device. It
    holds the optimizer weakly: the store must not keep its optimizer (and the pages' device memory) alive."""

    def forget_views(operation: str, page: Page) -> None:
        owner = optimizer()
        if owner is not None and owner._plan is not None:
            owner._plan.forget_views(page)

    return forget_views


class _HeldWeakly(weakref.ref):
    """A weak reference to a tensor away from the param groups, while the optimizer checks whether it lives on."""

    __slots__ = ()
