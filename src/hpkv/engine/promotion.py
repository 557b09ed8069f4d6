"""Promotion: a chunk held by a slower tier read into a reserved memory slot, checked, then made visible.

The engine (:class:`hpkv.engine.catalog.Catalog`) stages the chunks of a hit that lie below memory;
each gets a :class:`Promotion` future that settles True once the chunk is in memory (committed,
unpinned, still protected by the lookup that asked for it). A chunk that fails its check on one
tier is read from the next; a chunk that fails on every rank's tiers is not promoted, so a
failure is a shorter hit, never bad data. Without a slot to spare (or a memory tier), a chunk is
read into a private buffer instead (:meth:`Promoter.read_private`).

A hit's promotions run as one task per I/O thread, each reading its share a few chunks at a time:
storage reads and checks those few in one native call (``fetch_many``, the GIL released), other
tiers chunk by chunk. A read and its check are two steps (a tier's ``fetch_into``): where there
are cores to spare, the check runs on a verify thread while the I/O thread fetches the next record.

Thread contract: :meth:`Promoter.stage` and :meth:`Promoter.start_deferred` never block (a slot is
reserved on the caller's thread, the reads run on the I/O threads); :meth:`Promoter.read_private`
blocks for one read; :meth:`Promoter.close` waits for the reads in flight.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from hpkv.core.procs import name_os_thread
from hpkv.tiers.base import Tier
from hpkv.tiers.memory.bookkeeping import Slots
from hpkv.tiers.memory.pool import ShmPool

log = logging.getLogger(__name__)

# Chunks an I/O thread reads in one call of a tier that reads batches: a few, so that the hit's
# first chunks still land (and are consumed) while its later ones are read.
BATCH = 4


class Promotion(Future[bool]):
    """A promotion's future, with when its I/O thread (``io_thread``) took it up, when its bytes
    were in the slot, when its check began and when it settled (``time.monotonic``; 0.0 until
    then): what a slow hit's log line breaks its wait into (queued, read, handed over, checked)."""

    began = fetched = checking = settled = 0.0
    io_thread = 0
    lk = b""  # the chunk it promotes


