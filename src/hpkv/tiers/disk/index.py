"""In-process index of the chunk files this process knows: key -> size, LRU order, used bytes.

Not thread-safe by itself; :class:`StorageTier` calls it under its lock. The
files on disk are the truth: another process may add or remove files at any
time, so a miss here is confirmed with a ``stat`` and a hit may still fail to
open (a miss, then).
"""

from __future__ import annotations

from collections import OrderedDict


class DiskIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def touch(self, key: bytes) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def add(self, key: bytes, size: int) -> None:
        old = self._lru.pop(key, None)
        if old is not None:
            self.used -= old
        self._lru[key] = size
        self.used += size

    def remove(self, key: bytes) -> int | None:
        size = self._lru.pop(key, None)
        if size is not None:
            self.used -= size
        return size

    def victims(self, incoming: int) -> list[bytes]:
        """Least recently used keys to evict so that ``incoming`` more bytes fit; removed from the index."""
        out: list[bytes] = []
        while self._lru and self.used + incoming > self.capacity:
            key, size = self._lru.popitem(last=False)
            self.used -= size
            out.append(key)
        return out

    def keys(self) -> list[bytes]:
        return list(self._lru)

    def clear(self) -> list[bytes]:
        keys = list(self._lru)
        self._lru.clear()
        self.used = 0
        return keys
