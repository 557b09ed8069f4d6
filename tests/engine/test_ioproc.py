"""Promotions read in the I/O process (``HPKV_IO_PROCESS``): a real child process reads real storage
files into the real shared-memory pool and checks them; the parent commits only what it says is whole
and reads anything else again itself, so a corrupt or missing file is a miss exactly as without it."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import wait
from typing import Any

import pytest

from hpkv import HpkvConfig
from hpkv.core.keys import Namespace
from hpkv.engine.catalog import MEMORY, Catalog
from hpkv.engine.reads import staged_line
from tests.conftest import CHUNK, SMALL
from tests.engine.test_promotion import fill, flip_payload_byte, held_bytes


def catalog(shm_dir: str, storage_dir: str, **extra: Any) -> Catalog:
    settings: dict[str, Any] = {"mem_pool_size": "8M", "share_mem_file_path": shm_dir, "chunk_size": CHUNK}
    cfg = HpkvConfig(**settings | {"storage_path": storage_dir, "io_process": True} | extra)
    return Catalog(cfg, Namespace("ioproc", SMALL, CHUNK), verify_threads=0)


def promote(cat: Catalog, lks: list[bytes]) -> list[bool]:
    cat.clear((MEMORY,))
    futures = cat.stage(lks)
    done, _ = wait(futures, timeout=20)
    assert len(done) == len(futures), "a promotion never settled"
    return [f.result() for f in futures]


@pytest.mark.parametrize("auth", [None, "k" * 32], ids=["checksum", "mac"])
def test_the_child_promotes_exact_bytes_and_a_corrupt_or_missing_file_is_a_miss(
    shm_dir: str, storage_dir: str, auth: str | None
) -> None:
    cat = catalog(shm_dir, storage_dir, auth_key=auth)
    try:
        proc = cat._reads._proc
        assert proc is not None and proc.alive
        lks = cat.keys(list(range(5 * CHUNK)))
        payloads = fill(cat, lks)
        cat.clear((MEMORY,))
        since = time.monotonic()
        futures = cat.stage(lks)
        wait(futures, timeout=20)
        assert [f.result() for f in futures] == [True] * 5
        assert proc.served == 5  # every record came through the child, none read here
        # The log line says where the time went as it was: asked of the child, answered; no thread shares.
        line = staged_line(futures, "r1", since)
        assert "first asked of the I/O process at" in line and "from asking to its answer" in line, line
        assert "I/O threads" not in line
        assert [held_bytes(cat, lk) for lk in lks] == payloads
        assert cat.storage[0].stats()["io_process_reads"] == 5

        bad = cat.storage[0].path(cat.record_key(0, lks[1]))
        flip_payload_byte(bad)
        os.unlink(cat.storage[0].path(cat.record_key(0, lks[3])))
        assert promote(cat, lks) == [True, False, True, False, True]
        assert proc.served == 8  # the child refused the two; the parent's tier read them again
        assert cat.storage[0].stats()["io_process_reads"] == 8
        assert not os.path.exists(bad), "a corrupt file is removed, as without the I/O process"
        assert cat.locate_local(lks) == [MEMORY, None, MEMORY, None, MEMORY]
        assert [held_bytes(cat, lks[i]) for i in (0, 2, 4)] == [payloads[i] for i in (0, 2, 4)]
    finally:
        cat.close()


def test_a_dead_child_means_promotions_read_here_not_a_hang(shm_dir: str, storage_dir: str) -> None:
    cat = catalog(shm_dir, storage_dir)
    try:
        proc = cat._reads._proc
        assert proc is not None
        lks = cat.keys(list(range(3 * CHUNK)))
        payloads = fill(cat, lks)
        # The child counts its page-cache reads as the tier counts its own: the same reads, here
        # (after the kill) and there, add the same to page_cache_reads.
        cached = cat.storage[0].stats()["page_cache_reads"]
        assert promote(cat, lks) == [True] * 3 and proc.served == 3
        by_child = cat.storage[0].stats()["page_cache_reads"] - cached
        os.kill(proc._proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while proc.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not proc.alive
        cached = cat.storage[0].stats()["page_cache_reads"]
        assert promote(cat, lks) == [True] * 3
        assert proc.served == 3  # none since the kill
        assert cat.storage[0].stats()["page_cache_reads"] - cached == by_child
        assert [held_bytes(cat, lk) for lk in lks] == payloads
    finally:
        cat.close()


def test_without_storage_there_is_no_child(shm_dir: str) -> None:
    cfg = HpkvConfig(mem_pool_size="8M", share_mem_file_path=shm_dir, chunk_size=CHUNK, io_process=True)
    cat = Catalog(cfg, Namespace("ioproc", SMALL, CHUNK))
    try:
        assert cat._reads._proc is None
    finally:
        cat.close()


def test_the_child_starts_without_torch() -> None:
    """What the child imports (hpkv.core and the storage tier's file reader) leaves torch out: it
    starts in tens of milliseconds, not the second and ~200 MB that importing torch costs."""
    import subprocess
    import sys

    code = "import sys, hpkv.engine.ioproc; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_exact_bytes_while_stores_evict_and_the_pool_is_cleared(shm_dir: str, storage_dir: str) -> None:
    """Promotions through the child into a pool that holds the stored chunks and little more, while a
    writer stores new chunks (evicting) and the memory tier is cleared now and then: every slot read
    back after its promotion holds exactly the bytes stored under its key."""
    import random
    import threading

    import torch

    cat = catalog(shm_dir, storage_dir)
    cat.close()
    pool = cat.slot_bytes * 24  # 24 slots: 16 stored chunks and room for the writer's
    cat = catalog(shm_dir, storage_dir, mem_pool_size=pool)
    stop = threading.Event()
    try:
        proc = cat._reads._proc
        assert proc is not None
        lks = cat.keys(list(range(16 * CHUNK)))
        expected = dict(zip(lks, fill(cat, lks), strict=True))
        extra = cat.keys(list(range(10**6, 10**6 + 16 * CHUNK)))

        def writer() -> None:
            j = 0
            while not stop.is_set():
                some = extra[j % 16 : j % 16 + 4]
                j += 4
                cat.store(some, lambda _i, p: p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8)))

        th = threading.Thread(target=writer)
        th.start()
        rnd = random.Random(7)
        checked = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if rnd.random() < 0.3:
                cat.clear((MEMORY,))
            some = rnd.sample(lks, 6)
            wait(cat.stage(some), timeout=20)
            for lk in some:
                if cat.locate_local([lk]) == [MEMORY]:
                    try:
                        got = held_bytes(cat, lk)
                    except ValueError:  # evicted between the two calls
                        continue
                    assert got == expected[lk]
                    checked += 1
        stop.set()
        th.join()
        assert checked > 50 and proc.served > 50, (checked, proc.served)
    finally:
        stop.set()
        cat.close()
