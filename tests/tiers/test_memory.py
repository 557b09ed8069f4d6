from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from hpkv import HpkvConfigError
from hpkv.core import record
from hpkv.tiers.memory.pool import ShmPool, agreed_pool_path, pool_file_path, reclaim_stale, slot_bytes
from hpkv.tiers.memory.slots import SlotIndex
from tests.conftest import CHUNK, SMALL, bits_equal, random_tokens


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def slots_store(make_store: Any, slots: int) -> Any:
    """A memory-only store whose pool holds exactly ``slots`` chunks."""
    per = slot_bytes(record.record_bytes(SMALL.chunk_bytes(CHUNK)))
    return make_store(mem_pool_size=str(slots * per), storage_path=None)


def chunk(i: int) -> tuple[list[int], torch.Tensor]:
    """One chunk's tokens and KV (every byte ``i``)."""
    return random_tokens(CHUNK, seed=500 + i), torch.full(
        (SMALL.num_layers, 2, CHUNK, SMALL.num_kv_heads, SMALL.head_dim), float(i), dtype=SMALL.dtype
    )


def test_slot_index_lru_and_pins() -> None:
    idx = SlotIndex(2)
    for i in range(2):
        got = idx.reserve()
        assert got is not None
        idx.commit(got[0], k(i))
    pinned = idx.pin(k(0))  # k(0) is now most recently used and pinned
    assert pinned is not None
    got = idx.reserve()
    assert got is not None and got[1] == k(1)  # LRU unpinned victim
    idx.commit(got[0], k(2))
    idx.pin(k(2))
    assert idx.reserve() is None  # all pinned: no victim, no waiting
    idx.unpin(pinned)
    idx.check()


def test_slot_index_remove_while_pinned_frees_on_unpin() -> None:
    idx = SlotIndex(1)
    got = idx.reserve()
    assert got is not None
    idx.commit(got[0], k(0))
    slot = idx.pin(k(0))
    assert slot is not None
    assert idx.remove(k(0))
    assert idx.reserve() is None  # the slot is still being read
    idx.unpin(slot)
    assert idx.reserve() is not None
    idx.check()


def test_pool_file_mode_and_removal(make_store: Any) -> None:
    st = slots_store(make_store, 4)
    path = st.pool.path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.stat(path).st_blocks * 512 >= st.pool.size  # space allocated up front
    st.close()
    assert not os.path.exists(path)


def test_round_trip_and_eviction(make_store: Any) -> None:
    st = slots_store(make_store, 3)
    chunks = [chunk(i) for i in range(5)]
    for toks, kv in chunks:
        assert st.put(toks, kv) == CHUNK
    assert [st.lookup(toks) for toks, _ in chunks] == [0, 0, CHUNK, CHUNK, CHUNK]
    toks, kv = chunks[3]
    assert bits_equal(st.get(toks), kv)
    s = st.stats()["memory"]
    assert s["evictions"] == 2 and s["hits"] == 1 and s["chunks"] == 3
    st.check()


def test_full_of_pinned_slots_skips_the_write(make_store: Any) -> None:
    st = slots_store(make_store, 2)
    chunks = [chunk(i) for i in range(3)]
    for toks, kv in chunks[:2]:
        st.put(toks, kv)
    slots = st.engine.memory.pin([st.keys(chunks[0][0])[0]]) + st.engine.memory.pin(
        [st.keys(chunks[1][0])[0]]
    )
    assert len(slots) == 2  # both being read
    assert st.put(*chunks[2]) == 0  # no room, no waiting
    assert st.stats()["memory"]["writes_skipped"] == 1
    st.engine.memory.unpin(slots)
    assert st.put(*chunks[2]) == CHUNK
    st.check()


def test_corrupt_header_in_slot_is_a_miss(make_store: Any) -> None:
    st = slots_store(make_store, 2)
    toks, kv = chunk(7)
    st.put(toks, kv)
    [slot] = st.engine.memory.pin(st.keys(toks))
    st.engine.memory.unpin([slot])
    st.pool.view[slot * st.engine.slot_bytes] ^= 0xFF  # someone scribbled on the shared file
    assert st.get(toks).shape[2] == 0
    assert st.stats()["memory"]["corrupt"] == 1
    assert st.lookup(toks) == 0  # forgotten
    st.check()


