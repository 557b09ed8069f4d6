"""Tier throughput against references measured in the same run.

    python -m bench.tiers [--chunks 64] [--repeat 5] [--storage-dir DIR]

Chunks of 4 MiB (8 layers × 2 × 256 tokens × 4 KV heads × 128 × bf16):

* memory get / put   vs single-thread memcpy of the same bytes (ctypes.memmove)
* storage get        vs a raw parallel read of the same files (same threads, same O_DIRECT choice),
                       from the device (page cache dropped with posix_fadvise) and warm
* storage promote    the same files into pool slots, as a vLLM storage hit stages them, vs the
                       warm raw read
* lookup             per-chunk latency of ``KVStore.lookup`` (hit) over a whole prompt

Numbers are medians of ``--repeat`` runs; the machine is shared and noisy, so
read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from hpkv import HpkvConfig, KVLayout, KVStore
from hpkv.bench.refs import raw_read_gbps
from hpkv.core.units import format_size
from hpkv.engine.catalog import MEMORY, Catalog

LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)


def median_time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_parallel_read(paths: list[str], threads: int, direct: bool, bufs: list[memoryview]) -> None:
    """Read each of ``paths`` whole into its own buffer (page-aligned, touched by the caller
    beforehand, as the pool's slots are), ``threads`` at a time."""

    def read(i: int) -> int:
        fd = os.open(paths[i], os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            return os.preadv(fd, [bufs[i]], 0)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(read, range(len(paths))))


def touched_buffers(count: int, size: int) -> list[memoryview]:
    bufs = [memoryview(mmap.mmap(-1, size)) for _ in range(count)]
    for b in bufs:
        b[:: mmap.PAGESIZE] = bytes(len(b[:: mmap.PAGESIZE]))
    return bufs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.tiers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--chunks", type=int, default=64, help="chunks per prompt (default 64 = 256 MiB)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=4, help="storage I/O threads (ours and the raw reference)")
    ap.add_argument(
        "--storage-dir", default=None, help="directory for the storage tier (default: a temp dir)"
    )
    ap.add_argument(
        "--scan-files",
        type=int,
        default=0,
        help="also time the start-up index scan over this many chunk files (e.g. 100000)",
    )
    args = ap.parse_args(argv)

    torch.set_num_threads(1)  # compare single-threaded copies with single-threaded memcpy
    chunk = 256
    n = args.chunks
    payload = LAYOUT.chunk_bytes(chunk)
    total = payload * n
    toks = torch.randint(0, 150_000, (n * chunk,), generator=torch.Generator().manual_seed(1)).tolist()
    kv = (
        torch.randint(0, 256, (total,), dtype=torch.uint8)
        .view(torch.bfloat16)
        .view(LAYOUT.num_layers, 2, n * chunk, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    )
    gb = total / 1e9
    rows: list[tuple[str, float, float, str]] = []
    print(
        f"bench.tiers: {n} chunks × {format_size(payload)} = {format_size(total)}, "
        f"repeat {args.repeat}, {os.cpu_count()} CPUs, torch threads 1, storage threads {args.threads}"
    )

    shm = tempfile.mkdtemp(prefix="hpkv-bench-", dir="/dev/shm")
    st_root = args.storage_dir or tempfile.mkdtemp(prefix="hpkv-bench-st-", dir=os.path.expanduser("~"))
    try:
        # --- memory ---------------------------------------------------------
        cfg = HpkvConfig(
            mem_pool_size=int(total * 1.1) + (64 << 20), share_mem_file_path=shm, chunk_size=chunk
        )
        with KVStore(cfg, LAYOUT) as s:
            src = torch.empty(total, dtype=torch.uint8)
            dst = torch.empty(total, dtype=torch.uint8)
            src.copy_(kv.reshape(-1).view(torch.uint8))

            def memcpy() -> None:
                for i in range(n):
                    ctypes.memmove(dst.data_ptr() + i * payload, src.data_ptr() + i * payload, payload)

            memcpy()
            t_memcpy = median_time(memcpy, args.repeat)

            def put() -> None:
                s.clear()
                s.put(toks, kv)

            t_put = median_time(put, args.repeat)
            assert s.lookup(toks) == n * chunk
            prealloc = torch.empty_like(kv)
            prealloc.fill_(0)  # fault its pages in once, as an engine's KV buffer is
            t_get = median_time(lambda: s.get(toks, out=prealloc), args.repeat)
            t_get_fresh = median_time(lambda: s.get(toks), args.repeat)
            out = s.get(toks)
            assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8)), "memory get returned wrong bytes"
            t_look = median_time(lambda: s.lookup(toks), max(args.repeat, 20))
        rows.append(("memcpy (reference, 1 thread)", gb / t_memcpy, 1.0, ""))
        rows.append(
            ("memory get into a preallocated tensor", gb / t_get, t_memcpy / t_get, "target ≥ 0.80× memcpy")
        )
        rows.append(
            (
                "memory get into a new tensor",
                gb / t_get_fresh,
                t_memcpy / t_get_fresh,
                "pays first-touch page faults",
            )
        )
        rows.append(("memory put (copy + xxh3)", gb / t_put, t_memcpy / t_put, ""))

        # --- storage --------------------------------------------------------
        # O_DIRECT store vs O_DIRECT raw reads with the page cache dropped (the device),
        # buffered store vs buffered raw reads with the files cached (the page cache).
        def storage_config(mem_pool_size: int, o_direct: bool) -> HpkvConfig:
            return HpkvConfig(
                mem_pool_size=mem_pool_size,
                share_mem_file_path=shm,
                storage_path=st_root,
                chunk_size=chunk,
                storage_io_threads=args.threads,
                storage_o_direct=o_direct,
            )

        res: dict[str, float] = {}
        t_write = 0.0
        direct = False
        for label, o_direct in (("device", True), ("page cache", False)):
            with KVStore(storage_config(0, o_direct), LAYOUT) as s:
                if label == "device":
                    s.clear()
                    t0 = time.perf_counter()
                    s.put(toks, kv)
                    s.flush()
                    t_write = time.perf_counter() - t0
                assert s.storage is not None
                paths = [s.storage.path(s.record_key(k)) for k in s.keys(toks)]
                if label == "device":
                    direct = bool(s.storage.stats()["o_direct"])
                size = s.engine.slot_bytes
                prealloc = torch.empty_like(kv)
                prealloc.fill_(0)
                cold = label == "device"

                bufs = touched_buffers(len(paths), size)

                def raw(
                    cold: bool = cold,
                    paths: list[str] = paths,
                    bufs: list[memoryview] = bufs,
                    o_direct: bool = o_direct,
                ) -> None:
                    if cold:
                        drop_cache(paths)
                    raw_parallel_read(paths, args.threads, o_direct and cold, bufs)

                def ours(
                    cold: bool = cold, s: KVStore = s, out: torch.Tensor = prealloc, paths: list[str] = paths
                ) -> None:
                    if cold:
                        drop_cache(paths)
                    s.get(toks, out=out)

                raw()
                res[f"raw {label}"] = median_time(raw, args.repeat)
                res[f"ours {label}"] = median_time(ours, args.repeat)
                out = s.get(toks)
                assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8)), "storage get: wrong bytes"
        # --- promotion: what a vLLM storage hit does (into pool slots, checked on verify threads) ---
        with KVStore(storage_config(int(total * 1.1) + (64 << 20), False), LAYOUT) as s:
            engine, keys = s.engine, s.keys(toks)

            def promote(engine: Catalog = engine, keys: list[bytes] = keys) -> None:
                engine.clear((MEMORY,))
                futures = engine.stage(keys)
                wait(futures)
                assert all(f.result() for f in futures), "a promotion failed"

            promote()
            # Interleaved with the same reference as the ttft bench's storage row (buffers touched
            # before the timed read), round by round: this row's ratio is the rounds' median.
            ratios, times = [], []
            for _ in range(args.repeat):
                ref = raw_read_gbps(st_root, n, args.threads, cold=False, repeat=1)
                t0 = time.perf_counter()
                promote()
                times.append(time.perf_counter() - t0)
                ratios.append(gb / times[-1] / ref)
            res["promote"] = statistics.median(times)
            assert s.locate(toks) == [MEMORY] * n
            out = s.get(toks)
            assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8)), "promotion: wrong bytes"
        for label in ("device", "page cache"):
            raw_t, ours_t = res[f"raw {label}"], res[f"ours {label}"]
            mode = "O_DIRECT" if direct and label == "device" else "buffered"
            rows.append((f"raw parallel read, {label} (reference)", gb / raw_t, 1.0, mode))
            rows.append(
                (
                    f"storage get, {label} (read + verify + copy)",
                    gb / ours_t,
                    raw_t / ours_t,
                    f"{mode}; target ≥ 0.80× raw",
                )
            )
        rows.append(
            (
                "storage promote into pool slots, page cache",
                gb / res["promote"],
                statistics.median(ratios),
                f"vLLM's storage hit, vs a raw read of its files in each round "
                f"({min(ratios):.2f}-{max(ratios):.2f}×)",
            )
        )
        rows.append(("storage put (write-behind, until flushed)", gb / t_write, 0.0, ""))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if args.storage_dir is None:
            shutil.rmtree(st_root, ignore_errors=True)

    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure':<{width}}  {'GB/s':>7}  {'ratio':>6}  note")
    for name, rate, ratio, note in rows:
        r = f"{ratio:5.2f}×" if ratio else "     -"
        print(f"{name:<{width}}  {rate:7.2f}  {r}  {note}")
    print(f"\nlookup (hit, {n} chunks): {t_look / n * 1e6:.2f} µs per chunk (target < 20 µs)")
    if args.scan_files:
        scan_startup(args.scan_files)
    return 0


def scan_startup(count: int) -> None:
    """Time a new StorageTier's index scan over ``count`` chunk files (tiny files: the scan is stat-bound)."""
    from hpkv.tiers.disk import StorageTier

    root = tempfile.mkdtemp(prefix="hpkv-bench-scan-", dir=os.path.expanduser("~"))
    try:
        t = StorageTier(root, 1 << 50, 16, b"n" * 16)
        for i in range(count):
            with open(t.path(i.to_bytes(16, "big")), "wb") as f:
                f.write(b"x")
        t0 = time.perf_counter()
        t2 = StorageTier(root, 1 << 50, 16, b"n" * 16)
        dt = time.perf_counter() - t0
        print(
            f"start-up scan of {t2.scanned} chunk files: {dt:.2f} s "
            f"({dt / max(count, 1) * 1e6:.1f} µs per file)"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
