"""How long ``hf-paged plan`` takes and how much host memory it needs for Llama-shaped models of 1B, 8B and 70B.

Each model is only a ``config.json`` (Llama 3.2 1B, Llama 3 8B and Llama 3 70B shapes, bfloat16) written to a
temporary directory: no weights exist anywhere. Each plan runs in its own process, so its peak resident memory
(``ru_maxrss``, imports included) is its own. Prints one line per model and setup: plan time (seconds), peak host
memory (MiB) and the planned forward+backward and optimizer-step peaks for a GPU (GiB).

    python benchmarks/plan_scale.py                      # QLoRA with checkpointing, batch 1 x 2048, all sizes
    python benchmarks/plan_scale.py --sizes 8B --method full --optim adamw_torch
    python benchmarks/plan_scale.py --write-config 8B llama-3-8b   # only the config.json, for hf-paged plan
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "1B": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32},
    "8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32},
    "70B": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64},
}
"""Llama 3 shapes; all have 8 key-value heads and a 128256-token vocabulary."""


def write_config(size: str, directory: Path) -> Path:
    """A Llama ``config.json`` of ``size`` in ``directory``."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=128256,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=size == "1B",
        dtype="bfloat16",
        **SHAPES[size],
    )
    config.save_pretrained(directory)
    return directory


def plan_one(model: str, method: str, optim: str, batch: int, tokens: int, checkpointing: bool) -> dict:
    """Plan one setup in this process; its time, peak host memory and planned peaks."""
    from hf_paged.cli.config import load_config
    from hf_paged.cli.plan import plan_setup, setup_from_config

    config = load_config(
        None,
        [
            f"model.name={model}",
            f"training.optim={optim}",
            "training.optim_args=null",
            f"training.per_device_train_batch_size={batch}",
            f"tokenizer.max_length={tokens}",
            f"lora.gradient_checkpointing={str(checkpointing).lower()}",
        ],
    )
    started = time.perf_counter()
    result = plan_setup(setup_from_config(config, method), device="cuda")
    return {
        "seconds": time.perf_counter() - started,
        "host_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "forward_backward_gib": result.forward_backward_peak / 2**30,
        "optimizer_step_gib": result.optimizer_step_peak / 2**30,
        "total_params": result.total_params,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--method", choices=("full", "lora", "qlora"), default="qlora")
    parser.add_argument("--optim", default="hf_paged_adamw_8bit")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--write-config", nargs=2, metavar=("SIZE", "DIRECTORY"), help="only write a config.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_config is not None:
        size, directory = args.write_config
        if size not in SHAPES:
            parser.error(f"--write-config: SIZE must be one of {', '.join(SHAPES)}, got {size!r}")
        print(write_config(size, Path(directory)) / "config.json")
        return
    checkpointing = not args.no_checkpointing
    if args.one is not None:
        print(json.dumps(plan_one(args.one, args.method, args.optim, args.batch, args.tokens, checkpointing)))
        return
    print(
        f"{args.method}, {args.optim}, batch {args.batch} x {args.tokens}, "
        f"checkpointing {'on' if checkpointing else 'off'}, planned for cuda"
    )
    print(f"{'model':<6}{'params':>16}{'plan s':>9}{'host MiB':>10}{'fwd+bwd GiB':>13}{'step GiB':>10}")
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as directory:
            write_config(size, Path(directory))
            command = [sys.executable, __file__, "--one", directory, "--method", args.method, "--optim", args.optim]
            command += ["--batch", str(args.batch), "--tokens", str(args.tokens)]
            command += [] if checkpointing else ["--no-checkpointing"]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        figures = json.loads(output.strip().splitlines()[-1])
        print(
            f"{size:<6}{figures['total_params']:>16,}{figures['seconds']:>9.1f}{figures['host_peak_mib']:>10.0f}"
            f"{figures['forward_backward_gib']:>13.2f}{figures['optimizer_step_gib']:>10.2f}"
        )


if __name__ == "__main__":
    main()
