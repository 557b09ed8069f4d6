"""The storage tier: one file per chunk under fan-out directories, LRU by capacity."""

from hpkv.tiers.disk.tier import StorageTier, from_config

__all__ = ["StorageTier", "from_config"]
