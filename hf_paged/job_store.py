"""The job's key-value store, which every rank of every node reaches without a collective, and keys per launch.

``torchrun`` (and ``init_process_group``) share one store between all ranks of a job; hf-paged keeps in it what one
rank tells the others outside the collectives they may be waiting in: a failure that ends the job
(:mod:`hf_paged.rank_failure`) and a request to replay a step (:mod:`hf_paged.replay_requests`).
"""

from __future__ import annotations

import os

import torch.distributed as dist


def default_store() -> dist.Store:
    """The key-value store of the default process group (the one every rank of every node reaches).

    Raises:
        RuntimeError: the default process group is not initialized.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("hf-paged needs torch.distributed's default process group here: initialize it first")
    return dist.distributed_c10d._get_default_store()


def launch_scope() -> str:
    """What tells this launch and restart of ``torchrun`` from the others in the job's store (``run/restart``): keys
    under it are not seen by a restarted job (``--max-restarts``)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{run}/{restart}"
