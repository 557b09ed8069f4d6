"""What a first touch costs a read into shared memory: 16 reads of a 14 MiB file from the page cache
into a pool-like /dev/shm file, through a mapping whose pages are already faulted, then through a
second mapping of the same pages in the same process (what vLLM's single-GPU scheduler had before it
shared the worker's mapping), first and second time. Usage: python3 scripts/probe_fault.py"""

from __future__ import annotations

import mmap
import os
import tempfile
import time

N, K = 14 << 20, 16


def rate(fd: int, view: memoryview) -> float:
    t = time.perf_counter()
    for k in range(K):
        os.preadv(fd, [view[k * N : (k + 1) * N]], 0)
    return N * K / (time.perf_counter() - t) / 1e9


def main() -> None:
    with tempfile.NamedTemporaryFile() as src, tempfile.NamedTemporaryFile(dir="/dev/shm") as shm:
        src.write(os.urandom(N))
        src.flush()
        fd = src.fileno()
        os.pread(fd, N, 0)  # in the page cache
        os.posix_fallocate(shm.fileno(), 0, N * K)
        first = mmap.mmap(shm.fileno(), N * K)
        for i in range(0, N * K, mmap.PAGESIZE):
            first[i] = 1  # every page faulted in this mapping (the worker's, page-locked on CUDA)
        second = mmap.mmap(shm.fileno(), N * K)
        print(f"into the faulted mapping      {rate(fd, memoryview(first)):6.2f} GB/s")
        print(f"into a second mapping, first  {rate(fd, memoryview(second)):6.2f} GB/s")
        print(f"into a second mapping, again  {rate(fd, memoryview(second)):6.2f} GB/s")


if __name__ == "__main__":
    main()
