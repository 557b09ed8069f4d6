"""The error hierarchy.

A cache miss is never an exception: tiers return ``False``/``None`` and count it.
Exceptions are for things an operator must fix (configuration) or a tier that
cannot start at all.
"""

from __future__ import annotations


class HpkvError(Exception):
    """Root of every error hpkv raises on purpose."""


class HpkvConfigError(HpkvError, ValueError):
    """A configuration value is invalid.

    Subclasses ``ValueError`` so that callers written against LMCache-style
    connectors (which raise ``ValueError`` for rejected settings) keep working.
    The message always names the variable or key, the bad value and a good example.
    """


class HpkvTierError(HpkvError):
    """A tier could not start (e.g. the storage directory cannot be created)."""
