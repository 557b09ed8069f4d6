"""What the scheduler says when a computed chunk finds no memory slot to be stored in.

Every slot pinned (loads in flight, write-behind the slower tiers have not taken yet): the chunk
reaches no tier, and a later revisit recomputes it. Said at most once per ``every_s`` seconds,
with how many were skipped since, the pool's state and the setting that helps.
"""

from __future__ import annotations

import logging
import time

from hpkv.core.config import HpkvConfig
from hpkv.engine.catalog import MEMORY, Catalog

log = logging.getLogger("hpkv")


class PoolFullLog:
    def __init__(self, config: HpkvConfig, catalog: Catalog, every_s: float) -> None:
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
            self._catalog.num_slots,
            mem.get("cascade_pending", 0),
            self._config.where("mem_pool_size"),
            self._config.mem_pool_size / 2**20,
        )
        self._said, self._since = now, 0
