"""The page store: optimizer state in fixed-size pages that live on the device or rest in host memory.

A page is a small set of buffers (one per array of its format) holding the encoded state of one or more parameter element ranges
(:class:`Segment`). At any time a page has one home:

==============  ==========================================  ==============
state           buffers                                     counted in
==============  ==========================================  ==============
``EMPTY``       none; the page's state is all zeros         nothing
``HOST``        host buffer (pinned on CUDA)                ``host_bytes``
``PAGING_IN``   both; a host-to-device copy in flight       both
``RESIDENT``    device buffer                               ``device_bytes``
``PAGING_OUT``  both; a device-to-host write-back in flight both
==============  ==========================================  ==============

The store keeps ``device_bytes`` at or below the device budget at every transition: room for a page
is made (by writing back least recently used pages) before its device buffer is allocated.
``host_bytes`` counts what the backend really holds (pinned blocks are rounded up by the allocator).

Slots: while a step streams pages, the device block of a page written back and the host block of a page brought
in are kept, by buffer layout, for the next page of that layout to go the other way, so that a streamed step
allocates a few blocks rather than two per page. A kept device slot counts in ``device_bytes``, under the budget,
and is released where room for another layout is needed, where the budget is lowered, on :meth:`PageStore.evict`,
and when the step ends; a kept host block counts in ``host_bytes`` and is dropped when the step ends. A host block
is reused only as the destination of a write-back, which its device-to-host stream orders after the compute stream,
itself ordered after the page-in that read the block.

Ordering: a page-in runs on the backend's host-to-device stream and the compute stream is ordered after
it (no host wait) before the page becomes ``RESIDENT``; a write-back runs on the device-to-host stream
after the compute work queued before it. The host waits only where host memory is reused or read, or
where a device slot must be freed to stay within the budget. A device buffer is released to the backend
only once the compute stream is ordered after every copy that used it.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .blocks import packing
from .device import Buffers, BufferSpec, Event, SyncBackend, zero_buffers


class PageState(enum.Enum):
    """Where a page's buffers are; each state's ``on_device`` and ``on_host`` are 1 where it holds buffers there (plain
    attributes: the store reads them at every transition)."""

    EMPTY = ("empty", 0, 0)
    HOST = ("host", 0, 1)
    PAGING_IN = ("paging_in", 1, 1)
    RESIDENT = ("resident", 1, 0)
    PAGING_OUT = ("paging_out", 1, 1)

    def __init__(self, label: str, on_device: int, on_host: int) -> None:
        self.label = label
        self.on_device = on_device
        self.on_host = on_host


EMPTY, HOST, PAGING_IN, RESIDENT, PAGING_OUT = PageState
"""The states by plain names: a member read through its enum class costs a descriptor call, and the store reads them
several times per page and step."""


@dataclass(eq=False)
class Segment:
    """``length`` elements of the tensor numbered ``owner``, from element ``start``, at element ``offset`` of a page.

    The owner's number is the optimizer's (see :class:`~hf_paged.optim.layout.StateLayout`); the store never reads it.
    """

    owner: int
    start: int
    length: int
    offset: int


class Page:
    """One page: ``capacity`` elements of state in the buffers its format lays out (``specs``, ``nbytes`` bytes).

    A plain class with slots: the store reads and writes a streamed page's fields several times per step.
    """

    __slots__ = (
        "_capacity",
        "device",
        "event",
        "format",
        "host",
        "host_nbytes",
        "index",
        "nbytes",
        "segments",
        "specs",
        "state",
    )  # fmt: skip

    def __init__(
        self,
        index: int,
        format: Any,
        capacity: int,
        segments: list[Segment] | None = None,
        state: PageState = PageState.EMPTY,
        host: Buffers | None = None,
        device: Buffers | None = None,
        event: Event = None,
    ) -> None:
        self.index = index
        self.format = format
        self.capacity = capacity
        self.segments = [] if segments is None else segments
        self.state = state
        self.host = host
        self.device = device
        self.event = event

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, capacity: int) -> None:
        self._capacity = capacity
        self.specs: tuple[tuple[int, torch.dtype], ...] = tuple(self.format.buffer_specs(capacity))
        """The buffers of the page's format at this capacity."""
        self.nbytes: int = self.format.nbytes(capacity)
        """Bytes of the page's block (its buffers, each aligned), what a device slot of it holds."""
        self.host_nbytes: int | None = None
        """Bytes the store's backend holds for the page's host buffers (set by the store at first use)."""

    def __repr__(self) -> str:
        return f"Page(index={self.index}, capacity={self.capacity}, state={self.state.name}, segments={self.segments})"


