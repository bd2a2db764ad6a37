"""Spend ledger outbox: rows leave the hot path as an in-memory append plus one O_APPEND write to a local
spool file, and a background task drains them in batches into SQLite or Postgres.

A database error keeps rows queued and retried with backoff; a process crash keeps them in the spool, which
the next start (of any process using the same spool path) replays. Inserts are idempotent by request id
(ON CONFLICT DO NOTHING), so replays never double-count.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import sqlite3
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable, Protocol

import orjson

from gateway.budget.dimensions import LEDGERED
from gateway.stores.sql import enable_wal

log = logging.getLogger("gateway.budget.ledger")

COLUMNS: tuple[str, ...] = ("request_id", "ts", "principal_id", "tenant", "team", "project", "key_id", "partner", "end_user",
           "model", "backend", "prompt_tokens", "completion_tokens", "cached_tokens", "total_tokens", "cost",
           "currency", "gpu_seconds", "status", "cut_by_budget", "budget_store", "client_request_id",
           # unit economics (gateway/cost, docs/cost.md): `cost` above is the price charged; these are the
           # engine time apportioned to the request, what that cost the platform (in cost.currency), the
           # request's category and the GPU-seconds it saved (prefix/response cache) or wasted
           "engine", "gpu_seconds_apportioned", "engine_cost", "cost_basis", "cost_category",
           "saved_gpu_seconds", "wasted_gpu_seconds", "retries",
           # a response-cache hit (docs/cache.md#price): the tokens it answered without the GPU and the money
           # saved (its normal price minus what it was charged, in the budget currency, as `cost`)
           "saved_tokens", "saved_cost",
           # the tenant-owned LoRA adapter used and the weighted alias's arm ("<alias>:<arm>", a shadow copy's
           # with " (shadow)") of the request (gateway/cost/dims.py; NULL: none)
           "adapter", "arm")
# Columns added after the first release: an existing table gets them on open (ALTER TABLE ... ADD COLUMN).
_ADDED: tuple[str, ...] = ("client_request_id", "engine", "gpu_seconds_apportioned", "engine_cost", "cost_basis", "cost_category",
          "saved_gpu_seconds", "wasted_gpu_seconds", "retries", "saved_tokens", "saved_cost", "adapter", "arm")
_TYPES_SQL = {"ts": "DOUBLE PRECISION", "prompt_tokens": "BIGINT", "completion_tokens": "BIGINT",
              "cached_tokens": "BIGINT", "total_tokens": "BIGINT", "cost": "DOUBLE PRECISION",
              "gpu_seconds": "DOUBLE PRECISION", "status": "INTEGER", "cut_by_budget": "BOOLEAN",
              "gpu_seconds_apportioned": "DOUBLE PRECISION", "engine_cost": "DOUBLE PRECISION",
              "saved_gpu_seconds": "DOUBLE PRECISION", "wasted_gpu_seconds": "DOUBLE PRECISION",
              "retries": "INTEGER", "saved_tokens": "BIGINT", "saved_cost": "DOUBLE PRECISION"}
# a budget dimension's ledger column (gateway/budget/dimensions.py) that is not one of the above: added at the end
_DIMENSION_COLUMNS = {d.ledger: "BIGINT" if d.number is int else "DOUBLE PRECISION"
                      for d in LEDGERED if d.ledger and d.ledger not in COLUMNS}
COLUMNS += tuple(_DIMENSION_COLUMNS)
_ADDED += tuple(_DIMENSION_COLUMNS)
_TYPES_SQL.update(_DIMENSION_COLUMNS)


def _ddl(table: str) -> str:
    cols = ", ".join(f"{c} {_TYPES_SQL.get(c, 'TEXT')}" + (" PRIMARY KEY" if c == "request_id" else "")
                     for c in COLUMNS)
    return f"CREATE TABLE IF NOT EXISTS {table} ({cols})"


class LedgerSink(Protocol):
    async def open(self) -> None: ...

    async def write(self, rows: list[dict[str, Any]]) -> None: ...

    async def close(self) -> None: ...


class SqliteSink:
    """Ledger rows in a local SQLite file (the default, single host)."""

    def __init__(self, path: Path, table: str = "budget_ledger") -> None:
        self.path = path
        self.table = table
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    async def open(self) -> None:
        await asyncio.to_thread(self._init)

    def _conn(self) -> sqlite3.Connection:
        # One connection for the drainer (writes are serialised by the lock); WAL with synchronous=NORMAL
        # survives a process crash, and the outbox spool covers rows not yet committed.
        if self._db is None:
            db = sqlite3.connect(self.path, timeout=5.0, check_same_thread=False)
            enable_wal(db)
            db.execute("PRAGMA synchronous=NORMAL")
            self._db = db
        return self._db

    def _init(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            db = self._conn()
            db.execute(_ddl(self.table))
            have = {r[1] for r in db.execute(f"PRAGMA table_info({self.table})")}
            for c in _ADDED:
                if c not in have:
                    db.execute(f"ALTER TABLE {self.table} ADD COLUMN {c} {_TYPES_SQL.get(c, 'TEXT')}")

    async def write(self, rows: list[dict[str, Any]]) -> None:
        await asyncio.to_thread(self._write, rows)

    def _write(self, rows: list[dict[str, Any]]) -> None:
        with self._lock:
            db = self._conn()
            try:
                with db:
                    db.executemany(
                        f"INSERT INTO {self.table} ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))}) "
                        "ON CONFLICT(request_id) DO NOTHING", [tuple(map(r.get, COLUMNS)) for r in rows])
            except sqlite3.Error:
                db.close()  # reopen on the next try (file replaced, disk error, ...)
                self._db = None
                raise

    async def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


class PostgresSink:
    """Ledger rows in Postgres via asyncpg (multi-replica deployments)."""

    def __init__(self, dsn: str, table: str = "budget_ledger") -> None:
        self.dsn = dsn
        self.table = table
        self.pool: Any = None

    async def _pool(self) -> Any:
        import asyncpg

        if self.pool is None:
            self.pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=2, timeout=5.0)
            async with self.pool.acquire() as c:
                await c.execute(_ddl(self.table))
                for col in _ADDED:
                    await c.execute(f"ALTER TABLE {self.table} ADD COLUMN IF NOT EXISTS {col} "
                                    f"{_TYPES_SQL.get(col, 'TEXT')}")
        return self.pool

    async def open(self) -> None:
        try:
            await self._pool()
        except Exception as e:  # the drainer retries; the gateway serves meanwhile
            log.warning("ledger postgres not reachable at start: %s", type(e).__name__)

    async def write(self, rows: list[dict[str, Any]]) -> None:
        pool = await self._pool()
        ph = ", ".join(f"${i + 1}" for i in range(len(COLUMNS)))
        try:
            async with pool.acquire() as c:
                await c.executemany(
                    f"INSERT INTO {self.table} ({', '.join(COLUMNS)}) VALUES ({ph}) "
                    "ON CONFLICT (request_id) DO NOTHING", [tuple(map(r.get, COLUMNS)) for r in rows])
        except (OSError, ConnectionError) as e:
            await self._reset()
            raise e
        except Exception as e:
            if "connection" in type(e).__name__.lower() or "Interface" in type(e).__name__:
                await self._reset()
            raise

    async def _reset(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.terminate()

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
            self.pool = None


class Ledger:
    """The outbox: `enqueue` is cheap and synchronous; `start` replays spools and drains in the background."""

    def __init__(self, sink: LedgerSink, spool_path: Path, flush_s: float = 0.2, batch: int = 500) -> None:
        self.sink = sink
        self.spool_base = spool_path
        self.flush_s = flush_s
        self.batch = batch
        self.queue: deque[dict[str, Any]] = deque()
        self.written = 0
        self.failures = 0
        self._fd: int | None = None
        self.spool_path: Path | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        # spool lines of rows enqueued during this event-loop iteration, written by one os.write at its end
        # instead of one per request (several rows per write at saturation); the crash window is the same
        # iteration either way: a row is spooled before the loop next waits for I/O
        self._spool_buf: list[bytes] = []
        # called with each row before it is queued, to add fields other subsystems own (gateway/cost adds the
        # apportioned engine time and its cost); a failing one is logged, the row is still recorded
        self.enrichers: list[Callable[[dict[str, Any]], None]] = []

    @classmethod
    def from_config(cls, config: Any) -> "Ledger":
        b = config.raw.budgets
        if b.ledger == "postgres":
            if not b.ledger_dsn:
                raise ValueError("budgets.ledger is postgres but budgets.ledger_dsn is not set")
            sink: LedgerSink = PostgresSink(os.path.expandvars(b.ledger_dsn))
        else:
            sink = SqliteSink(config.resolve_path(b.sqlite_path))
        return cls(sink, config.resolve_path(b.spool_path), b.ledger_flush_s)

    # -- spool: one locked file per live process; unlocked ones belong to dead processes and are replayed
    def _open_spool(self) -> None:
        self.spool_base.parent.mkdir(parents=True, exist_ok=True)
        for i in range(64):
            p = self.spool_base if i == 0 else self.spool_base.with_name(f"{self.spool_base.name}.{i}")
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._fd, self.spool_path = fd, p
            return
        raise RuntimeError(f"no free ledger spool next to {self.spool_base}")

    def _replay_spools(self) -> None:
        """Load rows from our spool and from spools no live process holds (a crashed replica's)."""
        assert self.spool_path is not None and self._fd is not None  # _open_spool ran first
        cands = [self.spool_base] + sorted(self.spool_base.parent.glob(self.spool_base.name + ".*"))
        for p in cands:
            if not p.exists():
                continue
            if p == self.spool_path:
                self.queue.extend(self._read(p))  # left by our own previous run; stays spooled until written
                continue
            fd = os.open(p, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                rows = self._read(p)
                for r in rows:  # move into our spool so they survive until written
                    os.write(self._fd, orjson.dumps(r) + b"\n")
                self.queue.extend(rows)
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)

    @staticmethod
    def _read(p: Path) -> list[dict[str, Any]]:
        rows = []
        for line in p.read_bytes().splitlines():
            try:
                rows.append(orjson.loads(line))
            except orjson.JSONDecodeError:  # a torn last line from a crash mid-write
                continue
        return rows

    def check_config(self, config: Any) -> None:
        """A reload (gateway.app.Reloadable): a ledger's sink and spool are read once, at start."""

    def swap_config(self, config: Any) -> None:
        """Nothing to swap: the sink and spool stay until a restart."""

    async def start(self) -> None:
        self._open_spool()
        self._replay_spools()
        try:
            await self.sink.open()
        except Exception:
            log.exception("ledger sink open failed; rows stay spooled and are retried")
        self._task = asyncio.create_task(self._drain_loop(), name="ledger-drain")

    def enqueue(self, row: dict[str, Any]) -> None:
        """Queue one spend row (never blocks on the database)."""
        for enrich in self.enrichers:
            try:
                enrich(row)
            except Exception:
                log.exception("ledger enricher failed for %s", row.get("request_id"))
        if self._fd is not None:
            self._spool_buf.append(orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE))
            if len(self._spool_buf) == 1:
                try:
                    asyncio.get_running_loop().call_soon(self._write_spool)
                except RuntimeError:  # no loop running (scripts): write at once
                    self._write_spool()
        self.queue.append(row)
        if len(self.queue) >= self.batch:
            self._wake.set()

    async def flush(self) -> bool:
        """Write everything queued now; True when the queue is empty afterwards."""
        while self.queue:
            rows = [self.queue[i] for i in range(min(self.batch, len(self.queue)))]
            try:
                await self.sink.write(rows)
            except Exception as e:
                self.failures += 1
                log.warning("ledger write of %d rows failed (%s); kept for retry", len(rows), type(e).__name__)
                return False
            for _ in rows:
                self.queue.popleft()
            self.written += len(rows)
        if self._fd is not None and not self.queue:  # synchronous with enqueue: nothing can slip in between
            self._spool_buf.clear()  # lines of rows the sink now holds
            os.ftruncate(self._fd, 0)
        return True

    def _write_spool(self) -> None:
        if self._spool_buf and self._fd is not None:
            data = b"".join(self._spool_buf)
            self._spool_buf.clear()
            os.write(self._fd, data)

    async def _drain_loop(self) -> None:
        backoff = self.flush_s
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=backoff)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            ok = await self.flush()
            backoff = self.flush_s if ok else min(backoff * 2, 5.0)

    async def close(self, timeout_s: float = 5.0) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        try:
            await asyncio.wait_for(self.flush(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("ledger close: %d rows left in the spool for the next start", len(self.queue))
        await self.sink.close()
        self._write_spool()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
