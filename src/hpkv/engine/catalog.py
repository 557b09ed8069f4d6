"""The engine: what is cached where, and every move between tiers, for whichever engine hpkv serves.

One instance per serving process: vLLM's scheduler (all tensor-parallel ranks of the engine), a
library user's :class:`hpkv.KVStore` (one rank), SGLang's storage backend. It owns the memory pools
of the ranks it serves (slot s holds chunk k in every rank's pool file, each rank's own shard under
its own record key) and one instance per rank of every slower tier the configuration names (built
through :mod:`hpkv.tiers.base`'s registry, so adding a tier touches no code here). It talks to
those tiers only through the ``Tier`` protocol.

Both integrations use one interface (nothing else of this class is theirs to call):

* **lookup** — :meth:`Catalog.lookup` answers a :class:`~hpkv.engine.lookup.Lookup` with ``Hit``,
  ``Pending`` (ask again) or ``Miss``. Memory and the local tiers are asked per key, the remote
  tiers once per lookup (one pipelined round trip per rank, on a thread); the hit ends at the first
  chunk no tier holds, and is cut where loading would be slower than recomputing
  (:mod:`hpkv.engine.costs`). Its chunks below memory are promoted into memory
  (:mod:`hpkv.engine.promotion`) and are protected from eviction until pinned.
* **load** — a ``Hit``'s slots are pinned for the caller; :meth:`Catalog.finish_load` releases them
  and counts the hit. A streamed hit hands out its chunks as each arrives
  (:meth:`Catalog.arrivals`). :meth:`Catalog.release` ends a lookup in any phase.
* **store** — :meth:`Catalog.begin_store` reserves a slot (or, with no slot to spare, a private
  buffer) for a new chunk; the caller fills and seals it on every rank; :meth:`Catalog.finish_store`
  makes it visible and queues it for the slower tiers (:mod:`hpkv.engine.cascade`).

:mod:`hpkv.integrations.library.local` runs those pairs for a caller that holds the bytes in this process (the
library, SGLang).

Thread contract: every method may be called from any thread. ``lookup`` never blocks past its
``wait_until``; the pairs never wait on I/O; ``load`` and ``store`` block for their own reads.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable, Container, Iterable, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from typing import Any

import torch

from hpkv.core import record
from hpkv.core.config import HpkvConfig
from hpkv.core.errors import HpkvConfigError
from hpkv.core.keys import SHARED_TENANT as SHARED
from hpkv.core.keys import Namespace, Tokens, chunk_keys, record_key
from hpkv.engine.cascade import Cascade
from hpkv.engine.costs import LoadCosts
from hpkv.engine.interface import (
    MEMORY,
    Answer,
    Arrivals,
    Asked,
    Cut,
    Engine,
    Hit,
    Miss,
    Pending,
    Reserved,
    StoreTarget,
    Why,
)
from hpkv.engine.locator import Locator
from hpkv.engine.lookup import GIVE_UP_S, Ahead, Located, Lookup, Phase
from hpkv.engine.pools import open_memory
from hpkv.engine.promotion import Promoter
from hpkv.engine.stores import Stores
from hpkv.tiers.base import TIERS, Tier, builder
from hpkv.tiers.memory.pool import ShmPool, slot_bytes

log = logging.getLogger(__name__)


# How long a hit waits for pool slots that others hold before it is promoted as far as room goes
# (two waiting requests could each hold, protected, resident chunks the other needs room for).
ROOM_WAIT_S = 2.0

# A private record (see interface.StoreTarget) is an anonymous mapping, not a bytearray: a
# bytearray is zeroed and faulted in while its maker holds the GIL (milliseconds per chunk, stalling
# the engine's own threads), where a mapping's pages are faulted in by the copy that fills it, which
# runs without the GIL; it is page-aligned too (O_DIRECT writes).


class Catalog(Engine):
    def __init__(
        self,
        config: HpkvConfig,
        namespace: Namespace,
        ranks: Sequence[int] | None = None,
        *,
        defer_cascade: bool = False,
        adopt_pools: Sequence[str | None] | None = None,
        verify_threads: int | None = None,
    ) -> None:
        """``ranks``: the tensor-parallel ranks this process serves (default: all of ``namespace``'s);
        index ``i`` of every per-rank list here is rank ``ranks[i]``. ``defer_cascade``: hold
        write-behind while the engine computes (see :meth:`step_scheduled`). ``adopt_pools``: per
        rank, a pool file another process made for this one (:meth:`ShmPool.adopt`); a rank
        whose file is not there, or not that, gets a pool of its own. ``verify_threads``: threads
        that check what the I/O threads read (0: each I/O thread checks its own reads; default:
        ``storage_io_threads`` of them where this process may use twice that many cores, else 0)."""
        record.set_auth_key(config.auth_key_bytes)
        self.config = config
        self.chunk_size = config.chunk_size
        self.world_size = namespace.world_size
        self.ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        if not self.ranks or any(not 0 <= r < self.world_size for r in self.ranks):
            raise HpkvConfigError(
                f"ranks={self.ranks} must be in [0, world_size={self.world_size}); use e.g. rank=0"
            )
        self.namespaces = [namespace.for_rank(r) for r in self.ranks]
        self.rank_digests = [n.digest for n in self.namespaces]
        self.logical_digest = namespace.logical_digest
        self.payload_bytes = namespace.layout.chunk_bytes(self.chunk_size)
        self.record_bytes = record.record_bytes(self.payload_bytes)
        self.slot_bytes = slot_bytes(self.record_bytes)
        self.tiers: dict[str, list[Tier]] = {}  # name -> one per rank, fastest first
        self._closers: list[Callable[[], None]] = []
        # The host's pool (shared by every engine there, kept across restarts) unless the engine asks
        # for its own or names one pool file.
        memory = open_memory(
            config, self.ranks, self.world_size, self.logical_digest, self.slot_bytes, adopt_pools
        )
        self.pools: list[ShmPool] = memory.pools
        if memory.close is not None:
            self._closers.append(memory.close)
        try:
            for name in TIERS:
                built = builder(name)(config, self.payload_bytes, self.rank_digests)
                if built is not None:
                    self.tiers[name] = built.per_rank
                    self._closers.append(built.close)
        except BaseException:
            self._close_tiers()
            for p in self.pools:
                p.close()
            raise
        self.memory = memory.slots
        self._where = Locator(self.memory, self.tiers, self.record_key, lambda fn: self._promoter.submit(fn))
        self.num_slots = memory.slots.num_slots
        self._stores = Stores(
            self.memory,
            bool(self.pools),
            bool(self.tiers),
            lambda: self._cascade,
            self._where.held_below,
            self.record_bytes,
            self.payload_bytes,
            config.cascade_queue_chunks,
        )
        # Promotions from a remote tier wait on the network: as many threads as its workers.
        threads = max(config.storage_io_threads, config.valkey_num_workers if self._where.has_remote else 0)
        self.io_threads = threads
        # Where there are cores to spare, a read record is checked on a verify thread while its
        # I/O thread fetches the next one, so reading and hashing overlap; where there are not, the
        # extra threads would only contend for the same cores, and each I/O thread checks its own.
        if verify_threads is None:
            cores = len(os.sched_getaffinity(0))
            verify_threads = config.storage_io_threads if cores >= 2 * config.storage_io_threads else 0
        self._promoter = Promoter(
            self.memory,
            self.pools,
            self.slot_bytes,
            self.record_key,
            self.slow_tiers,
            threads,
            verify_threads,
        )
        self._closed = False
        # What loads cost against recomputing: the write-behind times its writes here, the engine's
        # scheduler its reads and steps (see hpkv.engine.costs).
        self.costs = LoadCosts(
            self.chunk_size, self.payload_bytes * len(self.ranks), enabled=config.cost_aware_loads
        )
        self._cascade = Cascade(
            config.cascade_queue_chunks,
            len(self.ranks),
            self.slow_tiers,
            self.record_key,
            self._slot_record,
            lambda slot: self.memory.unpin([slot]),
            defer=defer_cascade,
            pressure=self.memory.scarce,
            timed=self._timed_write,
            written=self._stores.spare,
        )

    def _timed_write(self, tier: str, nbytes: int, seconds: float) -> None:
        """A write to a remote tier bounds its reads (a slow link is slow both ways); a local tier's
        writes (a new file, a rename) say nothing of how fast its reads are."""
        ts = self.tiers.get(tier)
        if ts and ts[0].remote:
            self.costs.wrote(tier, nbytes, seconds)

    # -- tiers ------------------------------------------------------------------------

    def tier(self, name: str) -> list[Tier]:
        """The tier registered as ``name`` (see :data:`hpkv.tiers.base.TIERS`), one per served rank;
        empty when it is not configured."""
        return self.tiers.get(name, [])

    def tier_names(self) -> list[str]:
        return ([MEMORY] if self.pools else []) + list(self.tiers)

    def slow_tiers(self, i: int) -> list[Tier]:
        return [ts[i] for ts in self.tiers.values()]

    # -- keys ---------------------------------------------------------------------

    def keys(
        self,
        tokens: Tokens,
        limit: int | None = None,
        seed: bytes | None = None,
        extras: list[bytes | None] | None = None,
    ) -> list[bytes]:
        """Logical keys of the full chunks of ``tokens`` (``seed``/``extras``: a request's identity
        beyond its tokens, see :mod:`hpkv.core.keys`)."""
        return chunk_keys(seed or self.logical_digest, tokens, self.chunk_size, limit, extras)

    def record_key(self, i: int, lk: bytes) -> bytes:
        """The record key of ``lk`` for the rank at index ``i`` of :attr:`ranks`."""
        return record_key(self.rank_digests[i], lk)

    def unlink_pool_files(self) -> None:
        """Remove the pool files' names once every process that needs them has mapped them; the
        memory stays until the last mapping goes."""
        for p in self.pools:
            p.unlink()

    @property
    def pool_paths(self) -> list[str]:
        return [p.path for p in self.pools]

    # -- where a chunk is ------------------------------------------------------------

    def in_memory(self, lk: bytes) -> bool:
        return lk in self.memory

    def in_storage(self, lk: bytes) -> bool:
        """Whether a local tier's index holds ``lk`` (see :meth:`Locator.held_locally`)."""
        return self._where.held_locally(lk) is not None

    def locate_local(self, lks: Iterable[bytes], tenant: str = SHARED) -> list[str | None]:
        """Per key memory or a local tier or None, from the indexes, with no cut at a gap."""
        return self._where.locate_local(lks, tenant)

    def probe(
        self, gaps: list[bytes], held: list[tuple[bytes, str]], tenant: str = SHARED, *, remote: bool = True
    ) -> Future[Located]:
        """:meth:`Locator.locate_below` on an I/O thread; never blocks."""
        return self._where.probe(gaps, held, tenant, remote=remote)

    def _sources_needed(self) -> bool:
        """Whether a lookup needs to know where each read below memory comes from: for the cost plan
        (a prefill rate to weigh it against) or to measure the promotions into memory by source."""
        return bool(self.pools) or (self.costs.enabled and self.costs.prefill_rate() is not None)

    def locate(self, lks: Iterable[bytes], tenant: str = SHARED, *, remote: bool = True) -> list[str | None]:
        """Per key the fastest tier that holds it; None from the first key no tier holds onwards.
        The first steps of :meth:`lookup` (the remote tiers asked once, for the keys the local ones
        lack), waited for, with nothing protected, promoted or counted: an existence check.
        ``remote=False``: :meth:`locate_local` (no cut at a gap)."""
        if not remote:
            return self._where.locate_local(lks, tenant)
        lk = Lookup(list(lks), tenant)
        self._find(lk, 0, probe=True, sources=False)
        if lk.probe is not None:
            for i, name in zip(lk.probe_at, lk.probe.result()[0], strict=True):
                lk.where[i] = name
        out = lk.where
        if None in out:
            cut = out.index(None)
            out[cut:] = [None] * (len(out) - cut)
        return out

    # -- the lookup ---------------------------------------------------------------------

    def look_ahead(self, lk: Lookup) -> None:
        """The request was queued: ask now, on an I/O thread, what its first :meth:`lookup` would
        ask there (the remote tiers about the chunks the others lack, where each read below memory
        would come from), so that the lookup finds the answer in. Never blocks."""
        if not self.tiers or lk.phase is not Phase.NEW or lk.ahead is not None or not lk.lks:
            return
        where = self._where.locate_local(lk.lks, lk.tenant)
        gaps = [i for i, w in enumerate(where) if w is None] if self._where.has_remote else []
        held = []
        if self._sources_needed():
            held = [(k, w) for k, w in zip(lk.lks, where, strict=True) if w in self._where.local_names()]
        if gaps or held:
            answer = self.probe([lk.lks[i] for i in gaps], held, lk.tenant, remote=bool(gaps))
            lk.ahead = Ahead(answer, gaps)

    def lookup(
        self,
        lk: Lookup,
        first: int = 0,
        *,
        wait_until: float | None = None,
        defer: bool = False,
        stream: Callable[[int, int], bool] | None = None,
        probe: bool = True,
    ) -> Answer:
        """The hit of ``lk`` from chunk ``first`` on: a :class:`Hit` (its slots pinned for the caller),
        :class:`Pending` (tier I/O runs: ask again) or :class:`Miss`.

        The first ask finds each chunk's fastest tier (remote tiers: one batched check on an I/O
        thread, or the one :meth:`look_ahead` made), cuts the hit at the first gap and where
        loading would be slower than recomputing, and protects its chunks from eviction. Its chunks
        below memory are then promoted (unless pool slots are short: it waits for them up to
        ROOM_WAIT_S). Once every promotion settled (or GIVE_UP_S passed) the answer is a Hit of
        what is in memory from ``first`` on, pinned anew on every ask.

        ``wait_until`` (``time.monotonic``): wait for the lookup's own I/O until then (default:
        never wait). ``defer``: promotions read only from :meth:`start_deferred` on (vLLM: after the
        scheduling pass, whose other lookups the reading threads would slow down). ``stream(below,
        chunks)``: whether to answer a hit of ``chunks`` chunks, ``below`` of them below memory,
        as a streamed Hit (its chunks from :meth:`arrivals`). ``probe=False``: the caller has just
        checked existence itself (SGLang's ``batch_exists``), so the chunks no local tier holds are
        read from the remote tiers without asking first (a read that misses costs what the check
        would have)."""
        waits, room = lk.waits, lk.waited_for_room
        found = promotions = False

        def asked() -> Asked:
            if not (lk.waits - waits or lk.waited_for_room > room or found or promotions):
                return Asked()
            cut = None
            if found and lk.left_out:
                cut = Cut(lk.chunks, lk.found, frozenset(lk.left_out), lk.why_left)
            return Asked(
                waited=lk.waits - waits,
                waited_for_room=lk.waited_for_room and not room,
                found=found,
                used_ahead=found and lk.ahead_used,
                cut=cut,
                promotions=tuple(lk.promotions) if promotions else (),
                since=lk.since,
            )

        if lk.phase is Phase.NEW:
            self._find(lk, first, probe)
            self.memory.counters.add("misses", sum(w != MEMORY for w in lk.where))
            if lk.probe is not None:
                lk.since = time.monotonic()
                lk.to(Phase.LOCATING)
            else:
                self._cut(lk)
                found = True
        if lk.phase is Phase.LOCATING:
            assert lk.probe is not None
            self._wait([lk.probe], lk, wait_until)
            if not lk.probe.done() and not self._gave_up(lk, GIVE_UP_S):
                return Pending(Why.LOCATING, asked())
            names, sources = lk.probe.result() if lk.probe.done() else ([None] * len(lk.probe_at), {})
            for i, name in zip(lk.probe_at, names, strict=True):
                lk.where[i] = name
            lk.sources.update(sources)
            lk.probe = None
            self._cut(lk)
            found = True
        if lk.phase is Phase.FOUND:
            need = [k for k, w in zip(lk.protected, lk.where, strict=False) if w != MEMORY]
            if self._short_of_room(len(need)) and not self._gave_up(lk, ROOM_WAIT_S):
                # Promotions that found no slot would cut the hit short, and under load the engine
                # would recompute the rest behind the backlog holding the slots.
                lk.waited_for_room = True
                return Pending(Why.ROOM, asked())
            if not lk.protected:
                lk.to(Phase.READY)
            elif stream is not None and stream(len(need), len(lk.protected)):
                self._guard(lk)  # its chunks are pinned as each is handed out, steps later
                self._stream(lk)
            else:
                lk.staging = self._promoter.stage(need, lk.tenant, defer=defer)
                lk.promotions = list(lk.staging)
                lk.to(Phase.STAGING)
        if lk.phase is Phase.STREAMING:
            return Hit(
                lk.first,
                len(lk.protected),
                tiers=dict(lk.tiers),
                streaming=True,
                since=lk.since,
                asked=asked(),
            )
        if lk.phase is Phase.STAGING:
            self._wait(lk.staging, lk, wait_until)
            if not all(f.done() for f in lk.staging) and not self._gave_up(lk, GIVE_UP_S):
                return Pending(Why.PROMOTIONS, asked())
            self._staged(lk)
            promotions = bool(lk.promotions)
        slots = self.memory.pin(lk.lks[first:])
        self._unprotect(lk)  # pinned now, what of it is in memory
        if not slots:
            return Miss(asked())
        return Hit(first, len(slots), slots, dict(lk.tiers), since=lk.since, asked=asked())

    def _find(self, lk: Lookup, first: int, probe: bool, *, sources: bool = True) -> None:
        """Where each chunk from ``first`` is, from what memory and the tiers know without a system
        call (the memory tier asked once for all); what needs more is asked on an I/O thread in
        ``lk.probe``: the chunks that were not found (a file another process wrote, the remote
        tiers: the check made ahead if it is fresh and covers them), and where each read below
        memory would come from (``sources``, when :meth:`_sources_needed`). ``probe=False``: the
        remote tier is assumed to hold the gaps (a read that misses costs what the check would).
        Without a remote tier and nothing to ask of the found chunks, a gap is a miss at once and
        the local tiers are asked in the background for the next lookup."""
        lk.first = first
        lk.where = self._where.locate_local(lk.lks[first:], lk.tenant)
        keys = lk.lks[first:]
        gaps = [i for i, w in enumerate(lk.where) if w is None]
        ahead, lk.ahead = lk.ahead, None  # used once
        if gaps and self._where.has_remote and not probe:
            remote = self._where.remote_tiers()[0][0]
            for i in gaps:
                lk.where[i] = remote
            gaps = []
        held = []
        if sources and self._sources_needed():
            held = [(keys[i], w) for i, w in enumerate(lk.where) if w in self._where.local_names()]
        ask_remote = bool(gaps) and self._where.has_remote
        if not held and not ask_remote:
            if gaps and self._where.local_tiers():
                missing = [keys[i] for i in gaps]
                self._promoter.submit(lambda: self._where.in_slow_many(missing, lk.tenant, remote=False))
            return
        lk.probe_at = gaps
        lk.probe = None
        if ahead is not None and (ask_remote or not gaps):
            lk.probe = ahead.answer_for([first + i for i in gaps], [k for k, _ in held])
        lk.ahead_used = lk.probe is not None
        if lk.probe is None:
            lk.probe = self.probe([keys[i] for i in gaps], held, lk.tenant, remote=ask_remote)

    def _cut(self, lk: Lookup) -> None:
        """The hit ends at the first gap, then where loading stops paying (see LoadCosts.plan); its
        chunks are kept from eviction until they are pinned."""
        found = lk.where.index(None) if None in lk.where else len(lk.where)
        lk.found = found
        keys = lk.lks[lk.first : lk.first + found]
        where = lk.where[:found]
        n = found
        if found and any(w != MEMORY for w in where):
            # Where each read comes from was asked off this thread (_find's probe); a tier's name
            # where it was not asked.
            known = lk.sources
            sources = [
                MEMORY if w == MEMORY else known.get(k, w or "") for k, w in zip(keys, where, strict=True)
            ]
            lk.sources = {k: s for k, s in zip(keys, sources, strict=True) if s != MEMORY}
            plan = self.costs.plan(sources)
            n = plan.load
            if plan.left:
                lk.left_out = set(keys[n:])
                lk.why_left = plan.why
        lk.tiers = {t: where[:n].count(t) for t in [MEMORY, *self.tiers] if t in where[:n]}
        lk.protected, lk.chunks = keys[:n], n
        if any(w != MEMORY for w in where[:n]):  # a hit all in memory is pinned in this same call
            self._guard(lk)
        if not lk.since:
            lk.since = time.monotonic()
        lk.to(Phase.FOUND)

    def _short_of_room(self, need: int) -> bool:
        """Whether promoting ``need`` chunks now would find slots missing that other work holds for
        a while (other requests' leases and promotions, the write-behind's queue), so that asking
        again shortly beats a shorter hit. Never for more than half the pool: the write-behind may
        pin half, so more can never be counted on (such a hit is promoted as far as room goes)."""
        return 0 < need <= self.num_slots // 2 and self.memory.room() < need

    def _stream(self, lk: Lookup) -> None:
        # Each chunk's read is deferred to the end of the scheduling pass (see lookup's ``defer``).
        resident = self.memory.contains_many(lk.protected)
        for i, k in enumerate(lk.protected):
            futs = [] if resident[i] else self._promoter.stage([k], lk.tenant, defer=True)
            lk.awaited.append((i, futs[0] if futs else None))
        lk.staging = [f for _, f in lk.awaited if f is not None]
        lk.promotions = list(lk.staging)
        lk.to(Phase.STREAMING)

    def _staged(self, lk: Lookup) -> None:
        """Every promotion of the hit settled: count per tier what arrived (a failed promotion
        shortens the hit) and measure the reads."""
        resident = self.memory.contains_many(lk.protected)
        for name in self.tiers:
            if name in lk.tiers:
                lk.tiers[name] = sum(r for r, w in zip(resident, lk.where, strict=False) if w == name)
        self.costs.promoted(lk.promotions, lk.sources)
        lk.staging = []
        lk.to(Phase.READY)

    def _wait(self, futs: Sequence[Future[Any]], lk: Lookup, until: float | None) -> None:
        if until is None:
            return
        pending = [f for f in futs if not f.done()]
        left = until - time.monotonic()
        if pending and left > 0:
            lk.waits += 1
            wait(pending, timeout=left, return_when=ALL_COMPLETED)

    @staticmethod
    def _gave_up(lk: Lookup, limit: float) -> bool:
        return bool(lk.since) and time.monotonic() - lk.since > limit

    def arrivals(
        self,
        lk: Lookup,
        *,
        give_up: bool = False,
        gone: bool = False,
        private: bool = False,
        wait_until: float | None = None,
    ) -> Arrivals:
        """A streamed hit's chunks that reached memory since the last call, each pinned for the
        caller (released by :meth:`finish_load`), and those that never will: a failed promotion,
        tier I/O given up (``give_up``, or GIVE_UP_S passed), the request gone (``gone``: nothing is
        handed out any more). After the first failure every later chunk fails too (the engine
        recomputes from the first failed chunk anyway). ``private``: a chunk that reaches no slot
        (no memory tier, no slot to spare, a failed promotion) is ``unslotted`` instead, for the
        caller to read itself, and fails nothing after it. Once nothing is awaited the reads are
        measured and the lookup is READY. ``wait_until``: when nothing has arrived, wait until then
        for a first arrival."""
        pending = [f for _, f in lk.awaited if f is not None and not f.done()]
        if wait_until is not None and pending and len(pending) == len(lk.awaited) and not give_up:
            left = wait_until - time.monotonic()
            if left > 0:
                wait(pending, timeout=left, return_when=FIRST_COMPLETED)
        give_up = give_up or self._gave_up(lk, GIVE_UP_S)
        out = Arrivals()
        waiting: list[tuple[int, Future[bool] | None]] = []
        failing = False
        for i, fut in lk.awaited:
            arrived = fut is None or fut.done()
            if not failing and not arrived and not give_up:
                waiting.append((i, fut))
                continue
            ok = not failing and not gone and arrived and (fut is None or fut.result())
            slots = self.memory.pin([lk.protected[i]]) if ok else []
            if slots:
                out.ready.append((i, slots[0]))
                if fut is None:
                    out.resident.add(i)
            elif private and not gone:
                out.unslotted.append(i)
            else:
                failing = True
                out.failed.append(i)
        lk.awaited = waiting
        lk.staging = [f for _, f in waiting if f is not None]
        out.waiting = len(waiting)
        if not waiting and lk.phase is Phase.STREAMING:
            self.costs.promoted(lk.promotions, lk.sources)
            self._unprotect(lk)
            lk.to(Phase.READY)
        return out

    def finish_load(self, slots: Iterable[int], *, loaded: int = 0, nbytes: int = 0) -> None:
        """The caller is done with pinned ``slots`` (a Hit's, an arrival's); ``loaded`` chunks of
        ``nbytes`` (every rank's) were copied out of them (counted as memory hits)."""
        self.memory.unpin(slots)
        if loaded:
            self.memory.counters.add("hits", loaded)
            self.memory.counters.add("bytes_read", nbytes)

    def release(self, lk: Lookup) -> None:
        """End ``lk`` in any phase: its protection goes and nothing it awaits is handed out. A
        promotion still running completes into memory for a later hit. A released lookup may still
        be asked: it answers with what is in memory."""
        self._unprotect(lk)
        lk.awaited, lk.staging = [], []
        if lk.phase is not Phase.DONE:
            lk.to(Phase.DONE)

    def _guard(self, lk: Lookup) -> None:
        """Keep the hit's chunks from eviction until they are pinned (one question to the memory
        tier; a hit pinned in the call that found it needs none)."""
        if lk.protected and not lk.guarded:
            self.memory.protect(lk.protected)
            lk.guarded = True

    def _unprotect(self, lk: Lookup) -> None:
        if lk.protected and lk.guarded:
            self.memory.unprotect(lk.protected)
        lk.protected, lk.guarded = [], False

    def start_deferred(self) -> int:
        """Start the promotions that lookups with ``defer`` staged; how many."""
        return self._promoter.start_deferred()

    def stage(self, lks: Iterable[bytes], tenant: str = SHARED) -> list[Future[bool]]:
        """Promote ``lks`` (those not in memory) without a lookup: for tools that warm the memory
        tier and for tests. Never blocks; see :meth:`Promoter.stage`."""
        return self._promoter.stage(list(lks), tenant)

    # -- stores --------------------------------------------------------------------------

    def begin_stores(
        self,
        lks: Sequence[bytes],
        tenant: str = SHARED,
        *,
        rewrite: Container[bytes] = (),
        private: bool = False,
    ) -> list[Reserved]:
        """See :meth:`Stores.begin_stores`."""
        return self._stores.begin_stores(lks, tenant, rewrite=rewrite, private=private)

    def finish_stores(self, done: Sequence[tuple[bytes, StoreTarget, bool, str]]) -> list[bool]:
        """See :meth:`Stores.finish_stores`."""
        return self._stores.finish_stores(done)

    def begin_store(
        self, lk: bytes, tenant: str = SHARED, *, rewrite: bool = False, private: bool = False
    ) -> Reserved:
        """:meth:`begin_stores` of one chunk (``rewrite``: even where a slower tier holds it)."""
        return self.begin_stores([lk], tenant, rewrite=(lk,) if rewrite else (), private=private)[0]

    def finish_store(self, lk: bytes, target: StoreTarget, ok: bool, tenant: str = SHARED) -> bool:
        """:meth:`finish_stores` of one store."""
        return self.finish_stores([(lk, target, ok, tenant)])[0]

    # -- for a caller that holds the bytes in this process (see integrations/library/local.py) --------------

    def run_io(self, fn: Callable[..., object], *args: object) -> Future[object]:
        """Run ``fn`` on an I/O thread."""
        return self._promoter.submit(fn, *args)

    def slot_payload(self, slot: int, lk: bytes) -> torch.Tensor | None:
        """The first served rank's payload of ``lk`` in pinned ``slot``, its header checked (not its
        checksum: slots are written only by this engine, from verified records or the engine's
        own KV), or None: the chunk is dropped and the slot released."""
        rec = self._slot_record(0, slot)
        verdict = record.verify(
            rec, self.record_bytes, self.rank_digests[0], self.record_key(0, lk), self.payload_bytes,
            check_payload=False,
        )  # fmt: skip
        if verdict is not record.Verdict.OK:
            self.memory.drop(lk)
            self.finish_load([slot])
            return None
        p = slot * self.slot_bytes + record.HEADER_BYTES
        return self.pools[0].tensor[p : p + self.payload_bytes]

    def store_record(self, target: StoreTarget) -> memoryview:
        """The first served rank's record in a store's ``target`` (a slot, or a private record)."""
        if isinstance(target, mmap.mmap):
            return memoryview(target)
        return self._slot_record(0, target)

    def seal(self, lk: bytes, rec: memoryview) -> None:
        """Seal the first served rank's record of ``lk`` (its payload filled)."""
        record.seal(rec, self.rank_digests[0], self.record_key(0, lk), self.payload_bytes)

    def read_private(self, lk: bytes, tenant: str = SHARED) -> torch.Tensor | None:
        """The first served rank's verified record of ``lk`` in this thread's private buffer (valid
        until the thread's next call), or None: for a chunk that has no slot. Blocks for the read."""
        return self._promoter.read_private(lk, tenant)

    def read_direct(self, lk: bytes, pieces: list[memoryview]) -> bool | None:
        """The first served rank's payload of ``lk`` straight from its storage file into ``pieces``
        (see :meth:`StorageTier.read_payload_into`): True (verified), False (the file failed its
        check and is gone: the slower tiers may still have it), None (not tried here)."""
        read = None
        for ts in self.tiers.values():
            read = getattr(ts[0], "read_payload_into", None)
            if read is not None:
                break
        if read is None:
            return None
        got: bool | None = read(self.record_key(0, lk), pieces)
        return got

    # -- the engine's steps --------------------------------------------------------------

    def step_scheduled(self, computes: bool) -> None:
        """The engine scheduled a step, computing or not (see :meth:`Cascade.step_scheduled`)."""
        self._cascade.step_scheduled(computes)

    def step_done(self, computed: bool | None = None) -> None:
        """A scheduled step's output is back (see :meth:`Cascade.step_done`)."""
        self._cascade.step_done(computed)

    @property
    def engine_busy_now(self) -> bool:
        """Whether the engine computes a step now, as announced."""
        return self._cascade.busy

    def _slot_record(self, i: int, slot: int) -> memoryview:
        off = slot * self.slot_bytes
        return self.pools[i].view[off : off + self.record_bytes]

    def flush(self) -> None:
        """Wait for every queued cascade write and every promotion (deferred ones started)."""
        self._cascade.flush()
        self._promoter.start_deferred()
        for f in self._promoter.pending():
            f.result()

    # -- housekeeping --------------------------------------------------------------

    def clear(self, tiers: tuple[str, ...] | None = None) -> None:
        """Forget chunks of the named tiers (pinned slots are freed when their copies finish);
        default: memory and the local tiers. A remote tier is cleared only when named: it is
        shared with other engines."""
        if tiers is None:
            tiers = (MEMORY, *self._where.local_names())
        if MEMORY in tiers:
            self.memory.reset()
        named = [ts for n, ts in self.tiers.items() if n in tiers]
        if named:
            self.flush()
            for ts in named:
                for t in ts:
                    t.clear()

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier (summed over the served ranks): hits, misses, corrupt, bytes_read,
        bytes_written, writes, writes_skipped, evictions, errors, promotions, used_bytes,
        capacity_bytes, chunks; with several ranks also each rank's slower tiers
        (``storage.rank1``)."""
        out: dict[str, dict[str, int]] = {}
        n = len(self.ranks)
        if self.pools:
            used, pinned = len(self.memory), self.memory.pinned()
            out[MEMORY] = self.memory.counters.snapshot(
                used_bytes=used * self.payload_bytes * n,
                capacity_bytes=self.num_slots * self.payload_bytes * n,
                chunks=used,
                pinned_slots=pinned,
                slots=self.num_slots,
                cascade_pending=self._cascade.pending(),
            )
        for name, ts in self.tiers.items():
            per = [t.stats() for t in ts]
            agg = {k: sum(s[k] for s in per) for k in per[0]}
            for same in ("chunks", "o_direct", "connected", "reconnects"):  # per rank or shared: not additive
                if same in per[0]:
                    agg[same] = per[0][same]
            out[name] = agg
        if n > 1:
            for name, ts in self.tiers.items():
                for i, t in enumerate(ts):
                    out[f"{name}.rank{self.ranks[i]}"] = t.stats()
        return out

    def write_behind(self) -> dict[str, int]:
        """The write-behind's progress: chunks written to the slower tiers, the longest and the last
        wait from queued to written (ms), and how many are queued now."""
        written, worst, last = self._cascade.delays()
        return {
            "written": written,
            "delay_max_ms": round(worst * 1e3),
            "delay_last_ms": round(last * 1e3),
            "pending": self._cascade.pending(),
        }

    def stopping(self) -> None:
        """The engine is stopping: write-behind from now on writes at once (see :meth:`close`)."""
        self._cascade.hurry()

    def check(self) -> None:
        """Assert internal consistency (tests call this after fault injection)."""
        self.memory.check()
        for ts in self.tiers.values():
            for t in ts:
                t.check()

    def close(self, limit: float | None = None) -> None:
        """Flush the cascade (``limit``: for at most that many seconds, see :meth:`Cascade.close`),
        stop the threads, close the tiers, then unmap the pools. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._cascade.close(limit):
            return  # writes still run on the pools: the process exits with them mapped
        self.flush()
        self._promoter.close()
        # Remote workers first: a worker's last job may still reference its buffer (a slice of a
        # pool) until the worker ends, and a mapping with a live export cannot be closed.
        self._close_tiers()
        for p in self.pools:
            p.close()

    def _close_tiers(self) -> None:
        for close in self._closers:
            close()
        for ts in reversed(list(self.tiers.values())):
            for t in ts:
                t.close()
