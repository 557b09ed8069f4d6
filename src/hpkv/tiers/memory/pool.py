"""The memory pool's mapping: a pool file mapped into this process, as a tensor, and released.

No bookkeeping (which slot holds what is :mod:`hpkv.tiers.memory.bookkeeping`'s) and no file handling beyond
mapping (creating, naming and reclaiming files is :mod:`hpkv.tiers.memory.files`'s). A pool this
process created is removed when it closes, exits or is told to stop; one it attached is only
unmapped.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import os
import signal
import threading
import weakref
from typing import Any

import torch

from hpkv.core.errors import HpkvConfigError
from hpkv.core.pages import PAGE as PAGE  # re-exported: the slots are page-aligned
from hpkv.core.pages import read_ahead
from hpkv.tiers.memory.files import (  # re-exported: where pool files go
    agreed_pool_path as agreed_pool_path,
)
from hpkv.tiers.memory.files import create_pool_file, reclaim_if_unlocked, unlink_quietly
from hpkv.tiers.memory.files import pool_file_path as pool_file_path
from hpkv.tiers.memory.files import reclaim_stale as reclaim_stale

log = logging.getLogger(__name__)


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
        fd = create_pool_file(path, size, where=where, path_where=path_where, shared_group=shared_group)
        self._fd = fd
        try:
            self._mm = _map(fd, size)
        except BaseException:
            os.close(fd)
            unlink_quietly(path)
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
        _ATTACHED.add(self)
        return self

    @classmethod
    def map_shared(cls, path: str, size: int, *, prefault: bool = False) -> ShmPool:
        """Map a host pool file (:mod:`hpkv.tiers.memory.hostpool` owns it): this process's
        existing mapping of it if it has one (vLLM's single-GPU engine runs its worker in the
        scheduler's process: one mapping, page-locked once), else a new one like :meth:`attach`."""
        live = next(
            (p for p in list(_ATTACHED) if p.path == path and p.size == size and not p._closed),
            None,
        )
        if live is not None:
            return live._borrow()
        return cls.attach(path, size, prefault=prefault)

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
        if not reclaim_if_unlocked(path, size):
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
            unlink_quietly(self.path)
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
            unlink_quietly(self.path)
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
# Pools this process attached (another process's files), for map_shared.
_ATTACHED: weakref.WeakSet[ShmPool] = weakref.WeakSet()
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
                unlink_quietly(pool.path)
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
