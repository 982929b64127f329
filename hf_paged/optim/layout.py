"""Where each tensor's optimizer state lives: its pages and segments, keyed by tensor as ``optimizer.state`` is.

A tensor gets pages when it first needs state (its first step, or a loaded state dict), sized for the tensor it
is then: after an engine swaps the tensors of the param groups (accelerate's switch to FSDP2 shards, DeepSpeed
ZeRO's flat fp32 partitions), the new tensors get pages of their own size. A tensor keeps its pages while it is
away from the param groups (ZeRO-3 lists its partitions only around ``step()``), and meets them again when it
comes back; the optimizer frees the pages of a tensor away that nothing else holds. The layout never changes the
values of state: every segment starts on a block boundary of the tensor's elements, so blocks fall on the same
elements however tensors are packed into pages. Segments and the cuts between them are aligned so that the views a
kernel takes of a parameter, its gradient and each state's values or codes start at 16-byte boundaries (the
optimizer copies a chunk's scales where they do not): compiled kernels assume aligned inputs and otherwise copy them
in and out at every call, which before torch 2.8 lost the writes (pytorch#152425).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..codecs import Float32Codec, PageFormat, Rank1Normalized4bitCodec, Rank1Statistics
from ..store import Page, Segment
from ..stores import DeviceStores, device_key


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding this process's elements: a DTensor's local shard, else the tensor itself."""
    if type(tensor) in _PLAIN_TENSORS:  # the common case, without a failing attribute lookup
        return tensor
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
"""Classes of tensors that are their own local elements (a parameter of a DTensor is of another class)."""


def state_device(tensor: torch.Tensor) -> str:
    """The device that holds the state of ``tensor``: that of its local elements."""
    return device_key(local_tensor(tensor).device)


@dataclass(eq=False)
class TensorPages:
    """The pages holding one tensor's state: ``segments`` cover its local elements in order."""

    owner: int
    """The number that the tensor's segments carry (:attr:`Segment.owner`)."""
    shape: torch.Size
    """The local shape the state was laid out for."""
    device: str
    kind: str
    """The page format's name: ``"32bit"``, ``"8bit"``, ``"4bit"`` or ``"4bit-rank1"``."""
    segments: list[tuple[Page, Segment]]
    statistics: Rank1Statistics | None = None
    """The rank-1 statistics of a rank-1 normalized state (on the tensor's device), else ``None``."""

    @property
    def numel(self) -> int:
        return self.shape.numel()


