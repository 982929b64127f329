"""Integrations with the Hugging Face stack (these modules import transformers)."""

from .trainer import OPTIMIZER_NAMES, parse_optim_args, register

__all__ = ["OPTIMIZER_NAMES", "parse_optim_args", "register"]
