"""Parsing of memory sizes given as integers (bytes) or strings such as ``"8MiB"``."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_LARGEST_EXPONENT = 30
"""A size string's number is refused beyond 10 ** 30 (far more bytes than any machine has) and below 10 ** -30."""
_SIZE_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: float | str, name: str) -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts a non-negative integer, or a string made of a number and an optional unit
    (``B``, ``KB``, ``MB``, ``GB``, ``TB`` in powers of 1000, ``KiB``, ``MiB``, ``GiB``, ``TiB`` in
    powers of 1024; case-insensitive). ``name`` is the argument named in the error message.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number of bytes or a string such as '8MiB', got {value!r}")
    if isinstance(value, str):
        match = _SIZE_PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size: use a number of bytes or a number with one of the units "
                "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (for example '8MiB')"
            )
        digits = Decimal(match.group(1))  # exact, as floats are not: '4.1MB' is 4,100,000 bytes
        if digits and digits.adjusted() > _LARGEST_EXPONENT:
            raise ValueError(f"{name} must be a finite, non-negative size, got {value!r}")
        if digits and digits.adjusted() < -_LARGEST_EXPONENT:  # Fraction would build 10 ** -exponent
            raise ValueError(f"{name}={value!r} is not a whole number of bytes")
        exact = Fraction(digits) * _UNITS[unit]
    elif isinstance(value, int):
        exact = Fraction(value)
    elif isinstance(value, float):
        exact = Fraction(value) if math.isfinite(value) else None
    else:
        raise TypeError(f"{name} must be a number of bytes or a string such as '8MiB', got {type(value).__name__}")
    if exact is None or exact < 0:
        raise ValueError(f"{name} must be a finite, non-negative size, got {value!r}")
    if exact.denominator != 1:
        raise ValueError(f"{name}={value!r} is not a whole number of bytes")
    return int(exact)


def format_size(nbytes: int) -> str:
    """Return ``nbytes`` in the largest binary unit that keeps the number at least 1, e.g. ``'8.0 MiB'``."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor:
            return f"{nbytes / factor:.1f} {unit}"
    return f"{nbytes} B"
