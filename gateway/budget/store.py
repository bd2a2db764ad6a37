"""Budget stores: where counters and holds live. One atomic reserve and one atomic settle per request.

`MemoryBudgetStore` runs the pure reference model in-process (single replica) and snapshots it to SQLite;
`RedisBudgetStore` runs the same algorithm as one Lua script (one EVALSHA round trip per call) so every replica
sharing the Redis sees one budget. Both raise `StoreUnavailable` when they cannot answer.
"""
from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import orjson

from gateway.budget.model import BudgetState, ReserveArgs, ReserveResult, SettleArgs
from gateway.stores.sql import enable_wal

log = logging.getLogger("gateway.budget.store")
LUA = (resources.files("gateway.budget") / "budget.lua").read_text(encoding="utf-8")  # package data


class StoreUnavailable(Exception):
    """The store could not be reached or answered an error; the service applies fail-closed/open."""


class BudgetStore(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def reserve(self, args: ReserveArgs) -> ReserveResult: ...

    async def settle(self, args: SettleArgs) -> bool:
        """True when applied; False when a settle with the same idempotency marker was applied before."""
        ...


class MemoryBudgetStore:
    """Single-replica store: the reference model in memory, snapshotted to SQLite every interval and at close.

    Operations are synchronous Python between awaits, so each reserve/settle is atomic on the event loop.
    """

    def __init__(self, sqlite_path: Path | None = None, snapshot_interval_s: float = 5.0, name: str = "memory") -> None:
        self.path = sqlite_path
        self.interval = snapshot_interval_s
        self.name = name
        self.state = BudgetState()
        self._task: asyncio.Task[None] | None = None
        self._dirty = False

    async def start(self) -> None:
        if self.path is not None:
            loaded = await asyncio.to_thread(self._load)
            if loaded is not None:
                self.state = BudgetState.from_state(loaded)
            self._task = asyncio.create_task(self._snapshot_loop(), name="budget-snapshot")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self.path is not None:
            await self.snapshot()

    async def reserve(self, args: ReserveArgs) -> ReserveResult:
        self._dirty = True
        return ReserveResult.from_flat(self.state.reserve(args), args)

    async def settle(self, args: SettleArgs) -> bool:
        self._dirty = True
        return self.state.settle(args) == 1

    async def snapshot(self) -> None:
        """Write the whole state as one row (small: counters are bucketed, holds are short-lived)."""
        if self.path is None:
            return
        self.state.gc(time.time())
        blob = orjson.dumps(self.state.to_state())
        self._dirty = False
        await asyncio.to_thread(self._save, blob)

    def _connect(self) -> sqlite3.Connection:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=5.0)
        enable_wal(db)
        db.execute("CREATE TABLE IF NOT EXISTS budget_state (name TEXT PRIMARY KEY, state BLOB, saved_at REAL)")
        return db

    def _save(self, blob: bytes) -> None:
        db = self._connect()
        try:
            with db:
                db.execute("INSERT INTO budget_state VALUES (?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
                           "state=excluded.state, saved_at=excluded.saved_at", (self.name, blob, time.time()))
        finally:
            db.close()

    def _load(self) -> dict[str, Any] | None:
        db = self._connect()
        try:
            row = db.execute("SELECT state FROM budget_state WHERE name=?", (self.name,)).fetchone()
        finally:
            db.close()
        return orjson.loads(row[0]) if row else None

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if self._dirty:
                try:
                    await self.snapshot()
                except Exception:
                    log.exception("budget snapshot to %s failed; will retry", self.path)


class RedisBudgetStore:
    """Multi-replica store: the Lua script over all keys of a request, one EVALSHA per reserve/settle.

    redis-py's Script reloads the script after NOSCRIPT (e.g. a restarted Redis) transparently.
    """

    def __init__(self, url: str, timeout_s: float = 1.0, max_connections: int = 64) -> None:
        import redis.asyncio as aioredis

        self.url = url
        # a blocking pool: a burst waits for a free connection instead of failing as "store unavailable"
        pool = aioredis.BlockingConnectionPool.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, max_connections=max_connections,
            timeout=5.0, retry_on_timeout=False, health_check_interval=0)
        self.client = aioredis.Redis(connection_pool=pool)
        self.script = self.client.register_script(LUA)

    async def start(self) -> None:
        try:
            await self.client.script_load(LUA)
        except Exception as e:  # start anyway: the service's failure mode decides, and recovery is automatic
            log.warning("budget redis %s unreachable at start: %s", _safe_url(self.url), e)

    async def close(self) -> None:
        await self.client.aclose()

    async def reserve(self, args: ReserveArgs) -> ReserveResult:
        flat = await self._call(args.keys(), args.to_wire())
        return ReserveResult.from_flat(flat, args)

    async def settle(self, args: SettleArgs) -> bool:
        return int(await self._call(args.keys(), args.to_wire())) == 1

    async def _call(self, keys: list[str], wire: dict[str, Any]) -> Any:
        from redis.exceptions import ConnectionError as RedisConnectionError, RedisError

        try:
            return await self.script(keys=keys, args=[orjson.dumps(wire)])
        except (RedisError, OSError, asyncio.TimeoutError) as e:
            # no blind retry here: a reserve whose reply was lost must not hold twice (the caller answers 503);
            # settles are replayed by the service, made idempotent by their marker key.
            # Drop pooled sockets so the next call after a Redis restart starts on fresh connections.
            if isinstance(e, (RedisConnectionError, OSError)):
                await self.client.connection_pool.disconnect(inuse_connections=False)
            raise StoreUnavailable(f"budget redis: {type(e).__name__}: {e}") from e


def _safe_url(url: str) -> str:
    """A Redis URL without its password, for logs."""
    if "@" in url:
        scheme, rest = url.split("://", 1) if "://" in url else ("", url)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
