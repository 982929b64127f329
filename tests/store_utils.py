"""Helpers of the tests of the job's store: a store that counts the connections opened to it."""

from __future__ import annotations

import torch.distributed as dist


class CountedConnections:
    """A store standing for the default process group's, counting the connections opened to it (its clones)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.connections = 0

    def clone(self) -> dist.Store:
        self.connections += 1
        return self.store.clone()
