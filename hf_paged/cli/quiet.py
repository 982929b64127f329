"""Third-party messages that ``hf-paged train`` keeps out of a run because the user cannot act on them.

Each filter is scoped to one logger and one message, or to one warning; everything else those libraries say still
reaches the user. A message that matters for the run is said once in our own words instead (see :func:`notes`).
The examples and the quickstart notebook call :func:`install` too; importing ``hf_paged`` installs nothing.
"""

from __future__ import annotations

import logging
import re
import warnings


class _MessageFilter(logging.Filter):
    """Drops the records of one logger whose message matches ``pattern`` (a regular expression), and counts them."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.pattern.search(record.getMessage()):
            self.dropped += 1
            return False
        return True


_FILTERS = {
    # bitsandbytes tries to fetch an optional fast CPU kernel for 4-bit matmuls from the hub when it is imported
    # on CPUs with AVX-512 bf16; without it the 4-bit layers use bitsandbytes' portable CPU path.
    "bitsandbytes.backends.cpu.ops": _MessageFilter(r"^Failed to load CPU gemm_4bit_forward"),
    "kernels._internals.hf_hub": _MessageFilter(r"^Skipping publisher trust check"),
    # torchao's optional CUDA extensions, built for other Python or CUDA versions (peft imports torchao).
    "torchao": _MessageFilter(r"^Failed to load .*torchao[/\\]_C\w*\.\S+"),
    # A notice to torchao's authors about how it registers its enums with torch.compile.
    "torch.utils._pytree": _MessageFilter(r"is an Enum subclass and is now natively supported"),
    # DeepSpeed, when installed, says on every CPU-only import that it found no accelerator.
    "DeepSpeed": _MessageFilter(r"^Setting accelerator to CPU\."),
}


_WARNINGS = (
    # tqdm.auto in a notebook without ipywidgets: the progress bars are drawn as text instead of widgets.
    (r"IProgress not found", r"tqdm\."),
)
"""(message, module) regular expressions of the warnings kept out."""


def install() -> None:
    """Keep the messages above out of this process (idempotent): call it first, before the libraries are imported,
    as ``hf-paged train``, the examples and the notebook do."""
    for name, message_filter in _FILTERS.items():
        logger = logging.getLogger(name)
        if message_filter not in logger.filters:
            logger.addFilter(message_filter)
    for message, module in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)


def notes() -> list[str]:
    """What the dropped messages mean for this run, in our words: one line for each that matters."""
    if _FILTERS["bitsandbytes.backends.cpu.ops"].dropped:
        return ["4-bit matmuls use bitsandbytes' portable CPU path (its optional fast kernel is not installed)"]
    return []
