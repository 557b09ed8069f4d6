"""Shared fixtures: real shared-memory directories, real storage directories, small layouts."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hpkv import HpkvConfig, KVLayout, KVStore

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
CHUNK = 16  # tokens per chunk in tests: small records, many chunks


@pytest.fixture(autouse=True)
def _no_hpkv_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests build their configs explicitly; a developer's exported HPKV_* must not leak in."""
    for var in list(os.environ):
        if var.startswith("HPKV_"):
            monkeypatch.delenv(var)


@pytest.fixture(scope="session", autouse=True)
def _stop_host_pools() -> Iterator[None]:
    """Host pools that stores in this process started stop with the session, not an hour later."""
    yield
    from hpkv.tiers.memory.hostslots import stop_spawned

    stop_spawned()


@pytest.fixture
def shm_dir() -> Iterator[str]:
    path = f"/dev/shm/hpkv-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def storage_dir(tmp_path: Any) -> str:
    return str(tmp_path / "storage")


def random_kv(layout: KVLayout, tokens: int, seed: int = 0) -> torch.Tensor:
    """KV with every bit pattern likely (random bytes reinterpreted), not just nice floats."""
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, layout.num_kv, tokens, layout.num_kv_heads, layout.head_dim)
    n = layout.dtype_size * int(torch.tensor(shape).prod())
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(layout.dtype).view(shape)


def random_tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randint(0, 150_000, (n,), generator=g).tolist()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact comparison (NaN payloads included), unlike torch.equal."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


StoreFactory = Callable[..., KVStore]


@pytest.fixture
def make_store(shm_dir: str, storage_dir: str) -> Iterator[StoreFactory]:
    """Build stores that are closed at the end of the test. Keywords go to HpkvConfig."""
    made: list[KVStore] = []

    def factory(
        layout: KVLayout = SMALL, model_id: str = "tiny", rank: int = 0, world_size: int = 1, **cfg: Any
    ) -> KVStore:
        cfg.setdefault("mem_pool_size", "8M")
        # Each store its own pool, empty at start: these tests are about the engine; the host pool
        # that engines share has its own (tests/tiers/test_host_pool.py).
        cfg.setdefault("memory_pool", "engine")
        cfg.setdefault("share_mem_file_path", shm_dir)
        cfg.setdefault("storage_path", storage_dir)
        cfg.setdefault("chunk_size", CHUNK)
        store = KVStore(HpkvConfig(**cfg), layout, model_id=model_id, rank=rank, world_size=world_size)
        made.append(store)
        return store

    yield factory
    for s in made:
        s.close()


@pytest.fixture
def small_tmpfs(tmp_path: Any) -> Iterator[str | None]:
    """A real 1 MiB tmpfs, or None where mounting is not permitted (tests then inject the fault)."""
    mnt = tmp_path / "tiny-tmpfs"
    mnt.mkdir()
    # mode=0700: a fresh tmpfs is world-writable (1777), which hpkv refuses for a storage directory.
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1M,mode=0700", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        yield None
        return
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# -- real valkey servers (one standalone server and one 3-primary cluster per session) --------


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[Any]:
    from hpkv.bench.valkey import ValkeyServers

    with ValkeyServers() as s:
        yield s


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[Any]:
    from hpkv.bench.valkey import ValkeyServers

    with ValkeyServers(cluster=3) as s:
        yield s


@pytest.fixture(autouse=True)
def _no_auth_key_left() -> Iterator[None]:
    """The record auth key is per process; a test that sets one must not leak it into the next."""
    yield
    from hpkv.core import record

    record.set_auth_key(None)
