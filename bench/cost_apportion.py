"""GPU-seconds per engine: the simulator's true busy time vs the gateway's old wall-time figure vs the
apportioned one (gateway/cost), under a shared-prefix load that ramps its arrival rate (prints a table).

The fleet runs as a child process (`python -m backends.sim`); the gateway is wired in this process exactly as
`gateway serve` wires it and driven over ASGI by an open-loop Poisson client whose rate ramps linearly from
--rate-start to --rate-end req/s. Truth is each engine's `/sim/state` busy_s (the modelled time of every step
it ran); "old" is the sum over the requests an engine served of the gateway's wall time per request (what
`gpu_seconds` recorded before gateway/cost); "new" is the sum of the apportioned GPU-seconds in the ledger.
Per request, the apportioned GPU-seconds are compared with the simulator's own split of every step
(`/sim/costs`: prefill tokens x b or, decoding, c + d x context, plus an equal part of the per-step a):
req_err_p50/p90 are the median and 90th percentile of |apportioned - true| / true.

    python bench/cost_apportion.py --engines 4 --profile h200-8b,l40s-8b --rate-start 6 --rate-end 12 --duration 40
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import yaml
from gateway.completion import Step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backends.sim.fleet import FleetProcess

KEY = "bench-cost-key-0123456789"


def config(engines: list[dict], tmp: Path) -> dict:
    (tmp / "policy.yaml").write_text(yaml.safe_dump({"version": 1, "defaults": {"allow": True}, "rules": []}))
    return {"server": {"host": "127.0.0.1", "port": 0},
            "backends": [{"name": e["name"], "url": e["url"], "kind": "vllm", "models": ["sim-model"],
                          "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                          "location": {"country": "DE"}} for e in engines],
            "keys": [{"name": "k", "key": KEY, "tenant": "bench"}],
            "policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / "audit.jsonl")},
            "identity": {"sqlite_path": str(tmp / "id.db")},
            "budgets": {"sqlite_path": str(tmp / "budgets.db"), "spool_path": str(tmp / "spool.jsonl"),
                        "prices": {"sim-model": {"input": 0.5, "output": 1.5}}},
            "cost": {"default": {"gpu_hour": 2.5}},
            "routing": {"admission": False},
            "observability": {"log_level": "warning"},
            "data_dir": str(tmp)}


async def drive(cl: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, int]:
    rng = random.Random(args.seed)
    prefixes = [" ".join(f"sys{p}w{j}" for j in range(args.prefix_words)) for p in range(args.prefixes)]
    stats: dict[str, int] = defaultdict(int)
    tasks = []

    async def one(i: int) -> None:
        body = {"model": "sim-model", "max_tokens": rng.randint(args.min_tokens, args.max_tokens), "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": rng.choice(prefixes)},
                             {"role": "user", "content": " ".join(f"q{i}w{j}" for j in range(args.user_words))}]}
        try:
            async with cl.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {KEY}"}) as r:
                async for _ in r.aiter_raw():
                    pass
                stats[str(r.status_code)] += 1
        except httpx.HTTPError as e:
            stats[type(e).__name__] += 1

    t0 = time.monotonic()
    i = 0
    while (el := time.monotonic() - t0) < args.duration:
        rate = args.rate_start + (args.rate_end - args.rate_start) * el / args.duration
        tasks.append(asyncio.create_task(one(i)))
        i += 1
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    stats["sent"] = i
    return dict(stats)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


async def run(args: argparse.Namespace) -> int:
    from gateway.app import Gateway, build_app
    from gateway.config import parse_config
    from gateway.wiring import wire

    tmp = Path(tempfile.mkdtemp(prefix="bench-cost-"))
    fleet_args = ["--engines", str(args.engines), "--profile", args.profile]
    with FleetProcess(fleet_args, tmp / "fleet.json") as man:
        gw = Gateway(parse_config(yaml.safe_dump(config(man["engines"], tmp)), base_dir=tmp))
        wire(gw)
        wall: dict[str, float] = defaultdict(float)
        served: dict[str, int] = defaultdict(int)

        async def old_figure(ctx) -> None:  # the wall time the budget stage recorded before gateway/cost
            if ctx.backend and ctx.total_s is not None:
                wall[ctx.backend] += ctx.total_s
                served[ctx.backend] += 1

        gw.pipeline = gw.pipeline.with_step(Step("probe", old_figure), after="access_log")
        app = build_app(gw)
        await gw.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=300,
                                         limits=httpx.Limits(max_connections=1000)) as cl:
                stats = await drive(cl, args)
            seen = gw.cost.engines_snapshot()
        finally:
            await gw.close()
        async with httpx.AsyncClient() as c:
            truth = {e["name"]: (await c.get(e["url"].rsplit("/v1", 1)[0] + "/sim/state")).json()
                     for e in man["engines"]}
            per_req: dict[str, float] = {}
            for e in man["engines"]:
                per_req.update((await c.get(e["url"].rsplit("/v1", 1)[0] + "/sim/costs")).json()["costs"])
    db = sqlite3.connect(tmp / "budgets.db")
    new = dict(db.execute("select engine, sum(gpu_seconds_apportioned) from budget_ledger group by engine"))
    errs: dict[str, list[float]] = defaultdict(list)  # per request: |apportioned - true| / true
    for rid, engine, g in db.execute("select request_id, engine, gpu_seconds_apportioned from budget_ledger"):
        t = per_req.get(rid)
        if t and g is not None:
            errs[engine].append(abs(g - t) / t)
    db.close()
    rows = []
    for e in man["engines"]:
        n = e["name"]
        t = truth[n]["busy_s"]
        rows.append({"engine": n, "profile": e.get("profile"), "requests": served[n], "true_busy_s": round(t, 2),
                     "old_wall_gpu_s": round(wall[n], 2), "apportioned_gpu_s": round(new.get(n) or 0.0, 2),
                     "gateway_busy_s": round(seen.get(n, {}).get("busy_s", 0.0), 2),
                     "old_over_true": round(wall[n] / t, 2) if t else None,
                     "new_over_true": round((new.get(n) or 0.0) / t, 3) if t else None,
                     "req_err_p50": pct(errs[n], 0.5), "req_err_p90": pct(errs[n], 0.9)})
    print(f"requests: {stats}")
    cols = ["engine", "profile", "requests", "true_busy_s", "old_wall_gpu_s", "apportioned_gpu_s", "gateway_busy_s",
            "old_over_true", "new_over_true", "req_err_p50", "req_err_p90"]
    w = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print(" | ".join(c.ljust(w[c]) for c in cols))
    print("-|-".join("-" * w[c] for c in cols))
    for r in rows:
        print(" | ".join(str(r[c]).ljust(w[c]) for c in cols))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "stats": stats, "rows": rows}, indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--profile", default="h200-8b,l40s-8b")
    p.add_argument("--rate-start", type=float, default=6.0)
    p.add_argument("--rate-end", type=float, default=12.0)
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-words", type=int, default=600)
    p.add_argument("--user-words", type=int, default=60)
    p.add_argument("--min-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="also write the rows here")
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
