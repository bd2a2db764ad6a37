"""Spend-ledger insert cost with random vs time-ordered request ids, as the table grows.

The ledger (gateway/budget/ledger.py) keys every row by the gateway's request id (a primary key: replays are
idempotent, ON CONFLICT DO NOTHING). Random ids insert at random pages of that index, so each insert touches
a different leaf and, once the index outgrows the page cache, reads it back; time-ordered ids
(gateway/api/ingress.new_request_id: the millisecond, then 48 random bits) append at its right edge. This
fills a fresh table through the real sinks, 500 rows per write as the drainer batches them, and prints the
cost per row of the last batches before each checkpoint.

Run: .venv/bin/python bench/ledger_ids.py [--rows 400000] [--postgres DSN]  (Postgres: a scratch table)
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gateway.budget.ledger import PostgresSink, SqliteSink  # noqa: E402

ROW = {"ts": 0.0, "principal_id": "static:0", "tenant": "bench", "key_id": "static:0", "model": "m", "backend": "up",
       "prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "cost": 0.0, "currency": "EUR", "status": 200,
       "cut_by_budget": False, "engine": "up", "gpu_seconds_apportioned": 0.0014, "cost_category": "served",
       "saved_gpu_seconds": 0.0, "wasted_gpu_seconds": 0.0, "retries": 0, "saved_tokens": 0, "saved_cost": 0.0}
BATCH = 500
WINDOW = 20_000  # rows timed before each checkpoint


def random_ids(n: int) -> list[str]:
    return ["req_" + os.urandom(12).hex() for _ in range(n)]


def ordered_ids(n: int) -> list[str]:
    """What new_request_id makes at 10 requests per millisecond."""
    t0 = int(time.time() * 1000)
    return ["req_%012x%012x" % (t0 + i // 10, random.getrandbits(48)) for i in range(n)]


async def fill(sink, ids: list[str], checkpoints: list[int]) -> dict[int, float]:
    """Microseconds per row over the WINDOW rows before each checkpoint."""
    out: dict[int, float] = {}
    t = 0.0
    for i in range(0, len(ids), BATCH):
        rows = [{**ROW, "request_id": r, "ts": time.time()} for r in ids[i:i + BATCH]]
        t0 = time.perf_counter()
        await sink.write(rows)
        dt = time.perf_counter() - t0
        end = i + len(rows)
        for c in checkpoints:
            if c - WINDOW < end <= c:
                t += dt
            if end == c:
                out[c] = t / WINDOW * 1e6
                t = 0.0
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--postgres", default=None, help="a DSN: also measure the Postgres ledger (scratch tables)")
    a = ap.parse_args()
    checkpoints = sorted({c for c in (WINDOW, 100_000, a.rows) if WINDOW <= c <= a.rows})
    tmp = Path(tempfile.mkdtemp(prefix="bench-ledger-"))
    results: list[tuple[str, str, dict[int, float]]] = []
    for label, make in (("random (os.urandom)", random_ids), ("time-ordered", ordered_ids)):
        ids = make(a.rows)
        sink = SqliteSink(tmp / f"{label[:4]}.db")
        await sink.open()
        results.append(("sqlite", label, await fill(sink, ids, checkpoints)))
        await sink.close()
        if a.postgres:
            table = f"bench_ledger_{label[:4]}_{os.getpid()}"
            pg = PostgresSink(a.postgres, table=table)
            await pg.open()
            try:
                results.append(("postgres", label, await fill(pg, ids, checkpoints)))
            finally:
                pool = await pg._pool()
                async with pool.acquire() as c:
                    await c.execute(f"DROP TABLE IF EXISTS {table}")
                await pg.close()
    print(f"spend-ledger inserts, {BATCH} rows per write, us per row over the {WINDOW:,} rows before each size\n")
    print("| store | request ids | " + " | ".join(f"at {c:,} rows" for c in checkpoints) + " |")
    print("|---|---|" + "---|" * len(checkpoints))
    for store, label, r in results:
        print(f"| {store} | {label} | " + " | ".join(f"{r[c]:.1f}" for c in checkpoints) + " |")
    for store in ("sqlite", "postgres"):
        rs = [r for s, _, r in results if s == store]
        if len(rs) == 2:
            print(f"\n{store}: random / time-ordered at {checkpoints[-1]:,} rows = "
                  f"{rs[0][checkpoints[-1]] / rs[1][checkpoints[-1]]:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
