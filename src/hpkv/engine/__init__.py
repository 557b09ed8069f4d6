"""The store that composes tiers: lookups across tiers, promotion, write-behind cascade."""
