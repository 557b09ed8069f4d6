"""The memory tier: fixed slots in one shared-memory file, LRU, pinning."""

from hpkv.tiers.memory.tier import MemoryTier, SlotRef

__all__ = ["MemoryTier", "SlotRef"]
