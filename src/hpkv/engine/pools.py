"""The memory tier an engine gets: its pool files mapped (one per served rank) and who decides which
slot holds what — the host pool shared by every engine on the host (:mod:`hpkv.tiers.memory.hostpool`),
or a pool of the engine's own (``HPKV_MEMORY_POOL=engine``, or a pool path naming one file)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hpkv.core.config import HpkvConfig
from hpkv.tiers.memory.bookkeeping import MemorySlots, Slots
from hpkv.tiers.memory.hostslots import HostSlots, host_group, uses_host_pool
from hpkv.tiers.memory.pool import ShmPool, check_holds_a_chunk, pool_file_path


@dataclass
class MemoryTier:
    pools: list[ShmPool]  # index i: rank ranks[i]; empty with no memory tier
    slots: Slots
    close: Callable[[], None] | None = None  # let go of the host pool (its files stay)


def open_memory(
    config: HpkvConfig,
    ranks: Sequence[int],
    world_size: int,
    logical_digest: bytes,
    slot_bytes: int,
    adopt_pools: Sequence[str | None] | None = None,
) -> MemoryTier:
    """The memory tier for ``ranks`` of a model (``logical_digest``) of ``world_size`` ranks.
    ``adopt_pools``: per rank, a pool file another process made for this one (an engine's own pool
    only, see :meth:`ShmPool.adopt`)."""
    if config.mem_pool_size <= 0:
        return MemoryTier([], MemorySlots(0))
    check_holds_a_chunk(
        config.mem_pool_size,
        slot_bytes,
        config.chunk_size,
        config.where("mem_pool_size"),
        config.example("mem_pool_size"),
    )
    pools: list[ShmPool] = []
    if uses_host_pool(config):
        host = HostSlots(config, host_group(logical_digest), world_size, slot_bytes, config.mem_pool_size)
        try:
            for r in ranks:
                pools.append(ShmPool.map_shared(host.paths[r], host.size, prefault=True))
        except BaseException:
            for p in pools:
                p.close()
            host.close()
            raise
        return MemoryTier(pools, host, host.close)
    tag = logical_digest.hex()[:6]
    try:
        for i, r in enumerate(ranks):
            offered = adopt_pools[i] if adopt_pools else None
            adopted = ShmPool.adopt(offered, config.mem_pool_size) if offered else None
            if adopted is not None:
                pools.append(adopted)
                continue
            pools.append(
                ShmPool(
                    pool_file_path(config.share_mem_file_path, f"{tag}r{r}"),
                    config.mem_pool_size,
                    where=config.where("mem_pool_size"),
                    path_where=config.where("share_mem_file_path"),
                    shared_group=config.shared_group,
                )
            )
    except BaseException:
        for p in pools:
            p.close()
        raise
    return MemoryTier(pools, MemorySlots(config.mem_pool_size // slot_bytes))
