"""gateway/stores/sql.py: opening a SQLite database that another process is writing to at the same moment.

The CI failure behind this: two workers of `gateway serve --workers 2` opened one new identity database at once
and one of them died at start with "database is locked" from `PRAGMA journal_mode=WAL`. Switching to WAL needs
an exclusive lock; while another connection holds a RESERVED lock SQLite refuses at once, without calling the
busy handler (a 5 s timeout does not help: the two could deadlock). Pins: every way the stores open a database
waits such a writer out, and still raises what is not a lock, or a lock held past the limit."""
from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from gateway.stores import sql


def _writer_holding(path: Path, hold_s: float) -> threading.Thread:
    """Another connection in the middle of a write transaction (RESERVED lock) for `hold_s`."""
    s = sqlite3.connect(path)
    s.execute("create table if not exists t (x)")
    s.commit()
    s.close()
    y = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    y.execute("BEGIN IMMEDIATE")

    def later() -> None:
        time.sleep(hold_s)
        y.execute("COMMIT")
        y.close()

    t = threading.Thread(target=later)
    t.start()
    return t


def test_a_plain_wal_switch_fails_at_once_while_another_connection_writes(tmp_path):
    """The premise: SQLite's own busy timeout does not cover this case."""
    t = _writer_holding(tmp_path / "x.db", 0.3)
    x = sqlite3.connect(tmp_path / "x.db", timeout=5.0)
    t0 = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        x.execute("PRAGMA journal_mode=WAL")
    assert time.monotonic() - t0 < 0.2
    t.join()
    x.close()


def test_enable_wal_waits_for_the_writer_then_switches(tmp_path):
    t = _writer_holding(tmp_path / "x.db", 0.3)
    x = sqlite3.connect(tmp_path / "x.db", timeout=5.0)
    t0 = time.monotonic()
    sql.enable_wal(x)
    assert time.monotonic() - t0 >= 0.25
    assert x.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    t.join()
    x.close()


def test_enable_wal_gives_up_after_its_limit_with_sqlites_error(tmp_path):
    t = _writer_holding(tmp_path / "x.db", 1.0)
    x = sqlite3.connect(tmp_path / "x.db", timeout=5.0)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        sql.enable_wal(x, within_s=0.2)
    t.join()
    x.close()


def test_enable_wal_raises_other_errors_at_once(tmp_path):
    s = sqlite3.connect(tmp_path / "x.db")
    s.execute("create table t (x)")
    s.commit()
    s.close()
    x = sqlite3.connect(f"file:{tmp_path / 'x.db'}?mode=ro", uri=True)
    t0 = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        sql.enable_wal(x)  # not a lock: no retry
    assert time.monotonic() - t0 < 0.1
    x.close()


async def test_open_sqlite_waits_for_the_writer_then_opens_in_wal(tmp_path):
    t = _writer_holding(tmp_path / "id.db", 0.3)
    conn = await sql.open_sqlite(tmp_path / "id.db", "foreign_keys=ON")
    try:
        assert (await (await conn.execute("PRAGMA journal_mode")).fetchone())[0] == "wal"
        assert (await (await conn.execute("PRAGMA foreign_keys")).fetchone())[0] == 1
        assert (await (await conn.execute("PRAGMA busy_timeout")).fetchone())[0] == 5000
    finally:
        t.join()
        await conn.close()


@pytest.mark.parametrize("store", ["ledger", "budget_state", "cache"])
async def test_every_sqlite_store_opens_while_another_process_writes(tmp_path, store):
    """The spend ledger, the memory budget store's snapshot and the response cache open their file the same way."""
    path = tmp_path / "s.db"
    t = _writer_holding(path, 0.3)
    try:
        if store == "ledger":
            from gateway.budget.ledger import SqliteSink

            led = SqliteSink(path)
            await led.open()
            db = led._conn()
        elif store == "budget_state":
            from gateway.budget.store import MemoryBudgetStore

            st = MemoryBudgetStore(sqlite_path=path)
            db = st._connect()
        else:
            from gateway.cache.sqlite_store import SqliteStore

            db = SqliteStore(path).db
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        t.join()
