"""Reset means reset: nothing in flight at ``reset_external`` becomes visible after it.

The catalog (the vLLM scheduler's engine) with a real pool and a real storage directory;
the only stand-in is a gate that holds one storage read until the reset has happened
(a real disk cannot be made slow on demand).
"""

from __future__ import annotations

import threading
from typing import Any

from hpkv import HpkvConfig
from hpkv.core import record
from hpkv.core.keys import Namespace
from hpkv.engine.catalog import Catalog
from hpkv.engine.interface import MEMORY
from hpkv.tiers.base import STORAGE
from tests.conftest import CHUNK, SMALL


def catalog(shm_dir: str, storage_dir: str) -> Catalog:
    cfg = HpkvConfig(
        mem_pool_size="4M", share_mem_file_path=shm_dir, storage_path=storage_dir, chunk_size=CHUNK
    )
    return Catalog(cfg, Namespace("reset", SMALL, CHUNK))


def store(cat: Catalog, lk: bytes) -> int:
    """What the workers do for a store: fill and seal a reserved slot. Returns the slot (not committed)."""
    slot = cat.begin_store(lk)
    assert isinstance(slot, int)
    off = slot * cat.slot_bytes
    view = cat.pools[0].view[off : off + cat.record_bytes]
    view[record.HEADER_BYTES :] = bytes(cat.payload_bytes)
    record.seal(view, cat.rank_digests[0], cat.record_key(0, lk), cat.payload_bytes)
    return slot


def test_a_store_in_flight_at_a_reset_is_not_committed(shm_dir: str, storage_dir: str) -> None:
    cat = catalog(shm_dir, storage_dir)
    try:
        lk = cat.keys(list(range(CHUNK)))[0]
        slot = store(cat, lk)
        cat.clear((MEMORY,))  # POST /reset_prefix_cache?reset_external=true while the workers copy
        assert not cat.finish_store(lk, slot, True)
        assert not cat.in_memory(lk)
        cat.flush()
        assert not cat.in_storage(lk)  # nor cascaded
        cat.check()
        assert cat.stats()[MEMORY]["pinned_slots"] == 0
        # After the reset, stores work as before.
        assert cat.finish_store(lk, store(cat, lk), True) and cat.in_memory(lk)
    finally:
        cat.close()


def test_a_promotion_in_flight_at_a_reset_stays_invisible(
    shm_dir: str, storage_dir: str, monkeypatch: Any
) -> None:
    cat = catalog(shm_dir, storage_dir)
    try:
        lk = cat.keys(list(range(CHUNK)))[0]
        assert cat.finish_store(lk, store(cat, lk), True)
        cat.flush()
        assert cat.in_storage(lk)
        cat.clear((MEMORY,))
        reading, release = threading.Event(), threading.Event()
        real = cat.tier(STORAGE)[0].fetch_many

        def held(keys: list[bytes], bufs: list[memoryview], threads: int = 1) -> Any:
            [check] = real(keys, bufs, threads)  # read on the I/O thread; the check runs on a verify thread
            assert check is not None

            def gated() -> bool:
                ok = check()
                reading.set()
                release.wait(10)
                return ok

            return [gated]

        monkeypatch.setattr(cat.tier(STORAGE)[0], "fetch_many", held)
        [fut] = cat.stage([lk])
        assert reading.wait(10)
        cat.clear((MEMORY,))  # the reset lands while the promotion holds its bytes
        release.set()
        assert fut.result(10) is False
        assert not cat.in_memory(lk) and cat.locate_local([lk]) == [STORAGE]
        cat.check()
        monkeypatch.setattr(cat.tier(STORAGE)[0], "fetch_many", real)
        assert cat.stage([lk])[0].result(10) and cat.in_memory(lk)  # a promotion after the reset works
    finally:
        cat.close()
