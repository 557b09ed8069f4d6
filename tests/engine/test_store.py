from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from hpkv import HpkvConfig, HpkvConfigError, KVLayout, KVStore
from hpkv.core import record
from tests.conftest import CHUNK, SMALL, StoreFactory, bits_equal, random_kv, random_tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bit_exact_round_trip(make_store: StoreFactory, dtype: torch.dtype) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype)
    s = make_store(layout)
    toks = random_tokens(5 * CHUNK + 7)
    kv = random_kv(layout, len(toks))
    assert s.put(toks, kv) == 5 * CHUNK
    assert s.lookup(toks) == 5 * CHUNK
    out = s.get(toks)
    assert bits_equal(out, kv[:, :, : 5 * CHUNK])
    assert s.get(torch.tensor(toks)).shape == out.shape  # a tensor of tokens works too


def test_storage_round_trip_after_restart(make_store: StoreFactory) -> None:
    toks = random_tokens(4 * CHUNK)
    kv = random_kv(SMALL, len(toks))
    a = make_store()
    a.put(toks, kv)
    a.flush()
    a.close()
    b = make_store()  # new process state: empty pool, same directory
    assert b.locate(toks) == ["storage"] * 4
    assert bits_equal(b.get(toks), kv)
    assert b.locate(toks) == ["memory"] * 4  # promoted
    st = b.stats()
    assert st["storage"]["hits"] == 4 and st["memory"]["hits"] == 0


def test_mixed_hit_memory_then_storage(make_store: StoreFactory) -> None:
    toks = random_tokens(10 * CHUNK)
    kv = random_kv(SMALL, len(toks))
    a = make_store()
    a.put(toks, kv)
    a.flush()
    a.close()
    b = make_store()
    b.get(toks[: 3 * CHUNK])  # the first three chunks are promoted into memory
    assert b.locate(toks) == ["memory"] * 3 + ["storage"] * 7
    before = b.stats()
    assert bits_equal(b.get(toks), kv)
    after = b.stats()
    assert after["memory"]["hits"] - before["memory"]["hits"] == 3
    assert after["storage"]["hits"] - before["storage"]["hits"] == 7


def test_pool_too_small_for_the_prefix(make_store: StoreFactory) -> None:
    """A pool of 4 chunks and a 10-chunk prompt: storage gets everything, memory the recent part."""
    slot = -(-record.record_bytes(SMALL.chunk_bytes(CHUNK)) // 4096) * 4096
    s = make_store(mem_pool_size=4 * slot)
    toks = random_tokens(10 * CHUNK)
    kv = random_kv(SMALL, len(toks))
    assert s.put(toks, kv) == 10 * CHUNK
    s.flush()
    where = s.locate(toks)
    assert set(where) == {"memory", "storage"}
    assert where.count("memory") <= 4
    assert bits_equal(s.get(toks), kv)
    # The pool could not hold every chunk: older ones were evicted, or (while the cascade still
    # pinned them for their storage write) newer ones skipped memory; which, depends on timing.
    mem = s.stats()["memory"]
    assert mem["evictions"] + mem["writes_skipped"] > 0
    s.check()


def test_only_memory_and_only_storage(make_store: StoreFactory) -> None:
    toks = random_tokens(3 * CHUNK)
    kv = random_kv(SMALL, len(toks))
    m = make_store(storage_path=None)
    assert m.tier_names() == ["memory"]
    m.put(toks, kv)
    assert bits_equal(m.get(toks), kv)
    d = make_store(mem_pool_size=0)
    assert d.tier_names() == ["storage"]
    assert d.put(toks, kv) == 3 * CHUNK
    d.flush()
    assert d.locate(toks) == ["storage"] * 3
    assert bits_equal(d.get(toks), kv)


@pytest.mark.parametrize("change", ["layout", "rank", "salt", "model"])
def test_other_namespace_misses(make_store: StoreFactory, change: str) -> None:
    toks = random_tokens(2 * CHUNK)
    a = make_store()
    a.put(toks, random_kv(SMALL, len(toks)))
    a.flush()
    if change == "layout":
        b = make_store(KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16))
    elif change == "rank":
        b = make_store(rank=1, world_size=2)
    elif change == "salt":
        b = make_store(salt="tenant-b")
    else:
        b = make_store(model_id="other")
    assert b.lookup(toks) == 0
    assert b.get(toks).shape[2] == 0


