"""What a lookup costs on the host pool against an engine's own pool, with 1, 2, 4 and 8 engines.

    python -m bench.pool [--engines 1,2,4,8] [--seconds 3] [--chunks 32]

A lookup here is what a memory hit of a prompt of ``--chunks`` chunks asks of the pool's
bookkeeping: pin the chunks, then unpin them when the load is done (two requests to the pool
process; two lock-held calls on an engine's own pool). Every engine is a process of its own looping
for ``--seconds`` over the same resident chunks. Printed per engine count: the median microseconds
per lookup across engines (and the slowest engine's), and lookups per second of all engines
together, for both kinds of pool. The bytes are not copied: that cost is the same for both.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from hpkv.core.config import HpkvConfig
from hpkv.tiers.memory.bookkeeping import MemorySlots
from hpkv.tiers.memory.hostslots import HostSlots, stop_pool

SLOT = 1 << 16
GROUP = "bench0pool"


def keys(n: int) -> list[bytes]:
    return [i.to_bytes(16, "big") for i in range(n)]


def fill(m: Any, ks: list[bytes]) -> None:
    for k in ks:
        slot = m.reserve()
        assert slot is not None
        assert m.commit(slot, k, keep_pin=False)


def loop(m: Any, ks: list[bytes], seconds: float) -> tuple[int, float]:
    n, t0 = 0, time.perf_counter()
    until = t0 + seconds
    while time.perf_counter() < until:
        slots = m.pin(ks)
        assert len(slots) == len(ks)
        m.unpin(slots)
        n += 1
    return n, time.perf_counter() - t0


def engine(kind: str, cfg: HpkvConfig, chunks: int, seconds: float, start: Any, out: Any) -> None:
    ks = keys(chunks)
    if kind == "host":
        m: Any = HostSlots(cfg, GROUP, 1, SLOT, cfg.mem_pool_size)
    else:
        m = MemorySlots(cfg.mem_pool_size // SLOT)
        fill(m, ks)
    start.wait()
    out.put(loop(m, ks, seconds))
    if kind == "host":
        m.close()


def run(kind: str, engines: int, cfg: HpkvConfig, chunks: int, seconds: float) -> tuple[list[float], float]:
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=engine, args=(kind, cfg, chunks, seconds, start, out)) for _ in range(engines)
    ]
    for p in procs:
        p.start()
    time.sleep(0.5)  # every engine connected
    start.set()
    got = [out.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join()
    per = [t / n * 1e6 for n, t in got]
    rate = sum(n / t for n, t in got)
    return per, rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="1,2,4,8")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--chunks", type=int, default=32, help="chunks per lookup (32: an 8192-token prompt)")
    args = ap.parse_args(argv)
    d = tempfile.mkdtemp(prefix="hpkv-bench-pool-", dir="/dev/shm")
    cfg = HpkvConfig(mem_pool_size=4096 * SLOT, share_mem_file_path=d, pool_idle_timeout=60)
    try:
        seed = HostSlots(cfg, GROUP, 1, SLOT, cfg.mem_pool_size)
        fill(seed, keys(args.chunks))
        seed.close()
        cores = len(os.sched_getaffinity(0))
        print(f"lookup = pin + unpin of {args.chunks} chunks; {cores} cores; {args.seconds:g} s per engine")
        print(f"{'engines':>8} {'pool':>7} {'us/lookup':>10} {'slowest':>9} {'lookups/s':>10}")
        for n in [int(x) for x in args.engines.split(",")]:
            for kind in ("engine", "host"):  # interleaved, same engines, same keys
                per, rate = run(kind, n, cfg, args.chunks, args.seconds)
                print(
                    f"{n:>8} {kind:>7} {statistics.median(per):>10.1f} {max(per):>9.1f} {rate:>10.0f}",
                    flush=True,
                )
    finally:
        stop_pool(d)
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
