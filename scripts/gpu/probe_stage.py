"""What a vLLM storage hit's promotions cost, outside vLLM: hpkv's own staging against a raw read.

32 records of the 7B shape (14 MiB) are written to a storage directory and read back from the page
cache, interleaved round by round:

* ``raw T``: the files read whole by T threads (the ttft bench's storage reference);
* ``stage T/V``: ``Catalog.stage`` into pool slots with T I/O threads and V verify threads (0: each
  I/O thread checks its own reads);
* ``stage 4/V busy``: the first 4-thread staging while a Python thread spins, as an engine thread
  that holds the GIL would (``, 0.5 ms``: with the interpreter's switch interval at 0.5 ms instead
  of 5): how much the staging depends on getting the GIL back after each system call.

So the in-vLLM storage row can be told apart from what hpkv's code costs by itself::

    python3 scripts/gpu/probe_stage.py [ROUNDS]    (with hpkv importable: after scripts/gpu/install.sh)
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import wait

from bench.probe_records import stored_records

from hpkv.bench.refs import raw_read_gbps
from hpkv.engine.catalog import Catalog
from hpkv.engine.interface import MEMORY

CHUNKS = 32


def busy(fn: Callable[[], float], interval: float) -> float:
    """``fn()`` while another thread runs Python without pause, the switch interval ``interval``."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    before = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    t = threading.Thread(target=spin)
    t.start()
    try:
        return fn()
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(before)


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    cores = len(os.sched_getaffinity(0))
    with stored_records(CHUNKS, "probe-stage-") as rec:
        root, keys, gb = rec.root, rec.keys, CHUNKS * rec.payload / 1e9
        variants: dict[str, Callable[[], float]] = {}
        for threads, verify in ((4, 4), (4, 0), (8, 0), (8, 8)):
            if verify and threads + verify > 2 * cores:
                continue
            cat = rec.catalog(threads, verify)

            def stage(cat: Catalog = cat) -> float:
                cat.clear((MEMORY,))
                t0 = time.perf_counter()
                futures = cat.stage(keys)
                wait(futures)
                took = time.perf_counter() - t0
                assert all(f.result() for f in futures), "a promotion failed"
                return gb / took

            variants[f"stage {threads}/{verify}"] = stage
            if threads == 4 and not any(k.endswith("busy") for k in variants):
                variants[f"stage {threads}/{verify} busy"] = lambda stage=stage: busy(stage, 0.005)
                variants[f"stage {threads}/{verify} busy, 0.5 ms"] = lambda stage=stage: busy(stage, 0.0005)
        for threads in (4, 8):
            variants[f"raw {threads}"] = lambda t=threads: raw_read_gbps(
                root, CHUNKS, t, cold=False, repeat=1
            )
        for fn in variants.values():
            fn()
        rates: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                rates[name].append(fn())
        print(
            f"{os.uname().release}, {cores} cores; {CHUNKS} records of {rec.payload / 2**20:.1f} MiB, "
            f"{rounds} rounds"
        )
        for name, rs in rates.items():
            ref = statistics.median(rates["raw 8" if name.startswith(("stage 8", "raw 8")) else "raw 4"])
            m = statistics.median(rs)
            print(f"{name:24s} {m:6.2f} GB/s  {m / ref:4.2f}x raw  (rounds {min(rs):.2f}-{max(rs):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
