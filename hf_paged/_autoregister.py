"""Register the optimizer names with transformers once transformers is used, without importing it here.

``import hf_paged`` must make ``TrainingArguments(optim="hf_paged_adamw_8bit")`` work, yet the core may not
import transformers. Two transformers modules matter: ``training_args`` (the names) and
``trainer_optimizer`` (the factories; it imports ``training_args`` while it loads). For each, if it is
already loaded its part is registered at once, otherwise an import hook registers it right after the
module is first loaded. A registration runs while the module that imported the trigger may still be half
loaded (``trainer_callback`` imports ``training_args``), so it loads only the core and
:mod:`hf_paged.integrations.trainer`, never what needs the rest of transformers. DeepSpeed's ZeRO modules
(stage 3, stages 1 and 2, BF16_Optimizer), once loaded, get the same treatment: their optimizer state tools
learn to read paged state (:mod:`hf_paged.integrations.deepspeed_state`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType


def _register_names() -> None:
    from .integrations.trainer import register_names

    register_names()


def _register_handlers() -> None:
    from .integrations.trainer import register_handlers

    register_handlers()


def _register_resume() -> None:
    from .integrations.trainer import register_resume

    register_resume()


def _enable_deepspeed_state_tools() -> None:
    from .integrations.deepspeed_state import enable_deepspeed_state_tools

    enable_deepspeed_state_tools()


_TRIGGERS = {
    "transformers.training_args": _register_names,
    "transformers.trainer_optimizer": _register_handlers,
    "transformers.trainer": _register_resume,
    "deepspeed.runtime.zero.stage3": _enable_deepspeed_state_tools,
    "deepspeed.runtime.zero.stage_1_and_2": _enable_deepspeed_state_tools,
    "deepspeed.runtime.bf16_optimizer": _enable_deepspeed_state_tools,
}


class _RegisterAfterLoad(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, register: Callable[[], None]) -> None:
        self._loader = loader
        self._register = register

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._register()


class _TransformersHook(importlib.abc.MetaPathFinder):
    def __init__(self, pending: dict[str, Callable[[], None]]) -> None:
        self._pending = pending

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        register = self._pending.get(fullname)
        if register is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterLoad(spec.loader, lambda: self._loaded(fullname, register))
        return spec

    def _loaded(self, fullname: str, register: Callable[[], None]) -> None:
        """Register ``fullname``'s part once the module has loaded: a spec looked up but never loaded (as
        ``importlib.util.find_spec`` does) leaves the module pending."""
        self._pending.pop(fullname, None)
        if not self._pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        register()


def install() -> None:
    """Register each part now if its transformers module is loaded, else right after it loads."""
    if any(isinstance(finder, _TransformersHook) for finder in sys.meta_path):
        return
    pending = {}
    for module, register in _TRIGGERS.items():
        if module in sys.modules:
            register()
        else:
            pending[module] = register
    if pending:
        sys.meta_path.insert(0, _TransformersHook(pending))
