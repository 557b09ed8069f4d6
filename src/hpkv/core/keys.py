"""Chunk keys: a rolling 128-bit cryptographic prefix hash under a namespace.

Two levels, so that one catalog can speak for every tensor-parallel rank:

* the **logical key** of chunk i, the same for all ranks:
  ``lk[i] = BLAKE2b-128(lk[i-1] || tokens of chunk i as little-endian int64 [|| 0x01 || extra[i]])``,
  ``lk[-1]`` = the request's **seed**: the namespace digest without the rank, or, when the
  request carries an identity beyond its tokens (``cache_salt``, a LoRA adapter), a digest
  of both (:func:`request_seed`). ``extra[i]`` is a 16-byte digest of whatever else the
  engine keys chunk i by (multimodal inputs placed in it, prompt embeddings);
* the **record key** of rank r, under which that rank's shard is stored:
  ``BLAKE2b-128(rank namespace digest || lk[i])``.

The namespace fingerprints the model, KV layout, chunk size, TP size, rank and
an optional salt, so two models or TP layouts never read each other's chunks.
Everything is a pure function of its inputs: no ``hash()``, no per-process
seed, the same on every machine.

Why BLAKE2b and 128 bits: keys name records in tiers other processes and
tenants can read and write (a storage directory, a Valkey cluster). Poisoning a
victim's chunk means finding a prompt whose key equals the victim's: a second
preimage, 2^128 work for a cryptographic hash (with xxh3 it is cheap). A birthday
collision (2^64) only makes two of the attacker's own prompts share a chunk.
The payload checksum in the record header stays xxh3: it detects accidents; a
keyed MAC (``auth_key``) is what detects forgeries.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hpkv.core.layout import KVLayout

KEY_BYTES = 16
NAMESPACE_VERSION = "hpkv-ns-v2"
SHARED_TENANT = "shared"  # the tenant of requests without any salt (see tenant_tag)

Tokens = Sequence[int] | torch.Tensor | np.ndarray


def digest(*parts: bytes, person: bytes = b"hpkv") -> bytes:
    """BLAKE2b-128 of the length-prefixed ``parts`` (so no two part lists share an encoding)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=person)
    for p in parts:
        h.update(struct.pack("<Q", len(p)))
        h.update(p)
    return h.digest()


def text_bytes(s: str) -> bytes:
    """UTF-8 that never raises: a lone surrogate (possible in JSON strings) is kept, not refused."""
    return s.encode("utf-8", "surrogatepass")


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
        return digest(text_bytes(self.text()), person=b"hpkv-ns")

    @property
    def logical_digest(self) -> bytes:
        """The seed of the logical keys: the same for every rank of one model and layout."""
        return digest(text_bytes(self.text(with_rank=False)), person=b"hpkv-ns")

    def for_rank(self, rank: int) -> Namespace:
        return Namespace(self.model_id, self.layout, self.chunk_size, rank, self.world_size, self.salt)


def request_seed(logical_digest: bytes, *, cache_salt: str | None = None, lora: bytes | None = None) -> bytes:
    """The first link of a request's key chain: the namespace's own digest for a plain request,
    else a digest that also covers its ``cache_salt`` and its LoRA adapter's content digest."""
    if not cache_salt and not lora:
        return logical_digest
    return digest(
        logical_digest,
        b"salt",
        text_bytes(cache_salt or ""),
        b"lora",
        lora or b"",
        person=b"hpkv-request",
    )


def tenant_tag(salt: str = "", cache_salt: str | None = None) -> str:
    """The Valkey key-name segment of a tenant: ``shared`` for requests without any salt, else
    ``t`` + 16 hex digits derived from ``HPKV_SALT`` and the request's ``cache_salt`` (the salt
    itself never appears in a key name). Keys are ``hpkv:<tag>:...``: an ACL user limited to
    ``~hpkv:<tag>:*`` sees that tenant's chunks only (``hpkv tenant-prefix`` prints it)."""
    if not salt and not cache_salt:
        return SHARED_TENANT
    return "t" + digest(text_bytes(salt), text_bytes(cache_salt or ""), person=b"hpkv-tenant")[:8].hex()


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
    seed: bytes,
    tokens: Tokens,
    chunk_size: int,
    limit: int | None = None,
    extras: Sequence[bytes | None] | None = None,
) -> list[bytes]:
    """Keys of the full chunks of ``tokens`` (a trailing partial chunk has no key).

    ``seed`` is the namespace's logical digest or a :func:`request_seed`; ``extras[i]``
    (16 bytes or None) is mixed into chunk i's key. ``limit`` caps how many keys are
    computed (lookups that stop early).
    """
    arr = tokens_to_array(tokens)
    n = len(arr) // chunk_size
    if limit is not None:
        n = min(n, limit)
    raw = arr.view(np.uint8).data  # a memoryview over the same bytes
    step = chunk_size * 8
    keys: list[bytes] = []
    prev = seed
    for i in range(n):
        # Fixed-length fields, then an optional marked extra: no two inputs share an encoding.
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES, person=b"hpkv-chunk")
        h.update(raw[i * step : (i + 1) * step])
        extra = extras[i] if extras is not None and i < len(extras) else None
        if extra:
            h.update(b"\x01")
            h.update(extra)
        prev = h.digest()
        keys.append(prev)
    return keys


def record_key(rank_digest: bytes, logical_key: bytes) -> bytes:
    """The key under which one rank stores its shard of the chunk ``logical_key``."""
    return hashlib.blake2b(rank_digest + logical_key, digest_size=KEY_BYTES, person=b"hpkv-record").digest()
