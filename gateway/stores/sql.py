"""SQL plumbing shared by the stores written once with `?` placeholders (identity, batch): the rewrite to
asyncpg's `$n` placeholders, and the SQLite connection every SQLite store opens the same way."""
from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

_Q = re.compile(r"\?")
WAL_WITHIN_S = 15.0  # how long opening a database keeps retrying the switch to WAL while another process holds it


def to_dollar(sql: str) -> str:
    """Rewrite `?` placeholders to asyncpg's `$1, $2, ...`."""
    n = 0

    def sub(_: re.Match[str]) -> str:
        nonlocal n
        n += 1
        return f"${n}"

    return _Q.sub(sub, sql)


def is_locked(e: sqlite3.OperationalError) -> bool:
    """SQLITE_BUSY / SQLITE_LOCKED: another connection holds a lock this statement needs."""
    msg = str(e)
    return "database is locked" in msg or "database table is locked" in msg or "busy" in msg


def _wal_retry_delays(within_s: float):  # type: ignore[no-untyped-def]
    deadline, delay = time.monotonic() + within_s, 0.005
    while time.monotonic() < deadline:
        yield delay
        delay = min(delay * 2, 0.2)


def enable_wal(db: sqlite3.Connection, within_s: float = WAL_WITHIN_S) -> None:
    """`PRAGMA journal_mode=WAL`, retried while another connection holds the database. Worker processes of
    `gateway serve --workers N` open one new database file at the same moment; switching it to WAL needs an
    exclusive lock, and SQLite answers the second connection "database is locked" at once, without calling its
    busy handler (two connections upgrading their shared locks would deadlock), so a timeout does not help."""
    for delay in _wal_retry_delays(within_s):
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if not is_locked(e):
                raise
            time.sleep(delay)
    db.execute("PRAGMA journal_mode=WAL")  # the last try raises what SQLite says


async def open_sqlite(path: Path, *pragmas: str) -> Any:
    """An aiosqlite connection in autocommit mode (the stores issue BEGIN IMMEDIATE themselves), rows as
    `aiosqlite.Row`, WAL (retried as `enable_wal` does) and a 5 s busy timeout, plus the store's own `pragmas`
    (e.g. "foreign_keys=ON")."""
    import aiosqlite

    if str(path) != ":memory:":
        path.parent.mkdir(parents=True, exist_ok=True)
    conn = await aiosqlite.connect(str(path), isolation_level=None)
    conn.row_factory = aiosqlite.Row
    await conn.execute("PRAGMA busy_timeout=5000")
    for delay in _wal_retry_delays(WAL_WITHIN_S):
        try:
            await conn.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as e:
            if not is_locked(e):
                raise
            await asyncio.sleep(delay)
    else:
        await conn.execute("PRAGMA journal_mode=WAL")
    for p in pragmas:
        await conn.execute(f"PRAGMA {p}")
    return conn
