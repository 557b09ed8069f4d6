"""Records of the 7B shape in a storage directory, for the probes that read them back
(``scripts/gpu/probe_stage.py``, ``scripts/probe_interfere.py``): what a vLLM storage hit of the
H200 bench reads, outside vLLM."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from hpkv import HpkvConfig, KVStore
from hpkv.core.keys import Namespace
from hpkv.core.layout import KVLayout
from hpkv.engine.catalog import Catalog

LAYOUT = KVLayout(num_layers=28, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)  # Qwen2-7B's KV
CHUNK = 256


@dataclass
class Stored:
    root: str  # the storage directory
    shm: str  # the pool's directory
    chunks: int
    payload: int  # bytes per record's payload
    namespace: Namespace
    keys: list[bytes]
    cats: list[Catalog]

    def config(self, threads: int, **extra: Any) -> HpkvConfig:
        """Settings of a catalog over these records, its pool large enough for all of them."""
        return HpkvConfig(
            mem_pool_size=int(self.chunks * self.payload * 1.2) + (64 << 20),
            share_mem_file_path=self.shm,
            storage_path=self.root,
            chunk_size=CHUNK,
            storage_io_threads=threads,
            **extra,
        )

    def catalog(self, threads: int, verify_threads: int, **extra: Any) -> Catalog:
        """A catalog over the records (closed on leaving :func:`stored_records`)."""
        cat = Catalog(self.config(threads, **extra), self.namespace, verify_threads=verify_threads)
        self.cats.append(cat)
        return cat


@contextmanager
def stored_records(chunks: int, prefix: str) -> Iterator[Stored]:
    """``chunks`` records of random KV written to a fresh storage directory under ``~`` (a real
    disk, not tmpfs); everything made is removed on leaving."""
    root = tempfile.mkdtemp(prefix=prefix, dir=os.path.expanduser("~"))
    shm = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm")
    payload = LAYOUT.chunk_bytes(CHUNK)
    toks = list(range(chunks * CHUNK))
    kv = torch.randint(0, 256, (chunks * payload,), dtype=torch.uint8).view(torch.bfloat16)
    kv = kv.view(LAYOUT.num_layers, 2, chunks * CHUNK, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    made = Stored(root, shm, chunks, payload, Namespace("probe", LAYOUT, CHUNK), [], [])
    try:
        with KVStore(made.config(4), LAYOUT) as s:
            s.put(toks, kv)
            s.flush()
            made.namespace, made.keys = s.namespace, s.keys(toks)
        yield made
    finally:
        for cat in made.cats:
            cat.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
