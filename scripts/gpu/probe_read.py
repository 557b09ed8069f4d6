"""Page-cache read rate into different kinds of destination memory, and with hpkv's page-cache question.

The storage row of ``bench ttft`` is set against a raw read of hpkv's files into anonymous buffers,
while hpkv reads into its pool (a shared-memory file). This probe reads the same 32 files of 14 MiB
(the 7B shape's chunk) into each kind, interleaved round by round, to see whether the kind of
destination moves the rate (transparent huge pages apply to anonymous memory, to shmem only when
``shmem_enabled`` allows)::

    python3 scripts/gpu/probe_read.py [DIR]      (with hpkv importable: after scripts/gpu/install.sh)
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from hpkv import native

FILES, SIZE, ROUNDS = 32, 14 << 20, 7


def _thp() -> str:
    out = []
    for name in ("enabled", "shmem_enabled", "defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
                out.append(f"{name}: {f.read().strip()}")
        except OSError as e:
            out.append(f"{name}: {e}")
    return "; ".join(out)


def _huge() -> str:
    with open("/proc/meminfo") as f:
        return " ".join(line.split(":")[0] + "=" + line.split()[1] for line in f if "HugePages:" in line)


def _cachestat(path: str) -> bool:
    """hpkv's page-cache question through cachestat (Linux 6.5+)."""
    native.ask_cachestat(True)
    return native.in_page_cache(path)


def _cached(path: str) -> bool:
    """hpkv's page-cache question through mincore on a mapping (its fallback)."""
    native.ask_cachestat(False)
    return native.in_page_cache(path)


def _dest(kind: str, shm_dir: str) -> list[memoryview]:
    bufs = []
    for i in range(FILES):
        if kind.startswith("anon"):
            mm = mmap.mmap(-1, SIZE)
            mm.madvise(mmap.MADV_NOHUGEPAGE if kind == "anon-nohuge" else mmap.MADV_HUGEPAGE)
        else:
            fd = os.open(os.path.join(shm_dir, f"d{i}"), os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, SIZE)
            mm = mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED)
            os.close(fd)
            mm.madvise(mmap.MADV_HUGEPAGE)
        mm.write(b"\1" * SIZE)  # touched, as the pool's slots are
        bufs.append(memoryview(mm))
    return bufs


def main() -> int:
    root = tempfile.mkdtemp(prefix="probe-read-", dir=sys.argv[1] if len(sys.argv) > 1 else None)
    shm = tempfile.mkdtemp(prefix="probe-read-", dir="/dev/shm")
    print(os.uname().release, os.cpu_count(), "cpus;", _thp())
    print("before:", _huge())
    files = []
    for i in range(FILES):
        p = os.path.join(root, f"f{i}")
        with open(p, "wb") as f:
            f.write(os.urandom(SIZE))
        files.append(p)
    kinds = ["anon", "anon-nohuge", "shm", "shm+mincore", "shm+cachestat"]
    dests = {k: _dest(k, shm) for k in kinds[:3]}
    dests["shm+mincore"] = dests["shm+cachestat"] = dests["shm"]
    print("after touching:", _huge())
    rates: dict[tuple[str, int], list[float]] = {}
    for threads in (4, 8):
        with ThreadPoolExecutor(threads) as pool:
            for r in range(ROUNDS):
                for k in kinds if r % 2 == 0 else reversed(kinds):
                    bufs = dests[k]

                    def read(i: int, bufs: list[memoryview] = bufs, k: str = k) -> int:
                        fd = os.open(files[i], os.O_RDONLY)
                        try:
                            if k == "shm+mincore":  # hpkv's fstat and page-cache question before the read
                                assert _cached(files[i])
                            elif k == "shm+cachestat":
                                assert _cachestat(files[i])
                            return os.preadv(fd, [bufs[i]], 0)
                        finally:
                            os.close(fd)

                    t0 = time.perf_counter()
                    n = sum(pool.map(read, range(FILES)))
                    rates.setdefault((k, threads), []).append(n / (time.perf_counter() - t0) / 1e9)
    for (k, threads), v in rates.items():
        print(
            f"{k:12} {threads} threads: median {statistics.median(v):6.2f} GB/s  ({min(v):.2f}-{max(v):.2f})"
        )
    for d in (root, shm):
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        os.rmdir(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
