"""hf-paged: paged optimizers for fine-tuning with the Hugging Face stack.

The optimizers keep their state in pages that live on the accelerator under an explicit device budget
or rest in host memory, and work the same on CUDA, other accelerators and the CPU.
"""

from .optim import PagedAdamW, PagedAdamW8bit, PagedLion, PagedLion8bit, PagedOptimizer
from .sizes import parse_size

__version__ = "0.1.0"

__all__ = ["PagedAdamW", "PagedAdamW8bit", "PagedLion", "PagedLion8bit", "PagedOptimizer", "parse_size"]
