"""Integrations with the Hugging Face stack (these modules import transformers)."""

from .oom import disable_oom_recovery, enable_oom_recovery
from .trainer import OPTIMIZER_NAMES, parse_optim_args, register

__all__ = ["OPTIMIZER_NAMES", "disable_oom_recovery", "enable_oom_recovery", "parse_optim_args", "register"]
