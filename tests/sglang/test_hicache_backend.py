"""hpkv as SGLang HiCache's L3 backend, driven by SGLang's own HiCacheController and host pools.

Each test builds a real controller whose storage backend SGLang's factory loads from the
``dynamic`` extra config a user would pass, writes pages with ``write_storage`` (SGLang's backup
thread calls the backend), then prefetches them with ``prefetch`` (SGLang's query thread calls
``batch_exists``, its I/O thread ``batch_get_v1`` or ``batch_get``) into fresh host slots, and
compares the host pool's bytes.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from hpkv.integrations.sglang.backend import page_key
from tests.sglang import rig as h

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def settings(storage_dir: str, shm_dir: str, **more: Any) -> dict[str, Any]:
    return {"kv_storage_path": storage_dir, "share_mem_file_path": shm_dir, **more}


def assert_pages(r: h.Rig, got: h.Prefetched, want: list[torch.Tensor]) -> None:
    assert got.host_indices is not None
    for i, page in enumerate(want):
        assert torch.equal(h.page_bytes(r, got.host_indices, i), page), f"page {i} differs"


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "legacy"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backup_then_prefetch_is_bit_exact(storage_dir: str, shm_dir: str, layout: str, v1: bool) -> None:
    r = h.rig("dynamic", h.hpkv_extra(settings(storage_dir, shm_dir), v1=v1), layout=layout)
    try:
        from hpkv.integrations.sglang import HpkvHiCacheStorage

        assert isinstance(r.backend, HpkvHiCacheStorage)
        expected = "_page_get_zero_copy" if v1 else "_generic_page_get"
        assert r.controller.page_get_func.__name__ == expected
        toks = h.tokens(6, seed=1)
        idx, pages = h.fill_host(r, 6, seed=2)
        assert h.backup(r, toks, idx) == 6 * h.PAGE
        r.backend.flush()
        got = h.prefetch(r, toks)
        assert (got.hit_tokens, got.loaded_tokens) == (6 * h.PAGE, 6 * h.PAGE)
        assert_pages(r, got, pages)
        st = r.backend.hpkv_stats()
        assert st["storage"]["writes"] == 6 and st["storage"]["hits"] == 6
        # zero-copy: the files (in the page cache, just written) were read straight into the host pages
        assert st["storage"]["in_place_reads"] == (6 if v1 else 0)
    finally:
        r.close()


def test_a_restart_prefetches_everything_from_storage(storage_dir: str, shm_dir: str) -> None:
    extra = h.hpkv_extra(settings(storage_dir, shm_dir))
    r = h.rig("dynamic", extra)
    toks = h.tokens(8, seed=3)
    try:
        idx, pages = h.fill_host(r, 8, seed=4)
        assert h.backup(r, toks, idx) == 8 * h.PAGE
    finally:
        r.close()  # SGLang detaches the backend: hpkv's write-behind finishes first
    r = h.rig("dynamic", extra)  # a new server process over the same directory
    try:
        got = h.prefetch(r, toks)
        assert got.loaded_tokens == 8 * h.PAGE
        assert_pages(r, got, pages)
        st = r.backend.hpkv_stats()
        assert st["storage"]["hits"] == 8 and st["storage"]["misses"] == 0
        assert st["storage"]["corrupt"] == 0
    finally:
        r.close()


def test_only_valkey_one_get_per_page(valkey_server: Any, shm_dir: str) -> None:
    extra = h.hpkv_extra(
        {"remote_url": valkey_server.url, "share_mem_file_path": shm_dir, "valkey_mode": "standalone"}
    )
    r = h.rig("dynamic", extra)
    toks = h.tokens(5, seed=5)
    try:
        idx, pages = h.fill_host(r, 5, seed=6)
        assert h.backup(r, toks, idx) == 5 * h.PAGE
    finally:
        r.close()
    r = h.rig("dynamic", extra)
    try:
        hits, gets = valkey_server.keyspace_hits(), valkey_server.command_calls("get")
        got = h.prefetch(r, toks)
        assert got.loaded_tokens == 5 * h.PAGE
        assert_pages(r, got, pages)
        # SGLang's batch_exists: one EXISTS per page; its batch_get_v1: one GET per page, no second check.
        assert valkey_server.command_calls("get") - gets == 5
        assert valkey_server.keyspace_hits() - hits == 5 + 5
        assert r.backend.hpkv_stats()["valkey"]["hits"] == 5
    finally:
        r.close()


def test_a_flipped_byte_ends_the_prefetch_there(storage_dir: str, shm_dir: str) -> None:
    extra = h.hpkv_extra(settings(storage_dir, shm_dir))
    r = h.rig("dynamic", extra)
    toks = h.tokens(6, seed=7)
    try:
        idx, pages = h.fill_host(r, 6, seed=8)
        h.backup(r, toks, idx)
        r.backend.flush()
        store = r.backend.store
        hashes = h.page_hashes(toks, None, page_size=h.PAGE)
        victim = store.storage.path(store.record_key(page_key(hashes[3])))  # the fourth page's file
    finally:
        r.close()
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    r = h.rig("dynamic", extra)
    try:
        got = h.prefetch(r, toks)
        assert got.hit_tokens == 6 * h.PAGE  # it exists; its bytes are checked when read
        assert got.loaded_tokens == 3 * h.PAGE  # pages 0-2 served, the corrupt one and the rest not
        assert_pages(r, got, pages[:3])
        st = r.backend.hpkv_stats()["storage"]
        assert st["corrupt"] == 1 and st["in_place_reads"] >= 3  # checked on the way into the host pages
    finally:
        r.close()


@pytest.mark.parametrize(
    "change",
    [{"dtype": torch.float16}, {"layout": "layer_first"}, {"page": 32}],
    ids=["dtype", "layout", "page"],
)
def test_another_dtype_layout_or_page_size_gets_no_hits(
    storage_dir: str, shm_dir: str, change: dict[str, Any]
) -> None:
    extra = h.hpkv_extra(settings(storage_dir, shm_dir))
    page = change.get("page", h.PAGE)
    r = h.rig("dynamic", extra)
    toks = h.tokens(4 * max(1, page // h.PAGE), seed=9)
    try:
        idx, _ = h.fill_host(r, len(toks) // h.PAGE, seed=10)
        h.backup(r, toks, idx)
    finally:
        r.close()
    r = h.rig("dynamic", extra, **change)
    try:
        got = h.prefetch(r, toks)
        assert got.hit_tokens == 0 and got.loaded_tokens == 0
    finally:
        r.close()


def test_sglang_file_backend_serves_bytes_of_another_dtype(tmp_path: Any) -> None:
    """The contrast: SGLang's own ``file`` backend names pages by model and rank only, so the same
    directory hands float16 pages to a bfloat16 pool (sglang#33268). hpkv's test above: zero hits."""
    extra = {"file_storage_path": str(tmp_path / "file")}
    r = h.rig("file", extra, dtype=torch.float16)
    toks = h.tokens(2, seed=11)
    try:
        idx, _ = h.fill_host(r, 2, seed=12)
        h.backup(r, toks, idx)
    finally:
        r.close()
    r = h.rig("file", extra, dtype=torch.bfloat16)
    try:
        assert h.prefetch(r, toks).loaded_tokens == 2 * h.PAGE
    finally:
        r.close()


def test_mla_pages_are_written_once_and_shared_by_the_tp_ranks(storage_dir: str, shm_dir: str) -> None:
    extra = h.hpkv_extra(settings(storage_dir, shm_dir))
    toks = h.tokens(4, seed=13)
    files = lambda: sum(len(fs) for _, _, fs in os.walk(storage_dir))  # noqa: E731
    r1 = h.rig("dynamic", extra, mla=True, tp_rank=1, tp_size=2)  # not the storage writer
    try:
        assert not r1.backend.writer
        idx, _ = h.fill_host(r1, 4, seed=14)
        h.backup(r1, toks, idx)  # SGLang skips the backup on this rank (backup_skip) ...
        hashes = h.page_hashes(toks, None, page_size=h.PAGE)
        assert r1.backend.batch_set_v1(hashes, idx) == [True] * 4  # ... and the backend writes nothing
        r1.backend.flush()
        assert files() == 0
    finally:
        r1.close()
    r0 = h.rig("dynamic", extra, mla=True, tp_rank=0, tp_size=2)
    try:
        assert r0.backend.writer
        idx, pages = h.fill_host(r0, 4, seed=15)
        h.backup(r0, toks, idx)
        r0.backend.flush()
        assert files() == 4
    finally:
        r0.close()
    r1 = h.rig("dynamic", extra, mla=True, tp_rank=1, tp_size=2)  # rank 1 reads rank 0's pages
    try:
        got = h.prefetch(r1, toks)
        assert got.loaded_tokens == 4 * h.PAGE
        assert_pages(r1, got, pages)
    finally:
        r1.close()


def test_settings_are_checked_when_sglang_attaches_the_backend(storage_dir: str, shm_dir: str) -> None:
    with pytest.raises(ValueError, match=r"chunk_size.*=64 differs from SGLang's --page-size 16"):
        h.rig("dynamic", h.hpkv_extra(settings(storage_dir, shm_dir, chunk_size=64)))
    with pytest.raises(ValueError, match=r"kv_storage_size.*'lots'"):
        h.rig("dynamic", h.hpkv_extra(settings(storage_dir, shm_dir, kv_storage_size="lots")))
    bad = h.hpkv_extra({})
    bad["hpkv"] = "kv_storage_path=/x"
    with pytest.raises(ValueError, match=r'"hpkv" in --hicache-storage-backend-extra-config'):
        h.rig("dynamic", bad)


def test_the_backend_shortens_the_gil_switch_interval_and_never_lengthens_it(
    storage_dir: str, shm_dir: str
) -> None:
    """SGLang's scheduler thread polls without sleeping; hpkv's page I/O threads get the GIL back
    only when it is asked to let go, after the switch interval."""
    import sys

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        h.rig("dynamic", h.hpkv_extra(settings(storage_dir, shm_dir))).close()
        assert sys.getswitchinterval() == pytest.approx(200e-6, rel=0.01)
        sys.setswitchinterval(0.005)
        h.rig("dynamic", h.hpkv_extra(settings(storage_dir, shm_dir, sglang_switch_interval_us=0))).close()
        assert sys.getswitchinterval() == pytest.approx(0.005, rel=0.01)  # 0: left alone
        sys.setswitchinterval(50e-6)
        h.rig("dynamic", h.hpkv_extra(settings(storage_dir, shm_dir))).close()
        assert sys.getswitchinterval() == pytest.approx(50e-6, rel=0.05)  # already shorter: kept
        with pytest.raises(ValueError, match=r"sglang_switch_interval_us.*'fast'"):
            h.rig("dynamic", h.hpkv_extra(settings(storage_dir, shm_dir, sglang_switch_interval_us="fast")))
    finally:
        sys.setswitchinterval(before)


def test_hybrid_models_extra_pools_are_refused_by_name(storage_dir: str, shm_dir: str) -> None:
    r = h.rig("dynamic", h.hpkv_extra(settings(storage_dir, shm_dir)))
    try:
        r.backend.register_mem_host_pool_v2(r.host, "kv")  # the KV pool itself: fine
        with pytest.raises(NotImplementedError, match="'mamba' pool"):
            r.backend.register_mem_host_pool_v2(object(), "mamba")
    finally:
        r.close()


def test_the_servers_counters_reach_hpkv_stats(storage_dir: str, shm_dir: str) -> None:
    """A running SGLang server's hpkv counters are readable from outside it: the pages SGLang wrote
    and read, and each tier's hits, in the stats file ``hpkv stats`` reads; gone once detached."""
    from hpkv.integrations.statsfile import read_all

    r = h.rig("dynamic", h.hpkv_extra(settings(storage_dir, shm_dir)))
    try:
        toks = h.tokens(4, seed=21)
        idx, _ = h.fill_host(r, 4, seed=22)
        assert h.backup(r, toks, idx) == 4 * h.PAGE
        r.backend.flush()
        assert h.prefetch(r, toks).loaded_tokens == 4 * h.PAGE
        deadline = time.monotonic() + 5
        while True:  # the file is refreshed in the background
            docs = read_all(shm_dir)
            if (docs and docs[0]["connector"]["read"] == 4) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(docs) == 1 and docs[0]["pid"] == os.getpid() and docs[0]["engine"] == "sglang"
        pages = dict(docs[0]["connector"])
        assert pages.pop("read_us") > 0  # the time the reads took (the backend's load rate)
        assert pages == {"looked_up": 4, "found": 4, "read": 4, "written": 4}
        assert docs[0]["tiers"]["storage"]["hits"] == 4
    finally:
        r.close()
    assert read_all(shm_dir) == []


def test_a_config_without_the_writer_and_dcp_fields_is_accepted(storage_dir: str, shm_dir: str) -> None:
    """SGLang 0.5.17's HiCacheStorageConfig (its fields exactly) has no is_storage_writer, dcp_rank or
    dcp_size: the backend attaches, and every rank writes its own pages, as it does there."""
    from types import SimpleNamespace

    from hpkv.integrations.sglang.backend import HpkvHiCacheStorage

    config_0517 = SimpleNamespace(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="demo/model", tp_lcm_size=None,
        should_split_heads=False, extra_config={"hpkv": settings(storage_dir, shm_dir)},
    )  # fmt: skip
    backend = HpkvHiCacheStorage(config_0517)
    assert backend.writer is True
    backend.close()


def test_two_servers_share_the_hosts_memory_pool(shm_dir: str) -> None:
    """hpkv's memory tier on (SGLang's own host pool stays per server): pages one server backed up
    are memory hits for another on the host, bit-exact, with no storage tier at all."""
    from hpkv.tiers.memory.hostslots import stop_pool

    one = {"share_mem_file_path": shm_dir, "kv_mem_pool_size": "64M"}
    a = h.rig("dynamic", h.hpkv_extra(one))
    b = h.rig("dynamic", h.hpkv_extra(one))
    try:
        toks = h.tokens(6, seed=11)
        idx, pages = h.fill_host(a, 6, seed=12)
        assert h.backup(a, toks, idx) == 6 * h.PAGE
        a.backend.flush()
        got = h.prefetch(b, toks)
        assert (got.hit_tokens, got.loaded_tokens) == (6 * h.PAGE, 6 * h.PAGE)
        assert_pages(b, got, pages)
        st = b.backend.hpkv_stats()
        assert st["memory"]["hits"] == 6 and "storage" not in st
    finally:
        a.close()
        b.close()
        stop_pool(shm_dir)
