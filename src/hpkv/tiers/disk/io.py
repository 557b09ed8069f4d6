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
import mmap
import os
import secrets
from collections.abc import Callable
from typing import Any

from hpkv.core.paths import open_regular

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
    """Reads whole chunk files into caller buffers: from the page cache when the file is there,
    else with O_DIRECT where it works.

    A chunk written recently (or read by another engine) is usually still in the
    page cache, where a buffered read runs at memory speed; one that is not
    should come straight from the device without filling the page cache a
    second time (the pool already holds the bytes). So a read first asks the
    kernel whether every page of the file is cached (``cachestat``, else
    ``mincore`` on a mapping: neither starts I/O; ``RWF_NOWAIT`` would start readahead) and
    reads buffered if so, else with O_DIRECT. O_DIRECT needs page-aligned
    buffers and lengths; callers pass buffers from ``mmap`` (the pool's slots
    or scratch buffers), which are page-aligned, of a page-rounded length. If a
    file system refuses O_DIRECT, this falls back to buffered reads for good
    and says so once through ``direct``.
    """

    def __init__(self, o_direct: bool) -> None:
        self.direct = o_direct and hasattr(os, "O_DIRECT")
        self.cached_reads = 0  # reads served whole from the page cache (tests, benchmarks)

    def read(self, path: str, buf: memoryview, expected: int) -> tuple[int, int]:
        """Read up to ``len(buf)`` bytes of ``path`` into ``buf``.

        Returns ``(bytes read, inode)``; a file longer than ``expected`` is
        reported as ``expected + 1`` bytes so the caller sees a length mismatch
        without reading it all. Raises OSError (FileNotFoundError when absent).
        """
        fd = open_regular(path, follow=False)  # a FIFO, link or directory there: NotARegularFile
        try:
            st = os.fstat(fd)
            if st.st_size > expected:
                return expected + 1, st.st_ino
            if not st.st_size:
                return 0, st.st_ino
            total = 0
            if self.direct and _all_cached(fd, st.st_size):
                self.cached_reads += 1
            elif self.direct:
                dfd = self._open_direct(path)
                if dfd >= 0:
                    try:
                        total = os.preadv(dfd, [buf], 0)
                    finally:
                        os.close(dfd)
            # Buffered: no O_DIRECT here, or a short direct read (it needs aligned offsets).
            while total < st.st_size:
                n = os.preadv(fd, [buf[total:]], total)
                if not n:
                    break
                total += n
            return total, st.st_ino
        finally:
            os.close(fd)

    def read_cached(
        self, path: str, bufs: list[memoryview], size: int, check: Callable[[int], bool]
    ) -> tuple[bool, int] | None:
        """Read ``path`` into ``bufs`` (in order, together ``size`` bytes) in one call if the file
        reads at memory speed (whole in the page cache, or no O_DIRECT here), then ``check(bytes
        read)`` (``size + 1``: the file is longer). Returns ``(checked, inode)`` (the inode only
        when the check failed, else 0), or None: not read (not cached, not a regular file, an
        error), for :meth:`read` to deal with. Each system call is a round trip for Python's GIL,
        which a busy engine thread holds up to its switch interval each time, so there are as few
        as can be: open, ask the page cache, one vectored read, close."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            if self.direct:
                if not _all_cached(fd, size):
                    return None
                self.cached_reads += 1
            n = os.preadv(fd, [*bufs, _ONE_MORE], 0)
            if check(n):
                return True, 0
            return False, os.fstat(fd).st_ino
        except OSError:  # a directory, a FIFO: read() tells what it is
            return None
        finally:
            os.close(fd)

    def _open_direct(self, path: str) -> int:
        """An O_DIRECT descriptor, or -1 when this file system has none (then never again)."""
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.direct = False
            return -1


_ONE_MORE = memoryview(bytearray(1))  # past a record's end: a longer file shows as one byte more (never read)
_libc: Any = None
_CACHESTAT = 451  # cachestat(2), Linux 6.5+: one number on every architecture (the unified table)
_cachestat_works = True  # until a call says the kernel (or a seccomp filter) has no such call


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.mmap.restype = ctypes.c_void_p
            _libc.mmap.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_long,
            ]
            _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
            _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            _libc.syscall.restype = ctypes.c_long
        except (OSError, AttributeError):
            _libc = False
    return _libc


def in_page_cache(path: str) -> bool:
    """Whether the whole file at ``path`` is in the page cache (False when it is not there, cannot
    be opened, or the kernel will not say). Starts no I/O."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return _all_cached(fd, os.fstat(fd).st_size)
    except OSError:
        return False
    finally:
        os.close(fd)


def _all_cached(fd: int, size: int) -> bool:
    """Whether every page of the file's first ``size`` bytes is in the page cache (False when the
    kernel will not say). Asks ``cachestat`` (one call per file) where the kernel has it, else
    ``mincore`` on a mapping (a lookup per page, far slower for large files, but no read)."""
    global _cachestat_works
    libc = _load_libc()
    if not libc:
        return False
    pages = -(-size // PAGE)
    if _cachestat_works:
        rng, st = _Range(0, size), _CacheStat()
        rc = libc.syscall(_CACHESTAT, ctypes.c_uint(fd), ctypes.byref(rng), ctypes.byref(st), 0)
        if rc == 0:
            return bool(st.nr_cache >= pages)
        if ctypes.get_errno() not in (errno.ENOSYS, errno.EPERM):
            return False
        _cachestat_works = False  # an older kernel, or a seccomp filter: mincore from now on
    return _mincore_all(libc, fd, size, pages)


def _mincore_all(libc: Any, fd: int, size: int, pages: int) -> bool:
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return False
    try:
        vec = ctypes.create_string_buffer(pages)
        if libc.mincore(addr, size, vec) != 0:
            return False
        return b"\x00" not in vec.raw  # bit 0 of each byte: that page is resident
    finally:
        libc.munmap(addr, size)
