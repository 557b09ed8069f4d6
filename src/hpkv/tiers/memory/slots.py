"""Slot bookkeeping for the memory pool: which key lives in which slot, LRU order, pins.

Pure data structure, no I/O. Not thread-safe by itself: the engine (:class:`hpkv.engine.catalog.Catalog`)
calls it under one lock, and does the byte copies outside that lock while the
slots involved are pinned.

Slot states:
    free      on the free list
    reserved  handed to a writer by :meth:`reserve`, not yet visible
    live      in the index (visible to lookups), possibly pinned
    doomed    removed from the index while pinned; freed at the last unpin
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container


class SlotIndex:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self._pins = [0] * num_slots
        self._npinned = 0  # slots with a pin (kept in step: pinned() is asked often)
        self._doomed: set[int] = set()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def pin(self, key: bytes) -> int | None:
        """Pin the slot of ``key`` and mark it most recently used; None if absent."""
        slot = self._lru.get(key)
        if slot is None:
            return None
        self._lru.move_to_end(key)
        self._pins[slot] += 1
        if self._pins[slot] == 1:
            self._npinned += 1
        return slot

    def unpin(self, slot: int) -> None:
        assert self._pins[slot] > 0, f"slot {slot} unpinned more often than pinned"
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._npinned -= 1
        if self._pins[slot] == 0 and slot in self._doomed:
            self._doomed.discard(slot)
            self._free.append(slot)

    def reserve(self, protected: Container[bytes] = ()) -> tuple[int, bytes | None] | None:
        """A slot for a new record, pinned: a free one, or the least recently used unpinned one
        whose key is not in ``protected`` (chunks a lookup in progress is about to pin).

        Returns ``(slot, evicted_key)``, or None when every slot is pinned, reserved or
        protected (the caller skips the write; it never waits). Eviction looks past pinned
        and protected entries, so it is O(1) unless many of them are the oldest.
        """
        if self._free:
            slot = self._free.pop()
            self._pins[slot] = 1
            self._npinned += 1
            return slot, None
        for key, slot in self._lru.items():
            if self._pins[slot] == 0 and key not in protected:
                del self._lru[key]
                self._pins[slot] = 1
                self._npinned += 1
                self.evictions += 1
                return slot, key
        return None

    def commit(self, slot: int, key: bytes, *, keep_pin: bool = False) -> bool:
        """Make a reserved slot visible under ``key`` as most recently used.

        False if ``key`` was committed meanwhile by another writer: theirs is
        kept, ours is freed (and not left pinned, whatever ``keep_pin`` says).
        """
        if key in self._lru:
            self.abort(slot)
            return False
        self._lru[key] = slot
        if not keep_pin:
            self.unpin(slot)
        return True

    def abort(self, slot: int) -> None:
        """Give back a reserved slot that was never committed."""
        self._pins[slot] -= 1
        assert self._pins[slot] == 0
        self._npinned -= 1
        self._free.append(slot)

    def remove(self, key: bytes) -> bool:
        slot = self._lru.pop(key, None)
        if slot is None:
            return False
        if self._pins[slot]:
            self._doomed.add(slot)
        else:
            self._free.append(slot)
        return True

    def clear(self) -> int:
        keys = list(self._lru)
        for key in keys:
            self.remove(key)
        return len(keys)

    def pinned(self) -> int:
        """Slots with at least one pin. O(1)."""
        return self._npinned

    def room(self, protected: Collection[bytes] = ()) -> int:
        """Slots :meth:`reserve` could hand out now: the unpinned ones (free, or live and
        evictable) less the live unpinned ones whose key is in ``protected``."""
        held = 0
        for key in protected:
            slot = self._lru.get(key)
            held += slot is not None and self._pins[slot] == 0
        return self.num_slots - self._npinned - held

    def check(self) -> None:
        """Consistency check for tests: every slot is in exactly one state."""
        live = set(self._lru.values())
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is on the free list twice"
        assert len(live) == len(self._lru), "two keys share a slot"
        assert not (live & free), "a live slot is also free"
        assert not (self._doomed & (live | free)), "a doomed slot is live or free"
        for s in free:
            assert self._pins[s] == 0, f"free slot {s} is pinned"
        assert self._npinned == sum(1 for p in self._pins if p), "the pinned count drifted"
