"""Loads and tokenizes ``hf-paged train``'s data on every rank of a launch, as the command does, with rank 0 slowed.

Launched with ``torchrun --standalone --nproc-per-node 2 tests/scripts/tokenize_once.py --output-dir DIR``. Rank 0
sleeps ``--delay`` seconds before it loads the data, so that another rank, if it did not wait for rank 0, would
tokenize first and rank 0 would read its cache. Each rank writes ``rank<R>.json`` in ``--output-dir``: the number
of examples and the ``datasets`` maps it read from the cache instead of running (datasets' "Loading cached
processed dataset" log lines).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import datasets

from hf_paged.cli import train
from hf_paged.cli.config import load_config
from hf_paged.process_exit import end_distributed_run


class CacheReads(logging.Handler):
    """Counts datasets' log lines of a map or filter read from the cache."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("Loading cached processed dataset")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--delay", type=float, default=3.0, help="seconds rank 0 waits before loading")
    options = parser.parse_args()
    config = load_config(overrides=[f"training.output_dir={options.output_dir}", "data.max_samples=16"])
    args = train.training_arguments(config)
    rank = args.process_index
    cache_reads = CacheReads()
    datasets.logging.set_verbosity_info()
    datasets.logging.get_logger().addHandler(cache_reads)
    load_records = train.load_records
    if rank == 0:

        def slow_load_records(data):
            time.sleep(options.delay)
            return load_records(data)

        train.load_records = slow_load_records
    examples = train.training_data(config, train.build_tokenizer(config), args)
    os.makedirs(options.output_dir, exist_ok=True)
    with open(os.path.join(options.output_dir, f"rank{rank}.json"), "w") as file:
        json.dump({"examples": len(examples), "cache_reads": cache_reads.count}, file)


if __name__ == "__main__":
    main()
    end_distributed_run()  # ends the process: see hf_paged/process_exit.py
