"""``hf_paged.recover_oom`` with a DDP model, called once per step: how many connections to the job's store it opens.

Launched with ``torchrun --standalone --nproc-per-node 2 tests/scripts/recover_oom_connections.py --output-dir DIR``, on
the CPU (gloo). Each rank runs ``--steps`` steps of one micro-batch through ``recover_oom(..., model=ddp_model)``,
counting the connections opened to the default process group's store (its clones), and writes ``rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from store_utils import CountedConnections

import hf_paged
from hf_paged import replay_requests
from hf_paged.job_store import default_store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=5)
    options = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    counted = CountedConnections(default_store())
    replay_requests.default_store = lambda: counted
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    optimizer = hf_paged.PagedAdamW(model.parameters(), lr=1e-3)
    for _ in range(options.steps):
        hf_paged.recover_oom(lambda x: model(x).sum().backward(), [torch.randn(2, 4)], optimizer, model=model)
        optimizer.step()
        optimizer.zero_grad()
    result = {"steps": options.steps, "connections": counted.connections}
    with open(os.path.join(options.output_dir, f"rank{dist.get_rank()}.json"), "w") as file:
        json.dump(result, file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
