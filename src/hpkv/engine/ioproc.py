"""Promotions read in a helper process (``HPKV_IO_PROCESS``): storage records are read into the
memory pool and checked there, off the engine's process and its GIL.

A promotion's read and check run on hpkv's threads, but every one of them needs the GIL between its
system calls, and the engine's own thread (vLLM's scheduler and model runner: one Python thread that
launches each kernel) gives it up around every torch call: beside four reading threads an engine-like
thread ran 1.45x slower on the H200 machine and 1.69x on a 2-core box, beside the same reads in a child
process 1.08x and 1.00x (``scripts/probe_interfere.py``, ``child 4/4``). The pool is shared memory, so a
child can write the slots itself: :class:`IoProcess` starts ``python -m hpkv.engine.ioproc`` with the
pool files' descriptors, sends it one JSON line per record (which file, which slot, what the record must
say) and hears one line back per record: read and checked whole (header, key, namespace, length,
checksum or MAC, as :func:`hpkv.core.record.verify`), or not. The parent only commits what the child
says is whole; anything else (a missing, corrupt or foreign file, a dead child) is read again on the
parent's threads, whose tiers then decide (a miss, the next tier), so this path never serves what the
usual one would not.

Nothing read back from the child is code: JSON lines, each field checked.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

from hpkv.core import record
from hpkv.core.pages import read_ahead
from hpkv.core.paths import NotARegularFile
from hpkv.tiers.disk.io import Reader as FileReader

log = logging.getLogger("hpkv")

PIPE_BYTES = 1 << 20  # room for ~3000 requests in the pipe, so a burst of them never blocks the sender


@dataclass(frozen=True)
class Read:
    """One record to read into pool ``pool`` at byte ``offset``, into at most ``room`` bytes."""

    pool: int
    offset: int
    room: int
    path: str
    namespace: bytes
    key: bytes
    payload: int  # the payload's length the record must state


# (whole, cached): the record is in its slot, read and checked whole; it came whole from the page cache
# (as the storage tier's ``page_cache_reads`` counts: with O_DIRECT on, a read that needed none).
Done = Callable[[bool, bool], None]


class IoProcess:
    """The parent's side: one child, its pipes, and a thread that hears its answers."""

    def __init__(self, pool_paths: list[str], pool_size: int, threads: int, o_direct: bool) -> None:
        fds = [os.open(p, os.O_RDWR | os.O_CLOEXEC) for p in pool_paths]
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "hpkv.engine.ioproc"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=fds,
                close_fds=True,
            )
        finally:
            for fd in fds:
                os.close(fd)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._out = self._proc.stdin
        with contextlib.suppress(OSError):
            fcntl.fcntl(self._out.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._lock = threading.Lock()  # guards _pending, _next, _alive and writes to the pipe
        self._pending: dict[int, Done] = {}
        self._next = 0
        self._alive = True
        self.served = 0  # records the child read and checked whole (tests, benchmarks)
        auth = record.current_auth_key()
        hello = {
            "fds": fds,
            "size": pool_size,
            "threads": threads,
            "o_direct": o_direct,
            "auth": auth.hex() if auth is not None else None,
        }
        self._send(hello)
        self._thread = threading.Thread(
            target=self._answers, args=(self._proc.stdout,), name="hpkv-ioproc", daemon=True
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._alive

    def read(self, r: Read, done: Done) -> bool:
        """Ask the child for ``r``; ``done`` is called once, on this object's thread, with its verdict.
        False (``done`` never called): the child is gone; read it here."""
        with self._lock:
            if not self._alive:
                return False
            n = self._next
            self._next += 1
            self._pending[n] = done
            try:
                self._send(
                    {
                        "id": n,
                        "pool": r.pool,
                        "offset": r.offset,
                        "room": r.room,
                        "path": r.path,
                        "ns": r.namespace.hex(),
                        "key": r.key.hex(),
                        "payload": r.payload,
                    }
                )
            except OSError:
                del self._pending[n]
                self._lost("its pipe closed")
                return False
        return True

    def _send(self, msg: dict[str, object]) -> None:
        self._out.write(json.dumps(msg).encode() + b"\n")
        self._out.flush()

    def _answers(self, stream: IO[bytes]) -> None:
        for line in stream:
            try:
                msg = json.loads(line)
                n, ok, cached = int(msg["id"]), msg["ok"] is True, msg.get("cached") is True
            except (ValueError, KeyError, TypeError):
                log.error("hpkv: the I/O process said something unreadable: %.80r", line)
                continue
            with self._lock:
                done = self._pending.pop(n, None)
                self.served += ok
            if done is not None:
                done(ok, cached)
        with self._lock:
            self._lost("it exited")

    def _lost(self, why: str) -> None:
        """Called with the lock held: every pending read is answered False (read again here)."""
        if self._alive and self._proc.poll() not in (None, 0):
            log.warning(
                "hpkv: the I/O process stopped (%s, code %s); promotions are read in this process",
                why,
                self._proc.returncode,
            )
        self._alive = False
        pending, self._pending = self._pending, {}
        for done in pending.values():
            done(False, False)

    def close(self) -> None:
        """Let the child finish what it was asked, then stop it; every pending read is answered."""
        with self._lock:
            self._alive = False  # a read asked from now on is read in the parent
            with contextlib.suppress(OSError):
                self._out.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._thread.join(timeout=30)


# -- the child ---------------------------------------------------------------------------


def _child() -> int:
    # A Ctrl-C at the terminal reaches the whole process group: the engine stops this child by closing
    # its pipe, after the reads it was asked for.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    hello = json.loads(sys.stdin.buffer.readline())
    if hello.get("auth"):
        record.set_auth_key(bytes.fromhex(hello["auth"]))
    size = int(hello["size"])
    maps = [
        mmap.mmap(int(fd), size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) for fd in hello["fds"]
    ]
    for fd in hello["fds"]:
        os.close(int(fd))
    views = [memoryview(m) for m in maps]
    # Without it the first write into each slot faults its pages in here again (core/pages.py).
    threading.Thread(target=_read_ahead, args=(maps, size), name="hpkv-prefault", daemon=True).start()
    o_direct = bool(hello["o_direct"])
    readers = threading.local()  # one file reader per thread: its count of page-cache reads is this read's
    out = sys.stdout.buffer
    lock = threading.Lock()

    def one(msg: dict[str, object]) -> None:
        ok = cached = False
        if not hasattr(readers, "r"):
            readers.r = FileReader(o_direct)
        reader = readers.r
        try:
            off, room = int(msg["offset"]), int(msg["room"])  # type: ignore[call-overload]
            payload = int(msg["payload"])  # type: ignore[call-overload]
            buf = views[int(msg["pool"])][off : off + room]  # type: ignore[call-overload]
            expected = record.record_bytes(payload)
            before = reader.cached_reads
            n, _ = reader.read(str(msg["path"]), buf, expected)
            cached = reader.cached_reads > before
            ns, key = bytes.fromhex(str(msg["ns"])), bytes.fromhex(str(msg["key"]))
            ok = record.verify(buf, n, ns, key, payload) is record.Verdict.OK
        except (OSError, NotARegularFile, ValueError, KeyError, IndexError):
            ok = False  # the parent reads it again, and its tier says why
        line = json.dumps({"id": msg.get("id"), "ok": ok, "cached": cached}).encode() + b"\n"
        with lock:
            out.write(line)
            out.flush()

    with ThreadPoolExecutor(max(1, int(hello["threads"])), thread_name_prefix="hpkv-ioproc") as pool:
        for line in sys.stdin.buffer:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict):
                pool.submit(one, msg)
    return 0


def _read_ahead(maps: list[mmap.mmap], size: int) -> None:
    for m in maps:
        read_ahead(m, size)


if __name__ == "__main__":
    raise SystemExit(_child())
