"""The catalog: what is cached where, for every tensor-parallel rank of one engine.

Runs in the process that decides (vLLM's scheduler). It owns one slot index
for all ranks (slot s holds chunk k in every rank's pool file, each rank's own
shard under its own record key), the pool files themselves, and the storage
tier of each rank. Workers only copy between pool slots and the engine's KV.

All slow tier I/O runs here on background threads:

* **promote** (storage or valkey -> memory): before a storage hit is reported to the
  engine, its chunks are read into reserved slots and verified on every rank;
  a chunk that fails on any rank is simply not promoted, so a failure becomes
  a shorter hit, never bad data handed to a worker;
* **cascade** (memory -> storage, valkey): a newly stored chunk is written
  from its slot to each rank's storage and valkey shard through a bounded
  queue; when the queue is full the write is dropped and counted, never
  blocking the scheduler.

Valkey is the slowest tier: a chunk there is promoted (GET straight into the
pool slot, verified) exactly like a storage chunk. Existence checks for a
prompt are one pipelined round trip per rank.

Thread-safety: public methods may be called from any thread; the slot index
is guarded by one lock and no method holds it across I/O.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from hpkv.core import record
from hpkv.core.config import HpkvConfig
from hpkv.core.keys import SHARED_TENANT as SHARED
from hpkv.core.keys import Namespace, Tokens, chunk_keys, record_key
from hpkv.core.stats import TierStats
from hpkv.engine.cascade import WriteTarget
from hpkv.tiers.disk import StorageTier
from hpkv.tiers.memory.pool import ShmPool, check_holds_a_chunk, pool_file_path, slot_bytes
from hpkv.tiers.memory.slots import SlotIndex
from hpkv.tiers.valkey import ValkeyConnection, ValkeySettings, ValkeyTier
from hpkv.tiers.valkey.workers import Priority

log = logging.getLogger(__name__)

MEMORY = "memory"
STORAGE = "storage"
VALKEY = "valkey"


class Catalog:
    def __init__(self, config: HpkvConfig, namespace: Namespace) -> None:
        record.set_auth_key(config.auth_key_bytes)
        self.config = config
        self.chunk_size = config.chunk_size
        self.world_size = namespace.world_size
        self.namespaces = [namespace.for_rank(r) for r in range(self.world_size)]
        self.rank_digests = [n.digest for n in self.namespaces]
        self.logical_digest = namespace.logical_digest
        self.payload_bytes = namespace.layout.chunk_bytes(self.chunk_size)
        self.record_bytes = record.record_bytes(self.payload_bytes)
        self.slot_bytes = slot_bytes(self.record_bytes)
        self._lock = threading.Lock()
        self._mem_stats = TierStats()
        self.pools: list[ShmPool] = []
        self.storage: list[StorageTier] = []
        self.valkey: list[ValkeyTier] = []
        self._remote: ValkeyConnection | None = None
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
                for r in range(self.world_size):
                    path = pool_file_path(config.share_mem_file_path, f"{tag}r{r}")
                    self.pools.append(
                        ShmPool(
                            path,
                            config.mem_pool_size,
                            where=config.where("mem_pool_size"),
                            path_where=config.where("share_mem_file_path"),
                            shared_group=config.shared_group,
                        )
                    )
                num_slots = config.mem_pool_size // self.slot_bytes
            root = config.resolved_storage_path
            if root is not None:
                for r in range(self.world_size):
                    self.storage.append(
                        StorageTier(
                            root,
                            config.storage_size,
                            self.payload_bytes,
                            self.rank_digests[r],
                            o_direct=config.storage_o_direct,
                            where=config.where("storage_path"),
                            shared_group=config.shared_group,
                        )
                    )
            remote = ValkeySettings.from_config(config)
            if remote is not None:
                self._remote = ValkeyConnection(remote)
                self.valkey = [ValkeyTier(self._remote, self.payload_bytes, d) for d in self.rank_digests]
        except BaseException:
            for p in self.pools:
                p.close()
            raise
        self.num_slots = num_slots
        self._index = SlotIndex(num_slots)
        # Bumped by a reset of the memory tier: a slot reserved before it is never committed after it,
        # so no promotion or store in flight at the reset becomes visible.
        self._epoch = 0
        self._slot_epoch = [0] * num_slots
        self._staging: dict[bytes, Future[bool]] = {}
        # Chunks of lookups in progress: no reserve (promotion or store) may evict them before
        # the lookup pins them, so a long prompt's promotions never evict its own head.
        self._protected: dict[bytes, int] = {}
        # Promotions from valkey wait on the network: give them as many threads as valkey workers.
        threads = max(config.storage_io_threads, config.valkey_num_workers if self.valkey else 0)
        self._io = ThreadPoolExecutor(threads, thread_name_prefix="hpkv-promote")
        self._cascade: queue.Queue[tuple[bytes, int, str] | None] = queue.Queue(
            maxsize=max(config.cascade_queue_chunks, 1)
        )
        self._cascade_off = config.cascade_queue_chunks == 0 or not (self.storage or self.valkey)
        self._cascade_thread = threading.Thread(target=self._run_cascade, name="hpkv-cascade", daemon=True)
        self._cascade_thread.start()
        self._closed = False

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

    def record_key(self, rank: int, lk: bytes) -> bytes:
        return record_key(self.rank_digests[rank], lk)

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

    def in_storage(self, lk: bytes) -> bool:
        """True if every rank's storage holds its shard of ``lk``."""
        return bool(self.storage) and all(
            t.contains(self.record_key(r, lk)) for r, t in enumerate(self.storage)
        )

    def in_valkey_many(self, lks: list[bytes], tenant: str = SHARED) -> list[bool]:
        """Which of ``lks`` every rank's shard of is on the valkey tier (one pipelined round trip
        per rank; blocks for it)."""
        if not self.valkey or not lks:
            return [False] * len(lks)
        have = [True] * len(lks)
        for r, t in enumerate(self.valkey):
            got = t.contains_many([self.record_key(r, lk) for lk in lks], tenant)
            have = [a and b for a, b in zip(have, got, strict=True)]
        return have

    def probe_valkey(self, lks: list[bytes], tenant: str = SHARED) -> Future[list[bool]]:
        """:meth:`in_valkey_many` on an I/O thread; never blocks. A failure answers "absent"."""

        def run() -> list[bool]:
            try:
                return self.in_valkey_many(lks, tenant)
            except Exception:
                log.exception("hpkv: valkey existence check failed")
                return [False] * len(lks)

        return self._io.submit(run)

    def where(self, lk: bytes) -> str | None:
        return self.locate([lk])[0]

    def locate_local(self, lks: Iterable[bytes]) -> list[str | None]:
        """Per key memory, storage or None, without asking valkey and without cutting at a gap."""
        return [MEMORY if self.in_memory(lk) else STORAGE if self.in_storage(lk) else None for lk in lks]

    def locate(self, lks: Iterable[bytes], tenant: str = SHARED) -> list[str | None]:
        """Per key the fastest tier that holds it; None from the first key no tier holds onwards.

        Memory and storage are checked here; the keys they lack go to valkey in one batch."""
        keys = list(lks)
        out = self.locate_local(keys)
        rest = [i for i, w in enumerate(out) if w is None]
        if rest and self.valkey:
            # Only up to the first key nothing holds matters; ask for the local gaps before it too.
            for i, ok in zip(rest, self.in_valkey_many([keys[i] for i in rest], tenant), strict=True):
                if ok:
                    out[i] = VALKEY
        if None in out:
            cut = out.index(None)
            out[cut:] = [None] * (len(out) - cut)
        return out

    # -- promotion (storage -> memory) -------------------------------------------------

    def stage(self, lks: Iterable[bytes], tenant: str = SHARED) -> list[Future[bool]]:
        """Start promoting ``lks`` (those in storage but not memory) into memory; never blocks.

        Returns the futures of the promotions now running for these keys
        (True: the chunk is in memory now). Without a memory tier nothing can
        be staged and the list is empty.
        """
        futures: list[Future[bool]] = []
        if not self.pools or not (self.storage or self.valkey):
            return futures
        for lk in lks:
            with self._lock:
                if lk in self._index:
                    continue
                fut = self._staging.get(lk)
                if fut is None:
                    fut = self._io.submit(self._promote, lk, tenant)
                    self._staging[lk] = fut
            futures.append(fut)
        return futures

    def _promote(self, lk: bytes, tenant: str) -> bool:
        try:
            slot = self.reserve()
            if slot is None:
                return False
            off = slot * self.slot_bytes
            for r in range(self.world_size):
                if not self._read_rank(r, lk, self.pools[r].view[off : off + self.slot_bytes], tenant):
                    self.abort(slot)
                    return False
            with self._lock:
                if not self._commit_locked(slot, lk, keep_pin=False):
                    return False
            self._mem_stats.add("promotions")
            return True
        except Exception:
            log.exception("hpkv: promotion failed")
            return False
        finally:
            with self._lock:
                self._staging.pop(lk, None)

    def _read_rank(self, r: int, lk: bytes, buf: memoryview, tenant: str) -> bool:
        """Rank ``r``'s verified record of ``lk`` into ``buf``, from storage, else valkey."""
        rk = self.record_key(r, lk)
        if self.storage and self.storage[r].contains(rk) and self.storage[r].read_into(rk, buf):
            return True
        return bool(self.valkey) and self.valkey[r].read_into(rk, buf, Priority.PREFETCH, tenant)

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

    # -- stores (memory, then cascade to storage) ----------------------------------------

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
        and queue it for the slower tiers (each skips a chunk it already holds). False (and the
        slot freed) if another writer committed ``lk`` first or the memory tier was reset since
        the slot was reserved."""
        cascade = not self._cascade_off and (bool(self.valkey) or not self.in_storage(lk))
        with self._lock:
            if not self._commit_locked(slot, lk, keep_pin=cascade):
                return False
        self._mem_stats.add("writes")
        self._mem_stats.add("bytes_written", self.payload_bytes)
        if cascade:
            try:
                self._cascade.put_nowait((lk, slot, tenant))
            except queue.Full:
                self.unpin([slot])
                for t in self._slow_tiers():
                    t.count("writes_skipped")
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

    def _run_cascade(self) -> None:
        while True:
            item = self._cascade.get()
            try:
                if item is None:
                    return
                lk, slot, tenant = item
                off = slot * self.slot_bytes
                for r in range(self.world_size):
                    rk, rec = self.record_key(r, lk), self.pools[r].view[off : off + self.record_bytes]
                    for tier in self._slow_of_rank(r):
                        try:
                            tier.write(rk, rec, tenant)
                        except Exception:
                            log.exception("hpkv: cascade write to %s failed", tier.name)
                            tier.count("errors")
                self.unpin([slot])
            finally:
                self._cascade.task_done()

    def _slow_of_rank(self, r: int) -> list[WriteTarget]:
        return [tiers[r] for tiers in (self.storage, self.valkey) if tiers]

    def _slow_tiers(self) -> list[WriteTarget]:
        return [*self.storage, *self.valkey]

    def flush(self) -> None:
        """Wait for every queued cascade write and every running promotion."""
        self._cascade.join()
        with self._lock:
            pending = list(self._staging.values())
        for f in pending:
            f.result()

    # -- housekeeping --------------------------------------------------------------

    def clear(self, tiers: tuple[str, ...] = (MEMORY, STORAGE)) -> None:
        """Forget chunks of the named tiers (pinned slots are freed when their copies finish).
        Valkey is cleared only when named: it is shared with other engines."""
        if MEMORY in tiers:
            with self._lock:
                self._epoch += 1
                self._index.clear()
        if STORAGE in tiers:
            self._cascade.join()
            for t in self.storage:
                t.clear()
        if VALKEY in tiers:
            self._cascade.join()
            for v in self.valkey:
                v.clear()

    def stats(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        if self.pools:
            with self._lock:
                used, pinned = len(self._index), self._index.pinned()
            out[MEMORY] = self._mem_stats.snapshot(
                used_bytes=used * self.payload_bytes * self.world_size,
                capacity_bytes=self.num_slots * self.payload_bytes * self.world_size,
                chunks=used,
                pinned_slots=pinned,
                cascade_pending=self._cascade.qsize(),
            )
        if self.storage:
            per_rank = [t.stats() for t in self.storage]
            agg = {k: sum(s[k] for s in per_rank) for k in per_rank[0]}
            agg["chunks"] = per_rank[0]["chunks"]
            agg["o_direct"] = per_rank[0]["o_direct"]
            out[STORAGE] = agg
        if self.valkey:
            per = [t.stats() for t in self.valkey]
            vagg = {k: sum(s[k] for s in per) for k in per[0]}
            vagg["connected"] = per[0]["connected"]
            out[VALKEY] = vagg
        if self.world_size > 1:
            # Each rank reads and writes its own shard: its own counters show that every rank
            # served its part (memory hits are per slot, the same slots on every rank).
            for r, st in enumerate(self.storage):
                out[f"{STORAGE}.rank{r}"] = st.stats()
            for r, vt in enumerate(self.valkey):
                out[f"{VALKEY}.rank{r}"] = vt.stats()
        return out

    def check(self) -> None:
        with self._lock:
            self._index.check()
        for t in self.storage:
            t.check()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._cascade.join()
        self._cascade.put(None)
        self._cascade_thread.join(timeout=30)
        self._io.shutdown(wait=True)
        if self._remote is not None:
            self._remote.close()
        for p in self.pools:
            p.close()
