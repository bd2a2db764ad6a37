"""A budget dimension is one row of gateway/budget/dimensions.py: a process whose table has one more row (an
output-token limit, tests/budget/_new_dimension.py) compiles policies limiting it, reserves and settles it on the
memory, SQLite and Redis stores alike (the Lua script loops over the codes of a prelude generated from the table),
refuses with its own kind, header and message, and files its ledger column, with no other file changed. The SQLite
counters and ledger files and the Postgres ledger table were created by this version's table: the new hold and
ledger columns are added on open."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg
import redis
import yaml

from gateway.budget.ledger import PostgresSink
from gateway.budget.service import BudgetService
from gateway.config import parse_config

ROOT = Path(__file__).resolve().parents[2]


async def _create_files(base: Path, pg_dsn: str, pg_table: str) -> None:
    """The memory store's ledger, the SQLite store's counters and a Postgres ledger table, as this version (without
    the row) makes them."""
    sink = PostgresSink(pg_dsn, pg_table)
    await sink.open()
    await sink.close()
    for store in ("memory", "sqlite"):
        d = base / store
        d.mkdir()
        cfg = parse_config(yaml.safe_dump({"budgets": {"store": store, "sqlite_path": str(d / "budgets.db"),
                                                       "spool_path": str(d / "spool.jsonl")}}), "t.yaml", base_dir=d)
        svc = BudgetService(cfg)
        await svc.start()
        await svc.close()


async def _drop(pg_dsn: str, table: str) -> None:
    db = await asyncpg.connect(pg_dsn)
    try:
        await db.execute(f"DROP TABLE IF EXISTS {table}")
    finally:
        await db.close()


def test_a_dimension_added_to_the_table_works_on_every_store(tmp_path, redis_url, pg_dsn, prefix):
    table = f"ledger_nd_{uuid.uuid4().hex[:8]}"
    spec = {"dir": str(tmp_path), "redis_url": redis_url, "prefix": prefix, "pg_dsn": pg_dsn, "pg_table": table}
    try:
        asyncio.run(_create_files(tmp_path, pg_dsn, table))
        p = subprocess.run([sys.executable, "-m", "tests.budget._new_dimension", json.dumps(spec)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    finally:
        asyncio.run(_drop(pg_dsn, table))
        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(f"{prefix}:*"))
        if keys:
            r.delete(*keys)
        r.close()
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["limit"] == 100
    for store in ("memory", "sqlite", "redis"):
        seen = out[store]
        assert seen["allowance"] == 100, store  # uncapped: the output budget binds, not the 4096 default
        assert seen["reserved"] == 100 and seen["settled"] == 60, store
        assert seen["headers"] == {"x-ratelimit-limit-output-tokens": "100",
                                   "x-ratelimit-remaining-output-tokens": "0",
                                   "x-ratelimit-reset-output-tokens": seen["headers"]["x-ratelimit-reset-output-tokens"]}
        assert seen["allowance_after"] == 40 and seen["limit_evidence"] == 60, store
        status, code, message, ref = seen["refusal"]
        assert (status, code) == (429, "insufficient_quota"), store  # a day window: quota, like tokens
        assert "tenant output_tokens limit of 100 per day" in message
        assert ref == {"kind": "output_tokens", "scope": "tenant", "window": "day"}
    assert out["memory"]["ledger"] == [["memory-1", 70, 60]]
    assert out["postgres"] == ["pg-1", 70, 60]
