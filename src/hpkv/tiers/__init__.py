"""Storage tiers. Each imports only ``hpkv.core``."""
