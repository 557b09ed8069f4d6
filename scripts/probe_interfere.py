"""How much a storage hit's staging slows the engine's own thread, outside vLLM.

An "engine" thread dispatches small torch ops from Python (as vLLM's thread launches an eager
step's kernels) on a core of its own, while ``Catalog.stage`` promotes 64 records of the 7B
shape (14 MiB) from the page cache on the other cores, over and over, for the same window.
Variants, rounds interleaved:

* ``T/V``: T I/O threads, V verify threads (0: each I/O thread checks its own reads);
* ``4/4, busy 1``: 4 + 4 threads with ``HPKV_BUSY_IO_THREADS=1`` and a computing step out (the
  engine busy): one promotion reads at a time and checks its own read;
* ``child 4/4``: the same 4 + 4 threads' work in a child process (a catalog of its own over the
  same records, its own GIL): what staging would cost the engine's thread if the promotions left
  the engine's process. The child is told the records as JSON on stdin and reports its rate on
  stdout.

Printed: the engine thread's time for 2000 ops (mean over the window) against the same with
nothing staging, and the staging rate. The threads share no core with the engine thread, so what
slows it is the GIL: each reading thread takes it back after every read::

    python3 scripts/probe_interfere.py [ROUNDS]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import wait

import torch

from hpkv import HpkvConfig
from hpkv.bench.probe_records import LAYOUT, Stored, stored_records
from hpkv.core.keys import Namespace
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


def stage_for(cat: Catalog, keys: list[bytes], payload: int) -> float:
    """Promote ``keys`` over and over for the window; the staging rate in GB/s."""
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < WINDOW_S:
        cat.clear((MEMORY,))
        futures = cat.stage(keys)
        wait(futures)
        assert all(f.result() for f in futures), "a promotion failed"
        n += 1
    return n * len(keys) * payload / 1e9 / (time.perf_counter() - t0)


def child() -> int:
    """``--child``: a catalog over the parent's records; stages for a window per "go" line."""
    spec = json.loads(sys.stdin.readline())
    os.sched_setaffinity(0, set(spec["cores"]))
    ns = Namespace(spec["model_id"], LAYOUT, spec["chunk"], salt=spec["salt"])
    cfg = HpkvConfig(**spec["config"])
    cat = Catalog(cfg, ns, verify_threads=spec["verify"])
    keys = [bytes.fromhex(k) for k in spec["keys"]]
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        print(json.dumps(stage_for(cat, keys, spec["payload"])), flush=True)
    cat.close()
    return 0


class Child:
    """A child process staging the records (see :func:`child`), started once, run per window."""

    def __init__(self, r: Stored, threads: int, verify: int, cores: set[int]) -> None:
        cfg = r.config(threads)
        spec = {
            "cores": sorted(cores),
            "model_id": r.namespace.model_id,
            "chunk": r.namespace.chunk_size,
            "salt": r.namespace.salt,
            "verify": verify,
            "payload": r.payload,
            "keys": [k.hex() for k in r.keys],
            "config": {
                k: getattr(cfg, k)
                for k in (
                    "mem_pool_size",
                    "share_mem_file_path",
                    "storage_path",
                    "chunk_size",
                    "storage_io_threads",
                )
            },
        }
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit("the child process did not start")

    def __call__(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def main() -> int:
    if sys.argv[1:] == ["--child"]:
        return child()
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
                return stage_for(cat, rec.keys, rec.payload)

            variants[f"{threads}/{verify}" + (f", busy {busy}" if busy else "")] = stage
        kid = Child(rec, 4, 4, rest)
        variants["child 4/4"] = kid
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
        kid.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
