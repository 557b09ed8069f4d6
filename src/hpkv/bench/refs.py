"""References for the TTFT benchmark's load rates, measured in the same run on the same data:
pinned host-to-GPU copies on a GPU, else single-thread memcpy (memory), raw reads of the storage
tier's files (buffered from the page cache, or O_DIRECT after dropping them from it), a raw GLIDE
GET loop over the valkey tier's keys."""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


def memcpy_gbps(nbytes: int, repeat: int = 5) -> float:
    """Single-thread memcpy of ``nbytes`` (the reference for the memory tier's load rate)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def h2d_gbps(nbytes: int, repeat: int = 10) -> float:
    """Pinned host memory to the GPU, ``nbytes`` in one copy, timed with CUDA events: the memory
    tier's reference on a GPU (the link a hit's bytes must cross). Median over ``repeat``."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)  # first touch
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        began = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        ended = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        began.record()
        dst.copy_(src, non_blocking=True)
        ended.record()
        ended.synchronize()
        times.append(began.elapsed_time(ended) / 1e3)
    del src, dst
    return float(nbytes / statistics.median(times) / 1e9)


def memory_reference(nbytes: int) -> tuple[str, float]:
    """The memory tier's reference for a hit of ``nbytes``: pinned H2D where the engine has a CUDA GPU,
    else single-thread memcpy (the CPU build: a hit is a copy within host memory)."""
    if torch.cuda.is_available():
        return "pinned host-to-GPU copy of one prompt's KV (CUDA events)", h2d_gbps(nbytes)
    return "single-thread memcpy of one prompt's KV", memcpy_gbps(nbytes)


def drop_page_cache(root: str) -> int:
    """Drop every file under ``root`` from the page cache (written back first); returns the count."""
    return drop_files(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def warm_page_cache(root: str) -> int:
    """Read every file under ``root`` once, buffered, so the page cache holds it whole (a read
    with O_DIRECT, as of a dropped file, leaves it out); returns the count."""
    buf = bytearray(2**20)
    n = 0
    for d, _, fs in os.walk(root):
        for f in fs:
            try:
                with open(os.path.join(d, f), "rb", buffering=0) as fh:
                    while fh.readinto(buf):
                        pass
                n += 1
            except OSError:
                continue
    return n


def drop_files(paths: Iterable[str]) -> int:
    """Drop these files from the page cache (written back first); returns how many were dropped."""
    n = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


def raw_read_gbps(root: str, count: int, threads: int, *, cold: bool, repeat: int = 3) -> float:
    """Read ``count`` of the files under ``root`` whole, ``threads`` at a time: buffered from the page
    cache (read once first), or with O_DIRECT after dropping them from it. Median GB/s."""
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if not f.startswith("."))[
        :count
    ]
    if not files:
        raise RuntimeError(f"no files under {root}")
    size = max(os.path.getsize(f) for f in files)
    bufs = [memoryview(mmap.mmap(-1, -(-size // 4096) * 4096)) for _ in files]
    flags = os.O_RDONLY | (os.O_DIRECT if cold else 0)

    def read(i: int) -> int:
        fd = os.open(files[i], flags)
        try:
            return os.preadv(fd, [bufs[i]], 0)
        finally:
            os.close(fd)

    rates = []
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, range(len(files))))  # touch the buffers; warm the page cache
        for _ in range(repeat):
            if cold:
                drop_files(files)  # only the files it reads, not the whole tier
            t0 = time.perf_counter()
            total = sum(pool.map(read, range(len(files))))
            rates.append(total / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def raw_glide_gbps(
    valkey: Any, count: int, workers: int, repeat: int = 3, nodes: tuple[tuple[str, int], ...] | None = None
) -> float:
    """GET ``count`` of the server's hpkv keys into preallocated buffers with GLIDE, one client per
    thread (the loop hpkv's tier is built on, without its queue and checks). Median GB/s.
    ``nodes``: reach the server there instead (a proxy in front of it)."""
    import mmap

    from hpkv.bench.valkey_tier import raw_glide_loop

    conn = valkey.admin(0)
    try:
        keys: list[Any] = []
        cursor: Any = b"0"
        while len(keys) < count:
            cursor, page = conn.command("SCAN", cursor, "MATCH", "hpkv:*", "COUNT", "1000")
            keys += list(page)
            if int(cursor) == 0:
                break
        keys = keys[:count]
        if not keys:
            raise RuntimeError("no hpkv keys in the valkey server")
        size = max(int(conn.command("STRLEN", k)) for k in keys)
    finally:
        conn.close()
    bufs = [memoryview(mmap.mmap(-1, size)) for _ in keys]
    nodes = nodes or tuple(("127.0.0.1", n.port) for n in valkey.nodes)
    run = raw_glide_loop(nodes, [bytes(k) for k in keys], bufs, workers, size)
    rates = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        rates.append(len(keys) * size / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)
