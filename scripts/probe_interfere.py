"""How much a storage hit's staging slows the engine's own thread, outside vLLM.

An "engine" thread dispatches small torch ops from Python (as vLLM's thread launches an eager
step's kernels) on a core of its own, while ``Catalog.stage`` promotes 64 records of the 7B
shape (14 MiB) from the page cache on the other cores, over and over, for the same window.
Variants, rounds interleaved:

* ``T/V``: T I/O threads, V verify threads (0: each I/O thread checks its own reads);
* ``4/4, busy 1``: 4 + 4 threads with ``HPKV_BUSY_IO_THREADS=1`` and a computing step out (the
  engine busy): one promotion reads at a time and checks its own read.

Printed: the engine thread's time for 2000 ops (mean over the window) against the same with
nothing staging, and the staging rate. The threads share no core with the engine thread, so what
slows it is the GIL: each reading thread takes it back after every read::

    python3 scripts/probe_interfere.py [ROUNDS]
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import wait

import torch

from hpkv.bench.probe_records import stored_records
from hpkv.engine.catalog import MEMORY, Catalog

CHUNKS = 64
WINDOW_S = 0.25
OPS = 2000


def engine_during(stage: Callable[[], float] | None, engine_core: int) -> tuple[float, float]:
    """The engine thread's mean time for OPS ops over the window, and the staging rate."""
    a, b = torch.ones(8), torch.ones(8)
    took: list[float] = []
    go = threading.Event()

    def engine() -> None:
        os.sched_setaffinity(0, {engine_core})
        go.wait()
        end = time.perf_counter() + WINDOW_S
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            for _ in range(OPS):
                torch.add(a, b)
            took.append(time.perf_counter() - t0)

    th = threading.Thread(target=engine)
    th.start()
    time.sleep(0.05)
    go.set()
    rate = stage() if stage is not None else (time.sleep(WINDOW_S) or 0.0)
    th.join()
    return statistics.mean(took), rate


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: one for the engine thread, the rest for the staging")
    engine_core, rest = cores[0], set(cores[1:])
    os.sched_setaffinity(0, rest)  # this thread, and the threads it starts (the catalogs' pools)
    torch.set_num_threads(1)
    with stored_records(CHUNKS, "probe-interfere-") as rec:
        variants: dict[str, Callable[[], float] | None] = {"nothing staging": None}
        for threads, verify, busy in ((4, 4, 0), (4, 0, 0), (2, 0, 0), (1, 0, 0), (4, 4, 1)):
            cat = rec.catalog(threads, verify, busy_io_threads=busy)
            if busy:
                cat.step_scheduled(True)  # a computing step out, never answered here

            def stage(cat: Catalog = cat) -> float:
                t0 = time.perf_counter()
                n = 0
                while time.perf_counter() - t0 < WINDOW_S:
                    cat.clear((MEMORY,))
                    futures = cat.stage(rec.keys)
                    wait(futures)
                    assert all(f.result() for f in futures), "a promotion failed"
                    n += 1
                return n * CHUNKS * rec.payload / 1e9 / (time.perf_counter() - t0)

            variants[f"{threads}/{verify}" + (f", busy {busy}" if busy else "")] = stage
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                results[name].append(engine_during(fn, engine_core))
        base = statistics.median(t for t, _ in results["nothing staging"])
        print(
            f"{os.uname().release}, {len(cores)} cores (engine thread on core {engine_core}); "
            f"{CHUNKS} records of {rec.payload / 2**20:.1f} MiB from the page cache; {rounds} rounds"
        )
        for name, rs in results.items():
            t = statistics.median(x for x, _ in rs)
            spread = f"{min(x for x, _ in rs) / base:.2f}-{max(x for x, _ in rs) / base:.2f}"
            rate = statistics.median(r for _, r in rs)
            print(
                f"{name:16s} engine {OPS} ops {t * 1e3:6.2f} ms = {t / base:4.2f}x (rounds {spread})"
                f"  staging {rate:5.2f} GB/s"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
