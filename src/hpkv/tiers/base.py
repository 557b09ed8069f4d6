"""The one interface every tier below memory implements, and the registry that builds them.

A tier holds sealed chunk records (:mod:`hpkv.core.record`) under one rank's record keys; the engine
(:mod:`hpkv.engine.catalog`) builds one instance per tensor-parallel rank and never imports a tier's
module by name: adding a tier is one module with a ``from_config`` builder plus one line in
:data:`TIERS`. Memory is not a tier of this kind: it is the engine's own staging area (slots in
shared-memory pool files that the engine's workers copy from and to).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from hpkv.core.config import HpkvConfig
from hpkv.core.keys import SHARED_TENANT


class Tier(Protocol):
    """One rank's share of a tier below memory. Thread-safe; a miss is a value (False), never an
    exception; a tier that fails after start counts errors and answers misses."""

    name: str
    # True if asking costs a network round trip: lookups then ask in one batch, on a thread.
    remote: bool

    def contains_many(self, keys: list[bytes], tenant: str = SHARED_TENANT) -> list[bool]:
        """Which of ``keys`` the tier holds (remote: one pipelined round trip; unknown = absent)."""
        ...

    def held(self, key: bytes, tenant: str = SHARED_TENANT) -> bool:
        """Whether the tier is known to hold ``key``, without waiting on anything (may say False)."""
        ...

    def source(self, key: bytes, tenant: str = SHARED_TENANT) -> str:
        """Where a read of ``key`` would come from, for the cost of loading it: the tier's name, or
        a finer name where the tier has parts of different speeds (storage: the page cache or the
        device). Answered without waiting on the network."""
        ...

    def read_into(self, key: bytes, buf: memoryview, tenant: str = SHARED_TENANT) -> bool:
        """The verified record of ``key`` into ``buf`` (at least one record long); False: a miss."""
        ...

    def fetch_into(
        self, key: bytes, buf: memoryview, tenant: str = SHARED_TENANT
    ) -> Callable[[], bool] | None:
        """:meth:`read_into` in two halves, so that a caller can verify on another thread while
        this one fetches the next record: the record's bytes into ``buf`` now (None: a counted
        miss; nothing writes into ``buf`` once this returns), and a function that verifies them
        (True: ``buf`` holds a verified record, counted as a hit; False: a counted miss). ``buf``
        holds nothing usable until that function has said True."""
        ...

    def write(self, key: bytes, rec: memoryview, tenant: str = SHARED_TENANT) -> bool:
        """Store the sealed record ``rec`` (may block for the I/O; the engine calls it off the
        serving path)."""
        ...

    def delete(self, key: bytes, tenant: str = SHARED_TENANT) -> bool: ...

    def clear(self) -> int: ...

    def stats(self) -> dict[str, int]: ...

    def count(self, name: str, n: int = 1) -> None: ...

    def check(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class Built:
    """What a builder made: one tier per rank (in the order of the digests it was given), and what
    to close after them (a connection the ranks share)."""

    per_rank: list[Tier]
    close: Callable[[], None] = field(default=lambda: None)


# name -> "module:builder", slowest last (lookups and reads try them in this order). A builder is
# ``(config, payload_bytes, rank_digests) -> Built | None`` (None: not configured).
STORAGE = "storage"
VALKEY = "valkey"
TIERS: dict[str, str] = {
    STORAGE: "hpkv.tiers.disk:from_config",
    VALKEY: "hpkv.tiers.valkey:from_config",
}

Builder = Callable[[HpkvConfig, int, list[bytes]], "Built | None"]


def builder(name: str) -> Builder:
    """The builder registered under ``name`` (imported on first use)."""
    if name not in TIERS:
        raise KeyError(f"unknown tier {name!r}; known: {', '.join(TIERS)}")
    module, attr = TIERS[name].split(":")
    fn: Builder = getattr(importlib.import_module(module), attr)
    return fn
