"""Write-behind: new chunks from the memory pool (or a private buffer) to every slower tier.

Owned by the engine (:class:`hpkv.engine.catalog.Catalog`). Bounded and never blocking: when the
queue is full (or has no room at all: ``cascade_queue_chunks=0``) a write is dropped and counted on
each slower tier. One thread drains the queue in order, at a lowered CPU priority.

With ``defer=True`` (paced, vLLM's default) a write prefers the engine's idle time (the engine
announces its computing steps: :meth:`Cascade.engine_busy`), so that a cold prefill does not share
its cores with the writes of the chunks it just made; but no chunk waits for idle time longer than
CASCADE_PACE_S: an engine that never idles (prompts back to back, sustained load) still has every
chunk on the slower tiers within about that delay, plus the time to write what queued before it.
How long each chunk waited (queued to written on every tier) is kept: :meth:`Cascade.delays`.
"""

from __future__ import annotations

import logging
import mmap
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from hpkv.core.procs import background_priority, name_os_thread
from hpkv.tiers.base import Tier

log = logging.getLogger(__name__)

# The thread's nice value (Linux: per thread): its CFS weight is ~1/10 of the model's threads.
CASCADE_NICE = 10
# With defer: how long the engine must have been idle before a write (50 ms: longer than the gap
# between one request's last step and the next request's first in a closed loop, where a write
# started in that gap took the CPU from the next request's tokenization), and the longest a chunk
# waits for such a moment before it is written anyway (the bound a restart or a crash can lose).
CASCADE_IDLE_S = 0.05
CASCADE_PACE_S = 1.0
# The longest a deferred writer sleeps without being woken (it is woken on every change that matters;
# on two cores a poll every few ms took CPU from the model's threads at each wake-up).
CASCADE_RECHECK_S = 0.5
# Steps a vLLM engine can have scheduled and not yet answered (its batch queue: 2 with async
# scheduling, the pipeline depth + 1 at most); beyond it the oldest is taken as answered.
STEPS_IN_FLIGHT_MAX = 8

