"""Where the model and tokenizer of a config come from, checked before anything loads.

A name is the embedded one, a local directory, a name in the Hugging Face cache or, online, a model on the Hub.
Anything else is a :class:`ConfigError` at once: offline (``HF_HUB_OFFLINE``) without asking the Hub, online after
one request to it, instead of transformers' retries of every file and its traceback. A run whose model, tokenizer
and data are all embedded or local (the default) runs with the Hub offline: it needs nothing from the network.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from .config import Config, ConfigError

EMBEDDED = {"model.name": "tiny", "tokenizer.name": "byte"}
"""The names each key takes for what ships with hf-paged."""

HUB_TIMEOUT = 10.0
"""Seconds the one request to the Hub may take."""


def check_sources(config: Config) -> None:
    """Check ``model.name`` and ``tokenizer.name`` (when set apart from the model's); raise :class:`ConfigError`
    naming the key when one is neither local, cached nor on the Hub."""
    check_source("model.name", config.model.name)
    if config.tokenizer.name is not None:
        check_source("tokenizer.name", config.tokenizer.name)


def check_source(key: str, name: str) -> None:
    """Check that ``name``, the value of ``key``, can be loaded: the embedded one, a local directory, a name in
    the Hugging Face cache or, online, a model on the Hub."""
    if name == EMBEDDED.get(key):
        return
    path = Path(name).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise ConfigError(f"{key}: {name!r} is a file; give the directory that holds the model's config.json")
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ConfigError(f"{key}: no directory {name!r}, and it is not a Hugging Face Hub name (owner/name)") from None
    try:
        snapshot_download(name, local_files_only=True)
        return
    except LocalEntryNotFoundError:
        pass
    where = f"neither a local directory nor in the Hugging Face cache ({HF_HUB_CACHE})"
    if is_offline_mode():
        raise ConfigError(
            f"{key}: {name!r} is {where}, and HF_HUB_OFFLINE is set: download it where there is a connection "
            f"(hf download {name}) or give a local directory"
        )
    _check_on_hub(key, name, where)


def _check_on_hub(key: str, name: str, where: str) -> None:
    """One request to the Hub for ``name``: it must answer that the model exists."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HTTPError, RepositoryNotFoundError

    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT)
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{key}: {name!r} is {where}, and the Hugging Face Hub has no such model (a private or gated one needs "
            "hf auth login)"
        ) from None
    except (HTTPError, OSError) as error:  # no connection, a timeout, a server error: the Hub cannot say
        raise ConfigError(
            f"{key}: {name!r} is {where}, and the Hugging Face Hub cannot be reached ({type(error).__name__}: "
            f"{error}); set HF_HUB_OFFLINE=1 to use local and cached models only"
        ) from None


def is_local(config: Config) -> bool:
    """Whether everything ``config`` loads is embedded or on this machine: the model and tokenizer (the embedded ones
    or local directories) and the data (the shipped instructions, a local file or a local dataset's directory)."""
    names = {"model.name": config.model.name, "tokenizer.name": config.tokenizer.name}
    for key, name in names.items():
        if name is not None and name != EMBEDDED[key] and not Path(name).expanduser().is_dir():
            return False
    return config.data.path is None or Path(config.data.path).expanduser().exists()


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """The Hugging Face Hub offline while the block runs, for a run that needs nothing from the network, where
    libraries would still reach it: ``datasets`` counts each load, even of a local file, with a request.
    huggingface_hub and datasets read ``HF_HUB_OFFLINE`` once, when imported: both are imported first and their
    flags set, and the environment for libraries imported in the block; all are restored after it."""
    import datasets.config
    import huggingface_hub.constants

    flags = (huggingface_hub.constants, datasets.config)
    saved_flags = [module.HF_HUB_OFFLINE for module in flags]
    saved_environment = {key: os.environ.get(key) for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    os.environ.update(dict.fromkeys(saved_environment, "1"))
    for module in flags:
        module.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for key, value in saved_environment.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for module, value in zip(flags, saved_flags):
            module.HF_HUB_OFFLINE = value


def import_bitsandbytes_offline() -> None:
    """Import bitsandbytes (if installed) with the Hub offline (:func:`hub_offline`), before anything else imports
    it (peft does, with transformers' Trainer): its CPU backend asks the Hub for a kernel repository when imported
    on a CPU with AVX512-bf16, which it cannot load unless that repository is trusted, and it goes on without it.
    hf-paged's command line does without the request, which online is a wait and offline a failed lookup."""
    with hub_offline():
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            pass
