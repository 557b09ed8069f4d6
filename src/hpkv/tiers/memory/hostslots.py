"""An engine's side of the host pool (:mod:`hpkv.tiers.memory.hostpool`): find it, or start it, and
use its bookkeeping through the same interface as an engine's own pool
(:class:`hpkv.tiers.memory.bookkeeping.MemorySlots`), so the engine does not know which it has.

Thread contract: every method may be called from any thread; calls share one connection, one
request at a time. If the pool process goes away, this engine's memory tier answers misses from
then on (nothing pinned, nothing reserved) and says so once; it never blocks the engine.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from hpkv.core.config import HpkvConfig
from hpkv.core.errors import HpkvConfigError
from hpkv.core.stats import TierStats
from hpkv.tiers.memory.files import make_pool_dir
from hpkv.tiers.memory.wire import LOGFILE, PIDFILE, SOCKET, recv, send

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
REPLY_TIMEOUT_S = 30.0  # the pool answers in microseconds; this long means it is stuck or gone


def uses_host_pool(config: HpkvConfig) -> bool:
    """The engine's memory tier is the host pool: on, shared, and not one named pool file."""
    return (
        config.mem_pool_size > 0
        and config.memory_pool == "shared"
        and not config.share_mem_file_path.endswith(".shm")
    )


def host_group(logical_digest: bytes) -> str:
    """The name the host pool knows a model's pool by (its bookkeeping and files are per model)."""
    return logical_digest.hex()[:16]


def pool_dir(config: HpkvConfig) -> str:
    return os.path.abspath(os.path.expanduser(config.share_mem_file_path))


