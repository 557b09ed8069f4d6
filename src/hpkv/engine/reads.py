"""The catalog's reading half: every read from a slower tier, on the catalog's threads.

* **promotions** (:meth:`Reader.stage`): a chunk a lookup found in a slower tier is read into a
  reserved memory slot on an I/O thread, checked on every rank, and only then made visible; the
  caller (vLLM's scheduler) gets a future and never waits for it;
* **loads** (:meth:`Reader.load`, the library's and SGLang's path): the chunks of one request
  handed to the caller's ``consume``, memory hits from their slots, the others read into slots
  (promoted on the way) or, with no slot to spare, into a private buffer.

A read and its check are two steps (a tier's ``fetch_into``): where there are cores to spare, the
check runs on a verify thread while the I/O thread fetches the next record. A record that fails its
check on one tier is read from the next; a chunk that fails on every tier is a miss, never data.
"""

from __future__ import annotations

import functools
import logging
import mmap
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from hpkv.core import record
from hpkv.core.keys import SHARED_TENANT as SHARED
from hpkv.core.procs import name_os_thread
from hpkv.engine.ioproc import IoProcess, Read
from hpkv.tiers.base import Tier
from hpkv.tiers.disk.tier import NAME as STORAGE
from hpkv.tiers.disk.tier import StorageTier

if TYPE_CHECKING:
    from hpkv.core.config import HpkvConfig
    from hpkv.engine.catalog import Catalog, Consume

log = logging.getLogger(__name__)


class Promotion(Future[bool]):
    """A promotion's future, with when its I/O thread (``io_thread``) took it up, when its bytes
    were in the slot, when its check began and when it settled (``time.monotonic``; 0.0 until
    then): what a slow hit's log line breaks its wait into (queued, read, handed over, checked)."""

    began = fetched = checking = settled = 0.0
    io_thread = 0  # CHILD: the I/O process read and checked it
    lk = b""  # the chunk it promotes


CHILD = -1


def staged_line(futures: list[Future[bool]], request_id: str, since: float) -> str:
    """The log line of a hit whose chunks were promoted: how many, for which request, how long
    since ``since`` (the lookup, ``time.monotonic``) and where that went: when the first read
    began and the last chunk was ready; per chunk (median) its read, the wait until a check took
    it up and its check and commit; and the share of the reads' span in which the I/O threads
    that took part were reading (below 100% they waited between reads: for the GIL, a lock, the
    queue). Chunks the I/O process read and checked are given as one span each, from asking it to
    its answer (queueing there included). From the futures that are :class:`Promotion` s and finished."""
    took = (time.monotonic() - since) * 1e3
    line = f"staged {len(futures)} chunks into memory for request {request_id} in {took:.1f} ms"
    settled = [f for f in futures if isinstance(f, Promotion) and f.settled and f.checking]
    if not settled:
        return line
    first = min(f.began for f in settled) - since
    last = max(f.settled for f in settled) - since
    done = [f for f in settled if f.io_thread != CHILD]
    child = len(settled) - len(done)
    if not done:
        asked = statistics.median(f.fetched - f.began for f in settled)
        return (
            f"{line} (first asked of the I/O process at {first * 1e3:.1f} ms, last chunk ready at "
            f"{last * 1e3:.1f} ms; per chunk, median: {asked * 1e3:.2f} ms from asking to its answer)"
        )
    read = statistics.median(f.fetched - f.began for f in done)
    hand = statistics.median(f.checking - f.fetched for f in done)
    check = statistics.median(f.settled - f.checking for f in done)
    threads = len({f.io_thread for f in done})
    span = max(f.fetched for f in done) - min(f.began for f in done)
    busy = sum(f.fetched - f.began for f in done) / (threads * span) if span > 0 else 1.0
    return (
        f"{line} (first read began at {first * 1e3:.1f} ms, last chunk ready at {last * 1e3:.1f} ms; "
        f"per chunk, median: read {read * 1e3:.2f} ms, to a check {hand * 1e3:.2f} ms, check and commit "
        f"{check * 1e3:.2f} ms; {threads} I/O threads reading {busy:.0%} of the time"
        + (f"; {child} read by the I/O process)" if child else ")")
    )


