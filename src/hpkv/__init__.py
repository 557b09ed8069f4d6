"""hpkv: a hierarchical KV cache for LLM serving.

>>> from hpkv import HpkvConfig, KVLayout, KVStore

The names are imported when first used, so that a process needing only ``hpkv.core`` (the CLI's
``hpkv stats``, vLLM's plugin registration) starts without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpkv.core.config import HpkvConfig
    from hpkv.core.errors import HpkvConfigError, HpkvError, HpkvTierError
    from hpkv.core.layout import KVLayout
    from hpkv.integrations.library.store import KVStore

__all__ = ["HpkvConfig", "HpkvConfigError", "HpkvError", "HpkvTierError", "KVLayout", "KVStore"]
__version__ = "0.1.0"

_WHERE = {
    "HpkvConfig": "hpkv.core.config",
    "HpkvConfigError": "hpkv.core.errors",
    "HpkvError": "hpkv.core.errors",
    "HpkvTierError": "hpkv.core.errors",
    "KVLayout": "hpkv.core.layout",
    "KVStore": "hpkv.integrations.library.store",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpkv' has no attribute {name!r}")
