"""How one setting's raw value is read and checked: its spec (kind, bounds, example, README line) and
the conversion that turns a variable's text, a YAML value or a keyword argument into the field's value,
or an error that names where it came from, the bad value and a good example."""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from hpkv.core.errors import HpkvConfigError
from hpkv.core.units import parse_bool, parse_size

log = logging.getLogger("hpkv")


@dataclass(frozen=True)
class Spec:
    """How one setting is read, checked and documented (README's settings table is this table)."""

    env: str  # the HPKV_* variable
    example: str  # a good value, quoted in every error
    # "size" | "int" | "optint" | "float" | "bool" | "choice" | "path" | "optpath" | "str" | "optstr" | "url"
    kind: str
    help: str  # README's one line
    shown: str  # the default as README shows it
    minimum: int | None = None
    maximum: int | None = None
    # float: the minimum itself is a value too (0 meaning "off"), not only what is above it
    minimum_ok: bool = False
    choices: tuple[str, ...] = ()


def unknown_message(what: str, valid: list[str], noun: str) -> str:
    name = what.split(" ")[0]
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"unknown {noun} {what}; {hint}valid: {', '.join(sorted(valid))}"


def shown(raw: Any, limit: int = 48) -> str:
    """``repr`` of a value for a message, shortened (a 400-digit size must not fill the screen)."""
    text = repr(raw)
    return text if len(text) <= limit else f"{text[: limit - 5]}…{text[-4:]}"


_INT_RE = re.compile(r"^[+-]?[0-9]+$", re.ASCII)
_FLOAT_RE = re.compile(r"^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?$", re.ASCII)
_relative_logged: set[str] = set()


def _has_surrogate(text: str) -> bool:
    return any("\ud800" <= c <= "\udfff" for c in text)


def convert(name: str, spec: Spec, raw: Any, where: str) -> Any:
    def bad(why: str) -> HpkvConfigError:
        return HpkvConfigError(f"{where}={shown(raw)} {why}; use e.g. {spec.example}")

    if spec.kind == "optint" and (raw is None or (isinstance(raw, str) and raw.strip() == "")):
        return None
    if spec.kind == "size":
        try:
            return parse_size(raw)
        except ValueError as e:
            msg = str(e)
            raise bad(msg if msg.startswith(("is ", "rounds")) else "is not a size") from None
    if spec.kind in ("int", "optint"):
        if isinstance(raw, bool):
            raise bad("is not an integer")
        text = str(raw).strip() if not isinstance(raw, int) else ""
        if not isinstance(raw, int) and (len(text) > 20 or not _INT_RE.match(text)):
            raise bad("is not an integer")
        value = raw if isinstance(raw, int) else int(text)
        if spec.minimum is not None and value < spec.minimum:
            raise bad(f"is below the minimum {spec.minimum}")
        if spec.maximum is not None and value > spec.maximum:
            raise bad(f"is above the maximum {spec.maximum}")
        return value
    if spec.kind == "float":
        if isinstance(raw, bool):
            raise bad("is not a number")
        text = str(raw).strip() if not isinstance(raw, int | float) else ""
        if not isinstance(raw, int | float) and (len(text) > 40 or not _FLOAT_RE.match(text)):
            raise bad("is not a number")
        try:
            fvalue = float(text) if text else float(raw)
        except (ValueError, OverflowError):
            raise bad("is not a number") from None
        low = spec.minimum is not None and (
            fvalue < spec.minimum or (fvalue == spec.minimum and not spec.minimum_ok)
        )
        if not math.isfinite(fvalue) or low:
            raise bad(f"must be a number {'of at least' if spec.minimum_ok else 'above'} {spec.minimum}")
        if spec.maximum is not None and fvalue > spec.maximum:
            raise bad(f"is above the maximum {spec.maximum}")
        return fvalue
    if spec.kind == "choice":
        text = str(raw).strip().lower()
        if "true" in spec.choices and text not in spec.choices:  # a yes/no choice: 1, on, yes ...
            with contextlib.suppress(ValueError):
                text = "true" if parse_bool(raw) else "false"
        if text not in spec.choices:
            raise bad(f"is not one of {', '.join(spec.choices)}")
        return text
    if spec.kind == "url":
        if raw is None or (isinstance(raw, str) and raw.strip() == ""):
            return None
        if not isinstance(raw, str):
            raise bad("is not a URL")
        return raw.strip()
    if spec.kind == "optstr":
        if raw is None or raw == "":
            return None
        if not isinstance(raw, str | int) or isinstance(raw, bool):
            raise HpkvConfigError(f"{where} is not a string; use e.g. {spec.example}")
        if isinstance(raw, str) and _has_surrogate(raw):
            raise HpkvConfigError(
                f"{where} holds a lone surrogate (not valid Unicode); use e.g. {spec.example}"
            )
        return str(raw)
    if spec.kind == "bool":
        try:
            return parse_bool(raw)
        except ValueError:
            raise bad("is not a boolean") from None
    if spec.kind in ("path", "optpath"):
        if raw is None or (isinstance(raw, str) and raw.strip() == ""):
            if spec.kind == "optpath":
                return None
            raise bad("is empty")
        if not isinstance(raw, str | os.PathLike):
            raise bad("is not a path")
        text = str(os.fspath(raw))
        if "\0" in text:
            raise bad("contains a NUL byte")
        full = os.path.expanduser(text)
        if not os.path.isabs(full):
            # A relative path would follow the working directory of whichever process reads it
            # (vLLM's engine and workers may differ): made absolute here, once, and said.
            full = os.path.abspath(full)
            if full not in _relative_logged:
                _relative_logged.add(full)
                log.warning("hpkv: %s=%r is relative; using %s", where, text, full)
            return full
        return text
    if spec.kind == "str":
        if not isinstance(raw, str):
            raise bad("is not a string")
        if _has_surrogate(raw):
            raise bad("holds a lone surrogate (not valid Unicode)")
        return raw
    raise AssertionError(f"unknown kind {spec.kind} for {name}")  # pragma: no cover
