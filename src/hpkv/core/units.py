"""Parsing of human-written sizes and booleans used by the configuration."""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
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
        return value
    if isinstance(value, float):
        if value < 0 or value != value:
            raise ValueError("a size cannot be negative")
        return int(value)
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
    return int(float(number) * (1024 ** _POWERS[unit.lower()]))


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
