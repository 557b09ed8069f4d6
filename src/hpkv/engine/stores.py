"""The engine's stores: a slot (or a private record) for each new chunk, and the chunk made visible
and queued for the slower tiers once every rank filled it (see :mod:`hpkv.engine.catalog`).

Thread contract: every method may be called from any thread and never blocks on I/O.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Container, Sequence

from hpkv.core.keys import SHARED_TENANT as SHARED
from hpkv.engine.cascade import Cascade
from hpkv.engine.interface import HELD, NO_ROOM, Reserved, StoreTarget
from hpkv.tiers.memory.bookkeeping import Slots


class Stores:
    def __init__(
        self,
        memory: Slots,
        has_pools: bool,
        has_tiers: bool,
        cascade: Callable[[], Cascade],
        held_below: Callable[[bytes, str], bool],
        record_bytes: int,
        payload_bytes: int,
        spare_max: int,
    ) -> None:
        """``cascade``: the write-behind (built after this); ``held_below(lk, tenant)``: whether a
        slower tier holds ``lk`` for every rank as far as this process knows without asking."""
        self.memory = memory
        self.pools = has_pools
        self.tiers = has_tiers
        self._cascade_of = cascade
        self._held_below = held_below
        self.record_bytes = record_bytes
        self.payload_bytes = payload_bytes
        self._storing: set[bytes] = set()  # chunks reserved by begin_stores, not yet finished
        self._storing_lock = threading.Lock()
        # Private records the cascade has written, kept for the next stores: a fresh mapping costs
        # its page faults again and its unmapping a TLB flush on every core. At most as many as the
        # cascade's queue holds at once (the peak it could hold anyway).
        self._spare: list[mmap.mmap] = []
        self._spare_max = spare_max

    @property
    def _cascade(self) -> Cascade:
        return self._cascade_of()

    def spare(self, rec: mmap.mmap) -> None:
        """The cascade is done with a private record: keep it for a later store."""
        with self._storing_lock:
            if len(self._spare) < self._spare_max:
                self._spare.append(rec)

    def begin_stores(
        self,
        lks: Sequence[bytes],
        tenant: str = SHARED,
        *,
        rewrite: Container[bytes] = (),
        private: bool = False,
    ) -> list[Reserved]:
        """Where to put each new chunk of ``lks``: a reserved pool slot (every rank's; the caller
        fills and seals each rank's record in it, then calls :meth:`finish_stores`), or, with
        ``private`` and no slot to spare, a private record buffer for the first served rank. Or
        why not: HELD (memory or a slower tier holds it, or a store of it is in flight;
        ``rewrite``: the keys for which a slower tier's copy does not count, as for a chunk a hit
        left to recompute, which then goes into memory) or NO_ROOM (counted). A chunk already in
        memory that a slower tier may lack is queued for it again. The memory tier is asked twice
        for all of them (which are resident, then the slots for the others), not for each: the
        host pool's questions are round trips. Never blocks."""
        out: list[Reserved | None] = [None] * len(lks)
        resident = self.memory.pin_each(lks) if lks else {}
        release: list[int] = []
        for i, slot in resident.items():
            out[i] = HELD
            if self.tiers and self._cascade.needed(lks[i], tenant):
                self._cascade.submit(lks[i], slot, tenant)
            else:
                release.append(slot)
        self.memory.unpin(release)
        todo = [
            i
            for i, lk in enumerate(lks)
            if out[i] is None and (lk in rewrite or not self._held_below(lk, tenant))
        ]
        with self._storing_lock:
            mine = [i for i in todo if lks[i] not in self._storing]
            self._storing.update(lks[i] for i in mine)
        slots = self.memory.reserve_many(len(mine)) if self.pools and mine else []
        for i, slot in zip(mine, slots, strict=False):
            out[i] = slot
        with self._storing_lock:
            for i in mine[len(slots) :]:
                self._storing.discard(lks[i])
                out[i] = NO_ROOM
        if private and self.tiers:
            with self._storing_lock:
                for i, o in enumerate(out):
                    if o is NO_ROOM:
                        out[i] = self._spare.pop() if self._spare else mmap.mmap(-1, self.record_bytes)
        return [HELD if o is None else o for o in out]

    def finish_stores(self, done: Sequence[tuple[bytes, StoreTarget, bool, str]]) -> list[bool]:
        """Each ``(lk, target, ok, tenant)`` a :meth:`begin_stores` handed out is filled and sealed on
        every rank (``ok``) or given up. A slot becomes visible and is queued for the slower tiers
        unless they all hold ``lk`` (the slots committed with one question to the memory tier); a
        private record is queued for them. Per store: False (and the slot freed) if not ``ok``, if
        another writer committed ``lk`` first, if the memory tier was reset since, or if the
        write-behind's queue had no room for a private record."""
        out = [False] * len(done)
        commits: list[tuple[int, int, bool]] = []  # (index in done, slot, cascade)
        with self._storing_lock:
            for lk, _, _, _ in done:
                self._storing.discard(lk)
        for i, (lk, target, ok, tenant) in enumerate(done):
            if isinstance(target, mmap.mmap):
                out[i] = ok and self._cascade.submit(lk, target, tenant)
            elif not ok:
                self.memory.abort(target)
            else:
                commits.append((i, target, bool(self.tiers) and self._cascade.needed(lk, tenant)))
        got = self.memory.commit_many([(slot, done[i][0], keep) for i, slot, keep in commits])
        for (i, slot, cascade), ok in zip(commits, got, strict=True):
            if not ok:
                continue
            out[i] = True
            self.memory.counters.add("writes")
            self.memory.counters.add("bytes_written", self.payload_bytes)
            if cascade:
                self._cascade.submit(done[i][0], slot, done[i][3])
        return out
