"""What a vLLM request's chunks are, beyond their token ids: the engine's own cache identity.

vLLM's prefix cache keys a block by its tokens *and* the request's LoRA adapter,
the multimodal inputs placed in it, ``cache_salt`` and prompt embeddings
(``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``). hpkv
keys chunks by the same things, so it never hands one adapter's, image's or
tenant's KV to another request:

* ``cache_salt`` and the LoRA adapter go into the request's seed (every chunk
  depends on them through the rolling hash);
* each multimodal input overlapping chunk i (its content hash, offset and
  length relative to the chunk) and the prompt embeddings of chunk i go into
  ``extras[i]``.

The LoRA identity is the adapter's **content** (config and weight files),
digested once per adapter and file version: a renamed or moved adapter hits, a
retrained one under the same name does not. vLLM keys by name and path; content
is what survives restarts and machines, which storage and Valkey hits need.

A request hpkv cannot key correctly (an adapter it cannot read, a multimodal
input without a hash) gets ``skip`` set: the scheduler neither loads nor
stores it, and it is served by the engine as usual.

Runs on vLLM's scheduler thread; :meth:`IdentityReader.of` does no I/O except
the first time it meets an adapter (reading its files once).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

import torch

from hpkv.core.keys import KEY_BYTES, digest, request_seed, tenant_tag, text_bytes

log = logging.getLogger("hpkv")

# Files of a PEFT-format adapter directory that decide its weights; anything else (README, logs) is not.
_ADAPTER_SUFFIXES = (".safetensors", ".bin", ".pt", ".json")
_LORA_CACHE_MAX = 256


@dataclass(frozen=True)
class Identity:
    """How to key one request's chunks."""

    seed: bytes  # first link of the key chain (namespace, cache_salt, LoRA content)
    extras: list[bytes | None] | None  # per full chunk: multimodal/embedding digest, or None
    tenant: str  # Valkey key-name segment (see hpkv.core.keys.tenant_tag)
    skip: str | None = None  # why hpkv must not touch this request (None: it may)


class IdentityReader:
    def __init__(self, logical_digest: bytes, chunk_size: int, salt: str = "") -> None:
        self.logical_digest = logical_digest
        self.chunk_size = chunk_size
        self.salt = salt
        self._lora: dict[tuple[Any, ...], bytes] = {}
        self.skipped: dict[str, int] = {}  # kind -> requests not touched

    def of(self, request: Any) -> Identity:
        """The identity of a ``vllm.v1.request.Request`` (or anything with the same attributes)."""
        cache_salt = getattr(request, "cache_salt", None) or None
        tenant = tenant_tag(self.salt, cache_salt)
        lora = None
        lora_request = getattr(request, "lora_request", None)
        if lora_request is not None:
            lora = self.lora_digest(lora_request)
            if lora is None:
                return self._skip(
                    "lora_unreadable", tenant, f"adapter {getattr(lora_request, 'lora_name', '?')!r}"
                )
        seed = request_seed(self.logical_digest, cache_salt=cache_salt, lora=lora)
        n = prompt_length(request) // self.chunk_size
        extras: list[bytes | None] | None = None
        mm = _mm_items(request)
        if mm is None:
            return self._skip("multimodal_unhashed", tenant, "a multimodal input without a content hash")
        if mm:
            extras = [None] * n
            for i in range(n):
                extras[i] = _mm_extra(mm, i * self.chunk_size, (i + 1) * self.chunk_size)
        embeds = getattr(request, "prompt_embeds", None)
        if embeds is not None:
            if not isinstance(embeds, torch.Tensor):
                return self._skip(
                    "prompt_embeds_unknown", tenant, f"prompt embeddings of type {type(embeds)}"
                )
            extras = extras or [None] * n
            for i in range(n):
                e = _embeds_digest(embeds, i * self.chunk_size, (i + 1) * self.chunk_size)
                extras[i] = e if extras[i] is None else digest(extras[i] or b"", e, person=b"hpkv-extra")
        return Identity(seed, extras, tenant)

    def lora_digest(self, lora_request: Any) -> bytes | None:
        """Digest of the adapter's files (config + weights), cached per path and file version;
        None if they cannot be read (a remote or in-memory adapter)."""
        path = getattr(lora_request, "lora_path", None) or getattr(lora_request, "lora_local_path", None)
        if not path or not isinstance(path, str):
            return None
        try:
            files = _adapter_files(path)
        except OSError:
            return None
        if not files:
            return None
        version = tuple((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, _, st in files)
        key = (os.path.realpath(path), version)
        got = self._lora.get(key)
        if got is not None:
            return got
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"hpkv-lora")
        try:
            for name, full, _ in files:
                h.update(struct.pack("<Q", len(name)) + text_bytes(name))
                with open(full, "rb", buffering=0) as f:
                    size = os.fstat(f.fileno()).st_size
                    h.update(struct.pack("<Q", size))
                    while block := f.read(1 << 20):
                        h.update(block)
        except OSError:
            return None
        got = h.digest()
        if len(self._lora) >= _LORA_CACHE_MAX:
            self._lora.pop(next(iter(self._lora)))
        self._lora[key] = got
        log.info(
            "hpkv: LoRA adapter %r keyed by its content (%s)",
            getattr(lora_request, "lora_name", "?"),
            got.hex()[:16],
        )
        return got

    def _skip(self, kind: str, tenant: str, what: str) -> Identity:
        first = kind not in self.skipped
        self.skipped[kind] = self.skipped.get(kind, 0) + 1
        if first:
            log.warning(
                "hpkv: %s: hpkv cannot key this request as the engine does, so it neither loads nor stores "
                "such requests (they are served as without hpkv; counted as skipped_%s)",
                what,
                kind,
            )
        return Identity(self.logical_digest, None, tenant, skip=kind)


