"""Config section `cache:` (owned by the response cache, gateway/cache)."""
from __future__ import annotations

import msgspec


class CacheLocation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    country: str  # ISO 3166-1 alpha-2 where the in-process store keeps entries (the gateway's own node)


class CacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The response cache. Off for every request unless a policy rule sets `cache:` (docs/cache.md)."""

    store: str = "memory"  # "memory" (in process, per replica), "sqlite" (one node, survives restart) or "redis" (shared by replicas)
    location: CacheLocation | None = None  # where the configured store keeps entries (the node for memory/sqlite, the Redis server for redis); null: requests with a residency restriction are never stored
    max_entries: int = 10000  # store bound (least recently used entries evicted beyond it)
    max_partition_entries: int = 1000  # sqlite/redis: semantic candidates kept per partition (least recently used lose theirs first)
    sqlite_path: str | None = None  # store sqlite: the database file; null: <data_dir>/cache.db
    redis_url: str | None = None  # store redis: e.g. redis://cache.internal:6379/2 (required)
    redis_key_prefix: str = "gwcache"  # store redis: every key starts with it (a dedicated prefix or db per deployment)
    redis_timeout_s: float = 0.5  # store redis: a slower answer is a miss (lookups) or a skipped store (puts)
    max_entry_bytes: int = 262144  # a larger response is not stored
    max_temperature: float = 1.0  # requests sampling above this temperature never cache (absent temperature counts as 1.0)
    default_ttl_s: float = 300.0  # a rule's `cache` without ttl_s
    default_similarity: float = 0.86  # a semantic rule's `cache` without similarity: no near-miss false hit from 0.84 up with either embedder, 0.86 keeps a step of margin (docs/benchmarks.md, "Response cache")
    embedder: str = "wordllama"  # semantic tier: "wordllama" (the bundled wordllama model, 256 dims, offline), "lexical" (hashed word/char n-grams, no model) or "backend"
    embeddings_model: str | None = None  # embedder backend: a model served at /v1/embeddings by one of the gateway's backends (residency-checked)
    embeddings_timeout_s: float = 2.0  # embedder backend: a slower answer is a cache miss, never an error
