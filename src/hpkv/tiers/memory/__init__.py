"""The memory tier: fixed slots in shared-memory pool files (one per rank), LRU, pinning. The engine
(:mod:`hpkv.engine.catalog`) keeps the slot index; workers map the pool files to copy."""

from hpkv.tiers.memory.pool import ShmPool
from hpkv.tiers.memory.slots import SlotIndex

__all__ = ["ShmPool", "SlotIndex"]
