"""PostgreSQL identity store (asyncpg) with change events over LISTEN/NOTIFY.

Every mutation calls pg_notify in its own transaction, so all replicas listening on the channel drop the
affected cache entries within milliseconds of commit. If the listening connection breaks, the listener
reconnects and reports "*" (flush everything); the service's cache TTL bounds staleness meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import re
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import asyncpg

from gateway.identity.store import EventCallback, Row, SqlIdentityStore
from gateway.stores.sql import to_dollar

log = logging.getLogger("gateway.identity.postgres")
_SCHEMA = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class _PgTx:
    def __init__(self, conn: asyncpg.Connection, channel: str, cache: dict[str, str]) -> None:
        self.conn = conn
        self.channel = channel
        self.cache = cache

    def _sql(self, sql: str) -> str:
        s = self.cache.get(sql)
        if s is None:
            s = self.cache[sql] = to_dollar(sql)
        return s

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        return list(await self.conn.fetch(self._sql(sql), *args))

    async def execute(self, sql: str, *args: Any) -> None:
        await self.conn.execute(self._sql(sql), *args)

    async def notify(self, event: str) -> None:
        await self.conn.execute("SELECT pg_notify($1, $2)", self.channel, event)


class PostgresIdentityStore(SqlIdentityStore):
    def __init__(self, dsn: str, schema: str | None = None, channel: str = "gateway_identity",
                 reconnect_s: float = 1.0) -> None:
        if schema is not None and not _SCHEMA.match(schema):
            raise ValueError("postgres schema must match [a-z_][a-z0-9_]*")
        self.dsn = dsn
        self.schema = schema
        self.channel = channel if schema is None else f"{channel}_{schema}"[:63]
        self.reconnect_s = reconnect_s
        self._pool: asyncpg.Pool | None = None
        self._sql_cache: dict[str, str] = {}
        self._listeners: list[EventCallback] = []
        self._listen_conn: asyncpg.Connection | None = None
        self._watch: asyncio.Task[None] | None = None
        self._closing = False

    def _settings(self) -> dict[str, str]:
        return {"search_path": self.schema} if self.schema else {}

    async def open(self) -> None:
        if self.schema:
            conn = await asyncpg.connect(self.dsn)
            try:
                await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
            except asyncpg.UniqueViolationError:  # two replicas creating it at once
                pass
            finally:
                await conn.close()
        self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=10, server_settings=self._settings())

    async def close(self) -> None:
        self._closing = True
        if self._watch is not None:
            self._watch.cancel()
            try:
                await self._watch
            except (asyncio.CancelledError, Exception):
                pass
        if self._listen_conn is not None and not self._listen_conn.is_closed():
            await self._listen_conn.close()
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @asynccontextmanager
    async def _tx(self) -> AsyncIterator[_PgTx]:
        assert self._pool is not None, "store not opened"
        async with self._pool.acquire() as conn, conn.transaction():
            yield _PgTx(conn, self.channel, self._sql_cache)

    async def _migrate_lock(self, tx: Any) -> None:
        await tx.conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", f"gw_identity_migrate:{self.schema}")

    async def _is_unique_violation(self, e: BaseException) -> bool:
        return isinstance(e, asyncpg.UniqueViolationError)

    # ---- LISTEN/NOTIFY
    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        for cb in self._listeners:
            cb(payload)

    async def _connect_listener(self) -> None:
        conn = await asyncpg.connect(self.dsn, server_settings=self._settings())
        await conn.add_listener(self.channel, self._on_notify)
        self._listen_conn = conn

    async def listen(self, callback: EventCallback) -> None:
        self._listeners.append(callback)
        if self._listen_conn is None:
            await self._connect_listener()
            self._watch = asyncio.create_task(self._watchdog())

    async def _watchdog(self) -> None:
        """Reconnect a broken listener; everything may have changed meanwhile, so flush ("*")."""
        while not self._closing:
            await asyncio.sleep(self.reconnect_s)
            if self._listen_conn is not None and not self._listen_conn.is_closed():
                continue
            try:
                await self._connect_listener()
                log.warning("identity change listener reconnected; flushing caches")
                for cb in self._listeners:
                    cb("*")
            except (OSError, asyncpg.PostgresError) as e:
                log.warning("identity change listener reconnect failed: %s", type(e).__name__)
