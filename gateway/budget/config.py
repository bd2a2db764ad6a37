"""Config section `budgets:` (owned by the budget stage)."""
from __future__ import annotations

import msgspec


class ModelPrice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    input: float = 0.0  # per million tokens
    cached_input: float | None = None
    output: float = 0.0
    gpu_second: float | None = None
    currency: str = "EUR"


class BudgetsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    store: str = "memory"  # memory | redis
    redis_url: str = "redis://127.0.0.1:6379/0"
    on_store_error: str = "closed"  # closed | open
    sqlite_path: str = "var/budgets.db"
    ledger: str = "sqlite"  # sqlite | postgres
    ledger_dsn: str | None = None
    timezone: str = "UTC"
    default_max_tokens: int = 4096
    reservation_ttl_s: float = 120.0
    prices: dict[str, ModelPrice] = msgspec.field(default_factory=dict)
