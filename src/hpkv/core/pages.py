"""Reading a shared mapping's pages ahead of use, off the hot path: the engine's mapping of its pool
(:class:`hpkv.tiers.memory.pool.ShmPool`). Needs no torch."""

from __future__ import annotations

import mmap
import threading

import numpy as np

from hpkv.core.procs import background_priority, name_os_thread

PAGE = mmap.PAGESIZE
PREFAULT_NICE = 19  # the read-ahead yields the CPU to everything else (the model's threads on a CPU build)


def read_ahead(buf: mmap.mmap, size: int, stop: threading.Event | None = None) -> None:
    """Read one byte of every page of ``buf[:size]``, once, on the calling thread at the lowest
    priority; stops early when ``stop`` is set.

    tmpfs hands out fallocated pages zeroed on their first fault, and every other process that maps
    the file faults each page into its own tables again; in a VM with nested paging that costs up
    to ~10 us per 4 KiB page the first time the VM uses it and ~2 us in a second process, so the
    first store into each slot would pay it on the hot path (the engine's step, a promotion's
    read). Reading ahead of use moves that cost away; numpy's sum releases the
    GIL. At the lowest priority because a 2 GiB pool is 0.5 million faults, seconds of one core on a
    fresh VM, and at the default priority they were taken from the model right after a start (vLLM's
    CPU build)."""
    name_os_thread()
    background_priority(PREFAULT_NICE)
    pages = np.frombuffer(buf, dtype=np.uint8, count=size - size % PAGE)[::PAGE]
    per_step = (64 << 20) // PAGE
    for i in range(0, len(pages), per_step):
        if stop is not None and stop.is_set():
            return
        int(pages[i : i + per_step].sum())
