"""One page store per device, behind the interface of one store, and a device budget per device.

An optimizer whose parameters span several devices (a model loaded with ``device_map="auto"``) keeps the
state of each parameter on that parameter's device. :class:`DeviceStores` owns a
:class:`~hf_paged.store.PageStore` per device and offers the page store's interface over all of them:
pages are numbered across devices, and reading, writing and streaming a page go to the store of its
device. A page never mixes devices, and each store keeps its own device under its own budget.

Devices are named by :func:`device_key` (``"cpu"``, ``"cuda:0"``); any name ``torch.device`` accepts works,
so tests can give parameters on the CPU a pseudo device such as ``"cpu:1"`` with its own store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .budget import AutoBudget
from .device import Buffers
from .sizes import parse_size
from .store import OPERATIONS, Page, PageStore, PagingStats

Budget = int | None | str | AutoBudget
"""One device's parsed budget: bytes, ``None`` (no limit), ``"auto"`` (a new AutoBudget) or an AutoBudget."""


def device_key(device: torch.device | str) -> str:
    """The name of ``device`` that keys its store and budget: ``"cpu"``, ``"cuda:0"`` (index-less: the current)."""
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        module = getattr(torch, device.type, None)
        if hasattr(module, "current_device") and module.is_available():
            device = torch.device(device.type, module.current_device())
    return str(device)


def _parse_one_budget(budget: Any, name: str, page_size: int) -> Budget:
    if budget is None or isinstance(budget, AutoBudget):
        return budget
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        return "auto"
    try:
        nbytes = parse_size(budget, name)
    except ValueError as error:
        raise ValueError(f"{error}; or 'auto' to follow measured memory") from None
    if nbytes < page_size:
        raise ValueError(
            f"{name}={budget!r} is smaller than one page ({page_size} bytes): use None for no limit, "
            "'auto', or a budget of at least page_size (to free device memory before a spike, call evict())"
        )
    return nbytes


@dataclasses.dataclass(frozen=True)
class DeviceBudget:
    """A parsed ``device_budget``: one budget for every device, or a budget per device (others: no limit)."""

    default: Budget = None
    per_device: Mapping[str, Budget] | None = None

    @classmethod
    def parse(cls, budget: Any, name: str, page_size: int) -> DeviceBudget:
        """Parse bytes, a size string, ``None``, ``"auto"``, an AutoBudget, or a dict of device to any of these.

        Raises ValueError (TypeError for a value of the wrong type) naming ``name`` and, for a dict, the key.
        """
        if not isinstance(budget, Mapping):
            return cls(default=_parse_one_budget(budget, name, page_size))
        per_device: dict[str, Budget] = {}
        for key, value in budget.items():
            if not isinstance(key, (str, torch.device)):
                raise TypeError(f"{name} keys must be devices such as 'cuda:0', got {key!r}")
            try:
                device = device_key(key)
            except RuntimeError:
                raise ValueError(f"{name} key {key!r} is not a device: use names such as 'cuda:0' or 'cpu'") from None
            if device in per_device:
                raise ValueError(f"{name} gives device {device} two budgets (key {key!r})")
            per_device[device] = _parse_one_budget(value, f"{name}[{key!r}]", page_size)
        return cls(per_device=per_device)

    def resolve(self, devices: list[str]) -> dict[str, int | None | AutoBudget]:
        """The budget of each of ``devices``, a new AutoBudget for each ``"auto"``.

        Raises ValueError if one AutoBudget would measure two devices.
        """
        resolved: dict[str, int | None | AutoBudget] = {}
        owners: dict[int, str] = {}
        for device in devices:
            budget = self.default if self.per_device is None else self.per_device.get(device)
            if budget == "auto":
                budget = AutoBudget()
            if isinstance(budget, AutoBudget):
                if id(budget) in owners:
                    raise ValueError(
                        f"one AutoBudget cannot measure both {owners[id(budget)]} and {device}: pass 'auto' or a "
                        "dict with an AutoBudget per device"
                    )
                owners[id(budget)] = device
            resolved[device] = budget
        return resolved


