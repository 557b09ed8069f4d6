"""Parsing of human-written sizes and booleans used by the configuration."""

from __future__ import annotations

import re

# ASCII digits only: Python's float() and int() also take full-width and other Unicode digits.
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE | re.ASCII)
MAX_SIZE = 1 << 60  # 1 EiB: anything larger is a typo, not a pool
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: object) -> int:
    """Return a byte count for ``16G``, ``512MiB``, ``1.5GB``, ``4096`` or an int.

    Every unit is binary (``1G`` = ``1GB`` = ``1GiB`` = 2**30 bytes), as in
    ``free -h`` and vLLM's ``--kv-cache-memory``-style options; a plain number
    is bytes. Raises ``ValueError`` (without naming a variable; the caller adds
    that) for anything else, including negative sizes.
    """
    if isinstance(value, bool):
        raise ValueError("a boolean is not a size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        if value > MAX_SIZE:
            raise ValueError("is too large")
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("is not a finite size")
        if value < 0:
            raise ValueError("a size cannot be negative")
        return _checked(value, value == 0)
    if not isinstance(value, str):
        raise ValueError(f"{type(value).__name__} is not a size")
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError("not a size")
    number, unit, suffix = m.groups()
    if suffix.lower() == "i":  # "16Gi" is fine, "16i" is not
        suffix = "ib"
    if not unit and suffix and suffix.lower() != "b":
        raise ValueError("not a size")
    if len(number) > 30:
        raise ValueError("is too large")
    return _checked(float(number) * (1024 ** _POWERS[unit.lower()]), float(number) == 0)


def _checked(n: float, written_as_zero: bool) -> int:
    """Whole bytes; refuses what is too large, and what rounds to 0 unless it was written as 0."""
    if n > MAX_SIZE:
        raise ValueError("is too large")
    if int(n) == 0 and not written_as_zero:
        raise ValueError("rounds to 0 bytes (write 0 to turn it off)")
    return int(n)


def format_size(n: int) -> str:
    """``format_size(3 * 2**30) == '3.0GiB'``; for messages and reports."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{n}B"  # pragma: no cover - loop always returns


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_bool(value: object) -> bool:
    """``true/false/1/0/yes/no/on/off`` (any case) or a real bool."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError("not a boolean")