class Promoter:
    def __init__(
        self,
        memory: Slots,
        pools: list[ShmPool],
        slot_bytes: int,
        record_key: Callable[[int, bytes], bytes],
        slow_tiers: Callable[[int], list[Tier]],
        io_threads: int,
        verify_threads: int,
    ) -> None:
        """``pools``: one per served rank (slot s of each holds that rank's record of one chunk);
        ``record_key(i, lk)`` / ``slow_tiers(i)``: rank index ``i``'s record key and its tiers below
        memory, fastest first; ``io_threads`` read; ``verify_threads`` check what they read (0:
        each I/O thread checks its own reads)."""
        self._memory = memory
        self._pools = pools
        self._slot_bytes = slot_bytes
        self._record_key = record_key
        self._slow_tiers = slow_tiers
        self._lock = threading.Lock()  # guards _staging and _deferred
        self._staging: dict[bytes, Promotion] = {}
        self._deferred: list[tuple[bytes, int, str, Promotion]] = []
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="hpkv-io", initializer=name_os_thread)
        self._io_threads = io_threads
        self._verify = (
            ThreadPoolExecutor(verify_threads, thread_name_prefix="hpkv-verify", initializer=name_os_thread)
            if verify_threads > 0
            else None
        )
        self._scratch = threading.local()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn`` on an I/O thread (the remote tiers' existence checks, private reads)."""
        return self._io.submit(fn, *args)

    def pending(self) -> list[Future[bool]]:
        """The promotions running now."""
        with self._lock:
            return list(self._staging.values())

    def close(self) -> None:
        """Stop the threads once their work is done."""
        self.start_deferred()
        self._io.shutdown(wait=True)
        if self._verify is not None:  # after the I/O threads: their last fetches hand over here
            self._verify.shutdown(wait=True)

    # -- promotions ----------------------------------------------------------------------

    def stage(self, lks: list[bytes], tenant: str, *, defer: bool = False) -> list[Future[bool]]:
        """Start promoting ``lks`` (those not in memory); never blocks. Returns the futures of the
        promotions now running for them (one already running for a key is shared). Each new
        promotion's slot is reserved here, on the caller's thread (one that finds none settles
        False at once), so room the caller found is theirs. ``defer``: the reads wait for
        :meth:`start_deferred`."""
        futures: list[Future[bool]] = []
        if not self._pools:
            return futures
        now: list[tuple[bytes, int, str, Promotion]] = []
        for lk in lks:
            if lk in self._memory:
                continue
            with self._lock:
                fut = self._staging.get(lk)
                new = fut is None
                if fut is None:
                    fut = Promotion()
                    fut.lk = lk
                    self._staging[lk] = fut
            if new:
                slot = self._memory.reserve()
                if slot is None:
                    self._settle(lk, fut, False)
                elif defer:
                    with self._lock:
                        self._deferred.append((lk, slot, tenant, fut))
                else:
                    now.append((lk, slot, tenant, fut))
            futures.append(fut)
        self._start(now)
        return futures

    def start_deferred(self) -> int:
        """Start the reads that :meth:`stage` deferred; how many."""
        with self._lock:
            todo, self._deferred = self._deferred, []
        self._start(todo)
        return len(todo)

    def _start(self, todo: list[tuple[bytes, int, str, Promotion]]) -> None:
        """One task per I/O thread, each a share of ``todo`` in its order (every ``k``-th chunk,
        so the hit's first chunks land first): each hand-over between threads is a round trip for
        the GIL, which a busy engine thread may hold for its whole switch interval."""
        k = min(len(todo), self._io_threads)
        for j in range(k):
            share = todo[j::k]
            try:
                self._io.submit(self._promote_many, share)
            except RuntimeError:  # closing
                for lk, slot, _tenant, fut in share:
                    self._memory.abort(slot)
                    self._settle(lk, fut, False)

    def _promote_many(self, share: list[tuple[bytes, int, str, Promotion]]) -> None:
        """On an I/O thread: every rank's record of each chunk of ``share`` into its slot, BATCH
        chunks at a time (a tier that reads batches, storage, reads them in one native call), then
        each one's check (on a verify thread where there are some), which commits it and settles
        its future."""
        for at in range(0, len(share), BATCH):
            part = share[at : at + BATCH]
            began = time.monotonic()
            for *_, fut in part:
                fut.began, fut.io_thread = began, threading.get_ident()
            try:
                fetched = self._fetch_part(part)
            except Exception:
                log.exception("hpkv: promotion failed")
                fetched = [None] * len(part)
            for (lk, slot, _tenant, fut), checks in zip(part, fetched, strict=True):
                fut.fetched = time.monotonic()
                if checks is None:
                    self._memory.abort(slot)
                    self._settle(lk, fut, False)
                elif self._verify is None:
                    self._verify_promotion(lk, slot, checks, fut)
                else:
                    self._verify.submit(self._verify_promotion, lk, slot, checks, fut)

    def _verify_promotion(
        self, lk: bytes, slot: int, checks: list[Callable[[], bool]], fut: Promotion
    ) -> None:
        ok = False
        fut.checking = time.monotonic()
        try:
            if all(check() for check in checks):
                ok = self._memory.commit(slot, lk, keep_pin=False)
                if ok:
                    self._memory.counters.add("promotions")
            else:
                self._memory.abort(slot)
        except Exception:
            log.exception("hpkv: promotion failed")
            self._memory.abort(slot)
        finally:
            self._settle(lk, fut, ok)

    def _settle(self, lk: bytes, fut: Promotion, ok: bool) -> None:
        with self._lock:
            self._staging.pop(lk, None)
        fut.settled = time.monotonic()
        fut.set_result(ok)

    # -- reads of one chunk ----------------------------------------------------------------

    def _fetch_part(
        self, part: list[tuple[bytes, int, str, Promotion]]
    ) -> list[list[Callable[[], bool]] | None]:
        """Every rank's record of each chunk of ``part`` into its slot: per chunk its checks, or
        None (a rank had it nowhere). The chunks a rank's first tier holds, when that tier reads
        batches (``fetch_many``), are read in one call; the rest tier by tier."""
        out: list[list[Callable[[], bool]] | None] = [[] for _ in part]
        for i, pool in enumerate(self._pools):
            tiers = self._slow_tiers(i)
            rks = [self._record_key(i, lk) for lk, *_ in part]
            bufs = [
                pool.view[slot * self._slot_bytes : (slot + 1) * self._slot_bytes] for _, slot, *_ in part
            ]
            first: list[Callable[[], bool] | None] = [None] * len(part)
            rest = tiers
            fetch_many = getattr(tiers[0], "fetch_many", None) if tiers and not tiers[0].remote else None
            if fetch_many is not None:
                rest = tiers[1:]
                held = [
                    j
                    for j, (rk, (_, _, tenant, _)) in enumerate(zip(rks, part, strict=True))
                    if out[j] is not None and tiers[0].contains_many([rk], tenant)[0]
                ]
                for j, check in zip(
                    held, fetch_many([rks[j] for j in held], [bufs[j] for j in held]), strict=True
                ):
                    if check is not None:
                        first[j] = self._or_else(check, rest, rks[j], bufs[j], part[j][2])
            for j, checks in enumerate(out):
                if checks is None:
                    continue
                check = first[j] or self._fetch_from(rest, rks[j], bufs[j], part[j][2])
                if check is None:
                    out[j] = None
                else:
                    checks.append(check)
        return out

    def _or_else(
        self, check: Callable[[], bool], tiers: list[Tier], rk: bytes, buf: memoryview, tenant: str
    ) -> Callable[[], bool]:
        """``check``, or when it fails the record read again from ``tiers``, checked as it goes."""
        return lambda: check() or self._read_from(tiers, rk, buf, tenant)

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
                return self._or_else(check, tiers[n + 1 :], rk, buf, tenant)
        return None

    def _read_from(self, tiers: list[Tier], rk: bytes, buf: memoryview, tenant: str) -> bool:
        check = self._fetch_from(tiers, rk, buf, tenant)
        return check is not None and check()

    def read_private(self, lk: bytes, tenant: str) -> torch.Tensor | None:
        """The first served rank's verified record of ``lk`` into this thread's private buffer
        (reused by the thread's next call): its payload's bytes, or None (a miss). Blocks."""
        s = self._scratch
        if not hasattr(s, "buf"):  # page-aligned: O_DIRECT reads need it
            s.mm = mmap.mmap(-1, self._slot_bytes)
            s.buf = memoryview(s.mm)
            s.tensor = torch.frombuffer(s.mm, dtype=torch.uint8)
        if not self._read_from(self._slow_tiers(0), self._record_key(0, lk), s.buf, tenant):
            return None
        tensor: torch.Tensor = s.tensor
        return tensor
