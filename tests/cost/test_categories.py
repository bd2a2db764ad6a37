"""Savings through the real pipeline: a response-cache hit (no GPU, saved), an early budget refusal (rejected,
a row in the meter's cost_unbilled table), a served request with a prefix-cache hit (saved prefill); each shows in the
evidence, the ledger, /metrics and the meter's totals (an abandoned stream, waste, needs a real connection:
tests/cost/test_cost_e2e.py). The sim's true busy time counts every step it ran."""
from __future__ import annotations

import sqlite3

import pytest

import yaml
from gateway.completion import Step

from backends.sim.fleet import start_fleet
from backends.sim.profiles import get_profile
from backends.sim.scheduler import Scheduler, SimRequest
from tests.cost.helpers import KEY, gateway_config, wired_gateway

TIGHT = "cost-tight-key-0123456789"
POLICY = {"version": 1, "defaults": {"allow": True}, "rules": [
    {"id": "cache-search", "match": {"team": "search"}, "set": {"cache": {"mode": "exact", "ttl_s": 600}}},
    {"id": "tight", "match": {"team": "tight"}, "budgets": [{"window": "day", "tokens": 30}]}]}


async def test_cache_hits_rejections_aborts_and_prefix_savings(tmp_path):
    seen: dict[str, dict] = {}
    async with start_fleet(1, profiles=["l40s-8b"]) as fleet:
        cfg = gateway_config(fleet.manifest()["engines"], tmp_path)
        cfg["keys"].append({"name": "t", "key": TIGHT, "tenant": "smallco", "team": "tight"})
        (tmp_path / "policy.yaml").write_text(yaml.safe_dump(POLICY))
        async with wired_gateway(cfg, tmp_path) as (gw, cl):
            async def keep(ctx) -> None:
                seen[ctx.request_id] = dict(ctx.evidence.get("unit_cost") or {})

            gw.pipeline = gw.pipeline.with_step(Step("probe", keep), after="access_log")
            h = {"authorization": f"Bearer {KEY}"}
            body = {"model": "sim-model", "max_tokens": 8, "temperature": 0,
                    "messages": [{"role": "user", "content": "a question worth caching " * 40}]}
            first = await cl.post("/v1/chat/completions", headers=h, json=body)
            hit = await cl.post("/v1/chat/completions", headers=h, json=body)
            assert first.status_code == hit.status_code == 200
            assert hit.headers.get("x-gateway-cache") == "hit"
            # the same prefix again, a different question: the engine's prefix cache serves most of it
            again = await cl.post("/v1/chat/completions", headers=h, json={
                **body, "messages": [{"role": "user", "content": "a question worth caching " * 40 + "and more"}]})
            assert again.status_code == 200
            refused = await cl.post("/v1/chat/completions", headers={"authorization": f"Bearer {TIGHT}"},
                                    json={"model": "sim-model", "max_tokens": 500,
                                          "messages": [{"role": "user", "content": "hi"}]})
            assert refused.status_code == 429
            metrics = (await cl.get("/metrics")).text
            totals = gw.cost.snapshot()["totals"]
        truth = fleet.servers[0].engine.sched.stats.busy_s
    ids = {"first": first.headers["x-request-id"], "hit": hit.headers["x-request-id"],
           "again": again.headers["x-request-id"], "refused": refused.headers["x-request-id"]}
    cat = {k: seen[v]["category"] for k, v in ids.items()}
    assert cat == {"first": "served", "hit": "cache_hit", "again": "served", "refused": "rejected"}
    assert seen[ids["hit"]]["gpu_seconds"] == 0 and seen[ids["hit"]]["saved_gpu_seconds"]["response_cache"] > 0
    assert seen[ids["again"]]["saved_gpu_seconds"]["prefix_cache"] > 0
    assert seen[ids["refused"]]["gpu_seconds"] == 0 and seen[ids["refused"]]["cost"] == 0
    assert 'gateway_cost_requests_total{backend="none",category="cache_hit"' in metrics
    assert 'gateway_cost_saved_gpu_seconds_total{backend="sim-0",model="sim-model",reason="prefix_cache"}' in metrics
    assert {t["category"] for t in totals} >= {"served", "cache_hit", "rejected"}
    assert truth > 0
    db = sqlite3.connect(tmp_path / "budgets.db")
    spent = dict(db.execute("select request_id, cost_category from budget_ledger"))
    unbilled = dict(db.execute("select request_id, cost_category from cost_unbilled"))
    db.close()
    # the spend ledger keeps one row per request that spent; the others have the meter's own table
    assert spent == {ids["first"]: "served", ids["again"]: "served"}
    assert unbilled == {ids["hit"]: "cache_hit", ids["refused"]: "rejected"}


