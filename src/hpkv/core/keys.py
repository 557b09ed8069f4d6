"""Chunk keys: a rolling 128-bit prefix hash under a namespace.

Two levels, so that one catalog can speak for every tensor-parallel rank:

* the **logical key** of chunk i, the same for all ranks:
  ``lk[i] = xxh3_128(lk[i-1] || tokens of chunk i as little-endian int64)``,
  ``lk[-1]`` = digest of the namespace without the rank;
* the **record key** of rank r, under which that rank's shard is stored:
  ``xxh3_128(rank namespace digest || lk[i])``.

The namespace fingerprints the model, KV layout, chunk size, TP size, rank and
an optional salt, so two models or TP layouts never read each other's chunks.
Everything is a pure function of its inputs: no ``hash()``, no per-process
seed, the same on every machine.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from hpkv.core.layout import KVLayout

KEY_BYTES = 16
NAMESPACE_VERSION = "hpkv-ns-v1"

Tokens = Sequence[int] | torch.Tensor | np.ndarray


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two stores to share a chunk."""

    model_id: str
    layout: KVLayout
    chunk_size: int
    rank: int = 0
    world_size: int = 1
    salt: str = ""

    def text(self, with_rank: bool = True) -> str:
        rank = f"|rank={self.rank}" if with_rank else ""
        return (
            f"{NAMESPACE_VERSION}|model={self.model_id}|{self.layout.describe()}|chunk={self.chunk_size}"
            f"|tp={self.world_size}{rank}|salt={self.salt}"
        )

    @property
    def digest(self) -> bytes:
        """This rank's 16 bytes; also written into every record header as its layout fingerprint."""
        return xxhash.xxh3_128_digest(self.text().encode("utf-8"))

    @property
    def logical_digest(self) -> bytes:
        """The seed of the logical keys: the same for every rank of one model and layout."""
        return xxhash.xxh3_128_digest(self.text(with_rank=False).encode("utf-8"))

    def for_rank(self, rank: int) -> Namespace:
        return Namespace(self.model_id, self.layout, self.chunk_size, rank, self.world_size, self.salt)


def tokens_to_array(tokens: Tokens) -> np.ndarray:
    """Tokens as a contiguous little-endian int64 array (a list, a 1-D tensor or an ndarray)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        arr = tokens.detach().to("cpu", torch.int64).contiguous().numpy()
    elif isinstance(tokens, list):
        # struct.pack converts a list of ints ~3x faster than np.asarray or array('q') here.
        arr = np.frombuffer(struct.pack(f"<{len(tokens)}q", *tokens), dtype="<i8")
    else:
        arr = np.asarray(tokens, dtype=np.int64)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype="<i8")


def chunk_keys(
    namespace_digest: bytes, tokens: Tokens, chunk_size: int, limit: int | None = None
) -> list[bytes]:
    """Keys of the full chunks of ``tokens`` (a trailing partial chunk has no key).

    ``limit`` caps how many keys are computed (lookups that stop early).
    """
    arr = tokens_to_array(tokens)
    n = len(arr) // chunk_size
    if limit is not None:
        n = min(n, limit)
    raw = arr.view(np.uint8).data  # a memoryview over the same bytes
    step = chunk_size * 8
    keys: list[bytes] = []
    prev = namespace_digest
    h = xxhash.xxh3_128()
    for i in range(n):
        h.reset()
        h.update(prev)
        h.update(raw[i * step : (i + 1) * step])
        prev = h.digest()
        keys.append(prev)
    return keys


def record_key(rank_digest: bytes, logical_key: bytes) -> bytes:
    """The key under which one rank stores its shard of the chunk ``logical_key``."""
    return xxhash.xxh3_128_digest(rank_digest + logical_key)
