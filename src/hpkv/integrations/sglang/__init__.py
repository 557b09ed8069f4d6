"""hpkv under SGLang: an L3 storage backend for SGLang's hierarchical cache (HiCache).

SGLang loads it at run time, without a patch::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config \\
      '{"backend_name":"hpkv","module_path":"hpkv.integrations.sglang","class_name":"HpkvHiCacheStorage","interface_v1":1}'

The class lives in :mod:`hpkv.integrations.sglang.backend` (which imports SGLang); this package
re-exports it lazily so that importing hpkv never needs SGLang.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HpkvHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "HpkvHiCacheStorage":
        from hpkv.integrations.sglang.backend import HpkvHiCacheStorage

        return HpkvHiCacheStorage
    raise AttributeError(name)
