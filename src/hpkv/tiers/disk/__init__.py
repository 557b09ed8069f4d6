"""The storage tier: one file per chunk under fan-out directories, LRU by capacity."""

from hpkv.tiers.disk.tier import StorageTier

__all__ = ["StorageTier"]
