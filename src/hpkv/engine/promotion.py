"""Promotion: a chunk held by a slower tier read into a reserved memory slot, checked, then made visible.

The engine (:class:`hpkv.engine.catalog.Catalog`) stages the chunks of a hit that lie below memory;
each gets a :class:`Promotion` future that settles True once the chunk is in memory (committed,
unpinned, still protected by the lookup that asked for it). A chunk that fails its check on one
tier is read from the next; a chunk that fails on every rank's tiers is not promoted, so a
failure is a shorter hit, never bad data. Without a slot to spare (or a memory tier), a chunk is
read into a private buffer instead (:meth:`Promoter.read_private`).

A read and its check are two steps (a tier's ``fetch_into``): where there are cores to spare, the
check runs on a verify thread while the I/O thread fetches the next record.

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
        try:
            self._io.submit(self._promote, lk, slot, tenant, fut)
        except RuntimeError:  # closing
            self._memory.abort(slot)
            self._settle(lk, fut, False)

    def _promote(self, lk: bytes, slot: int, tenant: str, fut: Promotion) -> None:
        """On an I/O thread: every rank's record of ``lk`` into ``slot``, then its check (on a verify
        thread where there are some), which commits it and settles ``fut``."""
        fut.began, fut.io_thread = time.monotonic(), threading.get_ident()
        try:
            checks = self._fetch_all_ranks(lk, slot, tenant)
            fut.fetched = time.monotonic()
            if checks is None:
                self._memory.abort(slot)
                self._settle(lk, fut, False)
                return
            if self._verify is None:
                self._verify_promotion(lk, slot, checks, fut)
            else:
                self._verify.submit(self._verify_promotion, lk, slot, checks, fut)
        except Exception:
            log.exception("hpkv: promotion failed")
            self._memory.abort(slot)
            self._settle(lk, fut, False)

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

    def _fetch_all_ranks(self, lk: bytes, slot: int, tenant: str) -> list[Callable[[], bool]] | None:
        off = slot * self._slot_bytes
        checks = []
        for i, pool in enumerate(self._pools):
            check = self._fetch_from(
                self._slow_tiers(i), self._record_key(i, lk), pool.view[off : off + self._slot_bytes], tenant
            )
            if check is None:
                return None
            checks.append(check)
        return checks

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
