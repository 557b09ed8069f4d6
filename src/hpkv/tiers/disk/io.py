"""File system calls of the storage tier: atomic writes, aligned direct reads.

Crash safety: a record is written to a temporary file in the same directory
and renamed into place, so a reader sees either no file or a whole one; a
torn write is never visible. No fsync: after a power loss a renamed file may
be empty or hold garbage, which the record checksum turns into a miss.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
from collections.abc import Sequence

from hpkv import native
from hpkv.core import record

PAGE = 4096  # O_DIRECT alignment of offsets (buffers come page-aligned from mmap)

# Errors that mean "this chunk could not be written/read", not "hpkv is broken".
SOFT_ERRNOS = {
    errno.ENOSPC,
    errno.EIO,
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.EDQUOT,
    errno.ENOENT,
    errno.ESTALE,
    errno.EINVAL,
}


# Creating a file hpkv writes: never through a symlink planted at its name.
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


def create_exclusive(directory: str, prefix: str) -> tuple[int, str]:
    """A new file of mode 0600 under a random name in ``directory``: O_EXCL, so a file or symlink
    someone planted at the name is never opened or followed. Returns (fd, path)."""
    for _ in range(16):
        path = os.path.join(directory, f"{prefix}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(path, CREATE_FLAGS, 0o600), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", directory)


def write_atomic(path: str, data: memoryview, direct: bool = False) -> bool:
    """Write ``data`` to ``path`` through a new temp file (random name, O_EXCL|O_NOFOLLOW, mode
    0600) renamed into place (rename replaces a symlink at ``path``, never writes through it).

    ``direct``: the whole pages of a page-aligned ``data`` go with O_DIRECT (no page-cache copy),
    the last partial page buffered. Returns whether O_DIRECT was used: False when ``data`` is not
    page-aligned or the file system refuses O_DIRECT (the write is then buffered, whole).
    Raises OSError."""
    fd, tmp = create_exclusive(os.path.dirname(path), f".{os.path.basename(path)}")
    try:
        direct_bytes = done = _write_direct(fd, data) if direct else 0
        view = data[done:]
        while view:
            n = os.pwrite(fd, view, done)
            view = view[n:]
            done += n
        os.close(fd)
        fd = -1
        os.rename(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return direct_bytes > 0


_direct_ok = True  # until a file system refuses O_DIRECT writes (then buffered for good)


def _write_direct(fd: int, data: memoryview) -> int:
    """Write the whole pages of ``data`` at offset 0 of ``fd`` with O_DIRECT (set on the descriptor
    for these writes only). Returns the bytes written: 0 when ``data`` is not page-aligned or
    shorter than a page, or when the file system refuses O_DIRECT."""
    global _direct_ok
    body = len(data) // PAGE * PAGE
    if not _direct_ok or not body or not hasattr(os, "O_DIRECT") or _address(data) % PAGE:
        return 0
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        _direct_ok = False  # e.g. an older tmpfs
        return 0
    done = 0
    try:
        while done < body:
            try:
                n = os.pwrite(fd, data[done:body], done)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                break  # an alignment this device will not take: the rest goes buffered
            if n <= 0:
                break
            done += n
            if n % PAGE:
                break  # a short direct write: the rest goes buffered from ``done``
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return done


def _address(data: memoryview) -> int:
    """The address of ``data``'s first byte, or 1 (never aligned) when it cannot be had without a
    copy (a read-only or non-contiguous buffer)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(data))
    except (TypeError, ValueError):
        return 1


class Reader:
    """Reads whole chunk files into caller buffers and checks them, a batch in one native call
    (hpkv.native): from the page cache when the file is there, else with O_DIRECT where it works.

    A chunk written recently (or read by another engine) is usually still in the
    page cache, where a buffered read runs at memory speed; one that is not
    should come straight from the device without filling the page cache a
    second time (the pool already holds the bytes). So a read first asks the
    kernel whether every page of the file is cached (``cachestat``, else
    ``mincore`` on a mapping: neither starts I/O) and reads buffered if so, else
    with O_DIRECT. O_DIRECT needs page-aligned buffers: a record read into one
    buffer from ``mmap`` (the pool's slots, scratch buffers) has one; a record
    read in pieces is read buffered. If a file system refuses O_DIRECT, this
    reads buffered for good and says so through ``direct``.
    """

    def __init__(self, o_direct: bool) -> None:
        self.direct = o_direct and hasattr(os, "O_DIRECT")
        self.cached_reads = 0  # reads served whole from the page cache (tests, benchmarks)

    def read(
        self,
        jobs: Sequence[tuple[str, Sequence[memoryview], bytes]],
        record_bytes: int,
        namespace: bytes,
        *,
        cached_only: bool = False,
        threads: int = 1,
    ) -> list[native.Read]:
        """Each job ``(path, buffers, key)``: the record at ``path`` into ``buffers`` (in order; the
        first holds the header), checked against ``namespace``, ``key`` and ``record_bytes`` (and
        its xxh3; a MAC'd record's MAC is the caller's to check). ``cached_only``: where reads
        would go to the device, a file not whole in the page cache is not read
        (``native.NOT_CACHED``). One call for the batch, over up to ``threads`` threads."""
        auth = record.current_auth_key() is not None
        version = record.RECORD_VERSION_MAC if auth else record.RECORD_VERSION
        mode = native.BUFFERED if not self.direct else native.CACHED_ONLY if cached_only else native.DIRECT
        reads = native.read_records(
            [
                native.Job(os.fsencode(path), bufs, record_bytes, namespace, key, version, not auth, mode)
                for path, bufs, key in jobs
            ],
            threads,
        )
        for r in reads:
            if r.how == native.HOW_CACHED:
                self.cached_reads += 1
            elif r.how == native.HOW_DIRECT_REFUSED:
                self.direct = False
        return reads
