"""The storage tier: one record file per chunk, ``<root>/v1/<2 hex>/<32 hex>.kv``.

Survives restarts: the index is rebuilt by scanning the directory at start
(oldest modification time = least recently used). Several processes may share
one directory: writes are atomic renames, a reader holds its file open while
an evictor unlinks it, and every read is verified, so none of them can see a
torn or foreign record. Capacity is enforced by each process over the files it
knows.

Thread-safety: all methods may be called from any thread; the index is under
one lock, file I/O runs outside it. Errors during a write skip the chunk and
count an error; during a read they are a miss.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable

from hpkv import native
from hpkv.core import record
from hpkv.core.config import HpkvConfig
from hpkv.core.errors import HpkvConfigError
from hpkv.core.keys import SHARED_TENANT
from hpkv.core.paths import check_private_dir
from hpkv.core.stats import TierStats
from hpkv.native import in_page_cache
from hpkv.tiers.base import Built
from hpkv.tiers.disk.index import DiskIndex
from hpkv.tiers.disk.io import SOFT_ERRNOS, Reader, create_exclusive, write_atomic

log = logging.getLogger(__name__)

NAME = "storage"
DEVICE = "storage-device"  # where a read of a file not in the page cache comes from
FORMAT_DIR = "v1"
SUFFIX = ".kv"
_STALE_TMP_S = 3600.0
_LOG_EVERY_S = 30.0


class StorageTier:
    """One rank's chunk files (a :class:`hpkv.tiers.base.Tier`). Tenants share the directory: their
    keys already differ (a tenant's chunks are keyed with its salt)."""

    name = NAME
    remote = False

    def __init__(
        self,
        root: str,
        capacity: int,
        payload_bytes: int,
        namespace: bytes,
        *,
        o_direct: bool = True,
        direct_writes: bool = False,
        where: str = "HPKV_KV_STORAGE_PATH",
        shared_group: bool = False,
    ) -> None:
        self.root = os.path.join(root, FORMAT_DIR)
        self.payload_bytes = payload_bytes
        self.record_bytes = record.record_bytes(payload_bytes)
        self.namespace = namespace
        self._reader = Reader(o_direct)
        self.direct_writes = direct_writes
        self._direct_writes = 0  # records whose whole pages went with O_DIRECT
        self._in_place = 0  # records read_payload_into served (no buffer in between)
        self._lock = threading.Lock()
        self._stats = TierStats()
        self._index = DiskIndex(capacity)
        self._last_log = 0.0
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
        except OSError as e:
            raise HpkvConfigError(
                f"{where}={root!r} is not a writable directory ({e.strerror}); "
                "use a directory you can write, e.g. ~/storage"
            ) from None
        # Checked before anything is created in it: a directory another user owns or can write is refused.
        check_private_dir(root, where, "~/storage", shared_group=shared_group)
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            for i in range(256):
                os.makedirs(os.path.join(self.root, f"{i:02x}"), mode=0o700, exist_ok=True)
            fd, probe = create_exclusive(self.root, ".probe")  # never through a planted link
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise HpkvConfigError(
                f"{where}={root!r} is not a writable directory ({e.strerror}); "
                "use a directory you can write, e.g. ~/storage"
            ) from None
        check_private_dir(self.root, where, "~/storage", shared_group=shared_group)
        t0 = time.perf_counter()
        self.scanned = self._scan()
        self.scan_seconds = time.perf_counter() - t0

    # -- paths and startup --------------------------------------------------

    def path(self, key: bytes) -> str:
        h = key.hex()
        return f"{self.root}/{h[:2]}/{h}{SUFFIX}"

    def _scan(self) -> int:
        """Index every chunk file of this namespace's size; remove temp files left by crashes."""
        found: list[tuple[float, bytes, int]] = []
        foreign = 0
        now = time.time()
        for i in range(256):
            sub = os.path.join(self.root, f"{i:02x}")
            try:
                it = os.scandir(sub)
            except OSError:
                continue
            with it:
                for entry in it:
                    name = entry.name
                    try:
                        # Only regular files count; a symlink, FIFO or directory is not a record.
                        if not entry.is_file(follow_symlinks=False):
                            continue
                        if name.startswith(".") and name.endswith(".tmp"):
                            if now - entry.stat(follow_symlinks=False).st_mtime > _STALE_TMP_S:
                                os.unlink(entry.path)  # unlink never follows a link
                            continue
                        if not name.endswith(SUFFIX) or len(name) != 32 + len(SUFFIX):
                            continue
                        st = entry.stat(follow_symlinks=False)
                        key = bytes.fromhex(name[:32])
                    except (OSError, ValueError):
                        continue
                    # A file of another size is another layout's record or not a record at all:
                    # neither counted against the capacity nor evicted (one absurd file must not
                    # push every valid chunk out).
                    if st.st_size != self.record_bytes:
                        foreign += 1
                        continue
                    found.append((st.st_mtime, key, st.st_size))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index.add(key, size)
            excess = self._index.victims(0)
        self._unlink_all(excess)
        if foreign:
            log.info(
                "hpkv: storage %s: %d files of another size ignored (not this layout's records)",
                self.root,
                foreign,
            )
        return len(found)

    # -- lookups and reads ----------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """True if a file for ``key`` exists (known here, or written by another process since)."""
        with self._lock:
            if key in self._index:
                return True
        try:
            st = os.lstat(self.path(key))
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != self.record_bytes:
            return False
        with self._lock:
            self._index.add(key, st.st_size)
        return True

    def contains_many(self, keys: list[bytes], tenant: str = SHARED_TENANT) -> list[bool]:
        return [self.contains(k) for k in keys]

    def read_into(self, key: bytes, buf: memoryview, tenant: str = SHARED_TENANT) -> bool:
        """Read and verify the record of ``key`` into ``buf`` (page-aligned, page-rounded length
        ≥ the record). True: ``buf`` holds a verified record. False: a counted miss."""
        check = self.fetch_into(key, buf, tenant)
        return check is not None and check()

    def fetch_into(
        self, key: bytes, buf: memoryview, tenant: str = SHARED_TENANT
    ) -> Callable[[], bool] | None:
        """:meth:`read_into` in two halves (see the tier protocol): the file's bytes into ``buf``
        now, and the check of what they were found to be."""
        return self.fetch_many([key], [buf])[0]

    def fetch_many(
        self, keys: list[bytes], bufs: list[memoryview], threads: int = 1
    ) -> list[Callable[[], bool] | None]:
        """:meth:`fetch_into` for a batch, read and checked in one native call over ``threads``
        threads: per key, the check's verdict to take (it counts the hit or removes the bad file),
        or None: a counted miss."""
        paths = [self.path(k) for k in keys]
        reads = self._reader.read(
            [(p, [b], k) for p, b, k in zip(paths, bufs, keys, strict=True)],
            self.record_bytes,
            self.namespace,
            threads=threads,
        )
        out: list[Callable[[], bool] | None] = []
        for key, path, buf, r in zip(keys, paths, bufs, reads, strict=True):
            verdict = self._verdict(key, path, r, [buf])
            out.append(None if verdict is None else self._judge(key, path, r.inode, verdict))
        return out

    def _judge(self, key: bytes, path: str, ino: int, verdict: record.Verdict) -> Callable[[], bool]:
        def check() -> bool:
            if verdict is not record.Verdict.OK:
                self._failed(key, path, ino, verdict)
                return False
            self.count_hit(key)
            return True

        return check

    def _verdict(
        self, key: bytes, path: str, r: native.Read, bufs: list[memoryview]
    ) -> record.Verdict | None:
        """What a native read found, or None when there was nothing to check (no file, not a
        regular file, an error: each counted as a miss). A MAC'd record's MAC is checked here."""
        if r.status == native.NOT_FOUND:
            self._forget(key)
            self._stats.add("misses")
            return None
        if r.status == native.NOT_REGULAR:
            self._stats.add("corrupt")
            self._stats.add("misses")
            self._rate_limited_log(
                f"hpkv: storage {path} is not a regular file; treated as a miss and removed"
            )
            self._forget(key)
            with contextlib.suppress(OSError):
                os.unlink(path)  # removes the name (a link, a FIFO), never what a link points to
            return None
        if r.status == native.IO_ERROR:
            self._error("read", path, OSError(r.errno, os.strerror(r.errno), path))
            self._stats.add("misses")
            return None
        return self._found(key, r, bufs)

    def _found(self, key: bytes, r: native.Read, bufs: list[memoryview]) -> record.Verdict:
        """The verdict of a record the native reader read and checked (a MAC'd record's MAC is
        checked here, over ``bufs``)."""
        verdict = record.VERDICTS[r.status]
        if verdict is record.Verdict.OK and record.current_auth_key() is not None:
            verdict = record.check_pieces(bufs, self.namespace, key, self.payload_bytes)
        return verdict

    def _failed(self, key: bytes, path: str, ino: int, verdict: record.Verdict) -> None:
        self._stats.add("corrupt")
        self._stats.add("misses")
        self._rate_limited_log(
            f"hpkv: storage chunk {path} failed verification ({verdict.value}); treated as a miss and removed"
        )
        self._remove_bad(key, path, ino)

    def read_payload_into(
        self, key: bytes, pieces: list[memoryview], tenant: str = SHARED_TENANT
    ) -> bool | None:
        """The payload of ``key``'s record straight into ``pieces`` (writable; together one payload,
        in order) when its file is whole in the page cache (read at memory speed: a buffer in
        between would cost a second copy of every byte), then checked there. True: verified, a hit.
        False: the file failed the check (counted, removed); what ``pieces`` hold is garbage.
        None: not tried (no such file, not in the page cache, or an error): :meth:`read_into` reads
        it and counts what it finds."""
        return self.read_payloads_into([key], [pieces])[0]

    def read_payloads_into(
        self, keys: list[bytes], pieces: list[list[memoryview]], threads: int = 1
    ) -> list[bool | None]:
        """:meth:`read_payload_into` for a batch, in one native call over ``threads`` threads."""
        todo = [i for i, k in enumerate(keys) if self.contains(k)]
        for i in todo:
            size = sum(len(p) for p in pieces[i])
            if size != self.payload_bytes:
                raise ValueError(f"the pieces hold {size} bytes, a payload {self.payload_bytes}")
        jobs = [
            (self.path(keys[i]), [memoryview(bytearray(record.HEADER_BYTES)), *pieces[i]], keys[i])
            for i in todo
        ]
        reads = self._reader.read(jobs, self.record_bytes, self.namespace, cached_only=True, threads=threads)
        out: list[bool | None] = [None] * len(keys)
        for i, (path, bufs, key), r in zip(todo, jobs, reads, strict=True):
            if r.status in (native.NOT_CACHED, native.NOT_FOUND, native.NOT_REGULAR, native.IO_ERROR):
                continue  # read_into deals with it (and counts what it finds)
            out[i] = self._judge(key, path, r.inode, self._found(key, r, bufs))()
            if out[i]:
                with self._lock:
                    self._in_place += 1
        return out

    def count_hit(self, key: bytes) -> None:
        """``key``'s record was read and checked whole."""
        with self._lock:
            self._index.touch(key)
        self._stats.add("hits")
        self._stats.add("bytes_read", self.payload_bytes)

    # -- writes -------------------------------------------------------------

    def held(self, key: bytes, tenant: str = SHARED_TENANT) -> bool:
        """Whether this process knows a file for ``key`` (its index: no system call, for the engine's
        own thread); :meth:`contains` also finds one another process wrote since."""
        with self._lock:
            return key in self._index

    def source(self, key: bytes, tenant: str = SHARED_TENANT) -> str:
        """``storage`` when ``key``'s file is whole in the page cache (read at memory speed), else
        ``storage-device`` (read from the device, often many times slower)."""
        return NAME if in_page_cache(self.path(key)) else DEVICE

    def write(self, key: bytes, rec: memoryview, tenant: str = SHARED_TENANT) -> bool:
        """Write a sealed record for ``key`` unless the tier already holds it. True if it is on disk now."""
        if self.contains(key):
            with self._lock:
                self._index.touch(key)
            return True
        with self._lock:
            if key in self._index:  # another thread of this process is writing it
                return True
            victims = self._index.victims(len(rec))
            self._index.add(key, len(rec))
        self._unlink_all(victims)
        path = self.path(key)
        try:
            try:
                direct = write_atomic(path, rec, self.direct_writes)
            except FileNotFoundError:
                self._recreate()  # the directory vanished under us: make it again, try once more
                with self._lock:
                    self._index.add(key, len(rec))
                direct = write_atomic(path, rec, self.direct_writes)
        except OSError as e:
            with self._lock:
                self._index.remove(key)
            self._stats.add("writes_skipped")
            if e.errno in SOFT_ERRNOS:
                self._error("write", path, e)
                return False
            raise
        self._stats.add("writes")
        if direct:
            with self._lock:
                self._direct_writes += 1
        self._stats.add("bytes_written", self.payload_bytes)
        return True

    # -- housekeeping ---------------------------------------------------------

    def delete(self, key: bytes, tenant: str = SHARED_TENANT) -> bool:
        self._forget(key)
        try:
            os.unlink(self.path(key))
            return True
        except OSError:
            return False

    def clear(self) -> int:
        """Remove every chunk file under the root (all namespaces: it is this directory's cache)."""
        with self._lock:
            self._index.clear()
        n = 0
        for i in range(256):
            sub = os.path.join(self.root, f"{i:02x}")
            try:
                names = os.listdir(sub)
            except OSError:
                continue
            for name in names:
                if name.endswith(SUFFIX):
                    try:
                        os.unlink(os.path.join(sub, name))
                        n += 1
                    except OSError:
                        pass
        return n

    def stats(self) -> dict[str, int]:
        with self._lock:
            used, count, cap = self._index.used, len(self._index), self._index.capacity
        return self._stats.snapshot(
            used_bytes=used,
            capacity_bytes=cap,
            chunks=count,
            o_direct=int(self._reader.direct),
            page_cache_reads=self._reader.cached_reads,
            direct_writes=self._direct_writes,
            in_place_reads=self._in_place,
        )

    def count(self, name: str, n: int = 1) -> None:
        """Bump a counter from outside (the cascade counts writes it had to drop)."""
        self._stats.add(name, n)

    def check(self) -> None:
        """Consistency check for tests: every indexed key has a file of the right size."""
        with self._lock:
            keys = self._index.keys()
        for key in keys:
            st = os.stat(self.path(key))
            assert st.st_size == self.record_bytes, f"{self.path(key)} has {st.st_size} bytes"

    def close(self) -> None:
        pass

    # -- helpers ---------------------------------------------------------------

    def _recreate(self) -> None:
        """The storage directory (or a part) was deleted while running: forget what it held
        (lookups must not claim chunks that are gone) and create it again."""
        if not os.path.isdir(self.root):
            with self._lock:
                self._index.clear()
            log.warning(
                "hpkv: storage directory %s vanished; recreated it, its chunks are forgotten", self.root
            )
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        for i in range(256):
            os.makedirs(os.path.join(self.root, f"{i:02x}"), mode=0o700, exist_ok=True)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._index.remove(key)

    def _unlink_all(self, keys: list[bytes]) -> None:
        for key in keys:
            try:
                os.unlink(self.path(key))
                self._stats.add("evictions")
            except FileNotFoundError:
                pass
            except OSError as e:
                self._error("evict", self.path(key), e)

    def _remove_bad(self, key: bytes, path: str, ino: int) -> None:
        """Unlink a record that failed verification, unless another process has replaced it since."""
        self._forget(key)
        try:
            if os.stat(path).st_ino == ino:
                os.unlink(path)
        except OSError:
            pass

    def _error(self, what: str, path: str, e: OSError) -> None:
        self._stats.add("errors")
        self._rate_limited_log(f"hpkv: storage {what} failed for {path}: {e.strerror} (errno {e.errno})")

    def _rate_limited_log(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            log.warning(msg)


def from_config(config: HpkvConfig, payload_bytes: int, rank_digests: list[bytes]) -> Built | None:
    """One storage tier per rank under ``config.storage_path`` (the registry's builder)."""
    root = config.resolved_storage_path
    if root is None:
        return None
    return Built(
        [
            StorageTier(
                root,
                config.storage_size,
                payload_bytes,
                d,
                o_direct=config.storage_o_direct,
                direct_writes=config.storage_direct_writes,
                where=config.where("storage_path"),
                shared_group=config.shared_group,
            )
            for d in rank_digests
        ]
    )
