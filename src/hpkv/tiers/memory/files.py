"""The memory pool's files on disk: where they go, creating one, and removing those a crash left.

System calls only, no torch: the host pool's process (:mod:`hpkv.tiers.memory.hostpool`) creates the
files that engines map. A pool file is created with mode 0600, its space allocated up front with
``posix_fallocate`` (so a tmpfs that is too small fails at start, not with SIGBUS on a later
write), and held with a shared ``flock`` by its creator for the creator's life. A file that nobody
holds a lock on is left over from a crashed process and is removed at the next start in the same
directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
import threading

from hpkv.core.errors import HpkvConfigError
from hpkv.core.paths import check_private_dir
from hpkv.core.procs import pid_alive

log = logging.getLogger(__name__)

_POOL_RE = re.compile(r"^hpkv-(\d+)-[0-9A-Za-z]+\.shm$")
_counter = 0
_counter_lock = threading.Lock()


def pool_file_path(share_mem_file_path: str, tag: str) -> str:
    """Where this process's pool file goes.

    A path ending in ``.shm`` is the file itself; anything else is a directory
    (created if missing) in which each process gets ``hpkv-<pid>-<tag>.shm``,
    so several engines can share one directory.
    """
    global _counter
    path = os.path.abspath(os.path.expanduser(share_mem_file_path))
    if path.endswith(".shm"):
        return path
    with _counter_lock:
        _counter += 1
        n = _counter
    return os.path.join(path, f"hpkv-{os.getpid()}-{tag}{n:02x}.shm")


def agreed_pool_path(share_mem_file_path: str, owner_pid: int, tag: str) -> str | None:
    """The pool file two processes agree on without talking: ``hpkv-<owner_pid>-<tag>.shm`` in
    the pool directory (``tag``: letters and digits naming what it is for). None where the
    setting names one file: a file that exists there may be another engine's."""
    path = os.path.abspath(os.path.expanduser(share_mem_file_path))
    if path.endswith(".shm"):
        return None
    return os.path.join(path, f"hpkv-{owner_pid}-{tag}.shm")


def reclaim_stale(directory: str) -> list[str]:
    """Remove pool files in ``directory`` whose owner is gone (no process holds their lock)."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _POOL_RE.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or pid_alive(pid):
            continue
        path = os.path.join(directory, name)
        fd = open_own_file(path)
        if fd is None:  # named like a pool but not ours: never deleted
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        try:
            os.unlink(path)
            removed.append(path)
            log.warning("hpkv: removed stale memory pool file %s left by process %d", path, pid)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def open_own_file(path: str) -> int | None:
    """``path`` opened read-write if it is a regular file of this user (never through a link, never
    blocking on a FIFO), else None: the only kind of file hpkv may delete as a stale pool."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        return None
    return fd


def reclaim_if_unlocked(path: str, size: int) -> bool:
    """Remove ``path`` if it is a pool file left by a crash: a regular file of this user, of
    exactly ``size`` bytes, whose lock no process holds. Anything else at that name (a user's
    file, a link) is left alone; creating the pool then fails with a clear message. True: a pool
    file of that kind is there and its creator, alive, holds it."""
    fd = open_own_file(path)
    if fd is None:
        return False
    try:
        if os.fstat(fd).st_size != size:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(path)
        log.warning("hpkv: removed stale memory pool file %s", path)
    except BlockingIOError:
        return True
    except OSError:
        pass
    finally:
        os.close(fd)
    return False


def make_pool_dir(directory: str, path_where: str, shared_group: bool) -> None:
    """Create the pool directory if missing (0700) and refuse one that others may write."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as e:
        raise HpkvConfigError(
            f"{path_where}={directory!r} cannot be created ({e.strerror}); "
            "use a directory on a tmpfs you can write, e.g. /dev/shm/hpkv"
        ) from None
    check_private_dir(directory, path_where, "/dev/shm/hpkv", shared_group=shared_group, sticky_ok=True)


def create_pool_file(path: str, size: int, *, where: str, path_where: str, shared_group: bool) -> int:
    """Create the pool file ``path`` of ``size`` bytes, held with a shared lock: the open
    descriptor (the lock lasts while it is open). Errors name ``where`` (the size setting) or
    ``path_where`` (the directory setting) with a value that works."""
    directory = os.path.dirname(path)
    make_pool_dir(directory, path_where, shared_group)
    reclaim_stale(directory)
    if os.path.lexists(path):
        reclaim_if_unlocked(path, size)
    try:
        st = os.statvfs(directory)
    except OSError as e:
        raise HpkvConfigError(f"{path_where}={directory!r} is not usable ({e.strerror})") from None
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise HpkvConfigError(
            f"{where}={size} bytes does not fit in {directory} ({free} bytes free); "
            f"use a smaller pool, e.g. {max(free // 2 // 2**20, 1)}MiB, or a larger tmpfs"
        )
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise HpkvConfigError(
            f"{path_where}={path!r} already exists: a pool another process uses, or a file that is "
            f"not a {size}-byte pool of yours (hpkv never deletes those); "
            "use a directory instead, e.g. /dev/shm/hpkv, so each process gets its own file"
        ) from None
    except OSError as e:
        raise HpkvConfigError(
            f"{path_where}={path!r} cannot be created ({e.strerror}); use e.g. /dev/shm/hpkv"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                raise HpkvConfigError(
                    f"{where}={size} bytes cannot be allocated in {directory} ({e.strerror}); "
                    "use a smaller pool or a larger tmpfs"
                ) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, size)  # a filesystem without fallocate
    except BaseException:
        os.close(fd)
        unlink_quietly(path)
        raise
    return fd


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
