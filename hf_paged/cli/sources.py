"""Where the model and tokenizer of a config come from, checked before anything loads.

A name is the embedded one, a local directory, a name in the Hugging Face cache or, online, a model on the Hub.
Anything else is a :class:`ConfigError` at once: offline (``HF_HUB_OFFLINE``) without asking the Hub, online after
one request to it, instead of transformers' retries of every file and its traceback.
"""

from __future__ import annotations

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
