"""Write-behind from the memory tier (or a private buffer) to slower tiers.

Bounded: :meth:`Cascade.submit` never blocks. When the queue is full the
write to the slower tiers is dropped and counted on each of them. One thread
drains the queue in order; ``flush()`` waits until everything submitted so far
has been written or dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Protocol

from hpkv.core.keys import SHARED_TENANT
from hpkv.tiers.memory import MemoryTier, SlotRef

log = logging.getLogger(__name__)


class WriteTarget(Protocol):
    """A tier below memory. ``tenant`` names whose chunk it is (a Valkey key prefix; storage keeps
    every tenant in one directory, its keys already apart); ``held`` answers without waiting on a
    network, for callers that must not block."""

    name: str

    def write(self, key: bytes, rec: memoryview, tenant: str = SHARED_TENANT) -> bool: ...

    def held(self, key: bytes, tenant: str = SHARED_TENANT) -> bool: ...

    def count(self, name: str, n: int = 1) -> None: ...


Source = SlotRef | bytearray


class Cascade:
    def __init__(self, targets: list[WriteTarget], memory: MemoryTier | None, max_chunks: int) -> None:
        self.targets = targets
        self.memory = memory
        self._q: queue.Queue[tuple[bytes, Source] | None] = queue.Queue(maxsize=max(max_chunks, 1))
        self._disabled = max_chunks == 0
        self._thread = threading.Thread(target=self._run, name="hpkv-cascade", daemon=True)
        self._thread.start()

    def submit(self, key: bytes, source: Source) -> bool:
        """Queue a sealed record for the slower tiers; False (counted) if the queue is full.

        A ``SlotRef`` must be pinned by the caller; the cascade releases it.
        """
        if not self._disabled:
            try:
                self._q.put_nowait((key, source))
                return True
            except queue.Full:
                pass
        self._release(source)
        for t in self.targets:
            t.count("writes_skipped")
        return False

    def flush(self) -> None:
        """Block until every record submitted before this call is written or dropped."""
        self._q.join()

    def pending(self) -> int:
        return self._q.qsize()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                key, source = item
                view = source.record if isinstance(source, SlotRef) else memoryview(source)
                for t in self.targets:
                    try:
                        t.write(key, view)
                    except Exception:  # a tier bug must not kill the writer thread
                        log.exception("hpkv: cascade write to %s failed", t.name)
                        t.count("errors")
                self._release(source)
            finally:
                self._q.task_done()

    def _release(self, source: Source) -> None:
        if isinstance(source, SlotRef) and self.memory is not None:
            self.memory.release(source)
