"""A budget dimension is one row of gateway/budget/dimensions.py: a process whose table has one more row (an
output-token limit, tests/budget/_new_dimension.py) compiles policies limiting it, reserves and settles it on the
memory, SQLite and Redis stores alike (the Lua script loops over the codes of a prelude generated from the table),
refuses with its own kind, header and message, and files its ledger column, with no other file changed. The SQLite
counters and ledger files were created by this version's table: the new hold and ledger columns are added on open."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import redis
import yaml

from gateway.budget.service import BudgetService
from gateway.config import parse_config

ROOT = Path(__file__).resolve().parents[2]


async def _create_files(base: Path) -> None:
    """The memory store's ledger and the SQLite store's counters, as this version (without the row) makes them."""
    for store in ("memory", "sqlite"):
        d = base / store
        d.mkdir()
        cfg = parse_config(yaml.safe_dump({"budgets": {"store": store, "sqlite_path": str(d / "budgets.db"),
                                                       "spool_path": str(d / "spool.jsonl")}}), "t.yaml", base_dir=d)
        svc = BudgetService(cfg)
        await svc.start()
        await svc.close()


def test_a_dimension_added_to_the_table_works_on_every_store(tmp_path, redis_url, prefix):
    asyncio.run(_create_files(tmp_path))
    spec = {"dir": str(tmp_path), "redis_url": redis_url, "prefix": prefix}
    try:
        p = subprocess.run([sys.executable, "-m", "tests.budget._new_dimension", json.dumps(spec)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    finally:
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