def prompt_length(request: Any) -> int:
    """Prompt tokens of a request (with prompt embeddings, ``prompt_token_ids`` may be None)."""
    ids = getattr(request, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    embeds = getattr(request, "prompt_embeds", None)
    return int(embeds.shape[0]) if isinstance(embeds, torch.Tensor) else 0


def _adapter_files(path: str) -> list[tuple[str, str, os.stat_result]]:
    """The adapter's deciding files, sorted by name (regular files only; links are followed once)."""
    out = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if not entry.name.endswith(_ADAPTER_SUFFIXES) or entry.name.startswith("."):
            continue
        st = os.stat(entry.path)
        if not stat.S_ISREG(st.st_mode):
            continue
        out.append((entry.name, entry.path, st))
    return out


def _mm_items(request: Any) -> list[tuple[str, int, int]] | None:
    """(content hash, offset, length) of each multimodal input; [] when there are none,
    None when one has no hash (hpkv cannot tell two such inputs apart)."""
    feats = getattr(request, "mm_features", None)
    items: list[tuple[str, int, int]] = []
    if feats:
        for f in feats:
            ident = getattr(f, "identifier", None)
            pos = getattr(f, "mm_position", None)
            if not ident or pos is None:
                return None
            items.append((str(ident), int(pos.offset), int(pos.length)))
        return items
    # vLLM before mm_features: parallel lists of hashes and placeholder ranges.
    hashes = getattr(request, "mm_hashes", None)
    positions = getattr(request, "mm_positions", None)
    if positions:
        if not hashes or len(hashes) != len(positions) or not all(hashes):
            return None
        items = [(str(h), int(p.offset), int(p.length)) for h, p in zip(hashes, positions, strict=True)]
    return items


def _mm_extra(items: list[tuple[str, int, int]], start: int, end: int) -> bytes | None:
    parts: list[bytes] = []
    for ident, offset, length in items:
        if offset < end and offset + length > start:
            parts += [text_bytes(ident), struct.pack("<qq", offset - start, length)]
    return digest(*parts, person=b"hpkv-mm") if parts else None


def _embeds_digest(embeds: torch.Tensor, start: int, end: int) -> bytes:
    part = embeds[start:end].detach().to("cpu").contiguous()
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"hpkv-embeds")
    h.update(text_bytes(f"{part.dtype}|{tuple(part.shape)}"))
    h.update(part.reshape(-1).view(torch.uint8).numpy().data if part.numel() else b"")
    return h.digest()
