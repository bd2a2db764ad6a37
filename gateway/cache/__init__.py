"""Response cache: exact and semantic tiers, chosen per policy rule, partitioned by authorization (docs/cache.md)."""
