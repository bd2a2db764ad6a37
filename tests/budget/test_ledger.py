"""Ledger outbox against real SQLite and Postgres: idempotent by request id, rows survive a database outage
(kept queued, retried) and a process crash (spool replayed by the next start)."""
from __future__ import annotations

import asyncio
import os
import sqlite3
import uuid

import asyncpg
import pytest

from gateway.budget.ledger import Ledger, PostgresSink, SqliteSink
from tests.support.wait import async_wait_until


def row(rid: str, cost: float = 0.01) -> dict:
    return {"request_id": rid, "ts": 1.0, "tenant": "acme", "model": "m1", "prompt_tokens": 10,
            "completion_tokens": 5, "total_tokens": 15, "cost": cost, "currency": "EUR", "cut_by_budget": False}


async def test_sqlite_drains_and_is_idempotent(tmp_path):
    led = Ledger(SqliteSink(tmp_path / "l.db"), tmp_path / "spool", flush_s=0.05)
    await led.start()
    for i in range(20):
        led.enqueue(row(f"r{i}"))
    led.enqueue(row("r3", cost=99.0))  # duplicate id: first write wins
    await async_wait_until(lambda: not led.queue, what="the ledger queue to drain")
    await led.close()
    db = sqlite3.connect(tmp_path / "l.db")
    assert db.execute("select count(*), sum(cost) from budget_ledger").fetchone() == (20, pytest.approx(0.2))
    assert os.path.getsize(tmp_path / "spool") == 0  # everything written: spool emptied


async def test_postgres_outage_keeps_rows_and_retries(pg_dsn):
    table = f"ledger_{uuid.uuid4().hex[:8]}"
    sink = PostgresSink(pg_dsn, table)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        led = Ledger(sink, Path(d) / "spool", flush_s=0.05)
        await led.start()
        admin = await asyncpg.connect(pg_dsn)
        try:
            await admin.execute(f"ALTER TABLE {table} RENAME TO {table}_away")  # the database "hiccups"
            for i in range(10):
                led.enqueue(row(f"p{i}"))
            await async_wait_until(lambda: led.failures >= 1, what="a failed write to the missing table")
            assert len(led.queue) == 10 and led.failures >= 1  # nothing lost, nothing blocked
            await admin.execute(f"ALTER TABLE {table}_away RENAME TO {table}")
            await async_wait_until(lambda: not led.queue, what="the queue to drain once the table is back")
            assert not led.queue
            led.enqueue(row("p3"))  # a replay of an already written id
            await led.close()
            n = await admin.fetchval(f"SELECT count(*) FROM {table}")
            assert n == 10
        finally:
            await admin.execute(f"DROP TABLE IF EXISTS {table}")
            await admin.execute(f"DROP TABLE IF EXISTS {table}_away")
            await admin.close()


class _DownSink:
    """A sink whose database is unreachable (writes always fail), standing in for an outage at crash time."""

    async def open(self) -> None:
        return None

    async def write(self, rows):
        raise ConnectionRefusedError("db down")

    async def close(self) -> None:
        return None


async def _crash_and_restart(led: Ledger, spool, db_path) -> Ledger:
    """The process dies (no close(), no flush; the OS releases the spool lock) and a new one starts on the spool."""
    led._task.cancel()
    os.close(led._fd)
    led._fd = None
    led2 = Ledger(SqliteSink(db_path), spool, flush_s=0.05)
    await led2.start()
    return led2


async def test_crash_with_queued_rows_is_recovered_from_spool(tmp_path):
    spool = tmp_path / "spool.jsonl"
    led = Ledger(_DownSink(), spool, flush_s=0.05)
    await led.start()
    for i in range(7):
        led.enqueue(row(f"c{i}"))
    await async_wait_until(lambda: len(spool.read_bytes().splitlines()) == 7, what="7 rows in the spool")
    led2 = await _crash_and_restart(led, spool, tmp_path / "l.db")
    assert len(led2.queue) == 7
    await led2.close()
    db = sqlite3.connect(tmp_path / "l.db")
    assert db.execute("select count(*) from budget_ledger").fetchone()[0] == 7


async def test_second_live_process_takes_its_own_spool(tmp_path):
    spool = tmp_path / "spool.jsonl"
    a = Ledger(_DownSink(), spool)
    b = Ledger(_DownSink(), spool)
    await a.start()
    await b.start()
    assert a.spool_path != b.spool_path
    a.enqueue(row("x"))
    await b.close()  # b must not have stolen a's rows
    assert len(a.queue) == 1
    await a.close(timeout_s=0.2)


async def test_rows_of_one_loop_iteration_are_spooled_by_one_write_before_the_loop_waits(tmp_path, monkeypatch):
    """enqueue() runs on the request path: the spool lines of rows settled in one event-loop iteration go out
    in one os.write at its end (not one write per request), and none is lost if the process dies after it."""
    spool = tmp_path / "spool.jsonl"
    led = Ledger(_DownSink(), spool, flush_s=10)
    await led.start()
    writes: list[int] = []
    real_write = os.write

    def counting_write(fd, data):
        if fd == led._fd:
            writes.append(data.count(b"\n"))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", counting_write)
    for i in range(5):
        led.enqueue(row(f"s{i}"))
    assert spool.read_bytes() == b""  # still this iteration
    await asyncio.sleep(0)
    assert writes == [5] and len(spool.read_bytes().splitlines()) == 5
    led.enqueue(row("s5"))
    await asyncio.sleep(0)
    assert writes == [5, 1]
    led2 = await _crash_and_restart(led, spool, tmp_path / "l.db")  # the next start replays all six
    assert len(led2.queue) == 6
    await led2.close()
