"""Run a training script with the hf-paged optimizer names registered: ``python -m hf_paged.run SCRIPT.py ARGS...``.

The script needs no change: the names are registered before it builds its ``HfArgumentParser``, so
``--optim hf_paged_adamw_8bit`` works. Under ``accelerate launch -m hf_paged.run SCRIPT.py ARGS...`` every
process does the same, and a process group the script leaves open is ended once the script returns (all
ranks meet, then the group is destroyed, as PyTorch asks of a program before it exits).
``HF_PAGED_REPLACE_BITSANDBYTES=1`` also routes bitsandbytes' paged names to ours.
"""

from __future__ import annotations

import os
import runpy
import sys

from .integrations import register


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"hf_paged.run: no such script: {script}")
    register()
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    _end_process_group()


def _end_process_group() -> None:
    """End the process group a script left open: a barrier, so that no rank tears down its connections while
    another still uses them, then ``destroy_process_group``. Not after an error (a barrier would wait forever)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
