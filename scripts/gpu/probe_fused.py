"""Whether a storage read should check its record as the bytes land, not after: raw reads against
the two ways of reading and checking 32 records of the 7B shape (14 MiB) from the page cache.

* ``raw T``: each file read whole into its slot by T threads (the ttft bench's storage reference);
* ``split T+T``: the same reads, each record's xxh3 then computed on one of T other threads (what
  hpkv does today: the check reads the 14 MiB a second time, from DRAM);
* ``fused T P``: each file read in pieces of P bytes on T threads, each piece hashed (streaming
  xxh3) right after it lands, while it is still in the core's cache;
* ``... busy``: the same while another thread spins in Python (an engine thread on the GIL).

Rounds are interleaved; each line gives the median GB/s (min-max) and the ratio to ``raw`` of the
same thread count. Needs only xxhash::

    python3 scripts/gpu/probe_fused.py [ROUNDS]
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import xxhash

N, K = 14 << 20, 32


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    root = tempfile.mkdtemp(prefix="probe-fused-", dir=os.path.expanduser("~"))
    paths = [os.path.join(root, str(i)) for i in range(K)]
    for p in paths:
        with open(p, "wb") as f:
            f.write(os.urandom(N))
    mm = mmap.mmap(-1, N * K)
    view = memoryview(mm)
    for off in range(0, N * K, 4096):  # faulted, as the engine's pool is
        mm[off] = 0
    digests = []
    for p in paths:
        with open(p, "rb") as f:
            digests.append(xxhash.xxh3_64_intdigest(f.read()))

    def slot(i: int) -> memoryview:
        return view[i * N : (i + 1) * N]

    def read(i: int) -> int:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            return os.preadv(fd, [slot(i)], 0)
        finally:
            os.close(fd)

    def check(i: int) -> bool:
        return xxhash.xxh3_64_intdigest(slot(i)) == digests[i]

    def fused(i: int, piece: int) -> bool:
        fd = os.open(paths[i], os.O_RDONLY)
        h, buf, off = xxhash.xxh3_64(), slot(i), 0
        try:
            while off < N:
                n = os.preadv(fd, [buf[off : off + piece]], off)
                if not n:
                    break
                h.update(buf[off : off + n])
                off += n
        finally:
            os.close(fd)
        return h.intdigest() == digests[i]

    pools: dict[int, ThreadPoolExecutor] = {}

    def pool(n: int, tag: int = 0) -> ThreadPoolExecutor:
        return pools.setdefault(n * 10 + tag, ThreadPoolExecutor(n))

    def run_raw(t: int) -> Callable[[], None]:
        return lambda: list(pool(t).map(read, range(K)))

    def run_split(t: int) -> Callable[[], None]:
        def go() -> None:
            io, ver = pool(t), pool(t, 1)
            checks = []
            futs = [io.submit(read, i) for i in range(K)]
            for i, f in enumerate(futs):  # each check starts as its read ends, in order
                f.result()
                checks.append(ver.submit(check, i))
            assert all(c.result() for c in checks)

        return go

    def run_fused(t: int, piece: int) -> Callable[[], None]:
        return lambda: [None for ok in pool(t).map(lambda i: fused(i, piece), range(K)) if not ok and 1 / 0]

    def busy(fn: Callable[[], None]) -> Callable[[], None]:
        def go() -> None:
            stop = threading.Event()

            def spin() -> None:
                n = 0
                while not stop.is_set():
                    n += 1

            th = threading.Thread(target=spin)
            th.start()
            try:
                fn()
            finally:
                stop.set()
                th.join()

        return go

    cases: dict[str, tuple[int, Callable[[], None]]] = {}
    for t in (4, 8):
        cases[f"raw {t}"] = (t, run_raw(t))
        cases[f"split {t}+{t}"] = (t, run_split(t))
        for piece in (1 << 20, 2 << 20, 4 << 20):
            cases[f"fused {t} {piece >> 20}M"] = (t, run_fused(t, piece))
    cases["split 4+4 busy"] = (4, busy(run_split(4)))
    cases["fused 4 1M busy"] = (4, busy(run_fused(4, 1 << 20)))
    cases["fused 4 4M busy"] = (4, busy(run_fused(4, 4 << 20)))
    rates: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for _ in range(rounds):
            for name, (_, fn) in cases.items():
                t0 = time.perf_counter()
                fn()
                rates[name].append(N * K / (time.perf_counter() - t0) / 1e9)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cores = os.cpu_count()
    print(
        f"{K} records of {N >> 20} MiB from the page cache, {rounds} rounds, {cores} cores, "
        f"xxhash {xxhash.VERSION}"
    )
    for name, (t, _) in cases.items():
        r = rates[name]
        ref = statistics.median(rates[f"raw {t}"])
        med = statistics.median(r)
        print(f"{name:18s} {med:6.2f} GB/s ({min(r):.2f}-{max(r):.2f})  {med / ref:.2f}x raw {t}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
