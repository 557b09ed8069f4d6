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
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import wait

import torch

from hpkv import HpkvConfig, KVStore
from hpkv.bench.refs import raw_read_gbps
from hpkv.core.layout import KVLayout
from hpkv.engine.catalog import MEMORY, Catalog

CHUNKS, CHUNK = 32, 256
LAYOUT = KVLayout(num_layers=28, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)  # Qwen2-7B's KV


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
    root = tempfile.mkdtemp(prefix="probe-stage-", dir=os.path.expanduser("~"))
    shm = tempfile.mkdtemp(prefix="probe-stage-", dir="/dev/shm")
    payload = LAYOUT.chunk_bytes(CHUNK)
    gb = CHUNKS * payload / 1e9
    toks = list(range(CHUNKS * CHUNK))
    kv = torch.randint(0, 256, (CHUNKS * payload,), dtype=torch.uint8).view(torch.bfloat16)
    kv = kv.view(LAYOUT.num_layers, 2, CHUNKS * CHUNK, LAYOUT.num_kv_heads, LAYOUT.head_dim)

    def config(threads: int) -> HpkvConfig:
        return HpkvConfig(
            mem_pool_size=int(CHUNKS * payload * 1.2) + (64 << 20),
            share_mem_file_path=shm,
            storage_path=root,
            chunk_size=CHUNK,
            storage_io_threads=threads,
        )

    cats: list[Catalog] = []
    try:
        with KVStore(config(4), LAYOUT) as s:
            s.put(toks, kv)
            s.flush()
            namespace, keys = s.namespace, s.keys(toks)
        variants: dict[str, Callable[[], float]] = {}
        for threads, verify in ((4, 4), (4, 0), (8, 0), (8, 8)):
            if verify and threads + verify > 2 * cores:
                continue
            cat = Catalog(config(threads), namespace, verify_threads=verify)
            cats.append(cat)

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
            f"{os.uname().release}, {cores} cores; {CHUNKS} records of {payload / 2**20:.1f} MiB, "
            f"{rounds} rounds"
        )
        for name, rs in rates.items():
            ref = statistics.median(rates["raw 8" if name.startswith(("stage 8", "raw 8")) else "raw 4"])
            m = statistics.median(rs)
            print(f"{name:24s} {m:6.2f} GB/s  {m / ref:4.2f}x raw  (rounds {min(rs):.2f}-{max(rs):.2f})")
    finally:
        for cat in cats:
            cat.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
