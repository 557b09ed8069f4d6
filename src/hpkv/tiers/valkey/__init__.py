"""The remote tier: one Valkey (or Redis) key per chunk, shared by engines on many machines."""

from hpkv.tiers.valkey.client import ValkeySettings
from hpkv.tiers.valkey.tier import ValkeyConnection, ValkeyTier, from_config

__all__ = ["ValkeyConnection", "ValkeySettings", "ValkeyTier", "from_config"]
