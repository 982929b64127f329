"""The host kernels written in C++ (``host_kernels.cpp``), built at first use and cached by PyTorch.

:func:`host_kernels` builds the extension once per process with :func:`torch.utils.cpp_extension.load` (ninja and a
C++ compiler; the build lands in PyTorch's extension cache, ``TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``, in :func:`build_directory`, under a name of the capability and the source's version,
:func:`build_name`, so later processes load it in well under a second; one process at a time builds or loads it) and registers its operators, for each rule (``adamw``, ``lion``,
``ademamix``) one per segment (``torch.ops.hf_paged.adamw_segment_``) and one per page batch (``adamw_batch_``; see
:mod:`hf_paged.kernels.batch`), each for 8-bit, 4-bit and fp32 state. They return nothing, so PyTorch gives them
fake kernels of its own and a step traces under ``FakeTensorMode``. Where the extension cannot be built the optimizers keep PyTorch's kernels; the reason is
logged once.

``HF_PAGED_NATIVE`` chooses: ``0`` never uses the host kernels, ``1`` requires them (a failed build raises), unset
uses them where they build. Within :func:`host_kernels_disabled` they are not used, whatever it says.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # Windows: PyTorch's own lock alone
    fcntl = None

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("host_kernels.cpp")

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def native_setting() -> bool | None:
    """``HF_PAGED_NATIVE`` read now: ``False`` (off), ``True`` (required) or ``None`` (where it builds)."""
    setting = os.environ.get("HF_PAGED_NATIVE", "").strip().lower()
    if setting in _OFF:
        return False
    if setting in _ON:
        return True
    if setting:
        raise ValueError(f"HF_PAGED_NATIVE={setting!r} is not allowed: use 0 or 1")
    return None


_DISABLED = contextvars.ContextVar("hf_paged_host_kernels_disabled", default=False)


@contextlib.contextmanager
def host_kernels_disabled() -> Iterator[None]:
    """CPU pages take the PyTorch kernels within the block, whatever ``HF_PAGED_NATIVE`` says: for tracing on the
    CPU a step that will run on another device, whose pages take the PyTorch kernels (:func:`hf_paged.plan`)."""
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)


def host_kernels_enabled() -> bool:
    """Whether the optimizers update CPU pages of 8-bit and 4-bit state with the host kernels now.

    Reads ``HF_PAGED_NATIVE`` at each call (and whether :func:`host_kernels_disabled` is in effect); builds the
    kernels at the first call that needs them.
    """
    setting = native_setting()
    if setting is False or _DISABLED.get():
        return False
    reason = build_failure()
    if reason is not None and setting:
        raise RuntimeError(f"HF_PAGED_NATIVE=1, but hf_paged's host kernels could not be built: {reason}")
    return reason is None


def build_name(capability: str | None = None) -> str:
    """The extension's name for ``capability`` (``default``, ``avx2`` or ``avx512``; by default the one PyTorch runs
    now, which ``ATEN_CPU_CAPABILITY`` can lower) and this source: one build per capability
    (``hf_paged_host_kernels_default_...``, ``..._avx2_...`` or ``..._avx512_...``) and per version of
    ``host_kernels.cpp``, its path and the PyTorch and Python headers that the build's commands name (the first 12 hex
    digits of a SHA-256 of them all). Installs or checkouts sharing the extension cache then never load each other's
    build, nor rebuild it for their own in turn (two virtual environments, or two checkouts, took turns rebuilding one
    folder: 25 s of compiling at each switch)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    for path in (SOURCE.resolve(), Path(torch.__file__).parent, sysconfig.get_paths()["include"]):
        digest.update(os.fsencode(path) + b"\0")
    capability = capability or torch.backends.cpu.get_cpu_capability()
    return f"hf_paged_host_kernels_{capability.lower()}_{digest.hexdigest()[:12]}"


