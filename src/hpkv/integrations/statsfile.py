"""Counters readable from outside the engine: a small JSON file per engine, rewritten atomically.

``hpkv stats`` and the Prometheus collector read these files. A thread of the
engine's process (:class:`Refresher`) rewrites its file (write + rename, a few
hundred bytes) within REFRESH_S of a change while the engine is idle, never the
engine's own thread: gathering every tier's counters and writing a file per step
cost each request time on the engine's critical path. A client that got its
response reads counters that include its request once the file's ``time`` is
later than the response and nothing is ``pending``.
JSON only: nothing read back can execute code.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from hpkv.core.paths import read_regular_file
from hpkv.core.procs import name_os_thread, pid_alive

log = logging.getLogger("hpkv")

SUFFIX = ".stats.json"
HEARTBEAT_S = 0.25
REFRESH_S = 0.1  # the file itself is rewritten only on a change or a heartbeat
REFRESH_BUSY_S = 1.0  # while the engine computes (each refresh gathers every tier's counters)


class StatsFile:
    def __init__(self, path: str, model: str) -> None:
        self.path = path
        self.model = model
        self._last_body = ""
        self._last_write = 0.0
        self._lock = threading.Lock()

    @classmethod
    def for_pool_dir(cls, share_mem_file_path: str, model: str) -> StatsFile:
        d = stats_dir(share_mem_file_path)
        os.makedirs(d, mode=0o700, exist_ok=True)
        for p in glob.glob(os.path.join(d, f"hpkv-*{SUFFIX}")):  # left by engines that died
            pid = _pid_of(p)
            if pid is not None and pid != os.getpid() and not pid_alive(pid):
                with contextlib.suppress(OSError):
                    os.unlink(p)
        return cls(os.path.join(d, f"hpkv-{os.getpid()}{SUFFIX}"), model)

    def write(self, produce: Callable[[], dict[str, Any]], *, force: bool = False) -> None:
        """Rewrite the file if the counters changed since the last write, if forced, or if the last
        write is older than HEARTBEAT_S (so a reader can tell a file that is current from one
        that lags: its ``time`` is recent). Counters are taken under the file's lock: two writers
        (the scheduler thread, the refresher) can never put an older snapshot after a newer one."""
        with self._lock:
            data = produce()
            body = json.dumps(data, sort_keys=True)
            now = time.monotonic()
            if body == self._last_body and not force and now - self._last_write < HEARTBEAT_S:
                return
            self._last_body = body
            self._last_write = now
            doc = {"pid": os.getpid(), "model": self.model, "time": time.time(), **data}
            tmp = f"{self.path}.tmp"
            # Never through a link planted at the temp name (O_NOFOLLOW), then renamed into place.
            # A failure (full disk, a name taken) skips this write: counters are not worth a step.
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                with os.fdopen(os.open(tmp, flags, 0o600), "w") as f:
                    json.dump(doc, f)
                os.replace(tmp, self.path)
            except OSError:
                self._last_body = ""  # try again next time

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def stats_dir(share_mem_file_path: str) -> str:
    path = os.path.abspath(os.path.expanduser(share_mem_file_path))
    return os.path.dirname(path) if path.endswith(".shm") else path


def read_all(share_mem_file_path: str) -> list[dict[str, Any]]:
    """Every live engine's counters in that directory (files of dead processes are skipped)."""
    out = []
    for p in sorted(glob.glob(os.path.join(stats_dir(share_mem_file_path), f"hpkv-*{SUFFIX}"))):
        try:
            doc = json.loads(read_regular_file(p, 1 << 20, follow=False))  # a FIFO must not block
        except (OSError, ValueError):
            continue
        pid = doc.get("pid")
        if isinstance(pid, int) and not pid_alive(pid):
            continue
        out.append(doc)
    return out


def _pid_of(path: str) -> int | None:
    name = os.path.basename(path)[len("hpkv-") : -len(SUFFIX)]
    return int(name) if name.isdigit() else None


class Refresher:
    """Keeps a stats file current between steps (background tier work, cascade writes and
    promotions, changes counters when no step runs): every REFRESH_S, or every REFRESH_BUSY_S
    while ``busy()`` says the engine computes, since gathering the counters takes CPU from the step."""

    def __init__(
        self, file: StatsFile, stats: Callable[[], dict[str, Any]], busy: Callable[[], bool]
    ) -> None:
        self._file, self._stats, self._busy = file, stats, busy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpkv-stats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        name_os_thread()
        last = 0.0
        while not self._stop.wait(REFRESH_S):
            if self._busy() and time.monotonic() - last < REFRESH_BUSY_S:
                continue  # once idle, at once
            last = time.monotonic()
            try:
                self._file.write(self._stats)
            except Exception:  # a full disk must not kill the thread; the next try may work
                log.debug("hpkv: stats file write failed", exc_info=True)

    def stop(self) -> None:
        self._stop.set()
