"""Config section `budgets:` (owned by the budget stage)."""
from __future__ import annotations

from pathlib import Path

import msgspec


class ModelPrice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    input: float = 0.0  # per million tokens
    cached_input: float | None = None  # per million cached prompt tokens; None = same as input
    output: float = 0.0
    gpu_second: float | None = None  # self-hosted: price per GPU-second of the engine that served it
    batch_input: float | None = None  # per million input tokens of batch-lane lines (docs/batch.md); None = input
    batch_output: float | None = None  # per million output tokens of batch-lane lines; None = output
    cache_hit: float = 0.0  # per million tokens (prompt + completion) of a response-cache hit; 0: free, no budget
    currency: str = "EUR"


class BudgetsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    store: str = "auto"  # auto | memory | sqlite | redis; auto: memory in one process, sqlite (sqlite_path) with server.workers > 1 (docs/budgets.md)
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_timeout_s: float = 1.0  # per command; a dead Redis is detected within this
    redis_retry_s: float = 1.0  # after a Redis failure, how long to wait before trying it again
    key_prefix: str = "gwb"
    on_store_error: str = "closed"  # closed | open
    fail_open_fraction: float = 1.0  # fail-open: each replica enforces this fraction of every limit locally
    sqlite_path: str = "var/budgets.db"  # default ledger, memory store's snapshot; the sqlite store's counters go beside it (budgets-counters.db)
    snapshot_interval_s: float = 5.0
    ledger: str = "sqlite"  # sqlite | postgres
    ledger_dsn: str | None = None
    spool_path: str = "var/ledger-spool.jsonl"  # outbox spool (one file per process, suffixed when taken)
    ledger_flush_s: float = 0.2
    currency: str = "EUR"  # the currency money budgets and recorded costs are kept in
    fx_rates: dict[str, float] = msgspec.field(default_factory=dict)  # 1 unit of X = rate units of `currency`
    timezone: str = "UTC"
    default_max_tokens: int = 4096
    min_completion_tokens: int = 1  # an uncapped request is admitted if at least this many tokens remain
    reserve_gpu_seconds: float | None = None  # GPU-seconds reserved per request; null: the longest request allowed
    reservation_ttl_s: float = 120.0  # hold expiry; raised to the longest request the backends allow (budgets.md)
    prices: dict[str, ModelPrice] = msgspec.field(default_factory=dict)


def effective_store(cfg: BudgetsConfig, workers: int) -> str:
    """The store a process of `gateway serve --workers <workers>` uses (pure): `auto` is the in-process memory
    store for one process and the SQLite store, shared by the workers of the host, for more."""
    if cfg.store != "auto":
        return cfg.store
    return "sqlite" if workers > 1 else "memory"


def counters_path(sqlite_path: Path) -> Path:
    """The SQLite store's file, beside `sqlite_path` (var/budgets.db -> var/budgets-counters.db): apart from the
    ledger's table there, whose batch inserts would hold the database's one write lock that every reserve and
    settle of the host's workers takes."""
    return sqlite_path.with_name(f"{sqlite_path.stem}-counters{sqlite_path.suffix or '.db'}")