def extension_directory(name: str) -> Path:
    """Where the extension ``name`` is built and cached: ``py<X><Y>_torch<version>/<name>`` in PyTorch's extension
    cache (``TORCH_EXTENSIONS_DIR``, or ``~/.cache/torch_extensions``), one folder per Python and PyTorch version,
    since the build links against both."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    interpreter = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return Path(root) / interpreter / name


def build_directory() -> Path:
    """Where the host kernels are built and cached: :func:`extension_directory` of :func:`build_name`."""
    return extension_directory(build_name())


@contextlib.contextmanager
def _one_builder(directory: Path, what: str) -> Iterator[None]:
    """Hold an extension's build folder for this process alone, and remove the lock file a killed build left behind
    (with a warning naming ``what``, the extension in words).

    PyTorch marks a build in progress with a file, ``lock``, that its builder deletes when done, and every other
    process waits for as long as it exists: a build killed on the way (a SIGKILL, a job's time limit, a closed
    terminal) left it, and every later process waited forever at its first step. An operating-system lock on
    ``build.flock`` is released by the kernel however its holder ends, so the process holding it knows that a
    ``lock`` it finds is such a leftover. Where there is no ``fcntl`` (Windows) PyTorch's lock alone is taken.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(directory / "build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                logger.warning("hf_paged: removing %s, left by a build of %s that did not finish", stale, what)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_extension(name: str, sources: list[str], what: str, **options: Any) -> Any:
    """:func:`torch.utils.cpp_extension.load` of the extension ``name`` from ``sources`` (paths) into
    :func:`extension_directory`, one process at a time, removing the ``lock`` a killed build left (see
    :func:`_one_builder`; ``what``: the extension in words, for that warning); ``options``: ``load``'s other keyword
    arguments. Returns what ``load`` returns (the module, or ``None`` with ``is_python_module=False``)."""
    from torch.utils import cpp_extension

    directory = extension_directory(name)
    with _one_builder(directory, what):
        return cpp_extension.load(name=name, sources=sources, build_directory=str(directory), verbose=False, **options)


def _compile_flags() -> list[str]:
    """Optimization flags for the vector unit PyTorch's kernels use, as PyTorch detected it: AVX-512 code (sixteen
    fp32 lanes) for its AVX512 capability, AVX2 code (eight lanes) for AVX2, both with fused multiply-adds, scalar
    code for DEFAULT, each rounding as ATen's kernels of that capability round.

    The flags are part of the cache key, so machines of different capabilities sharing a cache get their own
    builds. ``-ffp-contract=off`` keeps every product and sum rounded as PyTorch's eager kernels round them.
    """
    flags = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp"]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if capability == "AVX512":
        flags += ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
    return flags


@functools.cache
def build_failure() -> str | None:
    """Build (or load from the cache) the host kernels once per process; why they are unavailable, or ``None``.

    The outcome is logged once: the build time on success, the reason and the fallback otherwise.
    """
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        reason = f"no C++ compiler ({compiler!r}) on PATH"
    elif not cpp_extension.is_ninja_available():
        reason = "ninja is not installed (pip install ninja)"
    else:
        reason = None
    if reason is None:
        start = time.perf_counter()
        try:
            load_extension(
                build_name(),
                [str(SOURCE)],
                "the host kernels",
                extra_cflags=_compile_flags(),
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
        except (RuntimeError, OSError, ImportError) as error:  # a failed build or load: the PyTorch kernels remain
            lines = [line for line in str(error).splitlines() if line.strip()]
            reason = f"{type(error).__name__}: {lines[0] if lines else ''}"
            errors = [line for line in lines if "error" in line.lower()][:3]
            if errors and errors[0] != lines[0]:
                reason += " (" + " | ".join(line.strip() for line in errors) + ")"
        else:
            logger.info("hf_paged: host kernels ready in %.1f s", time.perf_counter() - start)
            return None
    logger.warning("hf_paged: host kernels unavailable (%s); CPU pages keep PyTorch's kernels", reason)
    return reason
