"""Counters readable from outside the engine: a small JSON file per engine, rewritten atomically.

``hpkv stats`` and the Prometheus collector read these files; the scheduler
process writes its file at most every ``MIN_INTERVAL_S`` unless forced, and
always after a step that changed something a test or an operator waits for.
JSON only: nothing read back can execute code.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import time
from collections.abc import Callable
from typing import Any

MIN_INTERVAL_S = 0.05
SUFFIX = ".stats.json"


class StatsFile:
    def __init__(self, path: str, model: str) -> None:
        self.path = path
        self.model = model
        self._last = 0.0
        self._last_body = ""

    @classmethod
    def for_pool_dir(cls, share_mem_file_path: str, model: str) -> StatsFile:
        d = stats_dir(share_mem_file_path)
        os.makedirs(d, mode=0o700, exist_ok=True)
        return cls(os.path.join(d, f"hpkv-{os.getpid()}{SUFFIX}"), model)

    def write(self, produce: Callable[[], dict[str, Any]], *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < MIN_INTERVAL_S:
            return
        data = produce()
        body = json.dumps(data, sort_keys=True)
        if body == self._last_body and not force:
            return
        self._last, self._last_body = now, body
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
        if isinstance(pid, int) and not _alive(pid):
            continue
        out.append(doc)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
