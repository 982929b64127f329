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
from dataclasses import dataclass, field
from typing import Any

import torch

from .device import Buffers, Event, SyncBackend


class PageState(enum.Enum):
    EMPTY = "empty"
    HOST = "host"
    PAGING_IN = "paging_in"
    RESIDENT = "resident"
    PAGING_OUT = "paging_out"


_ON_DEVICE = (PageState.PAGING_IN, PageState.RESIDENT, PageState.PAGING_OUT)
_ON_HOST = (PageState.HOST, PageState.PAGING_IN, PageState.PAGING_OUT)


@dataclass(eq=False)
class Segment:
    """``length`` elements of the tensor numbered ``owner``, from element ``start``, at element ``offset`` of a page.

    The owner's number is the optimizer's (see :class:`~hf_paged.optim.layout.StateLayout`); the store never reads it.
    """

    owner: int
    start: int
    length: int
    offset: int


@dataclass(eq=False)
class Page:
    """One page: ``capacity`` elements of state in the buffers its format lays out."""

    index: int
    format: Any
    capacity: int
    segments: list[Segment] = field(default_factory=list)
    state: PageState = PageState.EMPTY
    host: Buffers | None = None
    device: Buffers | None = None
    event: Event = None

    @property
    def specs(self) -> list[tuple[int, torch.dtype]]:
        return self.format.buffer_specs(self.capacity)

    @property
    def nbytes(self) -> int:
        return self.format.nbytes(self.capacity)


