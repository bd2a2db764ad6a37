"""Benchmark the budget stage (reserve + settle) against Redis at a given concurrency; prints a table.

Measures per-request latency of BudgetStage.run (reserve) and BudgetStage.finish (settle + ledger enqueue)
over key/project/team/tenant scopes x minute/hour/day/month windows + concurrency, and counts Redis round trips
per request from Redis's own commandstats (EVALSHA calls) so the "one round trip each" claim is measured.

    python bench/budget.py --redis redis://127.0.0.1:6379/0 --concurrency 64 --requests 20000
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402
import yaml  # noqa: E402

from gateway.budget.service import BudgetService  # noqa: E402
from gateway.budget.stage import BudgetStage  # noqa: E402
from gateway.config import parse_config  # noqa: E402
from gateway.pipeline import RequestContext  # noqa: E402
from gateway.types import BudgetSpec, Decision, Principal, Usage  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def evalsha_calls(r: redis.Redis) -> int:
    st = r.info("commandstats")
    return int(st.get("cmdstat_evalsha", {}).get("calls", 0)) + int(st.get("cmdstat_eval", {}).get("calls", 0))


async def run(url: str, conc: int, n: int, store: str) -> dict:
    d = tempfile.mkdtemp()
    prefix = f"gwbbench:{uuid.uuid4().hex[:8]}"
    cfg = parse_config(yaml.safe_dump({"budgets": {
        "store": store, "redis_url": url, "key_prefix": prefix, "sqlite_path": f"{d}/b.db",
        "spool_path": f"{d}/spool.jsonl", "prices": {"m1": {"input": 0.5, "output": 1.5}}}}), "bench", base_dir=Path(d))
    svc = BudgetService(cfg)
    await svc.start()
    stage = BudgetStage(svc)
    big = 10**12
    budgets = (BudgetSpec(window="minute", scope="key", requests=big, tokens=big),
               BudgetSpec(window="hour", scope="project", tokens=big),
               BudgetSpec(window="day", scope="team", money=1e9, tokens=big),
               BudgetSpec(window="month", scope="tenant", money=1e9),
               BudgetSpec(window="minute", scope="tenant", concurrency=10_000))
    principals = [Principal(id=f"key:{i}", kind="api_key", tenant="acme", team="search", project="web",
                            key_id=f"k{i % 50}") for i in range(50)]
    reserve_us: list[float] = []
    settle_us: list[float] = []
    r = redis.Redis.from_url(url) if store == "redis" else None
    calls0 = evalsha_calls(r) if r else 0
    sem_n = iter(range(n))

    async def worker() -> None:
        for i in sem_n:
            ctx = RequestContext(request_id=f"b{i}", endpoint="chat", headers={}, body={}, model="m1",
                                 model_chain=("m1",), max_tokens=256, prompt_tokens_est=500,
                                 principal=principals[i % 50], decision=Decision(budgets=budgets))
            t0 = time.perf_counter()
            await stage.run(ctx)
            t1 = time.perf_counter()
            ctx.usage = Usage(500, 100)
            ctx.backend = "x"
            await stage.finish(ctx)
            t2 = time.perf_counter()
            reserve_us.append((t1 - t0) * 1e6)
            settle_us.append((t2 - t1) * 1e6)

    # warm up (script load, connections)
    w0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(conc)])
    wall = time.perf_counter() - w0
    calls = (evalsha_calls(r) - calls0) if r else 0
    await svc.close()
    if r:
        keys = list(r.scan_iter(f"{prefix}:*"))
        if keys:
            r.delete(*keys)
        r.close()
    return {"store": store, "conc": conc, "n": n, "wall": wall, "reserve": reserve_us, "settle": settle_us,
            "rt_per_req": calls / n if r else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--stores", nargs="+", default=["redis", "memory"])
    a = ap.parse_args()
    print("| store | conc | requests | req/s | reserve p50 µs | reserve p99 µs | settle p50 µs | settle p99 µs "
          "| reserve+settle mean µs | Redis round trips / request |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for store in a.stores:
        for c in a.concurrency:
            res = asyncio.run(run(a.redis, c, a.requests, store))
            both = [x + y for x, y in zip(res["reserve"], res["settle"])]
            print(f"| {store} | {c} | {res['n']} | {res['n'] / res['wall']:.0f} | {pct(res['reserve'], 50):.0f} "
                  f"| {pct(res['reserve'], 99):.0f} | {pct(res['settle'], 50):.0f} | {pct(res['settle'], 99):.0f} "
                  f"| {statistics.mean(both):.0f} | {res['rt_per_req']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
