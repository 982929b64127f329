"""Requests, through the job's key-value store, to replay a step on every rank after one rank ran out of memory.

When a rank runs out of memory in a micro-batch whose gradients the ranks all-reduce, its peers wait in those
all-reduces. The failing rank publishes a :class:`ReplayRequest` under the step's window and attempt, then joins the
all-reduces it owes; a peer reads the requests only once its own all-reduces completed, so it finds every request of
that attempt without a collective of its own (one store read per synchronized micro-batch). The keys live in the
store ``torchrun`` shares between all ranks of all nodes, under the launch and restart (see
:func:`~hf_paged.job_store.launch_scope`).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass

import torch.distributed as dist

from .job_store import default_store, launch_scope
from .sizes import format_size

_WINDOWS = itertools.count()
"""Windows (optimizer steps) of this process whose failures may be replayed on every rank: every rank of a job opens
the same windows in the same order, so the n-th window names one step on all of them."""


_connection: tuple[dist.Store, dist.Store] | None = None
"""The default process group's store that :class:`ReplayRequests` last used and this process's connection to it: one
per process and store, since opening one takes hundreds of milliseconds (a new process group brings a new store, a
restart of ``torchrun`` new processes)."""


def _default_connection() -> dist.Store:
    """This process's connection to the default process group's store, opened at its first use."""
    global _connection
    store = default_store()
    if _connection is None or _connection[0] is not store:
        _connection = (store, store.clone() if hasattr(store, "clone") else store)
    return _connection[1]


def next_window() -> int:
    """The number of the next window of this process (from 0)."""
    return next(_WINDOWS)


@dataclass
class ReplayRequest:
    """What one rank tells the others when it runs out of memory in a synchronized micro-batch: its global ``rank``,
    the optimizer ``step`` (from 1, ``None`` if not known), where (``phase``: ``"forward"`` or ``"backward"``), which
    micro-batch of how many (from 0), the error (``"OutOfMemoryError: ..."``), the optimizer state it moved to the host
    (bytes), how many of the gradients the ranks all-reduce it had handed over before the error, and its retry."""

    rank: int
    step: int | None
    phase: str
    micro_batch: int
    micro_batches: int
    error: str
    state_bytes_moved: int
    gradients_reduced: int
    gradients: int
    retry: int
    retries: int

    def describe(self) -> str:
        """One sentence: which rank ran out, where, and what it moved."""
        step = f"step {self.step}" if self.step is not None else "a step"
        reduced = (
            f", after {self.gradients_reduced} of {self.gradients} gradients were handed to the all-reduce"
            if self.phase == "backward"
            else ""
        )
        return (
            f"rank {self.rank} ran out of memory in the {self.phase} of {step} (micro-batch {self.micro_batch + 1} of "
            f"{self.micro_batches}{reduced}: {self.error}); it moved {format_size(self.state_bytes_moved)} of "
            f"optimizer state to the host, freed cached memory and joined the all-reduces it owed with zero gradients "
            f"(retry {self.retry} of {self.retries})"
        )


class ReplayRequests:
    """The replay requests of the job, in its store.

    Args:
        store: the job's key-value store, reached through a connection of its own; ``None``: the default process
            group's, through one connection per process that every ``ReplayRequests()`` shares.
    """

    def __init__(self, store: dist.Store | None = None) -> None:
        if store is None:
            self.store = _default_connection()
        else:
            self.store = store.clone() if hasattr(store, "clone") else store
        self.prefix = f"hf_paged/replay/{launch_scope()}"

    def _key(self, window: int, attempt: int) -> str:
        return f"{self.prefix}/{window}/{attempt}"

    def publish(self, window: int, attempt: int, request: ReplayRequest) -> None:
        """Add ``request`` to those of ``window``'s ``attempt`` (call it before joining the collectives owed).

        Returns once the store holds it: a ``TCPStore`` sends an append without waiting for a reply, and another
        connection's read could reach the store first; a read on this connection (the store serves each connection
        in order) waits for the append."""
        key = self._key(window, attempt)
        self.store.append(key, json.dumps(asdict(request)) + "\n")
        self.store.check([key])

    def read(self, window: int, attempt: int) -> list[ReplayRequest]:
        """The requests of ``window``'s ``attempt``, in the order published (one store round trip when there are
        none). Every request of the attempt is there once this rank's all-reduces of it have completed."""
        key = self._key(window, attempt)
        if not self.store.check([key]):
            return []
        lines = self.store.get(key).decode().splitlines()
        return [ReplayRequest(**json.loads(line)) for line in lines if line]
