"""Per-tier counters, safe to bump from any thread."""

from __future__ import annotations

import threading

COUNTERS = (
    "hits",  # chunks served
    "misses",  # chunks asked for and not served (absent, evicted, or failed verification)
    "corrupt",  # records that failed verification (also counted in misses)
    "bytes_read",
    "bytes_written",
    "writes",  # records written
    "writes_skipped",  # writes not done: no room, or the cascade queue was full
    "evictions",
    "errors",  # I/O errors (ENOSPC, EIO, EACCES, ...)
    "promotions",  # chunks copied up into this tier from a slower one
)


class TierStats:
    """Counters of one tier. ``snapshot()`` adds the gauges the tier reports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def snapshot(self, **gauges: int) -> dict[str, int]:
        with self._lock:
            out = dict(self._c)
        out.update(gauges)
        return out
