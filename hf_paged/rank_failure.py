"""A failure on one rank ends every rank of the job within seconds, with a note on what failed and what to change.

When one process of a distributed job fails (an out-of-memory error in its backward, say), its peers wait in the
next collective it never joins. On CPU (gloo) they soon see its connections close; on GPUs (NCCL) they wait until
the collective's timeout, often 10 to 30 minutes of a whole cluster, and across nodes no launcher stops them
earlier. Here the failing rank publishes a :class:`RankFailure` (rank, step, error, what to change) in the job's
key-value store, the one ``torchrun`` and ``init_process_group`` share between all ranks of all nodes, and every
rank runs a :class:`RankFailureWatcher`, a daemon thread that reads the store every ``poll_interval`` seconds
without a collective. When a peer's failure appears, the watcher logs the note, lets a checkpoint being written
finish (up to ``grace`` seconds), aborts the process group where the backend supports it and ends the process.
A store that stays unreachable for ``store_lost_after`` seconds (the node that held it has gone) ends it too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch.distributed as dist

from .job_store import default_store, launch_scope
from .recovery import ADVICE, is_out_of_memory, not_recovered_reason

logger = logging.getLogger(__name__)

EXIT_CODE = 1
"""The exit status of a process the watcher ends."""


@dataclass
class RankFailure:
    """What failed on one rank: its global ``rank``, the optimizer ``step`` it was in (from 1, ``None`` if not known),
    where (``phase``), the error (``"OutOfMemoryError: ..."``), what to change, the last checkpoint written and, for an
    out-of-memory error hf-paged tried to recover from, why it could not (``not_recovered``)."""

    rank: int
    step: int | None
    phase: str
    error: str
    advice: str
    checkpoint: str | None = None
    not_recovered: str | None = None

    @classmethod
    def of(
        cls, error: BaseException, rank: int, step: int | None, phase: str, checkpoint: str | None = None
    ) -> RankFailure:
        """The failure ``error`` raised on ``rank``; an out-of-memory error gets hf-paged's advice."""
        advice = ADVICE if is_out_of_memory(error) else f"See rank {rank}'s traceback for the cause."
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        error_line = f"{type(error).__name__}: {first_line}"[:500]
        return cls(rank, step, phase, error_line, advice, checkpoint, not_recovered_reason(error))

    def describe(self) -> str:
        """One paragraph: which rank failed, at which step, with what, why it was not recovered, what to change and
        where to resume."""
        step = f"step {self.step}" if self.step is not None else "an unknown step"
        resume = (
            f" Resume from the last checkpoint, {self.checkpoint}."
            if self.checkpoint
            else " No checkpoint was written before it."
        )
        why = f" hf-paged did not recover: {self.not_recovered}" if self.not_recovered else ""
        return f"rank {self.rank} failed in the {self.phase} of {step} with {self.error}.{why} {self.advice}{resume}"


def failure_key() -> str:
    """The store key of this job's failure record: one per launch and per restart of ``torchrun``, so that a
    restarted job does not see the failure that restarted it."""
    return f"hf_paged/rank_failure/{launch_scope()}"


class RankFailureWatcher:
    """Ends this process within seconds when another rank of the job publishes a :class:`RankFailure`.

    Args:
        store: the job's key-value store; ``None``: the default process group's.
        rank: this process's global rank; ``None``: the default process group's.
        poll_interval: seconds between two reads of the store (finite, > 0).
        grace: seconds a checkpoint being written (see :meth:`checkpointing`) may take to finish before the
            process ends anyway (its collectives may wait for the failed rank too); finite, >= 0.
        store_lost_after: seconds the store may stay unreachable before the job counts as ended (finite, >= 0).
        end_process: what ends the process, called with the exit status (``os._exit`` by default: the main thread
            may be blocked in a collective that only an exit interrupts).
    """

    def __init__(
        self,
        store: dist.Store | None = None,
        rank: int | None = None,
        *,
        poll_interval: float = 0.5,
        grace: float = 30.0,
        store_lost_after: float = 10.0,
        end_process: Callable[[int], None] = os._exit,
    ) -> None:
        for name, value in (("poll_interval", poll_interval), ("grace", grace), ("store_lost_after", store_lost_after)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if poll_interval == 0:
            raise ValueError("poll_interval must be a number of seconds > 0, got 0")
        store = default_store() if store is None else store
        self.store = store.clone() if hasattr(store, "clone") else store  # a connection of its own
        self.rank = dist.get_rank() if rank is None else rank
        self.key = failure_key()
        self.poll_interval = poll_interval
        self.grace = grace
        self.store_lost_after = store_lost_after
        self.end_process = end_process
        self._stop = threading.Event()
        self._checkpointing = 0
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None

    def start(self) -> RankFailureWatcher:
        """Start watching (a daemon thread); returns the watcher."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="hf-paged-rank-failure-watcher", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the job ended normally)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_interval + 5)
        self._thread = None

    def publish(self, failure: RankFailure) -> RankFailure:
        """Tell every rank of the job that this one failed; returns the job's first failure (another rank's where
        it was published earlier, as a peer's error that follows from it)."""
        try:
            first = self.store.compare_set(self.key, "", json.dumps(asdict(failure)))
            return RankFailure(**json.loads(first))
        except Exception as error:  # noqa: BLE001  (the rank's own error matters more than the store's)
            logger.warning("hf-paged: could not publish rank %d's failure in the job's store: %s", self.rank, error)
            return failure

    @contextlib.contextmanager
    def checkpointing(self) -> Iterator[None]:
        """While inside, a peer's failure waits (up to ``grace`` seconds) before ending the process, so that a
        checkpoint being written is finished."""
        with self._lock:
            self._checkpointing += 1
        try:
            yield
        finally:
            with self._lock:
                self._checkpointing -= 1
                self._lock.notify_all()

    # Internals ------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        unreachable_since: float | None = None
        while not self._stop.wait(self.poll_interval):
            try:
                found = self.store.check([self.key])
                record = json.loads(self.store.get(self.key)) if found else None
            except Exception as error:  # noqa: BLE001  (a store that went away: its host ended)
                if self._stop.is_set():
                    return
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since >= self.store_lost_after:
                    self._end(
                        f"hf-paged: ending rank {self.rank}: the job's store has been unreachable for "
                        f"{self.store_lost_after:g} s ({type(error).__name__}: {error}); the node that held it has "
                        "ended, so the collectives of this rank would wait for ranks that are gone."
                    )
                    return
                continue
            unreachable_since = None
            if record is not None and record["rank"] != self.rank:
                failure = RankFailure(**record)
                self._end(f"hf-paged: ending rank {self.rank} because {failure.describe()}")
                return

    def _end(self, note: str) -> None:
        """Log ``note``, let a checkpoint being written finish, abort the process group and end the process."""
        logger.error(note)
        with self._lock:
            finished = self._lock.wait_for(lambda: self._checkpointing == 0, timeout=self.grace)
        if not finished:
            logger.error("hf-paged: rank %d ends while writing a checkpoint; it may be incomplete", self.rank)
        aborting = threading.Thread(target=_abort_process_group, daemon=True)
        aborting.start()
        aborting.join(timeout=5.0)
        sys.stderr.flush()
        sys.stdout.flush()
        self.end_process(EXIT_CODE)


def _abort_process_group() -> None:
    """Abort the default process group where its backend can (NCCL): its pending collectives end at once."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):  # gloo cannot abort; the process ends either way
        dist.group.WORLD.abort()