def open_connection(config: HpkvConfig, *, start: bool = True) -> socket.socket:
    """A connection to the host pool of ``config``'s pool directory, starting the pool if none
    answers (``start``). Two engines starting at once start one pool: the start is under a lock
    file in the directory, and the pool itself refuses to run twice."""
    directory = pool_dir(config)
    path = os.path.join(directory, SOCKET)
    sock = _try_connect(path)
    if sock is not None or not start:
        if sock is None:
            raise ConnectionRefusedError(f"no hpkv pool answers at {path}")
        return sock
    make_pool_dir(directory, config.where("share_mem_file_path"), config.shared_group)
    lock_fd = os.open(os.path.join(directory, "hpkv-pool.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        sock = _try_connect(path)
        if sock is not None:
            return sock
        proc = _spawn(config, directory)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            sock = _try_connect(path)
            if sock is not None:
                return sock
            if proc.poll() not in (None, 0):  # the launcher failed; the pool itself logs its own end
                break
            time.sleep(0.02)
        raise HpkvConfigError(
            f"the hpkv pool for {config.where('share_mem_file_path')}={directory!r} did not start "
            f"(see {os.path.join(directory, LOGFILE)}); set HPKV_MEMORY_POOL=engine for a pool of "
            "the engine's own"
        )
    finally:
        os.close(lock_fd)


def _try_connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    sock.settimeout(REPLY_TIMEOUT_S)
    return sock


# Starts the pool and exits at once: the pool is then nobody's child. An engine that kills its own
# process tree when it stops (vLLM does) cannot take the pool with it.
_LAUNCHER = (
    "import os, subprocess, sys\n"
    "log = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)\n"
    "subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=log,\n"
    "                 start_new_session=True, close_fds=True)\n"
)


def _spawn(config: HpkvConfig, directory: str) -> subprocess.Popen[bytes]:
    """Start the pool process for ``directory``, detached from this process (see _LAUNCHER)."""
    cmd = [sys.executable, "-m", "hpkv.tiers.memory.hostpool", "--dir", directory]
    cmd += ["--idle-timeout", str(config.pool_idle_timeout)]
    if config.shared_group:
        cmd.append("--shared-group")
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, os.path.join(directory, LOGFILE), *cmd],
        stdin=subprocess.DEVNULL,
        close_fds=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    _SPAWNED.append(directory)
    log.info("hpkv: starting the host pool for %s", directory)
    return proc


# Pool directories whose pool this process started (tests stop them; an engine leaves them to
# their idle timeout).
_SPAWNED: list[str] = []


def request(sock: socket.socket, message: dict[str, Any]) -> dict[str, Any]:
    send(sock, message)
    reply = recv(sock)
    if reply is None:
        raise ConnectionResetError("the hpkv pool closed the connection")
    return reply


def pool_paths(
    config: HpkvConfig, group: str, ranks: int, slot_bytes: int, size: int
) -> tuple[list[str], int, int]:
    """The host pool's files for ``group`` (starting the pool, making the files if needed) without
    holding a connection: what a vLLM worker maps at start. (paths, size, num_slots)."""
    with contextlib.closing(open_connection(config)) as sock:
        reply = request(sock, _hello(config, group, ranks, slot_bytes, size, bind=False))
    if "error" in reply:
        raise HpkvConfigError(str(reply["error"]))
    return list(reply["paths"]), int(reply["size"]), int(reply["num_slots"])


def _hello(
    config: HpkvConfig, group: str, ranks: int, slot_bytes: int, size: int, *, bind: bool
) -> dict[str, Any]:
    return {
        "op": "hello",
        "group": group,
        "ranks": ranks,
        "slot_bytes": slot_bytes,
        "size": size,
        "bind": bind,
        "where": config.where("mem_pool_size"),
        "path_where": config.where("share_mem_file_path"),
    }


class HostSlots:
    """:class:`~hpkv.tiers.memory.bookkeeping.MemorySlots`' interface over the host pool's bookkeeping."""

    def __init__(self, config: HpkvConfig, group: str, ranks: int, slot_bytes: int, size: int) -> None:
        self._sock = open_connection(config)
        self._lock = threading.Lock()
        reply = request(self._sock, _hello(config, group, ranks, slot_bytes, size, bind=True))
        if "error" in reply:
            self._sock.close()
            raise HpkvConfigError(str(reply["error"]))
        self.paths: list[str] = list(reply["paths"])
        self.size = int(reply["size"])
        self.num_slots = int(reply["num_slots"])
        self.pool_pid = int(reply["pid"])
        self.counters = TierStats()
        self._pinned = 0  # the pool's pinned slots at the last answer (a hint)
        self._dead = False
        if self.size != size:
            log.warning(
                "hpkv: the host pool for this model was made with %d bytes per rank, not %s=%d; "
                "it keeps its size until it stops",
                self.size,
                config.where("mem_pool_size"),
                size,
            )

    def _ask(self, message: dict[str, Any]) -> dict[str, Any] | None:
        if self._dead:
            return None
        with self._lock:
            try:
                reply = request(self._sock, message)
            except (OSError, ValueError) as e:
                self._dead = True
                log.error(
                    "hpkv: the host pool (pid %d) is gone (%s); memory misses from now on", self.pool_pid, e
                )
                with contextlib.suppress(OSError):
                    self._sock.close()
                return None
        self._pinned = int(reply.get("pinned", self._pinned))
        return reply

    @staticmethod
    def _hex(lks: Iterable[bytes]) -> list[str]:
        return [k.hex() for k in lks]

    # -- what is where ----------------------------------------------------------------

    def __contains__(self, lk: bytes) -> bool:
        r = self._ask({"op": "contains", "key": lk.hex()})
        return bool(r and r["in"])

    def contains_many(self, lks: Sequence[bytes]) -> list[bool]:
        if not lks:
            return []
        r = self._ask({"op": "contains_many", "keys": self._hex(lks)})
        return [bool(x) for x in r["in"]] if r else [False] * len(lks)

    def __len__(self) -> int:
        r = self._ask({"op": "len"})
        return int(r["n"]) if r else 0

    def pinned(self) -> int:
        return self._pinned

    def protected(self) -> int:
        r = self._ask({"op": "protected"})
        return int(r["n"]) if r else 0

    def scarce(self) -> bool:
        return self.num_slots > 0 and self._pinned * 2 >= self.num_slots

    # -- pins ---------------------------------------------------------------------------

    def pin(self, lks: Iterable[bytes]) -> list[int]:
        keys = self._hex(lks)
        if not keys:
            return []
        r = self._ask({"op": "pin", "keys": keys})
        return [int(s) for s in r["slots"]] if r else []

    def pin_each(self, lks: Sequence[bytes]) -> dict[int, int]:
        if not lks:
            return {}
        r = self._ask({"op": "pin_each", "keys": self._hex(lks)})
        return {int(i): int(s) for i, s in r["slots"]} if r else {}

    def unpin(self, slots: Iterable[int]) -> None:
        got = [int(s) for s in slots]
        if got:
            self._ask({"op": "unpin", "slots": got})

    def protect(self, lks: Iterable[bytes]) -> None:
        keys = self._hex(lks)
        if keys:
            self._ask({"op": "protect", "keys": keys})

    def unprotect(self, lks: Iterable[bytes]) -> None:
        keys = self._hex(lks)
        if keys:
            self._ask({"op": "unprotect", "keys": keys})

    def room(self) -> int:
        r = self._ask({"op": "room"})
        return int(r["n"]) if r else 0

    # -- new chunks -----------------------------------------------------------------------

    def reserve(self) -> int | None:
        r = self._ask({"op": "reserve"})
        slot = None if r is None else r["slot"]
        if slot is None:
            self.counters.add("writes_skipped")
            return None
        if r and r["evicted"]:
            self.counters.add("evictions")
        return int(slot)

    def reserve_many(self, n: int) -> list[int]:
        if n <= 0:
            return []
        r = self._ask({"op": "reserve_many", "n": n})
        got = [int(s) for s in r["slots"]] if r else []
        if len(got) < n:
            self.counters.add("writes_skipped", n - len(got))
        if r and r["evicted"]:
            self.counters.add("evictions", int(r["evicted"]))
        return got

    def commit(self, slot: int, lk: bytes, *, keep_pin: bool) -> bool:
        r = self._ask({"op": "commit", "slot": slot, "key": lk.hex(), "keep_pin": keep_pin})
        return bool(r and r["ok"])

    def commit_many(self, items: Sequence[tuple[int, bytes, bool]]) -> list[bool]:
        if not items:
            return []
        r = self._ask({"op": "commit_many", "items": [[s, lk.hex(), keep] for s, lk, keep in items]})
        return [bool(x) for x in r["ok"]] if r else [False] * len(items)

    def abort(self, slot: int) -> None:
        self._ask({"op": "abort", "slot": slot})

    def drop(self, lk: bytes) -> None:
        self.counters.add("corrupt")
        self.counters.add("misses")
        self._ask({"op": "drop", "key": lk.hex()})

    def reset(self) -> None:
        """Forget every chunk of this model in the host pool: every engine of it sees the reset."""
        self._ask({"op": "reset"})

    def check(self) -> None:
        self._ask({"op": "check"})

    def close(self) -> None:
        """Disconnect: the pool lets go of whatever this engine still holds."""
        self._dead = True
        with contextlib.suppress(OSError):
            self._sock.close()


def stop_pool(directory: str, timeout: float = 10.0) -> bool:
    """Stop the pool serving ``directory`` and wait until its process is gone (SIGTERM, then
    SIGKILL, if it has not ended ``timeout`` seconds after being asked); False if none ran."""
    d = os.path.abspath(os.path.expanduser(directory))
    pid = _pool_pid(d)
    sock = _try_connect(os.path.join(d, SOCKET))
    if sock is not None:
        with contextlib.closing(sock), contextlib.suppress(OSError):
            request(sock, {"op": "stop"})
    if pid is None or not _held(d):
        return sock is not None
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _held(d):
                return True
            time.sleep(0.02)
    return True


def _pool_pid(directory: str) -> int | None:
    try:
        with open(os.path.join(directory, PIDFILE)) as f:
            return int(f.read().strip() or 0) or None
    except (OSError, ValueError):
        return None


def _held(directory: str) -> bool:
    """A pool process still holds the directory's pid file lock (it is running or ending)."""
    try:
        fd = os.open(os.path.join(directory, PIDFILE), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def pool_status(directory: str) -> dict[str, Any] | None:
    path = os.path.join(os.path.abspath(os.path.expanduser(directory)), SOCKET)
    sock = _try_connect(path)
    if sock is None:
        return None
    with contextlib.closing(sock):
        return request(sock, {"op": "status"})


def stop_spawned() -> None:
    """Stop the pools this process started (tests)."""
    while _SPAWNED:
        stop_pool(_SPAWNED.pop())
