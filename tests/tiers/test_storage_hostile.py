"""The storage tier against what an attacker or an unlucky operator puts in its directory.

Real files, symlinks, FIFOs and sparse files under tmp_path; every test asserts the safe outcome:
the planted target untouched, the call returning within a bound, valid chunks kept.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from hpkv import HpkvConfig, HpkvConfigError
from hpkv.core import record
from hpkv.tiers.disk import StorageTier
from hpkv.tiers.memory.pool import ShmPool
from tests.tiers.test_storage import NS, PAYLOAD, buf, k, rec, tier


def returns_within(seconds: float, fn: object) -> object:
    """Run ``fn`` on a thread; fail if it does not return in ``seconds`` (a hang is the bug)."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)  # type: ignore[operator]
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"did not return within {seconds} s"
    return out[0]


def test_a_fifo_in_place_of_a_chunk_is_a_miss_at_once(storage_dir: str) -> None:
    t = tier(storage_dir)
    os.mkfifo(t.path(k(1)))
    assert not t.contains(k(1))
    assert returns_within(5, lambda: t.read_into(k(1), buf())) is False
    assert not os.path.exists(t.path(k(1)))  # the name is removed; a write can use it again
    assert t.write(k(1), rec(k(1), 1)) and t.read_into(k(1), buf())
    returns_within(5, t.close)


def test_a_symlink_at_a_chunk_name_is_not_followed(storage_dir: str, tmp_path: object) -> None:
    t = tier(storage_dir)
    target = os.path.join(str(tmp_path), "precious")
    with open(target, "wb") as f:
        f.write(bytes(rec(k(1), 7)))  # even a valid record behind a link is not served
    os.symlink(target, t.path(k(1)))
    assert not t.contains(k(1))
    assert not t.read_into(k(1), buf())
    assert t.write(k(2), rec(k(2), 2))
    os.symlink(target, t.path(k(3)))
    assert t.write(k(3), rec(k(3), 3))  # rename replaces the link, never writes through it
    assert not os.path.islink(t.path(k(3)))
    with open(target, "rb") as f:
        assert f.read() == bytes(rec(k(1), 7))


def test_temp_and_probe_names_cannot_be_planted(storage_dir: str, tmp_path: object) -> None:
    """The old names (.<chunk>.<pid>.<tid>.tmp, .probe.<pid>) were predictable; links planted there
    were followed. Now both are random and created O_EXCL|O_NOFOLLOW."""
    target = os.path.join(str(tmp_path), "victim")
    with open(target, "wb") as f:
        f.write(b"keep me")
    root = os.path.join(storage_dir, "v1")
    os.makedirs(root)
    os.symlink(target, os.path.join(root, f".probe.{os.getpid()}"))
    t = tier(storage_dir)
    sub = os.path.dirname(t.path(k(1)))
    name = f".{os.path.basename(t.path(k(1)))}.{os.getpid()}.{threading.get_ident()}.tmp"
    os.symlink(target, os.path.join(sub, name))
    assert t.write(k(1), rec(k(1), 1))
    with open(target, "rb") as f:
        assert f.read() == b"keep me"
    assert not os.path.islink(t.path(k(1)))


def test_one_absurd_file_does_not_evict_the_valid_chunks(storage_dir: str) -> None:
    t = tier(storage_dir, capacity=1 << 20)
    for i in range(5):
        assert t.write(k(i), rec(k(i), i))
    huge = t.path(k(99))
    with open(huge, "wb") as f:
        f.truncate(10 << 30)  # 10 GB, sparse, newest
    t2 = tier(storage_dir, capacity=1 << 20)
    assert t2.scanned == 5
    assert all(t2.read_into(k(i), buf()) for i in range(5))
    assert os.path.exists(huge)  # not ours to delete either: ignored, not counted
    assert t2.stats()["used_bytes"] == 5 * record.record_bytes(PAYLOAD)


def test_a_deleted_storage_dir_is_recreated_and_forgotten(storage_dir: str) -> None:
    t = tier(storage_dir)
    assert t.write(k(1), rec(k(1), 1))
    shutil.rmtree(storage_dir)
    assert t.write(k(2), rec(k(2), 2))  # recreated on the next write
    assert t.stats()["chunks"] == 1 and not t.contains(k(1))
    assert t.read_into(k(2), buf())


def test_a_directory_in_place_of_a_chunk(storage_dir: str) -> None:
    t = tier(storage_dir)
    os.mkdir(t.path(k(1)))
    assert not t.contains(k(1))
    start = time.monotonic()
    assert not t.read_into(k(1), buf())
    assert time.monotonic() - start < 5
    assert StorageTier(storage_dir, 1 << 30, PAYLOAD, NS).scanned == 0


def theirs(tmp_path: object) -> tuple[str, int]:
    """A directory another user owns: as root, one of ours given to uid 12345 (open to all); as
    anyone else, / (root's)."""
    if os.geteuid() != 0:
        return "/", 0
    d = os.path.join(str(tmp_path), "theirs")
    os.mkdir(d)
    os.chmod(d, 0o777)
    os.chown(d, 12345, 12345)
    return d, 12345


def test_a_directory_another_user_owns_is_refused(tmp_path: object) -> None:
    """Another user who owns or can write the storage directory can plant records with valid
    checksums; hpkv refuses to start on it rather than serve them (and creates nothing in it)."""
    d, uid = theirs(tmp_path)
    with pytest.raises(
        HpkvConfigError, match=rf"HPKV_KV_STORAGE_PATH=.*owned by uid {uid}.*e\.g\. ~/storage"
    ):
        tier(d)
    assert not os.path.exists(os.path.join(d, "v1"))
    with pytest.raises(HpkvConfigError, match=rf"HPKV_SHARE_MEM_FILE_PATH=.*owned by uid {uid}"):
        ShmPool(os.path.join(d, "pool.shm"), 1 << 20)


def test_a_directory_others_can_write_is_refused_a_trusted_group_is_allowed(tmp_path: object) -> None:
    d = os.path.join(str(tmp_path), "open")
    os.mkdir(d)
    os.chmod(d, 0o777)
    with pytest.raises(HpkvConfigError, match="writable by every user"):
        tier(d)
    os.chmod(d, 0o770)
    with pytest.raises(HpkvConfigError, match="HPKV_SHARED_GROUP=true"):
        tier(d)
    assert tier(d, shared_group=True).write(k(1), rec(k(1), 1))
    cfg = HpkvConfig.load(env={"HPKV_SHARED_GROUP": "true", "HPKV_KV_STORAGE_PATH": d})
    assert cfg.shared_group


def test_a_file_that_is_not_a_pool_is_never_deleted_as_stale(tmp_path: object) -> None:
    d = os.path.join(str(tmp_path), "shm")
    os.mkdir(d, 0o700)
    mine = os.path.join(d, "x.shm")
    with open(mine, "wb") as f:
        f.write(b"my notes")
    with pytest.raises(HpkvConfigError, match=r"HPKV_SHARE_MEM_FILE_PATH=.*already exists"):
        ShmPool(mine, 1 << 20)
    with open(mine, "rb") as f:
        assert f.read() == b"my notes"
    # A pool file of this size left by a crash (ours, unlocked) is reclaimed as before.
    left = os.path.join(d, "left.shm")
    with open(left, "wb") as f:
        f.truncate(1 << 20)
    p = ShmPool(left, 1 << 20)
    p.close()
    assert not os.path.exists(left)
