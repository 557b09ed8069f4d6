"""File system calls of the storage tier: atomic writes, aligned direct reads.

Crash safety: a record is written to a temporary file in the same directory
and renamed into place, so a reader sees either no file or a whole one; a
torn write is never visible. No fsync: after a power loss a renamed file may
be empty or hold garbage, which the record checksum turns into a miss.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading

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


def write_atomic(path: str, data: memoryview) -> None:
    """Write ``data`` to ``path`` through a temp file + rename (mode 0600). Raises OSError."""
    tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = data
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.close(fd)
        fd = -1
        os.rename(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class Reader:
    """Reads whole chunk files into caller buffers, with O_DIRECT where it works.

    O_DIRECT needs page-aligned buffers and lengths; callers pass buffers from
    ``mmap`` (the pool's slots or scratch buffers), which are page-aligned, of
    a page-rounded length. If a file system refuses O_DIRECT, this falls back
    to buffered reads for good and says so once through ``direct``.
    """

    def __init__(self, o_direct: bool) -> None:
        self.direct = o_direct and hasattr(os, "O_DIRECT")

    def read(self, path: str, buf: memoryview, expected: int) -> tuple[int, int]:
        """Read up to ``len(buf)`` bytes of ``path`` into ``buf``.

        Returns ``(bytes read, inode)``; a file longer than ``expected`` is
        reported as ``expected + 1`` bytes so the caller sees a length mismatch
        without reading it all. Raises OSError (FileNotFoundError when absent).
        """
        fd = self._open(path)
        try:
            st = os.fstat(fd)
            if st.st_size > expected:
                return expected + 1, st.st_ino
            total = os.preadv(fd, [buf], 0) if st.st_size else 0
            if total < st.st_size:
                # A short read (rare): finish buffered, since O_DIRECT needs aligned offsets.
                with open(path, "rb", buffering=0) as f:
                    while total < st.st_size:
                        n = f.readinto(buf[total:]) if f.seek(total) == total else 0
                        if not n:
                            break
                        total += n
            return total, st.st_ino
        finally:
            os.close(fd)

    def _open(self, path: str) -> int:
        if self.direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False  # this file system has no O_DIRECT
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
