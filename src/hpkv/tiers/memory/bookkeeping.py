"""The memory tier's bookkeeping: which chunk is in which pool slot, pins, protection, the reset epoch.

One instance per engine's own pool (the engine's catalog holds it), or per model in the host pool
(:mod:`hpkv.tiers.memory.hostpool`), for the pools of every rank served: slot s holds chunk k in
every rank's pool file. The bytes are moved by others (the
promotion's I/O threads, vLLM's workers, a library caller) while the slots involved are pinned;
this module only decides who may use which slot.

* **pin**: a slot in use by a load or a queued write is never evicted or reused; it becomes free
  at its last unpin even if the chunk was dropped meanwhile.
* **protect**: a chunk a lookup is about to pin is not evicted by other work's reservations, so a
  long prompt's promotions never evict its own head. Counted: two lookups may protect one chunk.
* **epoch**: a reset of the memory tier bumps it; a slot reserved before a reset is never committed
  after it, so nothing in flight at the reset becomes visible.

Thread contract: every method may be called from any thread; each takes one lock for a few
dictionary operations and never holds it across I/O, so none of them blocks for long.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Protocol

from hpkv.core.stats import TierStats
from hpkv.tiers.memory.slots import SlotIndex


class Slots(Protocol):
    """Who may use which slot: this engine's own (:class:`MemorySlots`) or the host pool's
    (:class:`hpkv.tiers.memory.hostslots.HostSlots`); the engine cannot tell them apart."""

    num_slots: int
    counters: TierStats

    def __contains__(self, lk: bytes) -> bool: ...
    def contains_many(self, lks: Sequence[bytes]) -> list[bool]: ...
    def __len__(self) -> int: ...
    def pinned(self) -> int: ...
    def protected(self) -> int: ...
    def scarce(self) -> bool: ...
    def pin(self, lks: Iterable[bytes]) -> list[int]: ...
    def pin_each(self, lks: Sequence[bytes]) -> dict[int, int]: ...
    def unpin(self, slots: Iterable[int]) -> None: ...
    def protect(self, lks: Iterable[bytes]) -> None: ...
    def unprotect(self, lks: Iterable[bytes]) -> None: ...
    def room(self) -> int: ...
    def reserve(self) -> int | None: ...
    def reserve_many(self, n: int) -> list[int]: ...
    def commit(self, slot: int, lk: bytes, *, keep_pin: bool) -> bool: ...
    def commit_many(self, items: Sequence[tuple[int, bytes, bool]]) -> list[bool]: ...
    def abort(self, slot: int) -> None: ...
    def drop(self, lk: bytes) -> None: ...
    def reset(self) -> None: ...
    def check(self) -> None: ...


class MemorySlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._lock = threading.Lock()
        self._index = SlotIndex(num_slots)
        self._epoch = 0
        self._slot_epoch = [0] * num_slots
        self._protected: dict[bytes, int] = {}
        self.counters = TierStats()

    # -- what is where ----------------------------------------------------------------

    def __contains__(self, lk: bytes) -> bool:
        with self._lock:
            return lk in self._index

    def contains_many(self, lks: Sequence[bytes]) -> list[bool]:
        """Per key, whether it is in memory now (one lock for all of them)."""
        with self._lock:
            return [lk in self._index for lk in lks]

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def pinned(self) -> int:
        """Slots with a pin now (read without the lock: a hint, not a decision)."""
        return self._index.pinned()

    def protected(self) -> int:
        """Chunks some lookup protects from eviction now."""
        with self._lock:
            return len(self._protected)

    def scarce(self) -> bool:
        """Half the slots or more are pinned (queued writes, loads in flight)."""
        return self.num_slots > 0 and self._index.pinned() * 2 >= self.num_slots

    # -- pins ---------------------------------------------------------------------------

    def pin(self, lks: Iterable[bytes]) -> list[int]:
        """Pin the slots of the leading ``lks`` in memory; stops at the first that is not."""
        slots: list[int] = []
        with self._lock:
            for lk in lks:
                s = self._index.pin(lk)
                if s is None:
                    break
                slots.append(s)
        return slots

    def pin_each(self, lks: Sequence[bytes]) -> dict[int, int]:
        """Pin the slot of every key in memory, index -> slot; a key not in memory ends nothing."""
        out: dict[int, int] = {}
        with self._lock:
            for i, lk in enumerate(lks):
                s = self._index.pin(lk)
                if s is not None:
                    out[i] = s
        return out

    def unpin(self, slots: Iterable[int]) -> None:
        with self._lock:
            for s in slots:
                self._index.unpin(s)

    def protect(self, lks: Iterable[bytes]) -> None:
        """Keep ``lks`` from eviction until :meth:`unprotect`."""
        with self._lock:
            for lk in lks:
                self._protected[lk] = self._protected.get(lk, 0) + 1

    def unprotect(self, lks: Iterable[bytes]) -> None:
        with self._lock:
            for lk in lks:
                n = self._protected.get(lk, 0) - 1
                if n > 0:
                    self._protected[lk] = n
                else:
                    self._protected.pop(lk, None)

    def room(self) -> int:
        """Slots a reservation could get now (free, or evictable: unpinned, unprotected)."""
        with self._lock:
            return self._index.room(self._protected)

    # -- new chunks -----------------------------------------------------------------------

    def reserve(self) -> int | None:
        """A pinned, invisible slot for a new chunk, or None (counted) if every slot is pinned."""
        with self._lock:
            got = self._index.reserve(self._protected)
            if got is not None:
                self._slot_epoch[got[0]] = self._epoch
                if got[1] is not None:
                    self.counters.add("evictions")
        if got is None:
            self.counters.add("writes_skipped")
            return None
        return got[0]

    def reserve_many(self, n: int) -> list[int]:
        """Up to ``n`` reserved slots (see :meth:`reserve`), as many as there are; one question for
        all (the host pool's is a round trip)."""
        got: list[int] = []
        while len(got) < n:
            slot = self.reserve()
            if slot is None:
                self.counters.add("writes_skipped", n - len(got) - 1)
                break
            got.append(slot)
        return got

    def commit(self, slot: int, lk: bytes, *, keep_pin: bool) -> bool:
        """Make ``slot`` visible as ``lk``; False (the slot freed) if the memory tier was reset
        since the slot was reserved or another writer committed ``lk`` first."""
        with self._lock:
            if self._slot_epoch[slot] != self._epoch:
                self._index.abort(slot)
                return False
            return self._index.commit(slot, lk, keep_pin=keep_pin)

    def commit_many(self, items: Sequence[tuple[int, bytes, bool]]) -> list[bool]:
        """:meth:`commit` of each ``(slot, lk, keep_pin)``, in one question."""
        return [self.commit(slot, lk, keep_pin=keep) for slot, lk, keep in items]

    def abort(self, slot: int) -> None:
        """Give back a reserved slot that was never committed."""
        with self._lock:
            self._index.abort(slot)

    def drop(self, lk: bytes) -> None:
        """A resident chunk whose header failed: forget it (counted corrupt and a miss)."""
        self.counters.add("corrupt")
        self.counters.add("misses")
        with self._lock:
            self._index.remove(lk)

    def reset(self) -> None:
        """Forget every chunk; pinned slots are freed when their pins go."""
        with self._lock:
            self._epoch += 1
            self._index.clear()

    def check(self) -> None:
        with self._lock:
            self._index.check()