def test_corrupt_chunk_cuts_the_result_at_the_verified_prefix(make_store: StoreFactory) -> None:
    toks = random_tokens(5 * CHUNK)
    kv = random_kv(SMALL, len(toks))
    a = make_store(mem_pool_size=0)
    a.put(toks, kv)
    a.flush()
    assert a.storage is not None
    path = a.storage.path(a.record_key(a.keys(toks)[2]))
    with open(path, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        b = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    out = a.get(toks)
    assert out.shape[2] == 2 * CHUNK  # only the verified prefix, never the bad bytes
    assert bits_equal(out, kv[:, :, : 2 * CHUNK])
    assert a.stats()["storage"]["corrupt"] == 1
    assert a.lookup(toks) == 2 * CHUNK  # the bad file is gone: a later put rewrites it
    a.put(toks, kv)
    a.flush()
    assert bits_equal(a.get(toks), kv)


def test_chunks_already_held_are_not_rewritten(make_store: StoreFactory) -> None:
    toks = random_tokens(4 * CHUNK)
    kv = random_kv(SMALL, len(toks))
    s = make_store()
    s.put(toks, kv)
    s.flush()
    s.put(toks, kv)
    s.put(toks[: 2 * CHUNK], kv[:, :, : 2 * CHUNK])
    s.flush()
    st = s.stats()
    assert st["memory"]["writes"] == 4 and st["storage"]["writes"] == 4


def test_full_cascade_queue_drops_storage_writes_without_blocking(make_store: StoreFactory) -> None:
    s = make_store(cascade_queue_chunks=0)  # no queue at all: every storage write is dropped
    toks = random_tokens(3 * CHUNK)
    assert s.put(toks, random_kv(SMALL, len(toks))) == 3 * CHUNK  # held in memory
    s.flush()
    st = s.stats()
    assert st["storage"]["writes_skipped"] == 3 and st["storage"]["writes"] == 0
    assert st["memory"]["pinned_slots"] == 0


def test_pool_smaller_than_a_chunk_is_a_config_error(shm_dir: str) -> None:
    with pytest.raises(HpkvConfigError, match=r"mem_pool_size=1000 bytes holds no chunk"):
        KVStore(HpkvConfig(mem_pool_size=1000, share_mem_file_path=shm_dir), SMALL)


def test_env_names_in_store_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    blocker = os.path.join(str(tmp_path), "file")
    open(blocker, "w").close()
    monkeypatch.setenv("HPKV_KV_STORAGE_PATH", os.path.join(blocker, "st"))
    monkeypatch.setenv("HPKV_KV_MEM_POOL_SIZE", "0")
    with pytest.raises(HpkvConfigError, match="HPKV_KV_STORAGE_PATH"):
        KVStore(HpkvConfig.from_env(), SMALL)


def test_clear_and_context_manager(shm_dir: str, storage_dir: str) -> None:
    toks = random_tokens(2 * CHUNK)
    cfg = HpkvConfig(
        mem_pool_size="4M",
        share_mem_file_path=shm_dir,
        storage_path=storage_dir,
        chunk_size=CHUNK,
        memory_pool="engine",  # an engine's own pool goes with it (the host pool stays: test_host_pool)
    )
    with KVStore(cfg, SMALL) as s:
        s.put(toks, random_kv(SMALL, len(toks)))
        s.clear(tiers=("memory",))
        assert s.locate(toks) == ["storage", "storage"]
        s.clear()
        assert s.lookup(toks) == 0
        pool_path = s.pool.path if s.pool else ""
    assert not os.path.exists(pool_path)


def test_concurrent_threads(make_store: StoreFactory) -> None:
    slot = -(-record.record_bytes(SMALL.chunk_bytes(CHUNK)) // 4096) * 4096
    s = make_store(mem_pool_size=12 * slot)  # small pool: constant eviction and promotion
    prompts = [(random_tokens(6 * CHUNK, seed=i), random_kv(SMALL, 6 * CHUNK, seed=i)) for i in range(6)]
    errors: list[str] = []

    def worker(n: int) -> None:
        for round_ in range(15):
            toks, kv = prompts[(n + round_) % len(prompts)]
            s.put(toks, kv)
            out = s.get(toks)
            if not bits_equal(out, kv[:, :, : out.shape[2]]):
                errors.append(f"thread {n} round {round_}: wrong bytes")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s.flush()
    for toks, kv in prompts:
        assert bits_equal(s.get(toks), kv)
    st = s.stats()["memory"]
    assert st["pinned_slots"] == 0
    s.check()


def test_two_processes_share_one_storage_directory(shm_dir: str, storage_dir: str) -> None:
    """Two writers of the same chunks, readers while writers run, eviction under readers."""
    code = textwrap.dedent(f"""
        import sys, torch
        from hpkv import HpkvConfig, KVStore
        from tests.conftest import SMALL, CHUNK, random_kv, random_tokens, bits_equal
        me = int(sys.argv[1])
        rec = (SMALL.chunk_bytes(CHUNK) + 64)
        cfg = HpkvConfig(mem_pool_size=0, share_mem_file_path={shm_dir!r}, storage_path={storage_dir!r},
                         chunk_size=CHUNK, storage_size=40 * rec)
        bad = 0
        with KVStore(cfg, SMALL) as s:
            for r in range(40):
                seed = (r + me) % 8
                toks, kv = random_tokens(4 * CHUNK, seed), random_kv(SMALL, 4 * CHUNK, seed)
                s.put(toks, kv)
                s.flush()
                out = s.get(toks)
                if not bits_equal(out, kv[:, :, : out.shape[2]]):
                    bad += 1
        print("bad", bad)
    """)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(i)], stdout=subprocess.PIPE, text=True, env=env)
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert all("bad 0" in o for o in outs), outs
    tmp = [n for d, _, names in os.walk(storage_dir) for n in names if n.endswith(".tmp")]
    assert tmp == []


def test_put_validates_shape_and_dtype(make_store: StoreFactory) -> None:
    s = make_store()
    toks = random_tokens(CHUNK)
    with pytest.raises(ValueError, match="shape"):
        s.put(toks, random_kv(SMALL, CHUNK + 1))
    with pytest.raises(ValueError, match="dtype"):
        s.put(toks, random_kv(SMALL, CHUNK).to(torch.float32))


def test_hpkv_threads_carry_their_names_at_the_os_level(make_store: StoreFactory) -> None:
    """top -H, /proc and profilers must tell hpkv's threads from the engine's (CPython leaves every
    thread with the process's name): the promotion and write-behind threads name themselves."""
    toks = random_tokens(4 * CHUNK)
    kv = random_kv(SMALL, len(toks))
    a = make_store()
    a.put(toks, kv)
    a.flush()
    a.close()
    b = make_store()  # an empty pool: the lookup promotes from storage on the I/O threads
    assert bits_equal(b.get(toks), kv)
    assert b.stats()["storage"]["hits"] == 4
    names = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.add(f.read().strip())
        except OSError:
            continue
    assert "hpkv-cascade" in names, names
    assert any(n.startswith("hpkv-io") for n in names), names
