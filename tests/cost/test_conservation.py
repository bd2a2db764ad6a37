"""Conservation against live simulator processes, which know each engine's true busy time (the modelled time
of every step it ran): the GPU-seconds the gateway apportions to requests sum to the gateway's busy time
exactly and follow the engine's (the 5% bound: test_replay_conservation.py, on the sim's own clock), on a mixed
workload (shared system prompts and unique ones, streamed and not, short and long completions, two engine
profiles), while the gateway's wall time per request is several times too high."""
from __future__ import annotations

import asyncio
import random
import sqlite3

import httpx
import pytest
from gateway.completion import Step

from backends.sim.fleet import FleetProcess
from tests.cost.helpers import KEY, gateway_config, wired_gateway


async def _drive(cl, n: int, concurrency: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    shared = [" ".join(f"sys{p}w{j}" for j in range(300)) for p in range(3)]
    sem = asyncio.Semaphore(concurrency)
    statuses: list[int] = []

    async def one(i: int) -> None:
        system = rng.choice(shared) if rng.random() < 0.7 else " ".join(f"own{i}w{j}" for j in range(400))
        body = {"model": "sim-model", "max_tokens": rng.choice([8, 24, 48]), "stream": rng.random() < 0.6,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": " ".join(f"u{i}x{j}" for j in range(40))}]}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        async with sem, cl.stream("POST", "/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {KEY}"}) as r:
            async for _ in r.aiter_raw():
                pass
            statuses.append(r.status_code)

    await asyncio.gather(*(one(i) for i in range(n)))
    return statuses


async def test_apportioned_gpu_seconds_sum_to_the_engines_true_busy_time(tmp_path):
    """The fleet runs in its own process (as engines do), the gateway in this one; 200 requests, 16 at a time."""
    with FleetProcess(["--engines", "2", "--profile", "l40s-8b,h200-8b"], tmp_path / "fleet.json") as man:
        cfg = gateway_config(man["engines"], tmp_path)
        async with wired_gateway(cfg, tmp_path) as (gw, cl):
            wall: dict[str, float] = {}  # what gpu_seconds recorded before gateway/cost: the wall time

            async def keep(ctx) -> None:
                wall[ctx.request_id] = ctx.total_s

            gw.pipeline = gw.pipeline.with_step(Step("probe", keep), after="access_log")
            statuses = await _drive(cl, n=200, concurrency=16)
            assert statuses.count(200) == len(statuses), statuses
            seen = gw.cost.engines_snapshot()
        async with httpx.AsyncClient() as c:  # the simulator's truth: the modelled time of every step it ran
            truth = {e["name"]: (await c.get(e["url"].rsplit("/v1", 1)[0] + "/sim/state")).json()
                     for e in man["engines"]}
            per_req: dict[str, float] = {}  # the sim's own split of every step, per request
            for e in man["engines"]:
                per_req.update((await c.get(e["url"].rsplit("/v1", 1)[0] + "/sim/costs")).json()["costs"])
    db = sqlite3.connect(tmp_path / "budgets.db")  # gw.close() flushed the ledger
    rows = db.execute("select engine, sum(gpu_seconds_apportioned), sum(gpu_seconds), count(*), "
                      "sum(engine_cost) from budget_ledger group by engine").fetchall()
    rel, engine_of = {}, {}
    for rid, g, eng in db.execute("select request_id, gpu_seconds_apportioned, engine from budget_ledger"):
        rel[rid] = abs(g - per_req[rid]) / per_req[rid]
        engine_of[rid] = eng
    old = {rid: abs(w - per_req[rid]) / per_req[rid] for rid, w in wall.items()}
    assert len(rel) == len(old) == 200
    # per request (the sim's own split of each step): far closer than the wall time, even before the router
    # has learned the engines' prefill rates (its 8k tokens/s prior; bench/cost_apportion.py, warm: p50 1-3%)
    med = sorted(rel.values())[100]
    med_old = sorted(old.values())[100]
    assert med < med_old / 3, (med, med_old)
    db.close()
    per_engine = {r[0]: r for r in rows}
    assert sum(r[3] for r in rows) == 200
    for name, st in truth.items():
        busy = st["busy_s"]
        assert busy > 0.5, (name, st)  # each engine did real work
        apportioned = per_engine[name][1]
        why = (name, apportioned, {k: st[k] for k in ("busy_s", "busy_wall_s", "steps")}, seen[name])
        assert apportioned == pytest.approx(seen[name]["charged_s"], rel=1e-6), why  # ledger = meter
        assert apportioned == pytest.approx(seen[name]["busy_s"], rel=0.02), why  # charges conserve busy time
        # ... which is the engine's: within 1-3% on a quiet host (bench/cost_apportion.py, docs/cost.md), but
        # live processes on a host starved by others (load average 6 on 2 cores) stretch both the sim's steps
        # (its busy_wall_s > busy_s) and the gateway's view of each span, measured up to +22%; the 5% bound
        # is checked on the simulator's own clock (test_replay_conservation.py). Here: within 25%, and far
        # below the wall-time figure it replaces
        assert abs(apportioned - busy) <= 0.25 * busy, why
        old_sum = sum(w for rid, w in wall.items() if rid in engine_of and engine_of[rid] == name)
        assert old_sum > 1.5 * apportioned, (old_sum, why)
        # the ledger's charged GPU-seconds are the apportioned ones (budgets.prices gpu_second)
        assert per_engine[name][2] == pytest.approx(apportioned, rel=1e-3)
        # priced at the cost model's GPU-hour
        assert per_engine[name][4] == pytest.approx(apportioned * 2.5 / 3600, rel=1e-3)