class Reader:
    def __init__(self, cat: Catalog, io_threads: int, verify_threads: int, config: HpkvConfig) -> None:
        """``io_threads`` read; ``verify_threads`` check what they read (0: each I/O thread checks
        its own reads). With ``HPKV_IO_PROCESS`` a promotion from storage is read and checked in a
        helper process with as many threads (:mod:`hpkv.engine.ioproc`).
        ``busy_threads`` (``HPKV_BUSY_IO_THREADS``; 0: no limit): while the engine
        computes a step (:attr:`Catalog.engine_busy_now`), at most this many promotions read at
        once, each checked on its own I/O thread. Every thread that wakes from a read needs the
        GIL the engine's own thread runs its step on, and several contending take it from that
        thread in turn: an engine-like Python thread ran 1.43-1.68x slower beside 4 reading
        threads (without and with verify threads), 1.10x beside one, 1.09x with this limit at 1
        (scripts/probe_interfere.py)."""
        self._cat = cat
        self._busy_threads = config.busy_io_threads
        self._gate = threading.Condition()  # promotions reading now, and their limit while busy
        self._reading = 0
        self._lock = threading.Lock()  # guards _staging
        self._staging: dict[bytes, Promotion] = {}
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="hpkv-io", initializer=name_os_thread)
        self._verify = (
            ThreadPoolExecutor(verify_threads, thread_name_prefix="hpkv-verify", initializer=name_os_thread)
            if verify_threads > 0
            else None
        )
        self._scratch = threading.local()
        self._deferred: list[tuple[bytes, int, str, Promotion]] = []  # see stage(defer=True)
        self._proc: IoProcess | None = None
        if config.io_process and cat.pools and STORAGE in cat.tiers:
            try:
                paths = [p.path for p in cat.pools]
                threads = config.storage_io_threads + verify_threads
                self._proc = IoProcess(paths, cat.pools[0].size, threads, config.storage_o_direct)
            except OSError as e:
                log.warning("hpkv: HPKV_IO_PROCESS: no I/O process (%s); promotions are read here", e)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn`` on an I/O thread (the remote tiers' existence checks)."""
        return self._io.submit(fn, *args)

    def pending(self) -> list[Future[bool]]:
        """The promotions running now."""
        with self._lock:
            return list(self._staging.values())

    def close(self) -> None:
        """Stop the threads once their work is done."""
        self.start_deferred()
        if self._proc is not None:  # before the I/O threads: a failed read there is read again here
            self._proc.close()
        self._io.shutdown(wait=True)
        if self._verify is not None:  # after the I/O threads: their last fetches hand over here
            self._verify.shutdown(wait=True)

    # -- promotion (a slower tier -> memory) -------------------------------------------

    def stage(self, lks: list[bytes], tenant: str = SHARED, *, defer: bool = False) -> list[Future[bool]]:
        """See :meth:`Catalog.stage`; ``defer``: the reads of new promotions wait for
        :meth:`start_deferred` (their slots are reserved now)."""
        cat = self._cat
        futures: list[Future[bool]] = []
        if not cat.pools or not cat.tiers:
            return futures
        for lk in lks:
            if cat.in_memory(lk):
                continue
            with self._lock:
                fut = self._staging.get(lk)
                new = fut is None
                if fut is None:
                    fut = Promotion()
                    fut.lk = lk
                    self._staging[lk] = fut
            if new:
                # The slot is taken here, on the caller's thread: room the caller found for these
                # promotions (see Catalog.short_of_room) is theirs, not the next lookup's.
                slot = cat.reserve()
                if slot is None:
                    self._settle(lk, fut, False)
                elif defer:
                    with self._lock:
                        self._deferred.append((lk, slot, tenant, fut))
                else:
                    self._start(lk, slot, tenant, fut)
            futures.append(fut)
        return futures

    def start_deferred(self) -> int:
        """Start the reads that :meth:`stage` deferred; how many."""
        with self._lock:
            todo, self._deferred = self._deferred, []
        for lk, slot, tenant, fut in todo:
            self._start(lk, slot, tenant, fut)
        return len(todo)

    def _start(self, lk: bytes, slot: int, tenant: str, fut: Promotion) -> None:
        if self._proc is not None and self._start_in_child(lk, slot, tenant, fut):
            return
        self._start_here(lk, slot, tenant, fut)

    def _start_here(self, lk: bytes, slot: int, tenant: str, fut: Promotion) -> None:
        try:
            self._io.submit(self._promote, lk, slot, tenant, fut)
        except RuntimeError:  # the reader is closing
            self._cat.abort(slot)
            self._settle(lk, fut, False)

    def _start_in_child(self, lk: bytes, slot: int, tenant: str, fut: Promotion) -> bool:
        """Ask the I/O process for every rank's record of ``lk``, when storage is where each is read
        from; False: it is not (or the process is gone), read it here. Once every rank's answer is in,
        the slot is committed, or, where one failed, read again here, where the tiers say why."""
        cat, proc = self._cat, self._proc
        assert proc is not None
        reads: list[tuple[StorageTier, bytes, Read]] = []
        off = slot * cat.slot_bytes
        for i in range(len(cat.ranks)):
            rk = cat.record_key(i, lk)
            tier = next(
                (t for t in cat.slow_tiers(i) if not t.remote and t.contains_many([rk], tenant)[0]), None
            )
            if not isinstance(tier, StorageTier) or not proc.alive:
                return False
            reads.append(
                (
                    tier,
                    rk,
                    Read(i, off, cat.slot_bytes, tier.path(rk), tier.namespace, rk, tier.payload_bytes),
                )
            )
        lock = threading.Lock()
        answers: list[tuple[bool, bool] | None] = [None] * len(reads)  # per rank: (whole, page cache)
        left = [len(reads)]

        def done(i: int, ok: bool, cached: bool) -> None:
            with lock:
                answers[i] = (ok, cached)
                left[0] -= 1
                if left[0]:
                    return
            fut.fetched = fut.checking = time.monotonic()
            if not all(a is not None and a[0] for a in answers):
                self._start_here(lk, slot, tenant, fut)
                return
            for (tier, rk, _), a in zip(reads, answers, strict=True):
                tier.count_hit(rk, by_child=True, cached=a is not None and a[1])
            self._verify_promotion(lk, slot, [], fut)

        fut.began, fut.io_thread = time.monotonic(), CHILD
        for i, (_, _, r) in enumerate(reads):
            if not proc.read(r, functools.partial(done, i)):
                done(i, False, False)
        return True

    def _promote(self, lk: bytes, slot: int, tenant: str, fut: Promotion) -> None:
        """On an I/O thread: every rank's record of ``lk`` into its reserved ``slot``, then on to a
        verify thread (:meth:`_verify_promotion`) that commits it and settles ``fut``."""
        cat = self._cat
        limited = self._enter()
        fut.began, fut.io_thread = time.monotonic(), threading.get_ident()
        try:
            checks = self._fetch_all_ranks(lk, slot, tenant)
            fut.fetched = time.monotonic()
            if checks is None:
                cat.abort(slot)
                self._settle(lk, fut, False)
                return
            if self._verify is None or limited:
                self._verify_promotion(lk, slot, checks, fut)
            else:
                self._verify.submit(self._verify_promotion, lk, slot, checks, fut)
        except Exception:
            log.exception("hpkv: promotion failed")
            cat.abort(slot)
            self._settle(lk, fut, False)
        finally:
            self._leave()  # a limited promotion has read and checked by now: one thread's work

    def _enter(self) -> bool:
        """Wait, while the engine computes, until fewer than ``busy_threads`` promotions run; then
        count this one in. True: it was limited (it checks its own read, handing nothing on, so
        that it is one thread's work until :meth:`_leave`)."""
        limit = self._busy_threads
        if not limit:
            return False
        with self._gate:
            while self._reading >= limit and self._cat.engine_busy_now:
                self._gate.wait()
            self._reading += 1
            return self._cat.engine_busy_now

    def _leave(self) -> None:
        if self._busy_threads:
            with self._gate:
                self._reading -= 1
                self._gate.notify()

    def engine_idle(self) -> None:
        """The engine has no computing step out: every waiting promotion may read."""
        if self._busy_threads:
            with self._gate:
                self._gate.notify_all()

    def _verify_promotion(
        self, lk: bytes, slot: int, checks: list[Callable[[], bool]], fut: Promotion
    ) -> None:
        ok = False
        fut.checking = time.monotonic()
        try:
            if all(check() for check in checks):
                ok = self._cat.promoted(slot, lk)
            else:
                self._cat.abort(slot)
        except Exception:
            log.exception("hpkv: promotion failed")
            self._cat.abort(slot)
        finally:
            self._settle(lk, fut, ok)

    def _settle(self, lk: bytes, fut: Promotion, ok: bool) -> None:
        with self._lock:
            self._staging.pop(lk, None)
        fut.settled = time.monotonic()
        fut.set_result(ok)

    # -- reads of one chunk ----------------------------------------------------------

    def _fetch_all_ranks(self, lk: bytes, slot: int, tenant: str) -> list[Callable[[], bool]] | None:
        cat = self._cat
        off = slot * cat.slot_bytes
        checks = []
        for i in range(len(cat.ranks)):
            check = self._fetch_rank(i, lk, cat.pools[i].view[off : off + cat.slot_bytes], tenant)
            if check is None:
                return None
            checks.append(check)
        return checks

    def _fetch_rank(self, i: int, lk: bytes, buf: memoryview, tenant: str) -> Callable[[], bool] | None:
        """Rank ``i``'s record of ``lk`` into ``buf`` from the fastest slower tier that has it, and
        its check (see :meth:`_fetch_from`)."""
        return self._fetch_from(self._cat.slow_tiers(i), self._cat.record_key(i, lk), buf, tenant)

    def _fetch_from(
        self, tiers: list[Tier], rk: bytes, buf: memoryview, tenant: str
    ) -> Callable[[], bool] | None:
        """The record ``rk`` into ``buf`` from the first of ``tiers`` that has it (a local tier is
        asked first whether it holds it; a remote one is simply read), and its check: if that
        fails, the check reads from the tiers after it, checking as it goes."""
        for n, t in enumerate(tiers):
            if not t.remote and not t.contains_many([rk], tenant)[0]:
                continue
            check = t.fetch_into(rk, buf, tenant)
            if check is not None:
                rest = tiers[n + 1 :]
                return lambda: check() or self._read_from(rest, rk, buf, tenant)
        return None

    def _read_from(self, tiers: list[Tier], rk: bytes, buf: memoryview, tenant: str) -> bool:
        """:meth:`_fetch_from` and its check, on this thread."""
        check = self._fetch_from(tiers, rk, buf, tenant)
        return check is not None and check()

    # -- loads in this process (library, SGLang) -------------------------------------------

    def load(self, lks: list[bytes], consume: Consume, tenant: str = SHARED, *, probe: bool = True) -> int:
        """See :meth:`Catalog.load`."""
        cat = self._cat
        if not lks:
            return 0
        if probe or not cat.has_remote:
            located = cat.locate(lks, tenant)
        else:
            located = [w or "remote" for w in cat.locate_local(lks, tenant)]
        n = located.index(None) if None in located else len(located)
        if n < len(lks):
            cat.count_miss(1)  # the chunk that ended the hit (the ones after it were not asked for)
        pinned = cat.pin_each(lks[:n])  # the memory hits (located there, or promoted since)
        cat.protect(lks[:n])
        futures: dict[int, Future[bool | Future[bool]]] = {}
        done: dict[int, bool] = {}
        try:
            for i in range(n):  # the slow reads first, so they overlap the memory copies
                if i not in pinned:
                    futures[i] = self._io.submit(self._load_slow, i, lks[i], consume, tenant)
            for i, slot in pinned.items():
                if self._consume_slot(i, lks[i], slot, consume):
                    done[i] = True
                else:  # its header failed: the slower tiers may still have it
                    futures[i] = self._io.submit(self._load_slow, i, lks[i], consume, tenant)
            for i, fut in futures.items():
                r = fut.result()  # a slot's read hands its check to a verify thread
                done[i] = r.result() if isinstance(r, Future) else r
        finally:
            cat.unpin(pinned.values())
            cat.unprotect(lks[:n])
        k = 0
        while done.get(k):
            k += 1
        return k

    def _consume_slot(self, i: int, lk: bytes, slot: int, consume: Consume) -> bool:
        """A pinned memory hit: its header checked (not its checksum: slots are written only by
        this engine, from verified records or the engine's own KV), then consumed."""
        cat = self._cat
        off = slot * cat.slot_bytes
        rec = cat.pools[0].view[off : off + cat.record_bytes]
        verdict = record.verify(
            rec, cat.record_bytes, cat.rank_digests[0], cat.record_key(0, lk), cat.payload_bytes,
            check_payload=False,
        )  # fmt: skip
        if verdict is not record.Verdict.OK:
            cat.drop_corrupt(lk)
            return False
        p = off + record.HEADER_BYTES
        consume(i, cat.pools[0].tensor[p : p + cat.payload_bytes])
        cat.count_load(1, cat.payload_bytes)
        return True

    def _load_slow(self, i: int, lk: bytes, consume: Consume, tenant: str) -> bool | Future[bool]:
        """On an I/O thread: read ``lk`` into a reserved slot and hand its check, consume and
        promotion to a verify thread (its future), or, with no slot, read and check it into
        this thread's private buffer and consume it here."""
        cat = self._cat
        slot = cat.reserve() if cat.pools else None
        if slot is not None:
            try:
                checks = self._fetch_all_ranks(lk, slot, tenant)
            except BaseException:
                cat.abort(slot)
                raise
            if checks is None:
                cat.abort(slot)
                return False
            if self._verify is None:
                return self._consume_fetched(i, lk, slot, checks, consume)
            return self._verify.submit(self._consume_fetched, i, lk, slot, checks, consume)
        buf, tensor = self._scratch_buffer()
        if not self._read_from(cat.slow_tiers(0), cat.record_key(0, lk), buf, tenant):
            return False
        consume(i, tensor[record.HEADER_BYTES : record.HEADER_BYTES + cat.payload_bytes])
        return True

    def _consume_fetched(
        self, i: int, lk: bytes, slot: int, checks: list[Callable[[], bool]], consume: Consume
    ) -> bool:
        cat = self._cat
        try:
            ok = all(check() for check in checks)
        except BaseException:
            cat.abort(slot)
            raise
        if not ok:
            cat.abort(slot)
            return False
        p = slot * cat.slot_bytes + record.HEADER_BYTES
        try:
            consume(i, cat.pools[0].tensor[p : p + cat.payload_bytes])
        finally:
            cat.promoted(slot, lk)
        return True

    def _scratch_buffer(self) -> tuple[memoryview, torch.Tensor]:
        """A page-aligned buffer of one record for this thread (O_DIRECT reads need the alignment)."""
        s = self._scratch
        if not hasattr(s, "buf"):
            s.mm = mmap.mmap(-1, self._cat.slot_bytes)
            s.buf = memoryview(s.mm)
            s.tensor = torch.frombuffer(s.mm, dtype=torch.uint8)
        return s.buf, s.tensor
