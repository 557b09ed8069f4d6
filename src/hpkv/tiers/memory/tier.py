"""The memory tier: records in fixed slots of a shared-memory pool, LRU, pinned while copied.

Thread-safety: every method may be called from any thread. Bookkeeping runs
under one lock; byte copies happen outside it, on pinned slots, so an evictor
never reuses a slot under a copy. Nothing here blocks or waits for space: when
every slot is pinned, a write is skipped and counted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from hpkv.core import record
from hpkv.core.stats import TierStats
from hpkv.tiers.memory.pool import PAGE, ShmPool
from hpkv.tiers.memory.slots import SlotIndex

NAME = "memory"


@dataclass
class SlotRef:
    """A pinned slot. Valid until passed to ``release``/``commit``/``abort`` exactly once."""

    slot: int
    key: bytes
    record: memoryview  # the whole record: header + payload
    payload: torch.Tensor  # uint8 view of the payload bytes


class MemoryTier:
    name = NAME

    def __init__(self, pool: ShmPool, payload_bytes: int, namespace: bytes) -> None:
        self.pool = pool
        self.payload_bytes = payload_bytes
        self.record_bytes = record.record_bytes(payload_bytes)
        # Slots are page-aligned so O_DIRECT reads from storage can land in them directly.
        self.slot_bytes = -(-self.record_bytes // PAGE) * PAGE
        self.num_slots = pool.size // self.slot_bytes
        self.namespace = namespace
        self._index = SlotIndex(self.num_slots)
        self._lock = threading.Lock()
        self._stats = TierStats()

    # -- lookups ----------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def acquire(self, key: bytes, *, count: bool = True) -> SlotRef | None:
        """Pin the record of ``key`` for reading; None (a counted miss) if absent or its header is wrong.

        The checksum is not recomputed: slots are written only by this
        process, after verification or from the engine's own KV.
        """
        with self._lock:
            slot = self._index.pin(key)
        if slot is None:
            if count:
                self._stats.add("misses")
            return None
        ref = self._ref(slot, key)
        verdict = record.verify(
            ref.record, self.record_bytes, self.namespace, key, self.payload_bytes, check_payload=False
        )
        if verdict is not record.Verdict.OK:
            self._stats.add("corrupt")
            self._stats.add("misses")
            with self._lock:
                self._index.remove(key)
                self._index.unpin(slot)
            return None
        if count:
            self._stats.add("hits")
            self._stats.add("bytes_read", self.payload_bytes)
        return ref

    def release(self, ref: SlotRef) -> None:
        with self._lock:
            self._index.unpin(ref.slot)

    # -- writes -----------------------------------------------------------

    def reserve(self, key: bytes) -> SlotRef | None:
        """A pinned, invisible slot to fill with the record of ``key``; None if already held or no room.

        The caller writes the payload into ``ref.payload`` (or the whole
        record into ``ref.record``) and then calls :meth:`commit` or :meth:`abort`.
        """
        with self._lock:
            if key in self._index:
                return None
            got = self._index.reserve()
            if got is not None and got[1] is not None:
                self._stats.add("evictions")
        if got is None:
            self._stats.add("writes_skipped")
            return None
        return self._ref(got[0], key)

    def commit(self, ref: SlotRef, *, sealed: bool = False, keep_pin: bool = False) -> bool:
        """Make the record visible. ``sealed``: the header is already written and verified
        (a promotion from a slower tier); otherwise checksum the payload and write it now.
        ``keep_pin``: return with the slot still pinned (release it later). False if another
        thread committed the same key first (this slot is then freed and not pinned)."""
        if not sealed:
            record.seal(ref.record, self.namespace, ref.key, self.payload_bytes)
        with self._lock:
            if not self._index.commit(ref.slot, ref.key, keep_pin=keep_pin):
                return False
        self._stats.add("writes")
        self._stats.add("bytes_written", self.payload_bytes)
        return True

    def abort(self, ref: SlotRef) -> None:
        with self._lock:
            self._index.abort(ref.slot)

    # -- housekeeping -----------------------------------------------------

    def delete(self, key: bytes) -> bool:
        with self._lock:
            return self._index.remove(key)

    def clear(self) -> int:
        with self._lock:
            return self._index.clear()

    def stats(self) -> dict[str, int]:
        with self._lock:
            used = len(self._index)
            pinned = self._index.pinned()
        return self._stats.snapshot(
            used_bytes=used * self.payload_bytes,
            capacity_bytes=self.num_slots * self.payload_bytes,
            chunks=used,
            pinned_slots=pinned,
        )

    def check(self) -> None:
        with self._lock:
            self._index.check()

    def close(self) -> None:
        self.pool.close()

    def _ref(self, slot: int, key: bytes) -> SlotRef:
        off = slot * self.slot_bytes
        rec = self.pool.view[off : off + self.record_bytes]
        payload = self.pool.tensor[off + record.HEADER_BYTES : off + record.HEADER_BYTES + self.payload_bytes]
        return SlotRef(slot, key, rec, payload)

    def slot_buffer(self, ref: SlotRef) -> memoryview:
        """The whole page-aligned slot (for O_DIRECT reads, which round lengths up to pages)."""
        off = ref.slot * self.slot_bytes
        return self.pool.view[off : off + self.slot_bytes]
