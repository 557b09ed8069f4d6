"""KVStore: the tiered chunk store in one process (library users, tests, engines).

Tiers, fastest first: memory pool -> storage -> valkey. A lookup walks the
chunks of a prompt in order, takes each from the fastest tier that holds it,
and stops at the first chunk no tier holds; one prefix can come from several
tiers. Reads from storage or valkey are promoted into memory. Writes go to
memory synchronously and cascade to storage and valkey in the background.

Thread-safety: every public method may be called from any thread.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

import torch

from hpkv.core import record
from hpkv.core.config import HpkvConfig
from hpkv.core.errors import HpkvConfigError
from hpkv.core.keys import Namespace, Tokens, chunk_keys, record_key, tokens_to_array
from hpkv.core.layout import KVLayout
from hpkv.engine.cascade import Cascade, WriteTarget
from hpkv.tiers.disk import StorageTier
from hpkv.tiers.memory import MemoryTier, SlotRef
from hpkv.tiers.memory.pool import ShmPool, check_holds_a_chunk, pool_file_path, slot_bytes
from hpkv.tiers.valkey import ValkeyConnection, ValkeySettings, ValkeyTier

# consume(chunk_index, payload) reads a verified payload (uint8, canonical layout);
# produce(chunk_index, payload) fills one. Both run on hpkv threads and must not keep `payload`.
Consume = Callable[[int, torch.Tensor], None]
Produce = Callable[[int, torch.Tensor], None]


class KVStore:
    """Store and fetch the KV of token prefixes, chunk by chunk, across tiers.

    ``model_id``, ``layout``, ``rank``/``world_size`` and ``config.salt`` form
    the namespace: stores that differ in any of them never share a chunk.
    """

    def __init__(
        self,
        config: HpkvConfig,
        layout: KVLayout,
        model_id: str = "default",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not (0 <= rank < world_size):
            raise HpkvConfigError(f"rank={rank} must be in [0, world_size={world_size}); use e.g. rank=0")
        record.set_auth_key(config.auth_key_bytes)
        self.config = config
        self.layout = layout
        self.chunk_size = config.chunk_size
        self.namespace = Namespace(model_id, layout, config.chunk_size, rank, world_size, config.salt)
        self._ns = self.namespace.digest
        self.payload_bytes = layout.chunk_bytes(self.chunk_size)
        self.record_bytes = record.record_bytes(self.payload_bytes)
        self._buf_bytes = slot_bytes(self.record_bytes)
        self._chunk_shape = layout.chunk_shape(self.chunk_size)

        self.memory: MemoryTier | None = None
        self.storage: StorageTier | None = None
        self.valkey: ValkeyTier | None = None
        self._remote: ValkeyConnection | None = None
        try:
            if config.mem_pool_size > 0:
                check_holds_a_chunk(
                    config.mem_pool_size,
                    self._buf_bytes,
                    self.chunk_size,
                    config.where("mem_pool_size"),
                    config.example("mem_pool_size"),
                )
                path = pool_file_path(config.share_mem_file_path, self._ns.hex()[:8])
                pool = ShmPool(
                    path,
                    config.mem_pool_size,
                    where=config.where("mem_pool_size"),
                    path_where=config.where("share_mem_file_path"),
                    shared_group=config.shared_group,
                )
                self.memory = MemoryTier(pool, self.payload_bytes, self._ns)
            root = config.resolved_storage_path
            if root is not None:
                self.storage = StorageTier(
                    root,
                    config.storage_size,
                    self.payload_bytes,
                    self._ns,
                    o_direct=config.storage_o_direct,
                    where=config.where("storage_path"),
                    shared_group=config.shared_group,
                )
            remote = ValkeySettings.from_config(config)
            if remote is not None:
                self._remote = ValkeyConnection(remote)
                self.valkey = ValkeyTier(self._remote, self.payload_bytes, self._ns)
        except BaseException:
            if self.memory is not None:
                self.memory.close()
            raise
        targets: list[WriteTarget] = [t for t in (self.storage, self.valkey) if t is not None]
        self._cascade = Cascade(targets, self.memory, config.cascade_queue_chunks) if targets else None
        threads = max(config.storage_io_threads, config.valkey_num_workers if self.valkey else 0)
        self._io = ThreadPoolExecutor(threads, thread_name_prefix="hpkv-io")
        self._scratch = threading.local()
        self._closed = False

    # -- keys and lookups ------------------------------------------------------

    def keys(self, tokens: Tokens, limit: int | None = None) -> list[bytes]:
        """This rank's record keys of the full chunks of ``tokens``."""
        logical = chunk_keys(self.namespace.logical_digest, tokens, self.chunk_size, limit)
        return [record_key(self._ns, lk) for lk in logical]

    def tier_names(self) -> list[str]:
        return [t.name for t in self._tiers()]

    def locate_keys(self, keys: list[bytes], remote: bool = True) -> list[str | None]:
        """Per key, the fastest tier that holds it; None from the first key no tier holds onwards.

        Each tier is asked once for the keys the faster tiers lack (valkey: one pipelined round
        trip). ``remote=False``: local tiers only, and no cut at the first gap."""
        out: list[str | None] = [None] * len(keys)
        rest = list(range(len(keys)))
        for t in self._tiers():
            if not rest:
                break
            if not remote and isinstance(t, ValkeyTier):
                return out
            if isinstance(t, ValkeyTier):
                have = t.contains_many([keys[i] for i in rest])
            else:
                have = [t.contains(keys[i]) for i in rest]
            for i, h in zip(rest, have, strict=True):
                if h:
                    out[i] = t.name
            rest = [i for i in rest if out[i] is None]
        if None in out:
            cut = out.index(None)
            out[cut:] = [None] * (len(out) - cut)
        return out

    def locate(self, tokens: Tokens) -> list[str | None]:
        """Per full chunk of ``tokens``: the tier that would serve it, or None (no tier, or after a gap)."""
        return self.locate_keys(self.keys(tokens))

    def lookup(self, tokens: Tokens) -> int:
        """Tokens of the longest prefix of ``tokens`` that a mix of tiers holds (a multiple of chunk_size)."""
        located = self.locate_keys(self.keys(tokens))
        n = located.index(None) if None in located else len(located)
        return n * self.chunk_size

    # -- reads -------------------------------------------------------------------

    def load_chunks(self, keys: list[bytes], consume: Consume) -> int:
        """Hand each chunk's verified payload to ``consume``; return how many leading chunks succeeded.

        Memory hits are consumed on the calling thread; storage reads run in
        parallel on the I/O pool, are verified, promoted into memory and
        consumed there. Chunks after a failed one may still have been consumed;
        only the returned prefix counts. Blocks until every read is done.
        """
        futures: dict[int, Future[bool]] = {}
        done: dict[int, bool] = {}
        # Start the slow reads first so they overlap with the memory copies. Valkey is not
        # asked whether it holds a chunk: the GET itself answers (one request per chunk).
        located = self.locate_keys(keys, remote=False)
        for i, (key, tier) in enumerate(zip(keys, located, strict=True)):
            if tier is None and self.valkey is None:
                break
            if tier != "memory":
                futures[i] = self._io.submit(self._load_from_slow, i, key, consume)
        for i, (key, tier) in enumerate(zip(keys, located, strict=True)):
            if tier != "memory":
                continue
            ok = self._load_from_memory(i, key, consume)
            if not ok:  # evicted since locate: fall back to storage
                futures[i] = self._io.submit(self._load_from_slow, i, key, consume)
            else:
                done[i] = True
        for i, fut in futures.items():
            done[i] = fut.result()
        n = 0
        while done.get(n):
            n += 1
        return n

    def get(self, tokens: Tokens, out: torch.Tensor | None = None) -> torch.Tensor:
        """The KV of the full chunks of ``tokens``: ``[layers, 2, n, heads, dim]``, bit-exact.

        ``n`` covers the verified prefix only: a chunk that is missing or fails
        verification ends the result there (``n`` may be 0). Never unverified bytes.
        ``out``: a preallocated ``[layers, 2, ≥ full-chunk tokens, heads, dim]`` tensor to fill
        (an engine's own buffer); the result is a view of it. Bytes of ``out``
        beyond the returned prefix are unspecified.
        """
        keys = self.keys(tokens)
        L, K, C, H, D = self._chunk_shape
        if out is None:
            out = torch.empty((L, K, len(keys) * C, H, D), dtype=self.layout.dtype)
        elif (
            out.dtype != self.layout.dtype
            or out.dim() != 5
            or out.shape[2] < len(keys) * C
            or (tuple(out.shape[:2]) + tuple(out.shape[3:]) != (L, K, H, D))
        ):
            raise ValueError(
                f"out has shape {tuple(out.shape)} {out.dtype}; expected "
                f"{(L, K, len(keys) * C, H, D)} {self.layout.dtype}"
            )

        def consume(i: int, payload: torch.Tensor) -> None:
            out[:, :, i * C : (i + 1) * C].copy_(payload.view(self.layout.dtype).view(self._chunk_shape))

        n = self.load_chunks(keys, consume)
        return out[:, :, : n * C]

    def _load_from_memory(self, i: int, key: bytes, consume: Consume) -> bool:
        assert self.memory is not None
        ref = self.memory.acquire(key)
        if ref is None:
            return False
        try:
            consume(i, ref.payload)
        finally:
            self.memory.release(ref)
        return True

    def _read_slow(self, key: bytes, buf: memoryview) -> bool:
        """The verified record of ``key`` into ``buf``, from storage, else valkey."""
        if self.storage is not None and self.storage.contains(key) and self.storage.read_into(key, buf):
            return True
        return self.valkey is not None and self.valkey.read_into(key, buf)

    def _load_from_slow(self, i: int, key: bytes, consume: Consume) -> bool:
        if self.storage is None and self.valkey is None:
            return False
        promo = self.memory.reserve(key) if self.memory is not None else None
        if promo is not None:
            assert self.memory is not None
            if not self._read_slow(key, self.memory.slot_buffer(promo)):
                self.memory.abort(promo)
                return False
            try:
                consume(i, promo.payload)
            finally:
                self.memory.commit(promo, sealed=True)
            return True
        buf, tensor = self._scratch_buffer()
        if not self._read_slow(key, buf):
            return False
        consume(i, tensor[record.HEADER_BYTES : record.HEADER_BYTES + self.payload_bytes])
        return True

    def _scratch_buffer(self) -> tuple[memoryview, torch.Tensor]:
        """A page-aligned buffer of one record for this thread (O_DIRECT reads need the alignment)."""
        s = self._scratch
        if not hasattr(s, "buf"):
            s.mm = mmap.mmap(-1, self._buf_bytes)
            s.buf = memoryview(s.mm)
            s.tensor = torch.frombuffer(s.mm, dtype=torch.uint8)
        return s.buf, s.tensor

    # -- writes ------------------------------------------------------------------

    def store_chunks(self, keys: list[bytes], produce: Produce) -> int:
        """Store each chunk whose payload ``produce`` writes; return how many leading chunks are now held.

        Memory is written on the calling thread; storage gets the record through
        the cascade (never blocking: a full queue drops that storage write).
        Chunks a tier already holds are not rewritten.
        """
        held = 0
        counting = True
        for i, key in enumerate(keys):
            ok = self._store_one(i, key, produce)
            if counting and ok:
                held += 1
            else:
                counting = False
        return held

    def put(self, tokens: Tokens, kv: torch.Tensor) -> int:
        """Store the full chunks of ``tokens`` from ``kv`` ``[layers, 2, len(tokens), heads, dim]``.

        Returns the tokens now held (or queued for storage) as a prefix, a multiple of chunk_size.
        """
        arr = tokens_to_array(tokens)
        L, K, C, H, D = self._chunk_shape
        expect = (L, K, len(arr), H, D)
        if tuple(kv.shape) != expect:
            raise ValueError(f"kv has shape {tuple(kv.shape)}; expected {expect} for {len(arr)} tokens")
        if kv.dtype != self.layout.dtype:
            raise ValueError(f"kv has dtype {kv.dtype}; the layout says {self.layout.dtype}")

        def produce(i: int, payload: torch.Tensor) -> None:
            payload.view(self.layout.dtype).view(self._chunk_shape).copy_(kv[:, :, i * C : (i + 1) * C])

        return self.store_chunks(self.keys(arr), produce) * C

    def _store_one(self, i: int, key: bytes, produce: Produce) -> bool:
        # Slower tiers are asked with held(): never a network round trip, so put() never waits on a
        # slow or dead remote server (the cascade's SET does the rest in the background).
        slow = [t for t in (self.storage, self.valkey) if t is not None]
        cascade = self._cascade if slow else None
        if self.memory is not None:
            if self.memory.contains(key):
                if cascade is not None and not all(t.held(key) for t in slow):
                    held = self.memory.acquire(key, count=False)
                    if held is not None:
                        cascade.submit(key, held)
                return True
            if cascade is not None and any(t.held(key) for t in slow):
                return True  # a slower tier has it; a later hit promotes it
            ref = self.memory.reserve(key)
            if ref is not None:
                return self._fill_slot(i, ref, produce, cascade is not None)
        if cascade is None:
            return False
        if any(t.held(key) for t in slow):
            return True
        buf = bytearray(self.record_bytes)
        payload = torch.frombuffer(buf, dtype=torch.uint8)[record.HEADER_BYTES :]
        produce(i, payload)
        del payload
        record.seal(memoryview(buf), self._ns, key, self.payload_bytes)
        return cascade.submit(key, buf)

    def _fill_slot(self, i: int, ref: SlotRef, produce: Produce, cascade: bool) -> bool:
        assert self.memory is not None
        try:
            produce(i, ref.payload)
        except BaseException:
            self.memory.abort(ref)
            raise
        committed = self.memory.commit(ref, keep_pin=cascade)
        if cascade and committed:
            assert self._cascade is not None
            self._cascade.submit(ref.key, ref)  # the cascade releases the pin
        return True

    # -- housekeeping ------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every write to storage submitted so far is on disk (or dropped)."""
        if self._cascade is not None:
            self._cascade.flush()

    def clear(self, tiers: tuple[str, ...] = ("memory", "storage")) -> None:
        """Drop every chunk from the named tiers (after pending writes land, so none reappears).
        ``"valkey"`` deletes this namespace's keys on the server (only when named: it is shared)."""
        self.flush()
        for t in self._tiers():
            if t.name in tiers:
                t.clear()

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: hits, misses, corrupt, bytes_read, bytes_written, writes, writes_skipped,
        evictions, errors, used_bytes, capacity_bytes, chunks."""
        out = {t.name: t.stats() for t in self._tiers()}
        return out

    def check(self) -> None:
        """Assert internal consistency (tests call this after fault injection)."""
        for t in self._tiers():
            t.check()

    def close(self) -> None:
        """Flush, stop threads, remove the memory pool file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._cascade is not None:
            self._cascade.flush()
            self._cascade.close()
        self._io.shutdown(wait=True)
        # The valkey workers first: a worker's last job still references its buffer (a slice of the
        # pool) until the worker ends, and a mapping with a live export cannot be closed.
        if self._remote is not None:
            self._remote.close()
        for t in reversed(self._tiers()):  # valkey, storage, then the memory pool
            t.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _tiers(self) -> list[Any]:
        return [t for t in (self.memory, self.storage, self.valkey) if t is not None]