def test_stale_pool_file_of_dead_process_is_reclaimed(shm_dir: str) -> None:
    code = textwrap.dedent(f"""
        import os
        from hpkv.tiers.memory.pool import ShmPool, pool_file_path
        p = ShmPool(pool_file_path({shm_dir!r}, "x"), 1 << 20)
        print(p.path, flush=True)
        os._exit(0)  # crash: no close(), the file stays
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    stale = out.stdout.strip()
    assert os.path.exists(stale)
    assert stale in reclaim_stale(shm_dir)
    assert not os.path.exists(stale)


def test_live_pool_file_is_not_reclaimed(make_store: Any) -> None:
    first = slots_store(make_store, 1)
    other = slots_store(make_store, 1)  # a second start in the same directory
    assert os.path.exists(first.pool.path)
    other.close()


def test_pool_larger_than_tmpfs_is_a_config_error(shm_dir: str) -> None:
    os.makedirs(shm_dir, exist_ok=True)
    st = os.statvfs(shm_dir)
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    with pytest.raises(HpkvConfigError, match="HPKV_KV_MEM_POOL_SIZE"):
        ShmPool(pool_file_path(shm_dir, "t"), too_big)
    assert not [n for n in os.listdir(shm_dir) if n.endswith(".shm")]


def test_pool_on_a_small_real_tmpfs(small_tmpfs: str | None) -> None:
    if small_tmpfs is None:
        pytest.fail("mount -t tmpfs was refused; this test needs root (CI runs as root)")
    with pytest.raises(HpkvConfigError, match="HPKV_KV_MEM_POOL_SIZE"):
        ShmPool(pool_file_path(small_tmpfs, "t"), 4 << 20)
    pool = ShmPool(pool_file_path(small_tmpfs, "t"), 512 << 10)
    pool.tensor.fill_(1)  # the whole allocation is usable: no SIGBUS
    pool.close()


def test_unwritable_pool_directory(tmp_path: object) -> None:
    blocker = os.path.join(str(tmp_path), "a-file")
    open(blocker, "w").close()
    with pytest.raises(HpkvConfigError, match="HPKV_SHARE_MEM_FILE_PATH"):
        ShmPool(pool_file_path(os.path.join(blocker, "pool"), "t"), 1 << 20)


def test_payload_views_share_the_mapping(make_store: Any) -> None:
    st = slots_store(make_store, 2)
    toks = random_tokens(CHUNK, seed=9)

    def produce(i: int, payload: torch.Tensor) -> None:
        payload.copy_(torch.arange(payload.numel(), dtype=torch.int64).to(torch.uint8))

    assert st.store_chunks(st.keys(toks), produce) == 1
    [slot] = st.engine.memory.pin(st.keys(toks))
    st.engine.memory.unpin([slot])
    with open(st.pool.path, "rb") as f:  # written through the payload view, seen in the file
        f.seek(slot * st.engine.slot_bytes + record.HEADER_BYTES)
        assert f.read(16) == bytes(range(16))


def test_reserve_never_evicts_protected_keys() -> None:
    from hpkv.tiers.memory.slots import SlotIndex

    idx = SlotIndex(3)
    for k in (b"a", b"b", b"c"):
        got = idx.reserve()
        assert got is not None
        idx.commit(got[0], k)
    got = idx.reserve(protected={b"a", b"b"})  # a and b are the oldest, but a lookup holds them
    assert got is not None and got[1] == b"c"
    idx.commit(got[0], b"d")
    assert idx.reserve(protected={b"a", b"b", b"d"}) is None  # a shorter hit, never a thrash
    idx.check()


def test_room_counts_what_reserve_could_hand_out() -> None:
    from hpkv.tiers.memory.slots import SlotIndex

    idx = SlotIndex(5)
    assert idx.room() == 5
    for k in (b"a", b"b", b"c"):
        got = idx.reserve()
        assert got is not None
        idx.commit(got[0], k)
    reserved = idx.reserve()  # pinned, not yet visible
    assert reserved is not None
    pinned = idx.pin(b"a")
    assert pinned is not None
    # free: 1; live and unpinned: b, c; protected: c (and a, pinned anyway; x, not in the pool)
    assert idx.room(protected={b"a", b"c", b"x"}) == 2
    for _ in range(2):
        assert idx.reserve(protected={b"a", b"c", b"x"}) is not None
    assert idx.room(protected={b"a", b"c", b"x"}) == 0
    assert idx.reserve(protected={b"a", b"c", b"x"}) is None


def _pool_script(path: str, then: str) -> list[str]:
    import sys

    code = (
        "import sys, time\n"
        "from hpkv.tiers.memory.pool import ShmPool\n"
        f"p = ShmPool({path!r}, 256 << 20)\n"
        "print('ready', flush=True)\n" + then
    )
    return [sys.executable, "-c", code]


def test_exit_without_close_is_clean_and_leaves_no_file(shm_dir: str) -> None:
    """Ending right after start (the pre-fault thread still inside torch) aborted with
    'terminate called without an active exception' and left the file in /dev/shm."""
    import subprocess

    path = os.path.join(shm_dir, "exit.shm")
    for _ in range(3):
        r = subprocess.run(_pool_script(path, ""), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "terminate called" not in r.stderr
        assert not os.path.exists(path)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_removes_the_pool_file(shm_dir: str, sig: str) -> None:
    """How a process manager (or Ctrl-C) stops an engine: the pool file goes with the process."""
    import signal
    import subprocess

    path = os.path.join(shm_dir, f"{sig}.shm")
    p = subprocess.Popen(
        _pool_script(path, "time.sleep(60)\n"), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    assert os.path.exists(path)
    p.send_signal(getattr(signal, sig))
    rc = p.wait(timeout=30)
    assert rc != 0  # the signal still ends the process as it would have
    assert not os.path.exists(path)


def test_a_flipped_byte_in_a_pool_slots_header_is_a_miss(make_store: Any) -> None:
    """The pool is trusted for its payload (a 0600 file of the serving user; README says why) but
    every memory hit checks the slot's header: a damaged header is a counted miss, not data."""
    from tests.conftest import CHUNK, SMALL, random_kv, random_tokens

    s = make_store(storage_path=None)
    toks = random_tokens(2 * CHUNK, seed=61)
    kv = random_kv(SMALL, len(toks), seed=61)
    s.put(toks, kv)
    assert s.pool is not None
    view = s.pool.view
    for off in range(0, len(view), s.engine.slot_bytes):
        if bytes(view[off : off + 4]) == record.MAGIC:
            view[off + 30] ^= 0xFF  # inside the key field
            break
    out = s.get(toks)
    assert out.shape[2] < 2 * CHUNK
    assert s.stats()["memory"]["corrupt"] >= 1


def _resident_bytes(addr: int) -> int:
    """Rss of the mapping that holds ``addr`` in this process (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_an_attached_pool_is_read_ahead_only_when_asked_and_at_idle_priority(shm_dir: str) -> None:
    """A CPU engine's worker maps the scheduler's pool: with ``prefault`` its own page tables are
    filled in the background (else the first store into each slot pays the faults), by a thread
    at nice 19 (it must not take the CPU from the model's threads)."""
    size = 128 << 20
    owner = ShmPool(pool_file_path(shm_dir, "pf"), size)
    try:
        plain = ShmPool.attach(owner.path, size)
        assert _resident_bytes(plain.tensor.data_ptr()) < size // 4  # nothing touched it here
        plain.close()
        ahead = ShmPool.attach(owner.path, size, prefault=True)
        thread = ahead._prefault
        assert thread is not None
        nice = None
        while thread.is_alive() and nice != 19:  # 128 MiB of faults: a tenth of a second or more
            if thread.native_id is not None:
                try:
                    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                        nice = int(f.read().rsplit(")", 1)[1].split()[16])
                except OSError:
                    break  # it ended between the two lines
        assert nice == 19
        thread.join(timeout=60)
        assert _resident_bytes(ahead.tensor.data_ptr()) >= size - (1 << 20)
        ahead.close()
        assert ahead._prefault is None
    finally:
        owner.close()


def test_exit_while_an_attached_pool_is_read_ahead_is_clean(shm_dir: str) -> None:
    path = os.path.join(shm_dir, "attach-exit.shm")
    code = (
        "from hpkv.tiers.memory.pool import ShmPool\n"
        f"p = ShmPool({path!r}, 256 << 20)\n"
        f"a = ShmPool.attach({path!r}, 256 << 20, prefault=True)\n"
    )
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "terminate called" not in r.stderr
        assert not os.path.exists(path)


def test_a_pool_made_for_another_process_is_adopted_only_while_its_maker_holds_it(shm_dir: str) -> None:
    """A vLLM worker makes its rank's pool at start and the scheduler adopts it: same bytes, the
    maker keeps the file; a file of the wrong size, a link or a file nobody holds is not adopted
    (the unheld one is a crash's leftover and is removed)."""
    size = 4 << 20
    path = agreed_pool_path(shm_dir, os.getpid(), "adopt0")
    assert path == os.path.join(os.path.abspath(shm_dir), f"hpkv-{os.getpid()}-adopt0.shm")
    assert agreed_pool_path(os.path.join(shm_dir, "one.shm"), os.getpid(), "adopt0") is None
    maker = ShmPool(path, size, prefault=False)
    try:
        assert maker._prefault is None
        assert ShmPool.adopt(path, size + 4096) is None  # not the pool asked for
        link = os.path.join(shm_dir, f"hpkv-{os.getpid()}-link0.shm")
        os.symlink(path, link)
        assert ShmPool.adopt(link, size) is None
        adopted = ShmPool.adopt(path, size)
        assert adopted is not None and not adopted._owner
        maker.tensor[:8] = torch.arange(8, dtype=torch.uint8)
        assert bytes(adopted.view[:8]) == bytes(range(8))
        adopted.close()
        assert os.path.exists(path)  # only its maker removes it
    finally:
        maker.close()
    assert not os.path.exists(path)
    code = textwrap.dedent(f"""
        import os
        from hpkv.tiers.memory.pool import ShmPool
        ShmPool({path!r}, {size})
        os._exit(0)  # crash: the file stays, its lock is gone
    """)
    subprocess.run([sys.executable, "-c", code], check=True)
    assert os.path.exists(path)
    assert ShmPool.adopt(path, size) is None
    assert not os.path.exists(path)


def test_a_pool_made_in_this_process_is_adopted_through_its_own_mapping(shm_dir: str) -> None:
    """vLLM's single-GPU engine runs the worker that made the pool in the scheduler's process: the
    scheduler shares the worker's (page-locked) mapping instead of mapping and prefaulting it again,
    and letting go of either handle leaves the other's bytes readable."""
    size = 4 << 20
    path = agreed_pool_path(shm_dir, os.getpid(), "adopt1")
    assert path is not None
    maker = ShmPool(path, size, prefault=False)
    adopted = ShmPool.adopt(path, size)
    assert adopted is not None and adopted._mm is maker._mm and adopted._prefault is None
    assert not adopted._owner
    maker.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert bytes(adopted.view[:4]) == b"\x01\x02\x03\x04"
    adopted.close()
    assert bytes(maker.view[:4]) == b"\x01\x02\x03\x04" and os.path.exists(path)
    again = ShmPool.adopt(path, size)
    assert again is not None
    maker.close()  # the maker goes first: its file with it, the borrowed view stays valid
    assert not os.path.exists(path)
    assert bytes(again.view[:4]) == b"\x01\x02\x03\x04"
    again.close()
    assert ShmPool.adopt(path, size) is None
