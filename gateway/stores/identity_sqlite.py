"""SQLite identity store: the embedded default, created on first run (WAL, foreign keys on).

Single replica: change events go straight to the in-process listener after commit. Other processes on the
same file (e.g. the `gateway keys` CLI) are seen through the service's cache TTL.
"""
from __future__ import annotations

import asyncio
import sqlite3
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import aiosqlite

from gateway.identity.store import EventCallback, Row, SqlIdentityStore
from gateway.stores.sql import open_sqlite


class _SqliteTx:
    def __init__(self, conn: aiosqlite.Connection) -> None:
        self.conn = conn
        self.events: list[str] = []

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        async with self.conn.execute(sql, args) as cur:
            return list(await cur.fetchall())

    async def execute(self, sql: str, *args: Any) -> None:
        await self.conn.execute(sql, args)

    def notify(self, event: str) -> None:
        self.events.append(event)


class SqliteIdentityStore(SqlIdentityStore):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._conn: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()
        self._listeners: list[EventCallback] = []

    async def open(self) -> None:
        self._conn = await open_sqlite(self.path, "foreign_keys=ON")

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def listen(self, callback: EventCallback) -> None:
        self._listeners.append(callback)

    @asynccontextmanager
    async def _tx(self) -> AsyncIterator[_SqliteTx]:
        assert self._conn is not None, "store not opened"
        async with self._lock:
            tx = _SqliteTx(self._conn)
            await self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield tx
            except BaseException:
                await self._conn.execute("ROLLBACK")
                raise
            await self._conn.execute("COMMIT")
        for ev in tx.events:
            for cb in self._listeners:
                cb(ev)

    async def _is_unique_violation(self, e: BaseException) -> bool:
        return isinstance(e, sqlite3.IntegrityError) and ("UNIQUE" in str(e) or "PRIMARY KEY" in str(e))