class DeviceStores:
    """The pages of one optimizer in one :class:`PageStore` per device, with the interface of one store.

    Page indices run over all devices (``pages[i].index == i``); operations on a page go to its device's
    store, and the figures (``device_bytes``, ``host_bytes``, ``stats``, ``device_budget``) are totals.

    Args:
        new_store: makes the store of a device (named by :func:`device_key`) the first time it gets a page.
    """

    def __init__(self, new_store: Callable[[str], PageStore]) -> None:
        self._new_store = new_store
        self.stores: dict[str, PageStore] = {}
        self.pages: list[Page] = []
        self._page_devices: list[str] = []
        self._observers: list[tuple[Callable[[str, Page], None], tuple[str, ...]]] = []

    def store_for(self, device: str) -> PageStore:
        """The store of ``device``, made (under its budget) if it has none yet."""
        store = self.stores.get(device)
        if store is None:
            store = self._new_store(device)
            for observer, operations in self._observers:
                store.add_observer(observer, operations)
            self.stores[device] = store
        return store

    def add_page(self, format: Any, capacity: int, device: str) -> Page:
        """Append an empty page on ``device`` (making its store if needed) and return it."""
        page = self.store_for(device).add_page(format, capacity)
        page.index = len(self.pages)  # the device's store keys pages by index only
        self.pages.append(page)
        self._page_devices.append(device)
        return page

    def device_of(self, page: Page) -> str:
        """The device whose store holds ``page``."""
        return self._page_devices[page.index]

    def store_of(self, page: Page) -> PageStore:
        """The store that holds ``page``."""
        return self.stores[self.device_of(page)]

    def add_observer(self, observer: Callable[[str, Page], None], operations: Iterable[str] = OPERATIONS) -> None:
        """Call ``observer(operation, page)`` after every page operation among ``operations`` on any device."""
        operations = tuple(operations)
        self._observers.append((observer, operations))
        for store in self.stores.values():
            store.add_observer(observer, operations)

    # Totals -----------------------------------------------------------------------------------------

    @property
    def device_bytes(self) -> int:
        """Bytes of page buffers on all devices."""
        return sum(store.device_bytes for store in self.stores.values())

    @property
    def host_bytes(self) -> int:
        """Bytes of page buffers in host memory."""
        return sum(store.host_bytes for store in self.stores.values())

    @property
    def stats(self) -> PagingStats:
        """Transfer counters summed over the devices."""
        return PagingStats(
            **{
                field.name: sum(getattr(store.stats, field.name) for store in self.stores.values())
                for field in dataclasses.fields(PagingStats)
            }
        )

    @property
    def max_page_bytes(self) -> int:
        return max((page.nbytes for page in self.pages), default=0)

    def pages_resident(self) -> int:
        return sum(store.pages_resident() for store in self.stores.values())

    @property
    def device_budget(self) -> int | None:
        """The sum of the devices' budgets, ``None`` if any device has no limit (or there is no device yet)."""
        budgets = [store.device_budget for store in self.stores.values()]
        return None if not budgets or None in budgets else sum(budgets)

    # Budget and eviction ----------------------------------------------------------------------------

    def set_budget(self, device_budget: int | None) -> None:
        """Give every device the budget ``device_budget`` (bytes, ``None``: no limit), evicting down to it."""
        for store in self.stores.values():
            store.set_budget(device_budget)

    def evict(self, nbytes: int | None = None) -> int:
        """Write back pages, device after device, until at least ``nbytes`` (``None``: all) are freed.

        Returns the device bytes freed, over all devices.
        """
        freed = 0
        for store in self.stores.values():
            if nbytes is not None and freed >= nbytes:
                break
            freed += store.evict(None if nbytes is None else nbytes - freed)
        return freed

    def remove(self, pages: list[Page]) -> None:
        """Free and forget ``pages``; the pages left are numbered again over the devices, in their order."""
        gone = {id(page) for page in pages}
        for store in self.stores.values():
            store.remove([page for page in store.pages if id(page) in gone])
        kept = [(page, device) for page, device in zip(self.pages, self._page_devices) if id(page) not in gone]
        self.pages[:] = [page for page, _ in kept]
        self._page_devices[:] = [device for _, device in kept]
        index_of = {id(page): index for index, page in enumerate(self.pages)}
        for store in self.stores.values():
            store.renumber([index_of[id(page)] for page in store.pages])

    def clear(self) -> None:
        """Free and forget every page of every device; the stores, their budgets and statistics stay."""
        for store in self.stores.values():
            store.clear()
        self.pages.clear()
        self._page_devices.clear()

    # One step and whole pages -----------------------------------------------------------------------

    def stream(self, pages: list[Page]) -> Iterator[list[Page]]:
        """Yield ``pages`` in batches resident on their device (see :meth:`PageStore.stream`): the batches of
        one device after another."""
        if len(self.stores) == 1:  # every page is that store's
            yield from next(iter(self.stores.values())).stream(pages)
            return
        by_device: dict[str, list[Page]] = {}
        for page in pages:
            by_device.setdefault(self.device_of(page), []).append(page)
        for device, device_pages in by_device.items():
            yield from self.stores[device].stream(device_pages)

    def read(self, page: Page) -> Buffers | None:
        """CPU copies of the newest buffers of ``page``, ``None`` for an empty page (see :meth:`PageStore.read`)."""
        return self.store_of(page).read(page)

    def write(self, page: Page, data: Buffers | None) -> None:
        """Replace the buffers of ``page`` (see :meth:`PageStore.write`)."""
        self.store_of(page).write(page, data)