@dataclass
class PagingStats:
    """Cumulative transfer counters of a store."""

    bytes_to_device: int = 0
    bytes_to_host: int = 0
    page_ins: int = 0
    page_outs: int = 0
    stall_seconds: float = 0.0


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
        self._lru: OrderedDict[int, Page] = OrderedDict()
        self._outgoing: deque[Page] = deque()
        self._observers: list[Callable[[str, Page], None]] = []

    def add_page(self, format: Any, capacity: int) -> Page:
        """Append an empty page of ``capacity`` elements laid out by ``format`` and return it."""
        page = Page(index=len(self.pages), format=format, capacity=capacity)
        self.pages.append(page)
        return page

    def add_observer(self, observer: Callable[[str, Page], None]) -> None:
        """Call ``observer(operation, page)`` after every page operation (for monitoring and tests)."""
        self._observers.append(observer)

    @property
    def max_page_bytes(self) -> int:
        return max((page.nbytes for page in self.pages), default=0)

    def pages_resident(self) -> int:
        return sum(page.state is PageState.RESIDENT for page in self.pages)

    # Budget and eviction ---------------------------------------------------------------------------

    def set_budget(self, device_budget: int | None) -> None:
        """Set the budget and write back pages until the device holds no more than it."""
        self.device_budget = device_budget
        self._make_room(0, pinned=(), blocking=True)

    def evict(self, nbytes: int | None = None) -> int:
        """Write back least recently used pages until at least ``nbytes`` (``None``: all) are freed.

        Returns the number of device bytes freed. Waits for the write-backs to complete.
        """
        before = self.device_bytes
        target = 0 if nbytes is None else before - nbytes
        for page in list(self._lru.values()):
            if self.device_bytes - self._outgoing_bytes() <= target:
                break
            self._page_out(page)
        self._drain_outgoing()
        return before - self.device_bytes

    def _outgoing_bytes(self) -> int:
        return sum(page.nbytes for page in self._outgoing)

    def _fits(self, nbytes: int) -> bool:
        return self.device_budget is None or self.device_bytes + nbytes <= self.device_budget

    def _make_room(self, nbytes: int, pinned: Iterable[Page], blocking: bool) -> bool:
        """Free device bytes until ``nbytes`` more fit in the budget, never evicting a ``pinned`` page.

        Write-backs are started for as many least recently used pages as needed; when ``blocking``,
        the host then waits for them. Returns whether the bytes fit.
        """
        self._release_completed()
        if self._fits(nbytes):
            return True
        keep = {page.index for page in pinned}
        for page in list(self._lru.values()):
            if self.device_bytes - self._outgoing_bytes() + nbytes <= self.device_budget:
                break
            if page.index not in keep:
                self._page_out(page)
        while blocking and not self._fits(nbytes) and self._outgoing:
            self._finish_page_out(self._outgoing[0], wait=True)
        return self._fits(nbytes)

    def clear(self) -> None:
        """Free every page (device and host buffers, copies in flight finished first) and forget them all."""
        self._drain_outgoing()
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

    def _free(self, page: Page) -> None:
        """Release the buffers of ``page`` (a write-back in flight finished first); it is empty afterwards."""
        if page.state is PageState.PAGING_OUT:
            self._finish_page_out(page, wait=True)
        if page.state in (PageState.PAGING_IN, PageState.RESIDENT):
            self._finish_page_in(page)
            self.backend.release(page.device)
        page.device, page.host, page.event = None, None, None
        self._set_state(page, PageState.EMPTY)

    # Transitions -----------------------------------------------------------------------------------

    def _notify(self, operation: str, page: Page) -> None:
        for observer in self._observers:
            observer(operation, page)

    def _set_state(self, page: Page, state: PageState) -> None:
        self.device_bytes += page.nbytes * ((state in _ON_DEVICE) - (page.state in _ON_DEVICE))
        on_host = (state in _ON_HOST) - (page.state in _ON_HOST)
        if on_host:
            self.host_bytes += self.backend.host_nbytes(page.specs) * on_host
        page.state = state
        if state is PageState.RESIDENT:
            self._lru[page.index] = page
            self._lru.move_to_end(page.index)
        else:
            self._lru.pop(page.index, None)

    def _page_in(self, page: Page) -> None:
        """Start bringing ``page`` to the device; room for it must already have been made."""
        if page.state is PageState.EMPTY:
            page.device = self.backend.empty_device(page.specs)
            for buffer in page.device:
                buffer.zero_()
            self._set_state(page, PageState.RESIDENT)
        elif page.state is PageState.HOST:
            page.device = self.backend.empty_device(page.specs)
            page.event = self.backend.copy_to_device(page.device, page.host)
            self._set_state(page, PageState.PAGING_IN)
            self.stats.bytes_to_device += page.nbytes
            self.stats.page_ins += 1
        elif page.state is PageState.PAGING_OUT:
            self._outgoing.remove(page)
            self._set_state(page, PageState.PAGING_IN)
        self._notify("page_in", page)

    def _finish_page_in(self, page: Page) -> None:
        """Order the compute stream after ``page``'s copy (the host does not wait) and drop its host copy."""
        if page.state is PageState.PAGING_IN:
            self.backend.order_after(page.event)
            page.host, page.event = None, None
            self._set_state(page, PageState.RESIDENT)
            self._notify("resident", page)
        self._lru.move_to_end(page.index)

    def _page_out(self, page: Page) -> None:
        """Start writing ``page`` back to host memory."""
        page.host = self.backend.empty_host(page.specs)
        page.event = self.backend.copy_to_host(page.host, page.device)
        self._set_state(page, PageState.PAGING_OUT)
        self._outgoing.append(page)
        self.stats.bytes_to_host += page.nbytes
        self.stats.page_outs += 1
        self._notify("page_out", page)

    def _finish_page_out(self, page: Page, wait: bool) -> None:
        if wait:
            self.stats.stall_seconds += self.backend.wait(page.event)
        self._outgoing.remove(page)
        self.backend.release(page.device)
        page.device, page.event = None, None
        self._set_state(page, PageState.HOST)
        self._notify("released", page)

    def _release_completed(self) -> None:
        for page in [page for page in self._outgoing if self.backend.is_done(page.event)]:
            self._finish_page_out(page, wait=False)

    def _drain_outgoing(self) -> None:
        while self._outgoing:
            self._finish_page_out(self._outgoing[0], wait=True)

    # One step --------------------------------------------------------------------------------------

    def stream(self, pages: list[Page]) -> Iterator[list[Page]]:
        """Yield ``pages`` in batches, each page once, resident on the device, for their update.

        When every page is resident they come in one batch, which a multi-tensor kernel updates in one call.
        Otherwise each batch is one page: the resident pages first, then the others in their order,
        ``prefetch`` of them copied ahead while the page before is updated (an updated page makes room
        for the next copy). A page whose room is needed later is written back once it has been updated.
        The caller updates a batch's device buffers before taking the next batch.
        """
        self._make_room(0, pinned=(), blocking=True)
        resident = [page for page in pages if page.state is PageState.RESIDENT]
        streamed = [page for page in pages if page.state is not PageState.RESIDENT]
        if resident and not streamed:
            for page in resident:
                self._finish_page_in(page)
            yield resident
            self._make_room(0, pinned=(), blocking=True)
            return
        pending: dict[int, Page] = {page.index: page for page in pages}
        schedule = [([page], -1) for page in resident] + [([page], position) for position, page in enumerate(streamed)]
        fetched = 0
        try:
            for batch, position in schedule:
                if position == fetched:
                    self._fetch(batch[0], pending.values(), blocking=True)
                    fetched += 1
                while fetched < len(streamed) and fetched - position - 1 < self.prefetch:
                    if not self._fetch(streamed[fetched], pending.values(), blocking=False):
                        break
                    fetched += 1
                for page in batch:
                    self._finish_page_in(page)
                yield batch
                for page in batch:
                    del pending[page.index]
        finally:
            # A step that stops early (an error, or the caller leaving) leaves no page in flight: pages fetched
            # ahead become resident, where eviction and the budget reach them.
            for page in pending.values():
                if page.state is PageState.PAGING_IN:
                    self._finish_page_in(page)
        self._make_room(0, pinned=(), blocking=True)

    def _fetch(self, page: Page, pinned: Iterable[Page], blocking: bool) -> bool:
        """Start bringing ``page`` to the device if room can be made; return whether it was started."""
        if page.state is not PageState.PAGING_OUT and not self._make_room(page.nbytes, pinned, blocking):
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
        if page.state is PageState.EMPTY:
            return None
        if page.state is PageState.PAGING_OUT:
            self._finish_page_out(page, wait=True)
        if page.state is PageState.HOST:
            return tuple(buffer.clone() for buffer in page.host)
        self._finish_page_in(page)
        return tuple(buffer.to("cpu", copy=True) for buffer in page.device)

    def write(self, page: Page, data: Buffers | None) -> None:
        """Replace the buffers of ``page`` with ``data`` (CPU tensors of its specs; ``None``: all zeros).

        The page rests in host memory afterwards (or is empty); the next step brings it in.
        """
        if page.state is PageState.PAGING_OUT:
            self._finish_page_out(page, wait=True)
        if page.state in (PageState.PAGING_IN, PageState.RESIDENT):
            self._finish_page_in(page)
            self.backend.release(page.device)
            page.device = None
            self._set_state(page, PageState.EMPTY)
        if data is None:
            page.host = None
            self._set_state(page, PageState.EMPTY)
            return
        if page.host is None:
            page.host = self.backend.empty_host(page.specs)
        for buffer, source in zip(page.host, data):
            buffer.copy_(source)
        self._set_state(page, PageState.HOST)
        self._notify("written", page)
