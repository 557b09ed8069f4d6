"""The storage tier: one file per chunk under fan-out directories, LRU by capacity.

``StorageTier`` and ``from_config`` are imported when first used: :mod:`hpkv.tiers.disk.io` alone
(what the I/O process reads with) needs neither torch nor the settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpkv.tiers.disk.tier import StorageTier, from_config

__all__ = ["StorageTier", "from_config"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hpkv.tiers.disk import tier

        return getattr(tier, name)
    raise AttributeError(f"module 'hpkv.tiers.disk' has no attribute {name!r}")
