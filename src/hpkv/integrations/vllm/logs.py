"""The log lines the vLLM scheduler side writes about hits and stores: what they say and how often.

* a hit whose chunks were promoted: how long, and where that time went (:func:`staged_line`);
* chunks that found no memory slot to be stored in (:class:`PoolFullLog`, rate-limited).
"""

from __future__ import annotations

import logging
import statistics
import time
from concurrent.futures import Future

from hpkv.core.config import HpkvConfig
from hpkv.engine.interface import MEMORY, Engine
from hpkv.engine.promotion import Promotion

log = logging.getLogger("hpkv")


def staged_line(futures: list[Future[bool]], request_id: str, since: float) -> str:
    """The log line of a hit whose chunks were promoted: how many, for which request, how long
    since ``since`` (the lookup, ``time.monotonic``) and where that went: when the first read
    began and the last chunk was ready; per chunk (median) its read, the wait until a check took
    it up and its check and commit; and the share of the reads' span in which the I/O threads
    that took part were reading (below 100% they waited between reads: for the GIL, a lock, the
    queue). From the futures that are :class:`Promotion` s and finished."""
    took = (time.monotonic() - since) * 1e3
    line = f"staged {len(futures)} chunks into memory for request {request_id} in {took:.1f} ms"
    settled = [f for f in futures if isinstance(f, Promotion) and f.settled and f.checking]
    if not settled:
        return line
    first = min(f.began for f in settled) - since
    last = max(f.settled for f in settled) - since
    done = settled
    read = statistics.median(f.fetched - f.began for f in done)
    hand = statistics.median(f.checking - f.fetched for f in done)
    check = statistics.median(f.settled - f.checking for f in done)
    threads = len({f.io_thread for f in done})
    span = max(f.fetched for f in done) - min(f.began for f in done)
    busy = sum(f.fetched - f.began for f in done) / (threads * span) if span > 0 else 1.0
    return (
        f"{line} (first read began at {first * 1e3:.1f} ms, last chunk ready at {last * 1e3:.1f} ms; "
        f"per chunk, median: read {read * 1e3:.2f} ms, to a check {hand * 1e3:.2f} ms, check and commit "
        f"{check * 1e3:.2f} ms; {threads} I/O threads reading {busy:.0%} of the time" + ")"
    )


class PoolFullLog:
    """Computed chunks that found no memory slot (every slot pinned by loads in flight and by the
    write-behind's queue) reach no tier, and a revisit recomputes them: said at most once per
    ``every_s`` seconds, with how many since, the pool's state and the setting that helps."""

    def __init__(self, config: HpkvConfig, catalog: Engine, every_s: float) -> None:
        self._config, self._catalog, self._every_s = config, catalog, every_s
        self._said = 0.0
        self._since = 0

    def skipped(self, req_id: str) -> None:
        """One chunk of request ``req_id`` was not stored."""
        self._since += 1
        now = time.monotonic()
        if now - self._said < self._every_s:
            return
        mem = self._catalog.stats().get(MEMORY, {})
        log.warning(
            "hpkv: %d chunk(s) not stored (latest: request %s): every memory slot was pinned "
            "(%d of %d slots; %d chunks queued for the slower tiers). They reach no tier and a revisit "
            "recomputes them; a larger %s (now %.1f MiB) keeps up with more.",
            self._since,
            req_id,
            mem.get("pinned_slots", 0),
            mem.get("slots", 0),
            mem.get("cascade_pending", 0),
            self._config.where("mem_pool_size"),
            self._config.mem_pool_size / 2**20,
        )
        self._said, self._since = now, 0
