"""hpkv's native data path (``records.c``, built by ``pip install .``): a batch of chunk records read
from their files and checked (header and xxh3) in one call that releases the GIL for the whole batch
and spreads it over threads of its own.

A record's checksum is xxh3-64 from the xxhash package's own library, bound here, so the records
Python seals (core/record.py) and the ones checked here agree by construction.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import xxhash._xxhash

import hpkv.native._records as _records

_records.bind_xxh3(xxhash._xxhash.__file__)

# Statuses past record.Verdict's seven (0..6, in its order): why nothing was checked.
NOT_FOUND, NOT_REGULAR, IO_ERROR, NOT_CACHED = 7, 8, 9, 10
# How a file is read.
BUFFERED, CACHED_ONLY, DIRECT = 0, 1, 2
# How it was read.
HOW_NONE, HOW_BUFFERED, HOW_CACHED, HOW_DIRECT, HOW_DIRECT_REFUSED = 0, 1, 2, 3, 4


class Job(NamedTuple):
    """One record to read: ``path`` (bytes) into ``buffers`` (writable, in order; the first holds at
    least the 64-byte header), ``record_bytes`` long, expected to carry ``namespace`` and ``key``
    in a header of ``version``; ``check_payload``: verify its xxh3 (a version-1 record)."""

    path: bytes
    buffers: Sequence[memoryview]
    record_bytes: int
    namespace: bytes
    key: bytes
    version: int
    check_payload: bool
    mode: int


class Read(NamedTuple):
    status: int  # a record.Verdict's index (0 = OK), or NOT_FOUND, NOT_REGULAR, IO_ERROR, NOT_CACHED
    nread: int  # bytes read (record_bytes + 1: the file is longer)
    inode: int
    errno: int  # with IO_ERROR
    how: int  # HOW_*


def read_records(jobs: Sequence[Job], threads: int = 1) -> list[Read]:
    """Read and check every job's record; one call for the batch, the GIL released throughout, up to
    ``threads`` threads. Never raises for a file: each job's status says what happened to it."""
    return [Read(*r) for r in _records.read_records(jobs, threads)]


def in_page_cache(path: str) -> bool:
    """Whether the whole file at ``path`` is in the page cache (False when it is not there, cannot
    be opened, or the kernel will not say). Starts no I/O; releases the GIL."""
    return bool(_records.in_page_cache(os.fsencode(path)))


def ask_cachestat(flag: bool) -> bool:
    """Ask the page cache with ``cachestat`` where the kernel has it (True) or with ``mincore`` on
    a mapping (False); returns the previous choice."""
    return bool(_records.ask_cachestat(flag))
