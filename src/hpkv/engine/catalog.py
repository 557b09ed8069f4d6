"""The engine: what is cached where, and every move between tiers, for whichever engine hpkv serves.

One instance per serving process: vLLM's scheduler (all tensor-parallel ranks of the engine), a
library user's :class:`hpkv.KVStore` (one rank), SGLang's storage backend. It owns one slot index
for the memory pools of the ranks it serves (slot s holds chunk k in every rank's pool file, each
rank's own shard under its own record key), the pool files, and one instance per rank of every
slower tier the configuration names (built through :mod:`hpkv.tiers.base`'s registry, so adding a
tier touches no code here). Memory is the staging area: a chunk is read from a slower tier into a
reserved slot, verified on every rank, and only then becomes visible.

* **lookup**: memory and the local tiers (storage) are asked per key; the remote tiers (valkey)
  once per lookup, in one pipelined round trip per rank (:meth:`probe_remote` runs it on a thread
  for callers that must not wait); a hit ends at the first chunk no tier holds;
* **promote** (a slower tier -> memory): into a reserved slot, verified on every rank; a chunk that
  fails on any rank is not promoted, so a failure is a shorter hit, never bad data. Chunks a lookup
  is about to use are protected from eviction until it pins them (the reads, on the catalog's
  threads, are :mod:`hpkv.engine.reads`);
* **cascade** (memory -> slower tiers): a new chunk is written from its slot (or, without a memory
  tier, from a private buffer) to each rank's slower tiers through a bounded queue; when the queue
  is full the write is dropped and counted, never blocking the caller.

Thread-safety: public methods may be called from any thread; the slot index is guarded by one lock
and no method holds it across I/O.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future

import torch

from hpkv.core import record
from hpkv.core.config import HpkvConfig
from hpkv.core.errors import HpkvConfigError
from hpkv.core.keys import SHARED_TENANT as SHARED
from hpkv.core.keys import Namespace, Tokens, chunk_keys, record_key
from hpkv.core.stats import TierStats
from hpkv.engine.cascade import Cascade
from hpkv.engine.costs import LoadCosts
from hpkv.engine.reads import Reader
from hpkv.tiers.base import TIERS, Tier, builder
from hpkv.tiers.memory.pool import ShmPool, check_holds_a_chunk, pool_file_path, slot_bytes
from hpkv.tiers.memory.slots import SlotIndex

log = logging.getLogger(__name__)

MEMORY = "memory"
STORAGE = "storage"
VALKEY = "valkey"

# consume(chunk_index, payload) reads a verified payload (uint8, canonical layout, this rank's);
# produce(chunk_index, payload) fills one. Both run on hpkv threads and must not keep ``payload``.
Consume = Callable[[int, torch.Tensor], None]
Produce = Callable[[int, torch.Tensor], None]


class Catalog:
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
        self._lock = threading.Lock()
        self._mem_stats = TierStats()
        self.pools: list[ShmPool] = []
        self.tiers: dict[str, list[Tier]] = {}  # name -> one per rank, fastest first
        self._closers: list[Callable[[], None]] = []
        num_slots = 0
        try:
            if config.mem_pool_size > 0:
                check_holds_a_chunk(
                    config.mem_pool_size,
                    self.slot_bytes,
                    self.chunk_size,
                    config.where("mem_pool_size"),
                    config.example("mem_pool_size"),
                )
                tag = self.logical_digest.hex()[:6]
                for i, r in enumerate(self.ranks):
                    offered = adopt_pools[i] if adopt_pools else None
                    adopted = ShmPool.adopt(offered, config.mem_pool_size) if offered else None
                    if adopted is not None:
                        self.pools.append(adopted)
                        continue
                    self.pools.append(
                        ShmPool(
                            pool_file_path(config.share_mem_file_path, f"{tag}r{r}"),
                            config.mem_pool_size,
                            where=config.where("mem_pool_size"),
                            path_where=config.where("share_mem_file_path"),
                            shared_group=config.shared_group,
                        )
                    )
                num_slots = config.mem_pool_size // self.slot_bytes
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
        self.num_slots = num_slots
        self._index = SlotIndex(num_slots)
        # Bumped by a reset of the memory tier: a slot reserved before it is never committed after it,
        # so no promotion or store in flight at the reset becomes visible.
        self._epoch = 0
        self._slot_epoch = [0] * num_slots
        # Chunks of lookups in progress: no reserve (promotion or store) may evict them before
        # the lookup pins them, so a long prompt's promotions never evict its own head.
        self._protected: dict[bytes, int] = {}
        # Promotions from a remote tier wait on the network: as many threads as its workers.
        threads = max(config.storage_io_threads, config.valkey_num_workers if self.has_remote else 0)
        # Where there are cores to spare, a read record is checked on a verify thread while its
        # I/O thread fetches the next one: reading and hashing on one thread ran at 0.53-0.62x a
        # raw read of the same files with the same 4 threads on the H200 host (16 cores), and at
        # 0.89-0.91x with the hashing on 4 more. On 2 cores the extra threads only contend (0.60x
        # against 0.66x inline, bench tiers): there the I/O thread checks what it read itself.
        if verify_threads is None:
            cores = len(os.sched_getaffinity(0))
            verify_threads = config.storage_io_threads if cores >= 2 * config.storage_io_threads else 0
        self._reads = Reader(self, threads, verify_threads, config)
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
            lambda slot: self.unpin([slot]),
            defer=defer_cascade,
            pressure=self._slots_scarce,
            timed=self._timed_write,
        )

    def _timed_write(self, tier: str, nbytes: int, seconds: float) -> None:
        """A write to a remote tier bounds its reads (a slow link is slow both ways); a local tier's
        writes (a new file, a rename) say nothing of how fast its reads are."""
        ts = self.tiers.get(tier)
        if ts and ts[0].remote:
            self.costs.wrote(tier, nbytes, seconds)

    def _slots_scarce(self) -> bool:
        """Half the pool's slots or more are pinned (queued writes, loads in flight): deferred
        write-behind must free its slots now (read without the lock: a hint, not a decision)."""
        return self.num_slots > 0 and self._index.pinned() * 2 >= self.num_slots

    # -- tiers ------------------------------------------------------------------------

    @property
    def storage(self) -> list[Tier]:
        return self.tiers.get(STORAGE, [])

    @property
    def valkey(self) -> list[Tier]:
        return self.tiers.get(VALKEY, [])

    @property
    def has_remote(self) -> bool:
        return any(ts[0].remote for ts in self.tiers.values())

    def tier_names(self) -> list[str]:
        return ([MEMORY] if self.pools else []) + list(self.tiers)

    def _local_tiers(self) -> list[tuple[str, list[Tier]]]:
        return [(n, ts) for n, ts in self.tiers.items() if not ts[0].remote]

    def _remote_tiers(self) -> list[tuple[str, list[Tier]]]:
        return [(n, ts) for n, ts in self.tiers.items() if ts[0].remote]

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

    # -- lookups ------------------------------------------------------------------

    def in_memory(self, lk: bytes) -> bool:
        with self._lock:
            return lk in self._index

    def held_locally(self, lk: bytes, tenant: str = SHARED) -> str | None:
        """The first local tier (no network) that holds every rank's shard of ``lk``, or None."""
        for name, ts in self._local_tiers():
            if all(t.contains_many([self.record_key(i, lk)], tenant)[0] for i, t in enumerate(ts)):
                return name
        return None

    def in_storage(self, lk: bytes) -> bool:
        return self.held_locally(lk) is not None

    def locate_local(self, lks: Iterable[bytes], tenant: str = SHARED) -> list[str | None]:
        """Per key memory or a local tier or None, without asking a remote tier and without
        cutting at a gap."""
        return [MEMORY if self.in_memory(lk) else self.held_locally(lk, tenant) for lk in lks]

    def read_source(self, lk: bytes, tier: str, tenant: str = SHARED) -> str:
        """Where a read of ``lk`` from ``tier`` would come from (see ``Tier.source``; asked of the
        first served rank, whose files the others' follow), ``memory`` for the memory tier."""
        if tier == MEMORY or tier not in self.tiers:
            return tier
        return self.tiers[tier][0].source(self.record_key(0, lk), tenant)

    def in_remote_many(self, lks: list[bytes], tenant: str = SHARED) -> list[str | None]:
        """Per key the first remote tier that holds every rank's shard, else None: one pipelined
        round trip per rank and remote tier, for the keys the faster ones lack. Blocks for it."""
        out: list[str | None] = [None] * len(lks)
        for name, ts in self._remote_tiers():
            rest = [j for j, w in enumerate(out) if w is None]
            if not rest:
                break
            have = [True] * len(rest)
            for i, t in enumerate(ts):
                got = t.contains_many([self.record_key(i, lks[j]) for j in rest], tenant)
                have = [a and b for a, b in zip(have, got, strict=True)]
            for j, h in zip(rest, have, strict=True):
                if h:
                    out[j] = name
        return out

    def probe_remote(self, lks: list[bytes], tenant: str = SHARED) -> Future[list[str | None]]:
        """:meth:`in_remote_many` on an I/O thread; never blocks. A failure answers "absent"."""

        def run() -> list[str | None]:
            try:
                return self.in_remote_many(lks, tenant)
            except Exception:
                log.exception("hpkv: remote existence check failed")
                return [None] * len(lks)

        return self._reads.submit(run)

    def locate(self, lks: Iterable[bytes], tenant: str = SHARED) -> list[str | None]:
        """Per key the fastest tier that holds it; None from the first key no tier holds onwards.
        Remote tiers are asked once, for the keys the local ones lack (blocks for that)."""
        keys = list(lks)
        out = self.locate_local(keys, tenant)
        rest = [i for i, w in enumerate(out) if w is None]
        if rest and self.has_remote:
            for i, name in zip(rest, self.in_remote_many([keys[i] for i in rest], tenant), strict=True):
                out[i] = name
        if None in out:
            cut = out.index(None)
            out[cut:] = [None] * (len(out) - cut)
        return out

    # -- promotion (a slower tier -> memory) -------------------------------------------

    def stage(self, lks: Iterable[bytes], tenant: str = SHARED, *, defer: bool = False) -> list[Future[bool]]:
        """Start promoting ``lks`` (those not in memory) into memory; never blocks.

        Returns the futures of the promotions now running for these keys (True: the chunk is in
        memory now). Each new promotion's slot is reserved here, on the calling thread (one that
        finds none is settled False at once). Without a memory tier nothing can be staged and the
        list is empty. ``defer``: new promotions read only from :meth:`start_deferred` on (vLLM's
        scheduler: after the lookups of one scheduling pass, which the reading threads would
        otherwise slow down, contending for the GIL).
        """
        return self._reads.stage(list(lks), tenant, defer=defer)

    def start_deferred(self) -> int:
        """Start the promotions :meth:`stage` deferred; how many."""
        return self._reads.start_deferred()

    def promoted(self, slot: int, lk: bytes) -> bool:
        """A promotion's record is in ``slot`` and checked on every rank: make it visible (unpinned)
        and count it; False (the slot freed) after a reset or if ``lk`` was committed meanwhile."""
        with self._lock:
            ok = self._commit_locked(slot, lk, keep_pin=False)
        if ok:
            self._mem_stats.add("promotions")
        return ok

    # -- pins for loads ---------------------------------------------------------------

    def pin(self, lks: Iterable[bytes]) -> list[int]:
        """Pin the memory slots of the leading ``lks`` that are in memory; stops at the first that is not."""
        slots: list[int] = []
        with self._lock:
            for lk in lks:
                s = self._index.pin(lk)
                if s is None:
                    break
                slots.append(s)
        return slots

    def protect(self, lks: Iterable[bytes]) -> None:
        """Keep ``lks`` from being evicted until :meth:`unprotect` (counted: two lookups may
        protect the same chunk)."""
        with self._lock:
            for lk in lks:
                self._protected[lk] = self._protected.get(lk, 0) + 1

    def room(self) -> int:
        """Slots a promotion or store could get now (free, or evictable: unpinned, unprotected)."""
        with self._lock:
            return self._index.room(self._protected)

    def short_of_room(self, need: int) -> bool:
        """Whether promoting ``need`` chunks now would find slots missing that other work holds for
        a while (other requests' leases and promotions, the write-behind's queue), so that asking
        again shortly beats a shorter hit. Never for more than half the pool: the write-behind may
        pin half, so more can never be counted on (such a hit is promoted as far as room goes)."""
        return 0 < need <= self.num_slots // 2 and self.room() < need

    def unprotect(self, lks: Iterable[bytes]) -> None:
        with self._lock:
            for lk in lks:
                n = self._protected.get(lk, 0) - 1
                if n > 0:
                    self._protected[lk] = n
                else:
                    self._protected.pop(lk, None)

    def unpin(self, slots: Iterable[int]) -> None:
        with self._lock:
            for s in slots:
                self._index.unpin(s)

    def count_load(self, chunks: int, payload_bytes: int) -> None:
        self._mem_stats.add("hits", chunks)
        self._mem_stats.add("bytes_read", payload_bytes)

    def count_miss(self, chunks: int = 1) -> None:
        self._mem_stats.add("misses", chunks)

    def pin_each(self, lks: Sequence[bytes]) -> dict[int, int]:
        """Pin the memory slot of every key in memory, index -> slot; unlike :meth:`pin`, a key
        not in memory does not end the pins."""
        out: dict[int, int] = {}
        with self._lock:
            for i, lk in enumerate(lks):
                s = self._index.pin(lk)
                if s is not None:
                    out[i] = s
        return out

    def drop_corrupt(self, lk: bytes) -> None:
        """A memory hit whose header failed: forget it, counted as corrupt and a miss."""
        self._mem_stats.add("corrupt")
        self._mem_stats.add("misses")
        with self._lock:
            self._index.remove(lk)

    # -- loads in this process (library, SGLang) -------------------------------------------

    def load(self, lks: list[bytes], consume: Consume, tenant: str = SHARED, *, probe: bool = True) -> int:
        """Hand each chunk's verified payload (the first served rank's) to ``consume``; return how
        many leading chunks succeeded. Blocks until every read is done.

        The chunks are located once (remote tiers: one batched round trip) and the hit cut at the
        first gap. ``probe=False``: the caller has just asked (SGLang's ``batch_exists`` before its
        reads), so the chunks no local tier holds are read from the remote tiers directly (a GET
        that misses costs what the existence check would have). Memory hits are consumed on the
        calling thread; the others are read on the I/O threads into reserved slots, verified,
        consumed there and promoted (or, with no room or no memory tier, read into a private
        buffer). A chunk after a failed one may still have been
        consumed; only the returned prefix counts.
        """
        return self._reads.load(lks, consume, tenant, probe=probe)

    # -- stores ----------------------------------------------------------------------

    def reserve(self) -> int | None:
        """A pinned, invisible slot for a new chunk, or None (counted) if every slot is pinned."""
        with self._lock:
            got = self._index.reserve(self._protected)
            if got is not None:
                self._slot_epoch[got[0]] = self._epoch
                if got[1] is not None:
                    self._mem_stats.add("evictions")
        if got is None:
            self._mem_stats.add("writes_skipped")
            return None
        return got[0]

    def commit(self, lk: bytes, slot: int, tenant: str = SHARED) -> bool:
        """The workers have filled and sealed ``slot`` for ``lk`` on every rank: make it visible,
        and queue it for the slower tiers unless every rank's tiers are known to hold it. False
        (and the slot freed) if another writer committed ``lk`` first or the memory tier was reset
        since the slot was reserved."""
        cascade = bool(self.tiers) and self._cascade.needed(lk, tenant)
        with self._lock:
            if not self._commit_locked(slot, lk, keep_pin=cascade):
                return False
        self._mem_stats.add("writes")
        self._mem_stats.add("bytes_written", self.payload_bytes)
        if cascade:
            self._cascade.submit(lk, slot, tenant)
        return True

    def _commit_locked(self, slot: int, lk: bytes, *, keep_pin: bool) -> bool:
        """Under the lock: make ``slot`` visible as ``lk``, unless the memory tier was reset since
        the slot was reserved (then the slot is freed: nothing in flight at a reset becomes visible
        after it) or another writer committed ``lk`` first."""
        if self._slot_epoch[slot] != self._epoch:
            self._index.abort(slot)
            return False
        return self._index.commit(slot, lk, keep_pin=keep_pin)

    def abort(self, slot: int) -> None:
        with self._lock:
            self._index.abort(slot)

    def store(self, lks: list[bytes], produce: Produce, tenant: str = SHARED) -> int:
        """Store each chunk whose payload ``produce`` writes (one served rank only); return how many
        leading chunks are now held (in memory, or queued for or held by a slower tier). Chunks
        already held are not rewritten; nothing here waits on a remote server."""
        if len(self.ranks) != 1:
            raise ValueError("store() fills one rank's payloads; this catalog serves several ranks")
        held = 0
        for i, lk in enumerate(lks):
            if not self._store_one(i, lk, produce, tenant):
                break
            held += 1
        return held

    def _store_one(self, i: int, lk: bytes, produce: Produce, tenant: str) -> bool:
        slow = self.slow_tiers(0)
        rk = self.record_key(0, lk)
        if self.pools:
            with self._lock:
                present = self._index.pin(lk)
            if present is not None:
                if self.tiers and self._cascade.needed(lk, tenant):
                    self._cascade.submit(lk, present, tenant)
                else:
                    self.unpin([present])
                return True
            if slow and any(t.held(rk, tenant) for t in slow):
                return True  # a slower tier has it; a later hit promotes it
            slot = self.reserve()
            if slot is not None:
                off = slot * self.slot_bytes
                try:
                    produce(i, self.pools[0].tensor[off + record.HEADER_BYTES : off + self.record_bytes])
                except BaseException:
                    self.abort(slot)
                    raise
                record.seal(
                    self.pools[0].view[off : off + self.record_bytes],
                    self.rank_digests[0],
                    rk,
                    self.payload_bytes,
                )
                self.commit(lk, slot, tenant)
                return True
        if not slow:
            return False
        if any(t.held(rk, tenant) for t in slow):
            return True
        buf = bytearray(self.record_bytes)
        payload = torch.frombuffer(buf, dtype=torch.uint8)[record.HEADER_BYTES :]
        produce(i, payload)
        del payload  # the buffer must have no exports left when the cascade hands it to a tier
        record.seal(memoryview(buf), self.rank_digests[0], rk, self.payload_bytes)
        return self._cascade.submit(lk, buf, tenant)

    def step_scheduled(self, computes: bool) -> None:
        """The engine scheduled a step, computing or not (see :meth:`Cascade.step_scheduled`)."""
        self._cascade.step_scheduled(computes)

    def step_done(self, computed: bool | None = None) -> None:
        """A scheduled step's output is back (see :meth:`Cascade.step_done`)."""
        self._cascade.step_done(computed)
        if not self._cascade.busy:
            self._reads.engine_idle()

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
        self._reads.start_deferred()
        for f in self._reads.pending():
            f.result()

    # -- housekeeping --------------------------------------------------------------

    def clear(self, tiers: tuple[str, ...] = (MEMORY, STORAGE)) -> None:
        """Forget chunks of the named tiers (pinned slots are freed when their copies finish).
        A remote tier is cleared only when named: it is shared with other engines."""
        if MEMORY in tiers:
            with self._lock:
                self._epoch += 1
                self._index.clear()
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
            with self._lock:
                used, pinned = len(self._index), self._index.pinned()
            out[MEMORY] = self._mem_stats.snapshot(
                used_bytes=used * self.payload_bytes * n,
                capacity_bytes=self.num_slots * self.payload_bytes * n,
                chunks=used,
                pinned_slots=pinned,
                cascade_pending=self._cascade.pending(),
            )
        for name, ts in self.tiers.items():
            per = [t.stats() for t in ts]
            agg = {k: sum(s[k] for s in per) for k in per[0]}
            for same in ("chunks", "o_direct", "connected"):  # per rank, not additive
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
        with self._lock:
            self._index.check()
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
        self._reads.close()
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