# What a write is made from: a pool slot (every rank's pool), or one rank's private sealed record.
Source = int | mmap.mmap


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
        timed: Callable[[str, int, float], None] | None = None,
        written: Callable[[mmap.mmap], None] | None = None,
    ) -> None:
        """``tiers_of_rank(i)``: the slower tiers of the rank at index ``i``; ``record_key(i, lk)``
        its record key; ``slot_record(i, slot)`` the sealed record in that rank's pool slot;
        ``unpin(slot)`` releases the pin a queued slot carries; ``pressure()``: the memory pool needs
        the slots queued writes hold (with ``defer``: write now, or new chunks find no slot);
        ``timed(tier, nbytes, seconds)``: told how long each chunk's writes to a tier took (every
        rank's), on the writer thread; ``written(rec)``: a private record is written everywhere
        (or failed), the cascade keeps nothing of it."""
        self._ranks = ranks
        self._tiers_of_rank = tiers_of_rank
        self._record_key = record_key
        self._slot_record = slot_record
        self._unpin = unpin
        self._timed = timed
        self._written_cb = written
        # (key, source, tenant, when queued: time.monotonic)
        self._q: queue.Queue[tuple[bytes, Source, str, float] | None]
        self._q = queue.Queue(maxsize=max(max_chunks, 1))
        self._off = max_chunks == 0
        self._defer = defer
        self._pressure = pressure
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # a change that may let a deferred write go
        self._changes = 0
        self._busy = False
        self._idle_since = 0.0
        self._steps: deque[bool] = deque(maxlen=STEPS_IN_FLIGHT_MAX)  # scheduled, not answered
        self._urgent = 0  # flushes waiting: write at once
        self._closing = False
        self._written = 0  # chunks written to every slower tier (or failed there), and how late:
        self._delay_max = 0.0  # the longest any waited from queued to written, seconds
        self._delay_last = 0.0
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
                self._q.put_nowait((lk, source, tenant, time.monotonic()))
            except queue.Full:
                pass
            else:
                if self._defer:
                    self._changed()  # the queue's length and the pool's pins count
                return True
        if isinstance(source, int):
            self._unpin(source)
        for i in range(self._ranks):
            for t in self._tiers_of_rank(i):
                t.count("writes_skipped")
        return False

    def engine_busy(self, busy: bool) -> None:
        """The engine started (True) or finished (False) a step that computes. With ``defer`` the
        cascade writes once the engine has been idle for CASCADE_IDLE_S, or when its queue is half
        full, or the queued writes pin half the memory pool's slots (a pool full of pinned slots
        would turn every new chunk away from every tier), or the chunk has waited CASCADE_PACE_S:
        where tier work and the model share the CPU, write-behind then costs a prefill little;
        under sustained load every chunk still goes out within that delay (and a full queue still
        drops)."""
        if busy == self._busy:
            return
        if not busy:
            self._idle_since = time.monotonic()
        self._busy = busy
        if self._defer:
            self._changed()

    def _changed(self) -> None:
        with self._wake:
            self._changes += 1
            self._wake.notify_all()

    def step_scheduled(self, computes: bool) -> None:
        """The engine scheduled a step (``computes``: it has tokens to compute). With vLLM's async
        scheduling the next step is scheduled before the previous one's output is back, so one
        step's output does not make the engine idle: it is busy while any step it scheduled that
        computes has not been answered (:meth:`step_done`, in the same order)."""
        self._steps.append(computes)
        self.engine_busy(any(self._steps))

    def step_done(self, computed: bool | None = None) -> None:
        """A scheduled step's output is back: the oldest step of its kind (``computed``), or the
        oldest step when the kind is not known. A step whose output never came (vLLM does not hand
        on an empty step's output that no worker said anything in) is forgotten past
        ``STEPS_IN_FLIGHT_MAX``, and never mistaken for a computing step still out."""
        if computed is None:
            if self._steps:
                self._steps.popleft()
        elif computed in self._steps:
            self._steps.remove(computed)
        self.engine_busy(any(self._steps))

    @property
    def busy(self) -> bool:
        return self._busy

    def pending(self) -> int:
        return self._q.qsize()

    def flush(self) -> None:
        """Block until every write queued before this call is done or dropped (without waiting for
        idle time)."""
        with self._wake:
            self._urgent += 1
            self._changes += 1
            self._wake.notify_all()
        try:
            self._q.join()
        finally:
            with self._lock:
                self._urgent -= 1

    def hurry(self) -> None:
        """From now on write at once, without waiting for idle time (the engine is stopping)."""
        with self._wake:
            self._closing = True
            self._changes += 1
            self._wake.notify_all()

    def delays(self) -> tuple[int, float, float]:
        """Chunks written so far, the longest any waited from queued to written on every slower
        tier, and the last one's wait (seconds)."""
        with self._lock:
            return self._written, self._delay_max, self._delay_last

    def close(self, limit: float | None = None) -> bool:
        """Write what is queued (at once, no idle wait), then stop the thread. ``limit``: give up
        after that many seconds (the writes still queued then are lost, as with a kill). True if
        everything queued was written."""
        self.hurry()
        done = threading.Event()

        def drain() -> None:
            self._q.join()
            done.set()

        threading.Thread(target=drain, name="hpkv-cascade-close", daemon=True).start()
        finished = done.wait(limit)
        if finished:
            self._q.put(None)
            self._thread.join(timeout=30)
        else:
            log.warning(
                "hpkv: stopping with %d chunks not yet written to the slower tiers (%.1f s was the limit)",
                self._q.qsize(),
                limit or 0.0,
            )
        return finished

    def _may_write(self, queued_at: float) -> bool:
        if not self._defer or self._urgent or self._closing:
            return True
        if self._q.qsize() >= self._q.maxsize // 2:
            return True
        if self._pressure is not None and self._pressure():
            return True
        now = time.monotonic()
        if now - queued_at >= CASCADE_PACE_S:
            return True
        return not self._busy and now - self._idle_since >= CASCADE_IDLE_S

    def _wait_for_turn(self, queued_at: float) -> None:
        """Sleep until a deferred write may go: woken by each change (:meth:`_changed`), else when the
        idle time it waits for or the chunk's pace deadline has passed (never by polling)."""
        while True:
            with self._wake:
                seen = self._changes
            if self._may_write(queued_at):  # outside the lock: ``pressure`` asks the pool
                return
            now = time.monotonic()
            left = queued_at + CASCADE_PACE_S - now
            if not self._busy:
                left = min(left, self._idle_since + CASCADE_IDLE_S - now)
            with self._wake:
                if self._changes == seen:
                    self._wake.wait(min(max(left, 0.001), CASCADE_RECHECK_S))

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
                lk, source, tenant, queued_at = item
                self._wait_for_turn(queued_at)
                took: dict[str, list[float]] = {}  # tier -> [bytes, seconds] over the ranks
                for i in range(self._ranks):
                    rec = self._slot_record(i, source) if isinstance(source, int) else memoryview(source)
                    rk = self._record_key(i, lk)
                    for tier in self._tiers_of_rank(i):
                        t0 = time.monotonic()
                        try:
                            wrote = tier.write(rk, rec, tenant)
                        except Exception:  # a tier bug must not kill the writer thread
                            log.exception("hpkv: cascade write to %s failed", tier.name)
                            tier.count("errors")
                            wrote = False
                        if wrote:
                            t = took.setdefault(tier.name, [0.0, 0.0])
                            t[0] += len(rec)
                            t[1] += time.monotonic() - t0
                    del rec
                if isinstance(source, int):
                    self._unpin(source)
                elif self._written_cb is not None:
                    self._written_cb(source)
                waited = time.monotonic() - queued_at
                with self._lock:
                    self._written += 1
                    self._delay_last = waited
                    self._delay_max = max(self._delay_max, waited)
                if self._timed is not None:
                    for name, (nbytes, seconds) in took.items():
                        self._timed(name, int(nbytes), seconds)
            finally:
                self._q.task_done()
