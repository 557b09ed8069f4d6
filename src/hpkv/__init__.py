"""hpkv: a hierarchical KV cache for LLM serving.

>>> from hpkv import HpkvConfig, KVLayout, KVStore
"""

from hpkv.core.config import HpkvConfig
from hpkv.core.errors import HpkvConfigError, HpkvError, HpkvTierError
from hpkv.core.layout import KVLayout
from hpkv.engine.store import KVStore

__all__ = ["HpkvConfig", "HpkvConfigError", "HpkvError", "HpkvTierError", "KVLayout", "KVStore"]
__version__ = "0.1.0"
