"""The shared-memory file behind the memory pool: create, reclaim, map, release.

System calls only; no bookkeeping. The file is created with mode 0600, its
space allocated up front with ``posix_fallocate`` (so a tmpfs that is too
small fails here, at start, rather than with SIGBUS on a later write), and
held with a shared ``flock`` for the life of the process. A file that nobody
holds a lock on is left over from a crashed process and is removed at the
next start in the same directory.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import signal
import stat
import threading
import weakref
from typing import Any

import torch

from hpkv.core.errors import HpkvConfigError
from hpkv.core.pages import PAGE as PAGE  # re-exported: the slots are page-aligned
from hpkv.core.pages import read_ahead
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
        fd = _open_own_file(path)
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


def _open_own_file(path: str) -> int | None:
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


def _reclaim_if_unlocked(path: str, size: int) -> bool:
    """Remove ``path`` if it is a pool file left by a crash: a regular file of this user, of
    exactly ``size`` bytes, whose lock no process holds. Anything else at that name (a user's
    file, a link) is left alone; creating the pool then fails with a clear message. True: a pool
    file of that kind is there and its creator, alive, holds it."""
    fd = _open_own_file(path)
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


class ShmPool:
    """One mapped shared-memory file of ``size`` bytes.

    ``tensor`` is a uint8 CPU tensor over the whole mapping; slot views are
    slices of it (no copies). ``close()`` unmaps and removes the file.
    """

    def __init__(
        self,
        path: str,
        size: int,
        *,
        where: str = "HPKV_KV_MEM_POOL_SIZE",
        path_where: str = "HPKV_SHARE_MEM_FILE_PATH",
        shared_group: bool = False,
        prefault: bool = True,
    ) -> None:
        """``prefault``: touch every page of this mapping in the background (off where CUDA's
        page-locking maps them all anyway)."""
        self.path = path
        self.size = size
        directory = os.path.dirname(path)
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as e:
            raise HpkvConfigError(
                f"{path_where}={directory!r} cannot be created ({e.strerror}); "
                "use a directory on a tmpfs you can write, e.g. /dev/shm/hpkv"
            ) from None
        check_private_dir(directory, path_where, "/dev/shm/hpkv", shared_group=shared_group, sticky_ok=True)
        reclaim_stale(directory)
        if os.path.lexists(path):
            _reclaim_if_unlocked(path, size)
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
        self._fd = fd
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
            self._mm = _map(fd, size)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.view = memoryview(self._mm)
        self._closed = False
        if prefault:
            self._start_prefault()
        _OWNED.add(self)
        _install_exit_cleanup()

    def _start_prefault(self) -> None:
        self._stop_prefault = threading.Event()
        self._prefault = threading.Thread(target=self._touch_all, name="hpkv-prefault", daemon=True)
        self._prefault.start()
        _PREFAULTING.add(self)

    def _touch_all(self) -> None:
        """Read this process's mapping ahead of use, in the background, once (see
        :func:`hpkv.core.pages.read_ahead`); stops early if the pool is closed."""
        read_ahead(self._mm, self.size, self._stop_prefault)

    def _halt_prefault(self) -> None:
        if self._prefault is not None:
            self._stop_prefault.set()
            self._prefault.join()
            self._prefault = None

    @classmethod
    def attach(cls, path: str, size: int, *, prefault: bool = False) -> ShmPool:
        """Map a pool file another process created (vLLM workers map the scheduler's pools).

        The creator owns the file: ``close()`` here only unmaps. ``prefault``: touch every page of
        this mapping in the background (a CPU engine's worker; CUDA's page-locking maps them all).
        """
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < size:
                raise HpkvConfigError(f"memory pool file {path} is smaller than {size} bytes")
            self = cls._handle(path, size, _map(fd, size))
        finally:
            os.close(fd)
        if prefault:
            self._start_prefault()
        return self

    @classmethod
    def _handle(cls, path: str, size: int, mm: mmap.mmap) -> ShmPool:
        """A pool that this object does not own, over the mapping ``mm``: close() only unmaps."""
        self = cls.__new__(cls)
        self.path, self.size = path, size
        self._mm = mm
        self._fd = -1
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8)
        self.view = memoryview(mm)
        self._closed = False
        self._owner = False
        self._prefault = None
        return self

    @classmethod
    def adopt(cls, path: str, size: int) -> ShmPool | None:
        """Map a pool file that a live process created for this one to share (a vLLM worker
        makes its rank's pool at start, so that page-locking it is not paid by the first request),
        or None if ``path`` is not exactly that: a regular file of this user, never through a
        link, of ``size`` bytes, whose creator still holds its lock. An unlocked one is left over
        from a crash and is removed. Maps like :meth:`attach`, with a prefault, unless this process
        made it (vLLM's single-GPU engine runs its worker in the scheduler's process): then the
        maker's mapping is shared (:meth:`_borrow`)."""
        own = next((p for p in list(_OWNED) if p.path == path and p.size == size and not p._closed), None)
        if own is not None:
            return own._borrow()
        if not _reclaim_if_unlocked(path, size):
            return None
        return cls.attach(path, size, prefault=True)

    def _borrow(self) -> ShmPool:
        """A handle on this pool's own mapping, for another part of this process: no second mapping,
        whose pages would each fault again on first touch (a read into a page not yet mapped runs
        several times slower than into a mapped one; a page-locked pool is mapped whole) and whose
        prefault would spend a core at start. ``close()`` on it only lets
        go; the mapping stays until the last view of it is dropped."""
        return ShmPool._handle(self.path, self.size, self._mm)

    _owner = True
    _prefault: threading.Thread | None = None

    def unlink(self) -> None:
        """Remove the file's name now (owner only): processes that mapped it keep the memory, new
        ones can no longer attach. Nothing is left behind however this process ends."""
        if self._owner and not self._unlinked:
            self._unlinked = True
            _unlink_quietly(self.path)
            log.info("hpkv: memory pool %s mapped by every rank; its name is removed", self.path)

    _unlinked = False

    def close(self) -> None:
        """Unmap (and, if this process created it, remove) the file.
        Views still held elsewhere keep the memory alive until dropped."""
        if self._closed:
            return
        self._closed = True
        self._halt_prefault()
        if self._owner and not self._unlinked:
            _unlink_quietly(self.path)
        self.view.release()
        del self.tensor
        # Someone may still hold a tensor view; the mapping then goes when it does.
        with contextlib.suppress(BufferError):
            self._mm.close()
        if self._fd >= 0:
            os.close(self._fd)


# Pools this process created and has not closed: removed at interpreter exit and on SIGTERM/SIGINT,
# so a process that ends without close() (an engine stopped by its process manager, a script that
# forgot) leaves no file holding RAM in /dev/shm.
_OWNED: weakref.WeakSet[ShmPool] = weakref.WeakSet()
_installed = False
_install_lock = threading.Lock()


def _install_exit_cleanup() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        _installed = True
    # atexit runs before daemon threads are frozen: the prefault thread is stopped and joined there,
    # not torn down inside torch (which aborted the process: "terminate called without an active
    # exception").
    atexit.register(_close_owned)
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous = signal.getsignal(sig)
            signal.signal(sig, _make_handler(previous))
        except (ValueError, OSError):  # not the main thread: atexit still covers a normal exit
            pass


# Pools whose mapping a prefault thread may still be reading (attached ones too): stopped at
# interpreter exit, before daemon threads are frozen mid-read.
_PREFAULTING: weakref.WeakSet[ShmPool] = weakref.WeakSet()


@atexit.register
def _stop_prefaults() -> None:
    for pool in list(_PREFAULTING):
        with contextlib.suppress(Exception):
            pool._halt_prefault()


def _close_owned() -> None:
    for pool in list(_OWNED):
        with contextlib.suppress(Exception):
            pool.close()


def _make_handler(previous: Any) -> Any:
    def handler(signum: int, frame: Any) -> None:
        for pool in list(_OWNED):  # the file only: mappings (workers') stay valid until they end
            if pool._owner:
                _unlink_quietly(pool.path)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    return handler


def slot_bytes(record_bytes: int) -> int:
    """Pool slots are page-aligned (O_DIRECT reads land in them directly)."""
    return -(-record_bytes // PAGE) * PAGE


def check_holds_a_chunk(size: int, slot: int, chunk_tokens: int, where: str, example: str) -> None:
    """A pool too small for one chunk is a configuration error, not a pool that silently never hits."""
    if size < slot:
        raise HpkvConfigError(
            f"{where}={size} bytes holds no chunk (one chunk of {chunk_tokens} tokens is {slot} bytes "
            f"per rank); use e.g. {example}, or 0 to disable the memory tier"
        )


def _map(fd: int, size: int) -> mmap.mmap:
    """Map the pool shared, asking for huge pages: the first touch of a 4 KiB page costs
    microseconds in a VM with nested paging, an order of magnitude more than a huge page's share,
    which would otherwise dominate the first store into each slot."""
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_HUGEPAGE)
    return mm


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
