"""Integrations with the Hugging Face stack (these modules import transformers).

The names below load their module on first use. The import hook of :mod:`hf_paged._autoregister` imports
:mod:`hf_paged.integrations.trainer` while a transformers module is still half imported (``training_args``,
imported by ``trainer_callback``); importing this package must then load nothing that needs the rest of
transformers, such as :mod:`hf_paged.integrations.oom` and its ``TrainerCallback``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "OPTIMIZER_NAMES": "trainer",
    "disable_oom_recovery": "oom",
    "enable_oom_recovery": "oom",
    "parse_optim_args": "trainer",
    "register": "trainer",
}

__all__ = ["OPTIMIZER_NAMES", "disable_oom_recovery", "enable_oom_recovery", "parse_optim_args", "register"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
