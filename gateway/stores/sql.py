"""SQL plumbing shared by the stores written once with `?` placeholders (identity, batch): the rewrite to
asyncpg's `$n` placeholders, and the SQLite connection every SQLite store opens the same way."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_Q = re.compile(r"\?")


def to_dollar(sql: str) -> str:
    """Rewrite `?` placeholders to asyncpg's `$1, $2, ...`."""
    n = 0

    def sub(_: re.Match[str]) -> str:
        nonlocal n
        n += 1
        return f"${n}"

    return _Q.sub(sub, sql)


async def open_sqlite(path: Path, *pragmas: str) -> Any:
    """An aiosqlite connection in autocommit mode (the stores issue BEGIN IMMEDIATE themselves), rows as
    `aiosqlite.Row`, WAL and a 5 s busy timeout, plus the store's own `pragmas` (e.g. "foreign_keys=ON")."""
    import aiosqlite

    if str(path) != ":memory:":
        path.parent.mkdir(parents=True, exist_ok=True)
    conn = await aiosqlite.connect(str(path), isolation_level=None)
    conn.row_factory = aiosqlite.Row
    for p in ("journal_mode=WAL", *pragmas, "busy_timeout=5000"):
        await conn.execute(f"PRAGMA {p}")
    return conn
