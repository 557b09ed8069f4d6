"""Where a chunk is: memory and the tiers' indexes without a system call, and, off the caller's
thread, what needs more (files another process wrote, the remote tiers, where each read would come
from). The engine's lookups and stores ask here (see :mod:`hpkv.engine.catalog`).

Thread contract: every method may be called from any thread; ``probe`` never blocks, the methods
that ask a tier beyond its index say that they block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from hpkv.core.keys import SHARED_TENANT as SHARED
from hpkv.engine.interface import MEMORY
from hpkv.engine.lookup import Located, Names
from hpkv.tiers.base import Tier
from hpkv.tiers.memory.bookkeeping import Slots

log = logging.getLogger(__name__)


class Locator:
    def __init__(
        self,
        memory: Slots,
        tiers: dict[str, list[Tier]],
        record_key: Callable[[int, bytes], bytes],
        submit: Callable[[Callable[[], Any]], Future[Any]],
    ) -> None:
        """``tiers``: name -> one per served rank, fastest first (the engine's own dict);
        ``record_key(i, lk)``: the record key of ``lk`` for served rank ``i``; ``submit``: run a
        function on an I/O thread."""
        self.memory = memory
        self.tiers = tiers
        self.record_key = record_key
        self._submit = submit

    @property
    def has_remote(self) -> bool:
        return any(ts[0].remote for ts in self.tiers.values())

    def local_names(self) -> list[str]:
        """The local tiers below memory: a read's source there needs a look (see ``Tier.source``);
        a remote tier's is its name."""
        return [n for n, ts in self.tiers.items() if not ts[0].remote]

    def local_tiers(self) -> list[tuple[str, list[Tier]]]:
        return [(n, ts) for n, ts in self.tiers.items() if not ts[0].remote]

    def remote_tiers(self) -> list[tuple[str, list[Tier]]]:
        return [(n, ts) for n, ts in self.tiers.items() if ts[0].remote]

    def held_locally(self, lk: bytes, tenant: str = SHARED) -> str | None:
        """The first local tier (no network) known to hold every rank's shard of ``lk``, or None:
        from what each tier keeps in memory (``Tier.held``), no system call. A file another process
        wrote since is found by the lookup's probe (:meth:`locate_below`), off the caller's thread."""
        for name, ts in self.local_tiers():
            if all(t.held(self.record_key(i, lk), tenant) for i, t in enumerate(ts)):
                return name
        return None

    def locate_local(self, lks: Iterable[bytes], tenant: str = SHARED) -> list[str | None]:
        """Per key memory or a local tier or None, without asking a remote tier and without
        cutting at a gap."""
        keys = list(lks)
        resident = self.memory.contains_many(keys)  # one question for all: the host pool is a round trip
        return [MEMORY if r else self.held_locally(lk, tenant) for lk, r in zip(keys, resident, strict=True)]

    def read_source(self, lk: bytes, tier: str, tenant: str = SHARED) -> str:
        """Where a read of ``lk`` from ``tier`` would come from (see ``Tier.source``; asked of the
        first served rank, whose files the others' follow), ``memory`` for the memory tier."""
        if tier == MEMORY or tier not in self.tiers:
            return tier
        return self.tiers[tier][0].source(self.record_key(0, lk), tenant)

    def in_slow_many(self, lks: list[bytes], tenant: str = SHARED, *, remote: bool = True) -> Names:
        """Per key the first tier below memory that holds every rank's shard, else None: the local
        tiers asked for what their index lacks (a file another process wrote), then (``remote``)
        one pipelined round trip per rank and remote tier for the rest. Blocks for it."""
        out: Names = [None] * len(lks)
        for name, ts in self.local_tiers() + (self.remote_tiers() if remote else []):
            rest = [j for j, w in enumerate(out) if w is None]
            if not rest:
                break
            have = [True] * len(rest)
            for i, t in enumerate(ts):
                got = t.contains_many([self.record_key(i, lks[j]) for j in rest], tenant)
                have = [a and b for a, b in zip(have, got, strict=True)]
            for j, h in zip(rest, have, strict=True):
                if h:
                    out[j] = name
        return out

    def locate_below(
        self, gaps: list[bytes], held: list[tuple[bytes, str]], tenant: str = SHARED, *, remote: bool = True
    ) -> Located:
        """What a lookup asks off the engine's thread: per key of ``gaps`` the tier below memory that
        holds it (:meth:`in_slow_many`), and where each read would come from (``Tier.source``: for
        storage a look into the page cache per file) for those and for ``held`` (key, tier). A
        failure answers "absent". Blocks for it."""
        try:
            names = self.in_slow_many(gaps, tenant, remote=remote) if gaps else []
        except Exception:
            log.exception("hpkv: existence check failed")
            names = [None] * len(gaps)
        sources: dict[bytes, str] = {}
        for k, tier in [*held, *((k, n) for k, n in zip(gaps, names, strict=True) if n is not None)]:
            try:
                sources[k] = self.read_source(k, tier, tenant)
            except Exception:
                sources[k] = tier
        return names, sources

    def probe(
        self, gaps: list[bytes], held: list[tuple[bytes, str]], tenant: str = SHARED, *, remote: bool = True
    ) -> Future[Located]:
        """:meth:`locate_below` on an I/O thread; never blocks."""
        return self._submit(lambda: self.locate_below(gaps, held, tenant, remote=remote))

    def held_below(self, lk: bytes, tenant: str) -> bool:
        """A slower tier holds ``lk`` for every rank: a local one by its index, a remote one as far
        as this process knows without asking (see ``Tier.held``)."""
        if self.held_locally(lk, tenant) is not None:
            return True
        return any(
            all(t.held(self.record_key(i, lk), tenant) for i, t in enumerate(ts))
            for _, ts in self.remote_tiers()
        )
