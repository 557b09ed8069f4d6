"""Promotions into the memory pool: each record is read on an I/O thread and checked, before it is
committed, on a verify thread (where the process has cores to spare) or on the I/O thread itself.
Both ways, whatever this machine has. Real pool, real storage files, a real valkey server."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, wait
from typing import Any

import pytest
import torch

from hpkv import HpkvConfig
from hpkv.core import record
from hpkv.core.keys import Namespace
from hpkv.engine.catalog import Catalog
from hpkv.engine.interface import MEMORY
from hpkv.engine.promotion import Promotion
from hpkv.integrations.library import local
from hpkv.integrations.vllm.logs import staged_line
from hpkv.tiers.base import STORAGE, VALKEY
from tests.conftest import CHUNK, SMALL

VERIFY = pytest.mark.parametrize("verify_threads", [0, 2], ids=["inline", "verify-threads"])


def catalog(shm_dir: str, storage_dir: str, verify_threads: int, **extra: Any) -> Catalog:
    cfg = HpkvConfig(
        mem_pool_size="8M", share_mem_file_path=shm_dir, storage_path=storage_dir, chunk_size=CHUNK, **extra
    )
    return Catalog(cfg, Namespace("promote", SMALL, CHUNK), verify_threads=verify_threads)


def fill(cat: Catalog, lks: list[bytes]) -> list[bytes]:
    """Store one distinct payload per chunk the way the workers do; returns the payloads."""
    payloads = [os.urandom(cat.payload_bytes) for _ in lks]

    def produce(i: int, payload: Any) -> None:
        payload.copy_(torch.frombuffer(bytearray(payloads[i]), dtype=torch.uint8))

    assert local.store(cat, lks, produce) == len(lks)
    cat.flush()
    return payloads


def held_bytes(cat: Catalog, lk: bytes) -> bytes:
    [slot] = cat.memory.pin([lk])
    try:
        off = slot * cat.slot_bytes + record.HEADER_BYTES
        return bytes(cat.pools[0].view[off : off + cat.payload_bytes])
    finally:
        cat.memory.unpin([slot])


def flip_payload_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(record.HEADER_BYTES + 17)
        b = f.read(1)
        f.seek(record.HEADER_BYTES + 17)
        f.write(bytes([b[0] ^ 0x40]))


@VERIFY
def test_verified_promotions_commit_and_a_corrupt_file_is_a_miss_and_removed(
    shm_dir: str, storage_dir: str, verify_threads: int
) -> None:
    cat = catalog(shm_dir, storage_dir, verify_threads)
    try:
        lks = cat.keys(list(range(4 * CHUNK)))
        payloads = fill(cat, lks)
        assert cat.locate_local(lks) == [MEMORY] * 4
        cat.clear((MEMORY,))
        bad = cat.tier(STORAGE)[0].path(cat.record_key(0, lks[2]))
        flip_payload_byte(bad)
        since = time.monotonic()
        futures = cat.stage(lks)
        wait(futures, timeout=10)
        assert [f.result() for f in futures] == [True, True, False, True]
        # Each promotion says when it was taken up, read, handed to its check and settled, in that
        # order, and on which I/O thread; the staged log line breaks the wait down with those times.
        for f in futures:
            assert isinstance(f, Promotion) and since <= f.began <= f.fetched <= f.checking <= f.settled
            assert f.io_thread
        line = staged_line(futures, "r1", since)
        assert line.startswith("staged 4 chunks into memory for request r1 in ")
        assert " ms (first read began at " in line and ", to a check " in line and "check and commit" in line
        threads = len({f.io_thread for f in futures})
        assert f"; {threads} I/O threads reading " in line and line.endswith("% of the time)")
        assert staged_line([Future()], "r2", since).endswith(" ms")  # no times to break down
        for i in (0, 1, 3):
            assert held_bytes(cat, lks[i]) == payloads[i]
        assert not cat.in_memory(lks[2]) and not os.path.exists(bad)
        st = cat.stats()
        assert st[STORAGE]["hits"] == 3 and st[STORAGE]["corrupt"] == 1
        assert st[MEMORY]["promotions"] == 3 and st[MEMORY]["pinned_slots"] == 0
        cat.check()
    finally:
        cat.close()


@VERIFY
def test_a_storage_record_that_fails_its_check_is_read_from_valkey(
    shm_dir: str, storage_dir: str, valkey_server: Any, verify_threads: int
) -> None:
    cat = catalog(
        shm_dir, storage_dir, verify_threads, remote_url=valkey_server.url, valkey_mode=valkey_server.mode
    )
    try:
        lks = cat.keys(list(range(2 * CHUNK)), seed=os.urandom(16))
        payloads = fill(cat, lks)
        cat.flush()
        assert all(cat.tier(VALKEY)[0].contains_many([cat.record_key(0, lk) for lk in lks]))
        cat.clear((MEMORY,))
        flip_payload_byte(cat.tier(STORAGE)[0].path(cat.record_key(0, lks[1])))
        futures = cat.stage(lks)
        wait(futures, timeout=10)
        assert [f.result() for f in futures] == [True, True]
        assert [held_bytes(cat, lk) for lk in lks] == payloads
        st = cat.stats()
        assert st[STORAGE]["corrupt"] == 1 and st[VALKEY]["hits"] == 1
    finally:
        cat.close()


@VERIFY
def test_a_load_checks_what_it_read_and_cuts_at_a_corrupt_chunk(
    shm_dir: str, storage_dir: str, verify_threads: int
) -> None:
    """Catalog.load (KVStore.get, SGLang's prefetch): the same split, and only the verified prefix
    counts."""
    cat = catalog(shm_dir, storage_dir, verify_threads)
    try:
        lks = cat.keys(list(range(4 * CHUNK)))
        payloads = fill(cat, lks)
        cat.clear((MEMORY,))
        flip_payload_byte(cat.tier(STORAGE)[0].path(cat.record_key(0, lks[2])))
        got: dict[int, bytes] = {}

        def consume(i: int, payload: torch.Tensor) -> None:
            got[i] = payload.numpy().tobytes()

        assert local.load(cat, lks, consume) == 2
        assert got[0] == payloads[0] and got[1] == payloads[1] and 2 not in got
        assert cat.locate_local(lks[:2]) == [MEMORY, MEMORY]
        assert cat.stats()[MEMORY]["pinned_slots"] == 0
        cat.check()
    finally:
        cat.close()