@dataclass
class PagingStats:
    """Cumulative transfer counters of a store."""

    bytes_to_device: int = 0
    bytes_to_host: int = 0
    page_ins: int = 0
    page_outs: int = 0
    stall_seconds: float = 0.0


OPERATIONS = ("page_in", "resident", "page_out", "released", "written")
"""The page operations a store reports to its observers: a copy to the device started (or a page made there), a page
made resident, a write-back started, a written-back page's device buffers released, a page's host buffers
replaced."""


class PageStore:
    """Pages of optimizer state under a device budget.

    Args:
        backend: allocates buffers and copies them for one device.
        device_budget: the most bytes of page buffers on the device at any time, or ``None`` for no limit.
        prefetch: how many pages a step copies to the device ahead of the page being updated.
    """

    def __init__(self, backend: SyncBackend, device_budget: int | None, prefetch: int) -> None:
        self.backend = backend
        self.device_budget = device_budget
        self.prefetch = prefetch
        self.pages: list[Page] = []
        self.stats = PagingStats()
        self.device_bytes = 0
        self.host_bytes = 0
        self.generation = 0
        """Advances whenever a page changes state or index: while it stays, every page keeps its device buffers."""
        self._lru: OrderedDict[int, Page] = OrderedDict()
        self._outgoing: deque[Page] = deque()
        self._pinned: set[int] = set()
        """Indices of the pages a step still has to update: never evicted."""
        self._observers: dict[str, list[Callable[[str, Page], None]]] = {operation: [] for operation in OPERATIONS}
        self._slots: dict[tuple[BufferSpec, ...], list[Buffers]] = {}
        """Free device blocks kept for reuse while a step streams, by buffer layout (counted in ``device_bytes``)."""
        self._host_slots: dict[tuple[BufferSpec, ...], list[Buffers]] = {}
        """Free host blocks kept for write-backs while a step streams, by buffer layout (counted in ``host_bytes``)."""
        self._keeping = False
        """Whether freed blocks are kept in :attr:`_slots` and :attr:`_host_slots` (while a step streams)."""

    def add_page(self, format: Any, capacity: int) -> Page:
        """Append an empty page of ``capacity`` elements laid out by ``format`` and return it."""
        page = Page(index=len(self.pages), format=format, capacity=capacity)
        self.pages.append(page)
        return page

    def add_observer(self, observer: Callable[[str, Page], None], operations: Iterable[str] = OPERATIONS) -> None:
        """Call ``observer(operation, page)`` after every page operation among ``operations`` (for monitoring and
        tests; by default all of :data:`OPERATIONS`)."""
        for operation in operations:
            self._observers[operation].append(observer)

    @property
    def max_page_bytes(self) -> int:
        return max((page.nbytes for page in self.pages), default=0)

    def pages_resident(self) -> int:
        return sum(page.state is RESIDENT for page in self.pages)

    # Budget and eviction ---------------------------------------------------------------------------

    def set_budget(self, device_budget: int | None) -> None:
        """Set the budget and write back pages until the device holds no more than it."""
        self.device_budget = device_budget
        self._make_room(0, blocking=True)

    def evict(self, nbytes: int | None = None) -> int:
        """Write back least recently used pages until at least ``nbytes`` (``None``: all) are freed.

        Returns the number of device bytes freed. Waits for the write-backs to complete.
        """
        self._release_slots()
        before = self.device_bytes
        target = 0 if nbytes is None else before - nbytes
        victims = []
        projected = self.device_bytes - self._outgoing_bytes()
        for page in self._lru.values():
            if projected <= target:
                break
            victims.append(page)
            projected -= page.nbytes
        for page in victims:
            self._page_out(page)
        self._drain_outgoing()
        self._release_slots()
        return before - self.device_bytes

    def _outgoing_bytes(self) -> int:
        """Bytes of the pages being written back (a few: each is released once its copy completes)."""
        return sum(page.nbytes for page in self._outgoing)

    def _fits(self, nbytes: int) -> bool:
        return self.device_budget is None or self.device_bytes + nbytes <= self.device_budget

    def _room(self, nbytes: int, specs: tuple[BufferSpec, ...] | None) -> bool:
        """Whether a device slot of layout ``specs`` (``nbytes`` bytes; ``None``: any ``nbytes`` more) can be had
        within the budget: a kept one, or a new one once the kept slots, none of that layout, are released."""
        if specs is not None and self._slots.get(specs):
            return True
        if self._fits(nbytes):
            return True
        if not self._slots:
            return False
        self._release_slots()
        return self._fits(nbytes)

    def _make_room(self, nbytes: int, blocking: bool, specs: tuple[BufferSpec, ...] | None = None) -> bool:
        """Free device bytes until a slot of layout ``specs`` (``nbytes`` bytes; ``None``: ``nbytes`` more) fits in
        the budget (see :meth:`_room`), never evicting a page a step still has to update.

        Write-backs are started for as many least recently used pages as needed; when ``blocking``, the host then
        waits for them. Returns whether the slot fits. Constant time per page written back: the pages are taken from
        the front of the least recently used order, where a step's pages are not (each is moved to the end when it
        is handed out for its update).
        """
        self._release_completed()
        if self._room(nbytes, specs):
            return True
        projected = self.device_bytes - self._outgoing_bytes() + nbytes
        victims = []
        for page in self._lru.values():
            if projected <= self.device_budget:
                break
            if page.index not in self._pinned:
                victims.append(page)
                projected -= page.nbytes
        for page in victims:
            self._page_out(page)
        if victims:
            self._release_completed()
        while blocking and not self._room(nbytes, specs) and self._outgoing:
            self._finish_page_out(self._outgoing[0], wait=True)
        return self._room(nbytes, specs)

    def clear(self) -> None:
        """Free every page (device and host buffers, copies in flight finished first) and forget them all."""
        self._drain_outgoing()
        self._release_slots()
        for page in self.pages:
            self._free(page)
        self.pages.clear()

    def remove(self, pages: Iterable[Page]) -> None:
        """Free ``pages`` (device and host buffers, copies in flight finished first) and forget them; the pages
        left are numbered again from 0 in their order (see :meth:`renumber`)."""
        gone = {id(page) for page in pages}
        for page in self.pages:
            if id(page) in gone:
                self._free(page)
        self.pages[:] = [page for page in self.pages if id(page) not in gone]
        self.renumber(range(len(self.pages)))

    def renumber(self, indices: Iterable[int]) -> None:
        """Give the pages, in their order, the ``indices`` (the pages a :class:`~hf_paged.stores.DeviceStores`
        numbers over its devices); the resident pages keep their order of use."""
        for page, index in zip(self.pages, indices, strict=True):
            page.index = index
        self._lru = OrderedDict((page.index, page) for page in self._lru.values())
        self.generation += 1

    def _free(self, page: Page) -> None:
        """Release the buffers of ``page`` (a write-back in flight finished first); it is empty afterwards."""
        if page.state is PAGING_OUT:
            self._finish_page_out(page, wait=True)
        if page.state in (PAGING_IN, RESIDENT):
            self._finish_page_in(page)
            self.backend.release(page.device)
        page.device, page.host, page.event = None, None, None
        self._set_state(page, EMPTY)

    # Transitions -----------------------------------------------------------------------------------

    def _set_state(self, page: Page, state: PageState) -> None:
        """Move ``page`` to ``state``, its bytes to where that state holds buffers."""
        on_device = state.on_device - page.state.on_device
        if on_device:
            self.device_bytes += page.nbytes * on_device
        on_host = state.on_host - page.state.on_host
        if on_host:
            if page.host_nbytes is None:
                page.host_nbytes = self.backend.host_nbytes(page.specs)
            self.host_bytes += page.host_nbytes * on_host
        previous = page.state
        page.state = state
        self.generation += 1
        if state is RESIDENT:  # from a state off the least recently used order: it goes to its end
            self._lru[page.index] = page
        elif previous is RESIDENT:
            del self._lru[page.index]

    def _slot(self, page: Page) -> Buffers:
        """A device block for ``page``: a kept slot of its layout, else a new one (room for it made)."""
        free = self._slots.get(page.specs)
        if not free:
            return self.backend.empty_device(page.specs)
        slot = free.pop()
        if not free:
            del self._slots[page.specs]
        self.device_bytes -= page.nbytes  # counted again as the page's
        return slot

    def _host_slot(self, page: Page) -> Buffers:
        """A host block for ``page``'s write-back: a kept one of its layout, else a new one."""
        free = self._host_slots.get(page.specs)
        if not free:
            return self.backend.empty_host(page.specs)
        self.host_bytes -= page.host_nbytes  # counted again as the page's
        return free.pop()

    def _release_slots(self) -> None:
        """Release the kept device slots and drop the kept host blocks."""
        for specs, free in self._slots.items():
            nbytes = packing(specs)[1]
            for slot in free:
                self.backend.release(slot)
                self.device_bytes -= nbytes
        self._slots.clear()
        for specs, free in self._host_slots.items():
            self.host_bytes -= self.backend.host_nbytes(specs) * len(free)
        self._host_slots.clear()

    def _page_in(self, page: Page) -> None:
        """Start bringing ``page`` to the device; room for it must already have been made."""
        if page.state is EMPTY:
            page.device = self._slot(page)
            zero_buffers(page.device)
            self._set_state(page, RESIDENT)
        elif page.state is HOST:
            page.device = self._slot(page)
            page.event = self.backend.copy_to_device(page.device, page.host)
            self._set_state(page, PAGING_IN)
            self.stats.bytes_to_device += page.nbytes
            self.stats.page_ins += 1
        elif page.state is PAGING_OUT:
            self._outgoing.remove(page)
            self._set_state(page, PAGING_IN)
        for observer in self._observers["page_in"]:
            observer("page_in", page)

    def _finish_page_in(self, page: Page) -> None:
        """Order the compute stream after ``page``'s copy (the host does not wait) and drop its host copy."""
        if page.state is PAGING_IN:
            self.backend.order_after(page.event)
            host = page.host
            page.host, page.event = None, None
            self._set_state(page, RESIDENT)
            kept = self._host_slots.setdefault(page.specs, []) if self._keeping else None
            if kept is not None and len(kept) <= max(1, self.prefetch):  # a copy window's write-backs take them
                kept.append(host)
                self.host_bytes += page.host_nbytes
            for observer in self._observers["resident"]:
                observer("resident", page)
        else:
            self._lru.move_to_end(page.index)

    def _page_out(self, page: Page) -> None:
        """Start writing ``page`` back to host memory."""
        if page.host_nbytes is None:
            page.host_nbytes = self.backend.host_nbytes(page.specs)
        page.host = self._host_slot(page)
        page.event = self.backend.copy_to_host(page.host, page.device)
        self._set_state(page, PAGING_OUT)
        self._outgoing.append(page)
        self.stats.bytes_to_host += page.nbytes
        self.stats.page_outs += 1
        for observer in self._observers["page_out"]:
            observer("page_out", page)

    def _finish_page_out(self, page: Page, wait: bool) -> None:
        if wait:
            self.stats.stall_seconds += self.backend.wait(page.event)
        self._outgoing.remove(page)
        slot = page.device
        page.device, page.event = None, None
        self._set_state(page, HOST)
        if self._keeping:
            self._slots.setdefault(page.specs, []).append(slot)
            self.device_bytes += page.nbytes
        else:
            self.backend.release(slot)
        for observer in self._observers["released"]:
            observer("released", page)

    def _release_completed(self) -> None:
        """Release the pages whose write-backs have completed: those at the front of the queue (a copy stream
        completes its copies in order)."""
        while self._outgoing and self.backend.is_done(self._outgoing[0].event):
            self._finish_page_out(self._outgoing[0], wait=False)

    def _drain_outgoing(self) -> None:
        while self._outgoing:
            self._finish_page_out(self._outgoing[0], wait=True)

    # One step --------------------------------------------------------------------------------------

    def stream(self, pages: list[Page]) -> Iterator[list[Page]]:
        """Yield ``pages`` in batches, each page once, resident on the device, for their update.

        The pages resident now come first, in one batch. The others follow in their order, in batches of the pages
        whose copies were started together: at most ``max(1, prefetch)`` copies, started while the batch before is
        updated (``prefetch`` 0: each page is copied when its turn comes), and the empty pages among them, which take
        no copy. Room for a copy is made by writing back
        least recently used pages, never one this step still has to update; a copy that finds no room without the
        host waiting waits for the next batch. The caller updates a batch's device buffers before taking the next
        batch. The store's work is constant time per page.
        """
        self._make_room(0, blocking=True)
        resident = [page for page in pages if page.state is RESIDENT]
        streamed = [page for page in pages if page.state is not RESIDENT]
        window = max(1, self.prefetch)
        ahead = window if self.prefetch else 0
        self._pinned = {page.index for page in pages}
        self._keeping = True
        position = 0
        try:
            batch = resident
            while batch or position < len(streamed):
                if not batch:
                    batch = self._start_copies(streamed, position, window, wait_for_room=True)
                    position += len(batch)
                following = self._start_copies(streamed, position, ahead, wait_for_room=False)
                position += len(following)
                if batch is resident:  # handed out for their update: the most recently used
                    for page in batch:
                        self._lru.move_to_end(page.index)
                else:
                    for page in batch:
                        self._finish_page_in(page)
                yield batch
                self._pinned.difference_update(page.index for page in batch)
                batch = following
        finally:
            # A step that stops early (an error, or the caller leaving) leaves no page in flight: pages fetched
            # ahead become resident, where eviction and the budget reach them.
            for page in streamed:
                if page.state is PAGING_IN:
                    self._finish_page_in(page)
            self._pinned = set()
            self._keeping = False
            self._release_slots()
        self._make_room(0, blocking=True)

    def _start_copies(self, pages: list[Page], first: int, count: int, wait_for_room: bool) -> list[Page]:
        """Start bringing ``pages`` from ``first`` on to the device, up to ``count`` copies, as long as room can be made
        without the host waiting (for the first of them, with ``wait_for_room``, waiting for write-backs if need be);
        return those started. An empty page takes no copy (its device buffers are zeroed on the compute stream), so
        it does not count: a step's first pages come in one batch where they fit."""
        started: list[Page] = []
        copies = 0
        for position in range(first, len(pages)):
            page = pages[position]
            copies += page.state is not EMPTY
            if copies > count or not self._fetch(page, blocking=wait_for_room and not started):
                break
            started.append(page)
        return started

    def _fetch(self, page: Page, blocking: bool) -> bool:
        """Start bringing ``page`` to the device if room can be made; return whether it was started."""
        if page.state is not PAGING_OUT and not self._make_room(page.nbytes, blocking, page.specs):
            if blocking:
                raise RuntimeError(
                    f"a page of {page.nbytes} bytes does not fit in the device budget of {self.device_budget} bytes"
                )
            return False
        self._page_in(page)
        return True

    # Reading and writing whole pages ----------------------------------------------------------------

    def read(self, page: Page) -> Buffers | None:
        """Return CPU copies of the newest buffers of ``page``, or ``None`` for an empty (all-zero) page."""
        if page.state is EMPTY:
            return None
        if page.state is PAGING_OUT:
            self._finish_page_out(page, wait=True)
        if page.state is HOST:
            return tuple(buffer.clone() for buffer in page.host)
        self._finish_page_in(page)
        return tuple(buffer.to("cpu", copy=True) for buffer in page.device)

    def write(self, page: Page, data: Buffers | None) -> None:
        """Replace the buffers of ``page`` with ``data`` (CPU tensors of its specs; ``None``: all zeros).

        The page rests in host memory afterwards (or is empty); the next step brings it in.
        """
        if page.state is PAGING_OUT:
            self._finish_page_out(page, wait=True)
        if page.state in (PAGING_IN, RESIDENT):
            self._finish_page_in(page)
            self.backend.release(page.device)
            page.device = None
            self._set_state(page, EMPTY)
        if data is None:
            page.host = None
            self._set_state(page, EMPTY)
            return
        if page.host is None:
            page.host = self.backend.empty_host(page.specs)
        for buffer, source in zip(page.host, data):
            buffer.copy_(source)
        self._set_state(page, HOST)
        for observer in self._observers["written"]:
            observer("written", page)
