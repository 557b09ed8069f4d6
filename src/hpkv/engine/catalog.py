"""The engine: what is cached where, and every move between tiers, for whichever engine hpkv serves.

One instance per serving process: vLLM's scheduler (all tensor-parallel ranks of the engine), a
library user's :class:`hpkv.KVStore` (one rank), SGLang's storage backend. It owns the memory pools
of the ranks it serves (slot s holds chunk k in every rank's pool file, each rank's own shard under
its own record key) and one instance per rank of every slower tier the configuration names (built
through :mod:`hpkv.tiers.base`'s registry, so adding a tier touches no code here). It talks to
those tiers only through the ``Tier`` protocol. It wires the parts and delegates to them: where a
chunk is (:mod:`hpkv.engine.locator`), the lookup's steps (:mod:`hpkv.engine.lookups`), the stores'
reservations (:mod:`hpkv.engine.stores`), promotions (:mod:`hpkv.engine.promotion`), the write-behind
(:mod:`hpkv.engine.cascade`) and what loads cost (:mod:`hpkv.engine.costs`).

The integrations call it only through :mod:`hpkv.engine.interface` (its core, :class:`Engine`, and
the interfaces beside it that each needs); the core's pairs:

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
from collections.abc import Callable, Container, Iterable, Sequence
from concurrent.futures import Future

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
    InProcessEngine,
    Reserved,
    SteppedEngine,
    StoreTarget,
)
from hpkv.engine.locator import Locator
from hpkv.engine.lookup import Located, Lookup
from hpkv.engine.lookups import Lookups
from hpkv.engine.pools import open_memory
from hpkv.engine.promotion import Promoter
from hpkv.engine.stores import Stores
from hpkv.tiers.base import TIERS, Tier, builder
from hpkv.tiers.memory.pool import ShmPool, slot_bytes

log = logging.getLogger(__name__)


# A private record (see interface.StoreTarget) is an anonymous mapping, not a bytearray: a
# bytearray is zeroed and faulted in while its maker holds the GIL (milliseconds per chunk, stalling
# the engine's own threads), where a mapping's pages are faulted in by the copy that fills it, which
# runs without the GIL; it is page-aligned too (O_DIRECT writes).


class Catalog(InProcessEngine, SteppedEngine):
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
            self.chunk_size,
            self.payload_bytes * len(self.ranks),
            enabled=config.cost_aware_loads,
            probe_chunks=threads,
        )
        self._lookups = Lookups(
            self.memory,
            self._where,
            self._promoter,
            self.costs,
            list(self.tiers),
            pooled=bool(self.pools),
            probe=lambda *a, **k: self.probe(*a, **k),
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

    # -- the lookup ---------------------------------------------------------------------

    def look_ahead(self, lk: Lookup) -> None:
        """See :meth:`Lookups.look_ahead`."""
        self._lookups.look_ahead(lk)

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
        """See :meth:`Lookups.lookup`."""
        return self._lookups.lookup(lk, first, wait_until=wait_until, defer=defer, stream=stream, probe=probe)

    def locate(self, lks: Iterable[bytes], tenant: str = SHARED, *, remote: bool = True) -> list[str | None]:
        """See :meth:`Lookups.locate`."""
        return self._lookups.locate(lks, tenant, remote=remote)

    def arrivals(
        self,
        lk: Lookup,
        *,
        give_up: bool = False,
        gone: bool = False,
        private: bool = False,
        wait_until: float | None = None,
    ) -> Arrivals:
        """See :meth:`Lookups.arrivals`."""
        return self._lookups.arrivals(lk, give_up=give_up, gone=gone, private=private, wait_until=wait_until)

    def release(self, lk: Lookup) -> None:
        """See :meth:`Lookups.release`."""
        self._lookups.release(lk)

    def finish_load(self, slots: Iterable[int], *, loaded: int = 0, nbytes: int = 0) -> None:
        """The caller is done with pinned ``slots`` (a Hit's, an arrival's); ``loaded`` chunks of
        ``nbytes`` (every rank's) were copied out of them (counted as memory hits)."""
        self.memory.unpin(slots)
        if loaded:
            self.memory.counters.add("hits", loaded)
            self.memory.counters.add("bytes_read", nbytes)

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

    def read_direct(self, lks: list[bytes], pieces: list[list[memoryview]]) -> list[bool | None]:
        """The first served rank's payload of each of ``lks`` straight from its storage file into
        its ``pieces`` (see :meth:`StorageTier.read_payloads_into`): per chunk True (verified),
        False (the file failed its check and is gone: the slower tiers may still have it), None
        (not tried here)."""
        read = None
        for ts in self.tiers.values():
            read = getattr(ts[0], "read_payloads_into", None)
            if read is not None:
                break
        if read is None:
            return [None] * len(lks)
        got: list[bool | None] = read([self.record_key(0, lk) for lk in lks], pieces)
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
