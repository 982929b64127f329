"""Run a training script with the hf-paged optimizer names registered: ``python -m hf_paged.run SCRIPT.py ARGS...``.

The script needs no change: the import hook that ``import hf_paged`` installs (:mod:`hf_paged._autoregister`)
registers the names as the script loads transformers, before it builds its ``HfArgumentParser``, so
``--optim hf_paged_adamw_8bit`` works, and a script that never loads transformers does not wait for it. Under
``accelerate launch -m hf_paged.run SCRIPT.py ARGS...`` every process does the same, and once the script returns (or
exits with status 0), a process group it left open is ended (all ranks meet, then the group is destroyed, as PyTorch
asks of a program before it exits) and the process ends without the interpreter's finalization, in which gloo's
threads can abort it (see :mod:`hf_paged.process_exit`). ``HF_PAGED_REPLACE_BITSANDBYTES=1`` also routes
bitsandbytes' paged names to ours.
"""

from __future__ import annotations

import os
import runpy
import sys

from .process_exit import end_distributed_run


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"hf_paged.run: no such script: {script}")
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_request:  # sys.exit(main()), as example scripts end
        if exit_request.code not in (None, 0):
            raise
    end_distributed_run()


if __name__ == "__main__":
    main()
