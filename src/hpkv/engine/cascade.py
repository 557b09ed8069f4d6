"""Write-behind: new chunks from the memory pool (or a private buffer) to every slower tier.

Owned by the engine (:class:`hpkv.engine.catalog.Catalog`). Bounded and never blocking: when the
queue is full (or has no room at all: ``cascade_queue_chunks=0``) a write is dropped and counted on
each slower tier. One thread drains the queue in order, at a lowered CPU priority. With
``defer=True`` (vLLM's CPU build, where the model and hpkv share the cores) it also waits for idle
time: the engine announces its computing steps (:meth:`Cascade.engine_busy`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from hpkv.core.procs import background_priority, name_os_thread
from hpkv.tiers.base import Tier

log = logging.getLogger(__name__)

# The thread's nice value (Linux: per thread): its CFS weight is ~1/10 of the model's threads.
CASCADE_NICE = 10
# With defer: how long the engine must have been idle before a write, and how long a step may hold it back.
CASCADE_IDLE_S = 0.01
CASCADE_DEFER_MAX_S = 5.0

# What a write is made from: a pool slot (every rank's pool), or one rank's private sealed record.
Source = int | bytearray


class Cascade:
    def __init__(
        self,
        max_chunks: int,
        ranks: int,
        tiers_of_rank: Callable[[int], list[Tier]],
        record_key: Callable[[int, bytes], bytes],
        slot_record: Callable[[int, int], memoryview],
        unpin: Callable[[int], None],
        *,
        defer: bool = False,
        pressure: Callable[[], bool] | None = None,
    ) -> None:
        """``tiers_of_rank(i)``: the slower tiers of the rank at index ``i``; ``record_key(i, lk)``
        its record key; ``slot_record(i, slot)`` the sealed record in that rank's pool slot;
        ``unpin(slot)`` releases the pin a queued slot carries; ``pressure()``: the memory pool needs
        the slots queued writes hold (with ``defer``: write now, or new chunks find no slot)."""
        self._ranks = ranks
        self._tiers_of_rank = tiers_of_rank
        self._record_key = record_key
        self._slot_record = slot_record
        self._unpin = unpin
        self._q: queue.Queue[tuple[bytes, Source, str] | None] = queue.Queue(maxsize=max(max_chunks, 1))
        self._off = max_chunks == 0
        self._defer = defer
        self._pressure = pressure
        self._lock = threading.Lock()
        self._busy = False
        self._busy_since = self._idle_since = 0.0
        self._urgent = 0  # flushes waiting: write at once
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="hpkv-cascade", daemon=True)
        self._thread.start()

    def needed(self, lk: bytes, tenant: str) -> bool:
        """Whether a slower tier of some rank may lack ``lk`` (asked without waiting on anything)."""
        return not all(
            t.held(self._record_key(i, lk), tenant)
            for i in range(self._ranks)
            for t in self._tiers_of_rank(i)
        )

    def submit(self, lk: bytes, source: Source, tenant: str) -> bool:
        """Queue a write of ``lk`` (a slot's pin passes to the cascade); never blocks. False (the pin
        released, ``writes_skipped`` counted on each slower tier) when there is no room."""
        if not self._off:
            try:
                self._q.put_nowait((lk, source, tenant))
                return True
            except queue.Full:
                pass
        if isinstance(source, int):
            self._unpin(source)
        for i in range(self._ranks):
            for t in self._tiers_of_rank(i):
                t.count("writes_skipped")
        return False

    def engine_busy(self, busy: bool) -> None:
        """The engine started (True) or finished (False) a step that computes. With ``defer`` the
        cascade writes only once the engine has been idle for CASCADE_IDLE_S, or when its queue is
        half full, or the queued writes pin half the memory pool's slots (a pool full of pinned
        slots would turn every new chunk away from every tier), or a step has run for
        CASCADE_DEFER_MAX_S: where tier work and the model share
        the CPU, write-behind then costs a prefill little; under sustained load it still runs (and
        a full queue still drops)."""
        now = time.monotonic()
        if busy and not self._busy:
            self._busy_since = now
        elif not busy and self._busy:
            self._idle_since = now
        self._busy = busy

    def pending(self) -> int:
        return self._q.qsize()

    def flush(self) -> None:
        """Block until every write queued before this call is done or dropped (without waiting for
        idle time)."""
        with self._lock:
            self._urgent += 1
        try:
            self._q.join()
        finally:
            with self._lock:
                self._urgent -= 1

    def close(self) -> None:
        self._closing = True
        self.flush()
        self._q.put(None)
        self._thread.join(timeout=30)

    def _may_write(self) -> bool:
        if not self._defer or self._urgent or self._closing:
            return True
        if self._q.qsize() >= self._q.maxsize // 2:
            return True
        if self._pressure is not None and self._pressure():
            return True
        now = time.monotonic()
        if self._busy:
            return now - self._busy_since > CASCADE_DEFER_MAX_S
        return now - self._idle_since >= CASCADE_IDLE_S

    def _run(self) -> None:
        # Write-behind is never urgent: where it shares cores with the model (vLLM's CPU build),
        # it must take the CPU only when the model does not need it.
        name_os_thread()
        background_priority(CASCADE_NICE)
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                lk, source, tenant = item
                while not self._may_write():
                    time.sleep(0.005)
                for i in range(self._ranks):
                    rec = self._slot_record(i, source) if isinstance(source, int) else memoryview(source)
                    rk = self._record_key(i, lk)
                    for tier in self._tiers_of_rank(i):
                        try:
                            tier.write(rk, rec, tenant)
                        except Exception:  # a tier bug must not kill the writer thread
                            log.exception("hpkv: cascade write to %s failed", tier.name)
                            tier.count("errors")
                    del rec
                if isinstance(source, int):
                    self._unpin(source)
            finally:
                self._q.task_done()