def _round_up(elements: int, multiple: int) -> int:
    return -(-elements // multiple) * multiple


def cut_alignment(page_format: PageFormat, shape: torch.Size, capacity: int) -> int:
    """Elements at multiples of which a tensor of ``shape`` is cut between pages of ``page_format`` holding
    ``capacity`` elements: the format's split alignment, and for fp32 state of a tensor of two or more dimensions also
    whole rows (slices along the first dimension), where such a multiple is at most 1/64 of a page (the room a cut can
    leave unused)."""
    split = page_format.split_alignment
    if len(shape) < 2 or shape.numel() == 0 or not isinstance(page_format.codecs[0], Float32Codec):
        return split
    rows = math.lcm(split, shape.numel() // shape[0])
    return rows if rows <= capacity // 64 else split


class StateLayout:
    """The pages of every tensor that has state, in a :class:`~hf_paged.stores.DeviceStores`.

    Args:
        store: the pages' stores, one per device.
        formats: the page formats by name.
        page_size: bytes of one page.
        device_of: the device that holds a tensor's state (by default :func:`state_device`).
    """

    def __init__(
        self,
        store: DeviceStores,
        formats: dict[str, PageFormat],
        page_size: int,
        device_of: Callable[[torch.Tensor], str] = state_device,
    ) -> None:
        self.store = store
        self.formats = formats
        self.page_size = page_size
        self.device_of = device_of
        self._pages_of: dict[torch.Tensor, TensorPages] = {}
        self._tensor_of: dict[int, torch.Tensor] = {}
        self._owners = itertools.count()

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return tensor in self._pages_of

    def __getitem__(self, tensor: torch.Tensor) -> TensorPages:
        return self._pages_of[tensor]

    def get(self, tensor: torch.Tensor) -> TensorPages | None:
        """The pages of ``tensor``, ``None`` where it has none (one lookup)."""
        return self._pages_of.get(tensor)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._pages_of)

    def values(self) -> Iterator[TensorPages]:
        """The pages of every tensor laid out."""
        return iter(self._pages_of.values())

    def tensor_of(self, segment: Segment) -> torch.Tensor:
        """The tensor whose state ``segment`` holds."""
        return self._tensor_of[segment.owner]

    def place(self, tensors: Sequence[tuple[torch.Tensor, str]]) -> None:
        """Give ``(tensor, format name)`` pairs that have no pages yet new pages, packed one after another in one
        open page per device and format; the last page of each is trimmed to what it holds.

        Each segment starts at a multiple of the format's :attr:`~hf_paged.codecs.PageFormat.offset_alignment` in
        its page, and a tensor is cut between pages at multiples of its
        :attr:`~hf_paged.codecs.PageFormat.split_alignment`, so that the views of each segment start at 16-byte
        boundaries (the padding between segments is less than 16 bytes of each buffer). A tensor of fp32 state is cut
        at whole rows (its first dimension) too, where that leaves at most 1/64 of a page unused
        (:func:`cut_alignment`): each segment is then a slice of the tensor along its first dimension, which a step
        takes as it is (PyTorch's fused AdamW takes the segments of fp32 ``PagedAdamW``: one split of the parameter
        and one of the gradient, not a flat view and a split of each)."""
        open_pages: dict[tuple[str, str], Page] = {}
        used: dict[int, int] = {}
        for tensor, kind in tensors:
            if tensor in self._pages_of:
                raise ValueError("a tensor that has pages cannot be placed again")
            page_format = self.formats[kind]
            local = local_tensor(tensor)
            device = self.device_of(tensor)
            owner = next(self._owners)
            segments = []
            start, numel = 0, local.numel()
            capacity = page_format.capacity_for(self.page_size)
            cut = cut_alignment(page_format, local.shape, capacity)
            while start < numel:
                page = open_pages.get((device, kind))
                offset = 0 if page is None else _round_up(used[page.index], page_format.offset_alignment)
                room = 0 if page is None else page.capacity - offset
                left = numel - start
                length = left if left <= room else room - room % cut
                if length <= 0:
                    page = self.store.add_page(page_format, capacity, device)
                    open_pages[device, kind] = page
                    offset, length = 0, min(left, capacity - capacity % cut)
                segment = Segment(owner, start, length, offset)
                page.segments.append(segment)
                segments.append((page, segment))
                used[page.index] = offset + _round_up(length, page_format.alignment)
                start += length
            statistics = None
            if isinstance(page_format.codecs[0], Rank1Normalized4bitCodec):
                statistics = Rank1Statistics(tuple(local.shape), len(page_format.codecs), local.device)
            self._pages_of[tensor] = TensorPages(owner, local.shape, device, kind, segments, statistics)
            self._tensor_of[owner] = tensor
        for page in open_pages.values():
            page.capacity = used[page.index]

    def detach(self, tensor: torch.Tensor) -> TensorPages:
        """Forget ``tensor`` and return its pages, which keep its state (:meth:`attach` gives them back)."""
        pages = self._pages_of.pop(tensor)
        del self._tensor_of[pages.owner]
        return pages

    def attach(self, tensor: torch.Tensor, pages: TensorPages) -> None:
        """Give ``tensor`` back the pages :meth:`detach` returned."""
        self._pages_of[tensor] = pages
        self._tensor_of[pages.owner] = tensor

    def free(self, detached: Sequence[TensorPages]) -> None:
        """Free the pages that hold only the state of ``detached`` tensors. A page that also holds a tensor still
        laid out keeps its buffers (the detached tensors' segments leave it)."""
        owners = {pages.owner for pages in detached}
        touched = {id(page): page for pages in detached for page, _ in pages.segments}
        emptied = []
        for page in touched.values():
            page.segments[:] = [segment for segment in page.segments if segment.owner not in owners]
            if not page.segments:
                emptied.append(page)
        if emptied:
            self.store.remove(emptied)

    def clear(self) -> None:
        """Forget every tensor and free every page, on the devices and in host memory."""
        self.store.clear()
        self._pages_of.clear()
        self._tensor_of.clear()

    @property
    def tensor_elements(self) -> int:
        """Local elements of the tensors that have pages."""
        return sum(pages.numel for pages in self._pages_of.values())
