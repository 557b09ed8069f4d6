"""Counters readable from outside the engine: a small JSON file per engine, rewritten atomically.

``hpkv stats`` and the Prometheus collector read these files; the scheduler
process rewrites its file (write + rename, a few hundred bytes) after each
step that changed a counter, so a client that got its response can read
counters that already include its request.
JSON only: nothing read back can execute code.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from hpkv.core.procs import pid_alive

SUFFIX = ".stats.json"


class StatsFile:
    def __init__(self, path: str, model: str) -> None:
        self.path = path
        self.model = model
        self._last_body = ""
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
        """Rewrite the file if the counters changed since the last write (or if forced)."""
        data = produce()
        body = json.dumps(data, sort_keys=True)
        with self._lock:
            if body == self._last_body and not force:
                return
            self._last_body = body
            doc = {"pid": os.getpid(), "model": self.model, "time": time.time(), **data}
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self.path)

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
            with open(p) as f:
                doc = json.load(f)
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