def test_the_simulators_busy_time_is_the_sum_of_its_step_times():
    prof = get_profile("tiny")
    s = Scheduler(prof, lambda r: 7)
    reqs = [SimRequest(f"r{i}", 40, list(range(i * 100, i * 100 + 40)), max_tokens=5) for i in range(3)]
    for r in reqs:
        s.add(r)
    now, total, prefill = 0.0, 0.0, 0.0
    while s.has_work():
        plan = s.schedule(now)
        assert plan is not None
        total += prof.step_time(plan.prefill_tokens, plan.decode_seqs, plan.decode_ctx_tokens)
        prefill += prof.prefill_s_per_token * plan.prefill_tokens
        now += plan.duration
        s.commit(plan, now)
    assert s.stats.busy_s == total and s.stats.busy_prefill_s == prefill and s.stats.steps == 5  # one prefill step, four decodes
    # the per-request truth splits every step: its sum is the busy time
    assert sum(r.true_s for r in reqs) == pytest.approx(s.stats.busy_s, rel=1e-12)
    assert all(r.true_s > 0 for r in reqs)


async def test_a_failed_attempt_is_retry_waste_on_its_engine_not_part_of_the_charge(tmp_path):
    """The dispatcher tells the meter of each attempt: the first engine answers 500, the second serves. The
    first engine's time is booked on its own clock (conserved there) as the request's `retry` waste; the
    request's charged GPU-seconds are those of the engine that answered."""
    seen: dict[str, dict] = {}
    async with start_fleet(2, profiles=["l40s-8b", "l40s-8b"]) as fleet:
        engines = fleet.manifest()["engines"]
        cfg = gateway_config(engines, tmp_path)
        async with wired_gateway(cfg, tmp_path) as (gw, cl):
            async def keep(ctx) -> None:
                seen[ctx.request_id] = dict(ctx.evidence.get("unit_cost") or {})

            gw.pipeline = gw.pipeline.with_step(Step("probe", keep), after="access_log")
            fleet.servers[0].engine.faults.error_rate = 1.0
            first, second = engines[0]["name"], engines[1]["name"]
            r = await cl.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, json={
                "model": "sim-model", "max_tokens": 8, "provider": {"order": [first, second]},
                "messages": [{"role": "user", "content": "one engine fails, the next one answers " * 20}]})
            assert r.status_code == 200
            uc = seen[r.headers["x-request-id"]]
            clocks = gw.cost.engines_snapshot()
    assert uc["engine"] == second and uc["retries"] == 1 and uc["category"] == "served"
    assert uc["retry_gpu_seconds"] > 0 and uc["wasted_gpu_seconds"] == {"retry": uc["retry_gpu_seconds"]}
    assert uc["gpu_seconds"] > 0
    assert clocks[first]["busy_s"] > 0 and clocks[first]["in_flight"] == 0
    assert clocks[first]["charged_s"] == pytest.approx(clocks[first]["busy_s"], rel=1e-6, abs=1e-6)
    assert uc["retry_gpu_seconds"] == pytest.approx(clocks[first]["charged_s"], rel=1e-3, abs=1e-6)
