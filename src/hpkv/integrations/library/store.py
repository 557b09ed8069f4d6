"""KVStore: hpkv's engine in one process, for library users, tests and engines without a connector.

A thin facade over :class:`hpkv.engine.catalog.Catalog` (the engine behind vLLM's connector too),
serving one tensor-parallel rank: tensors in and out, keys from tokens. Tiers, fastest first:
memory pool -> storage -> valkey. A lookup takes each chunk from the fastest tier that holds it and
stops at the first chunk no tier holds (valkey is asked once per lookup); reads from a slower tier
are promoted into memory; writes go to memory and cascade to the slower tiers in the background.

Thread-safety: every public method may be called from any thread.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch

from hpkv.core import record
from hpkv.core.config import HpkvConfig
from hpkv.core.errors import HpkvConfigError
from hpkv.core.keys import SHARED_TENANT, Namespace, Tokens, tokens_to_array
from hpkv.core.layout import KVLayout
from hpkv.engine.catalog import Catalog
from hpkv.integrations.library import local
from hpkv.integrations.library.local import Consume, Into, Produce
from hpkv.tiers.base import STORAGE, VALKEY
from hpkv.tiers.memory.pool import ShmPool


class KVStore:
    """Store and fetch the KV of token prefixes, chunk by chunk, across tiers.

    ``model_id``, ``layout``, ``rank``/``world_size`` and ``config.salt`` form
    the namespace: stores that differ in any of them never share a chunk.
    Keys (:meth:`keys`) are logical chunk keys; :meth:`record_key` names a
    chunk inside a tier (this rank's record).
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
        self.config = config
        self.layout = layout
        self.chunk_size = config.chunk_size
        self.namespace = Namespace(model_id, layout, config.chunk_size, rank, world_size, config.salt)
        self.engine = Catalog(config, self.namespace, ranks=[rank])
        self.payload_bytes = self.engine.payload_bytes
        self.record_bytes = record.record_bytes(self.payload_bytes)
        self._chunk_shape = layout.chunk_shape(self.chunk_size)
        self._closed = False

    # -- tiers, for inspection --------------------------------------------------

    @property
    def pool(self) -> ShmPool | None:
        return self.engine.pools[0] if self.engine.pools else None

    @property
    def storage(self) -> Any:
        """This rank's storage tier (a :class:`hpkv.tiers.disk.StorageTier`), or None."""
        tiers = self.engine.tier(STORAGE)
        return tiers[0] if tiers else None

    @property
    def valkey(self) -> Any:
        """This rank's valkey tier (a :class:`hpkv.tiers.valkey.ValkeyTier`), or None."""
        tiers = self.engine.tier(VALKEY)
        return tiers[0] if tiers else None

    def tier_names(self) -> list[str]:
        return self.engine.tier_names()

    # -- keys and lookups ------------------------------------------------------

    def keys(self, tokens: Tokens, limit: int | None = None) -> list[bytes]:
        """Logical keys of the full chunks of ``tokens``."""
        return self.engine.keys(tokens, limit)

    def record_key(self, key: bytes) -> bytes:
        """This rank's record key of the chunk ``key`` (its name in the storage and valkey tiers)."""
        return self.engine.record_key(0, key)

    def locate_keys(self, keys: list[bytes], remote: bool = True) -> list[str | None]:
        """Per key, the fastest tier that holds it; None from the first key no tier holds onwards.
        ``remote=False``: memory and local tiers only, and no cut at the first gap."""
        return self.engine.locate(keys, remote=remote)

    def locate(self, tokens: Tokens) -> list[str | None]:
        """Per full chunk of ``tokens``: the tier that would serve it, or None (no tier, or after a gap)."""
        return self.locate_keys(self.keys(tokens))

    def lookup(self, tokens: Tokens) -> int:
        """Tokens of the longest prefix of ``tokens`` that a mix of tiers holds (a multiple of chunk_size)."""
        located = self.locate(tokens)
        n = located.index(None) if None in located else len(located)
        return n * self.chunk_size

    # -- reads -------------------------------------------------------------------

    def load_chunks(
        self, keys: list[bytes], consume: Consume, *, probe: bool = True, into: Into | None = None
    ) -> int:
        """Hand each chunk's verified payload to ``consume``; return how many leading chunks succeeded
        (see :func:`hpkv.integrations.library.local.load`: memory hits on the calling thread,
        slower ones as they land, promoted into memory; blocks until every read is done).
        ``probe=False``: skip the remote existence check (the caller just made it) and read what the
        local tiers lack remotely.
        ``into(i)``: chunk ``i``'s destination, for reads straight from the page cache to it."""
        return local.load(self.engine, keys, consume, SHARED_TENANT, probe=probe, into=into)

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

    # -- writes ------------------------------------------------------------------

    def store_chunks(self, keys: list[bytes], produce: Produce) -> int:
        """Store each chunk whose payload ``produce`` writes; return how many leading chunks are now
        held. Memory is written on the calling thread; the slower tiers get the record through the
        cascade (never blocking: a full queue drops that write). Chunks already held are not
        rewritten; nothing here waits on a remote server."""
        return local.store(self.engine, keys, produce, SHARED_TENANT)

    def put(self, tokens: Tokens, kv: torch.Tensor) -> int:
        """Store the full chunks of ``tokens`` from ``kv`` ``[layers, 2, len(tokens), heads, dim]``.

        Returns the tokens now held (or queued for the slower tiers) as a prefix, a multiple of chunk_size.
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

    # -- housekeeping ------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every write to the slower tiers submitted so far is done (or dropped)."""
        self.engine.flush()

    def clear(self, tiers: tuple[str, ...] | None = None) -> None:
        """Drop every chunk from the named tiers (after pending writes land, so none reappears).
        ``"valkey"`` deletes this namespace's keys on the server (only when named: it is shared)."""
        self.flush()
        self.engine.clear(tiers)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: hits, misses, corrupt, bytes_read, bytes_written, writes, writes_skipped,
        evictions, errors, promotions, used_bytes, capacity_bytes, chunks."""
        return self.engine.stats()

    def check(self) -> None:
        """Assert internal consistency (tests call this after fault injection)."""
        self.engine.check()

    def close(self) -> None:
        """Flush, stop threads, remove the memory pool file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
