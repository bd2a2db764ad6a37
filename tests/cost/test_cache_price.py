"""A response-cache hit's price through the real pipeline (docs/cache.md#price): with `cache_hit` priced, a hit
is charged over the principal's budgets like any request (a hit that does not fit is the budget's 429), the spend
ledger gets its row (category cache_hit, saved tokens and money) and the audit record its charge; with the
default (0) a hit stays free, counts against no budget and keeps its row in cost_unbilled."""
from __future__ import annotations

import json
import sqlite3

import pytest
import yaml

from backends.sim.fleet import start_fleet
from tests.cost.helpers import KEY, gateway_config, wired_gateway

OTHER = "cost-other-key-0123456789"  # same tenant and team (shares the tenant's entries), its own key budget
POLICY = {"version": 1, "defaults": {"allow": True}, "rules": [
    {"id": "cache", "match": {"tenant": "acme"}, "set": {"cache": {"mode": "exact", "ttl_s": 600}},
     "budgets": [{"window": "day", "scope": "key", "requests": 1}, {"window": "day", "money": 1000.0}]}]}
BODY = {"model": "sim-model", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "a question whose answer is cached " * 30}]}
RATE = 0.25  # per million tokens of a hit


async def _run(tmp_path, prices):
    async with start_fleet(1, profiles=["l40s-8b"]) as fleet:
        cfg = gateway_config(fleet.manifest()["engines"], tmp_path, prices=prices)
        cfg["keys"].append({"name": "o", "key": OTHER, "tenant": "acme", "team": "search", "project": "p1"})
        (tmp_path / "policy.yaml").write_text(yaml.safe_dump(POLICY))
        async with wired_gateway(cfg, tmp_path) as (gw, cl):
            first = await cl.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, json=BODY)
            o = {"authorization": f"Bearer {OTHER}"}
            hit = await cl.post("/v1/chat/completions", headers=o, json=BODY)
            again = await cl.post("/v1/chat/completions", headers=o, json=BODY)
            snap = gw.cost.snapshot()
    db = sqlite3.connect(tmp_path / "budgets.db")
    db.row_factory = sqlite3.Row
    spent = {r["request_id"]: dict(r) for r in db.execute("select * from budget_ledger")}
    unbilled = {r["request_id"]: dict(r) for r in db.execute("select * from cost_unbilled")}
    db.close()
    audit = {}
    for line in (tmp_path / "audit.jsonl").read_text().splitlines():
        rec = json.loads(line)
        audit[rec["request_id"]] = rec
    return first, hit, again, spent, unbilled, audit, snap


async def test_a_priced_hit_is_charged_filed_and_refused_when_it_does_not_fit(tmp_path):
    prices = {"sim-model": {"input": 0.5, "output": 1.5, "gpu_second": 0.001, "cache_hit": RATE}}
    first, hit, again, spent, unbilled, audit, snap = await _run(tmp_path, prices)
    assert first.status_code == 200 and first.headers["x-gateway-cache"] == "miss"
    assert hit.status_code == 200 and hit.headers["x-gateway-cache"] == "hit"
    assert hit.json()["choices"] == first.json()["choices"]
    # charged like any request: the key's one request a day is used by the hit, so the next hit is refused
    assert hit.headers["x-ratelimit-remaining-requests"] == "0"
    assert again.status_code == 429 and again.json()["error"]["code"] == "rate_limit_exceeded"
    assert again.headers["x-gateway-cache"] == "hit" and "retry-after" in again.headers  # the lookup hit
    fid, hid, aid = (r.headers["x-request-id"] for r in (first, hit, again))
    tokens = hit.json()["usage"]["prompt_tokens"] + hit.json()["usage"]["completion_tokens"]
    charged = tokens * RATE / 1e6
    row = spent[hid]  # the budget stage's row, not the meter's cost_unbilled one
    assert hid not in unbilled and row["cost_category"] == "cache_hit" and row["backend"] is None
    assert row["cost"] == pytest.approx(charged) and row["total_tokens"] == tokens
    assert row["saved_tokens"] == tokens
    assert row["saved_cost"] == pytest.approx(spent[fid]["cost"] - charged)
    assert row["saved_gpu_seconds"] > 0 and row["gpu_seconds_apportioned"] == 0 and row["engine_cost"] == 0
    assert spent[fid]["cost_category"] == "served" and spent[fid]["saved_tokens"] == 0
    # the refused hit: a rejection, no spend, nothing saved
    assert aid not in spent and unbilled[aid]["cost_category"] == "rejected" and not unbilled[aid]["saved_tokens"]
    # the audit record: the charge as for any charged request, and the cache facts
    rec = audit[hid]
    assert rec["cost"]["amount"] == pytest.approx(charged) and rec["cost"]["priced_as"] == "cache_hit"
    assert rec["budget"]["settled"]["money"] == pytest.approx(charged)
    cache = rec["evidence"]["cache"]
    assert cache["result"] == "hit" and cache["created_by"] == fid
    assert cache["saved"]["charged"] == pytest.approx(charged)
    assert cache["saved"]["cost"] == pytest.approx(spent[fid]["cost"] - charged)
    assert rec["unit_cost"]["category"] == "cache_hit" and rec["unit_cost"]["charged"] == pytest.approx(charged)
    assert audit[aid]["evidence"]["cache"]["refused_by"] == "budget" and audit[aid]["status"] == 429
    # /admin/cost's snapshot: tokens and money the hits saved
    (m,) = [r for r in snap["by_model"] if r["backend"] == "none"]
    assert m["saved_tokens"] == tokens and m["saved_cost"] == pytest.approx(spent[fid]["cost"] - charged)


async def test_a_free_hit_by_default_counts_against_no_budget_and_stays_unbilled(tmp_path):
    first, hit, again, spent, unbilled, audit, snap = await _run(tmp_path, None)
    assert first.status_code == hit.status_code == again.status_code == 200  # hits use no request budget
    assert hit.headers["x-gateway-cache"] == again.headers["x-gateway-cache"] == "hit"
    assert "x-ratelimit-remaining-requests" not in hit.headers
    fid, hid, aid = (r.headers["x-request-id"] for r in (first, hit, again))
    assert set(spent) == {fid}
    tokens = hit.json()["usage"]["prompt_tokens"] + hit.json()["usage"]["completion_tokens"]
    for rid in (hid, aid):
        row = unbilled[rid]
        assert row["cost_category"] == "cache_hit" and row["cost"] == 0
        assert row["saved_tokens"] == tokens and row["saved_cost"] == pytest.approx(spent[fid]["cost"])
        assert "cost" not in audit[rid] or audit[rid]["cost"] is None
        assert audit[rid]["evidence"]["cache"]["saved"]["cost"] == pytest.approx(spent[fid]["cost"])


async def test_a_priced_streamed_hit_is_replayed_and_charged(tmp_path):
    prices = {"sim-model": {"input": 0.5, "output": 1.5, "cache_hit": RATE}}
    async with start_fleet(1, profiles=["l40s-8b"]) as fleet:
        cfg = gateway_config(fleet.manifest()["engines"], tmp_path, prices=prices)
        cfg["keys"].append({"name": "o", "key": OTHER, "tenant": "acme", "team": "search", "project": "p1"})
        (tmp_path / "policy.yaml").write_text(yaml.safe_dump(POLICY))
        async with wired_gateway(cfg, tmp_path) as (gw, cl):
            first = await cl.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, json=BODY)
            hit = await cl.post("/v1/chat/completions", headers={"authorization": f"Bearer {OTHER}"},
                                json={**BODY, "stream": True, "stream_options": {"include_usage": True}})
    assert first.status_code == hit.status_code == 200 and hit.headers["x-gateway-cache"] == "hit"
    assert hit.text.rstrip().endswith("data: [DONE]")
    usage = first.json()["usage"]
    db = sqlite3.connect(tmp_path / "budgets.db")
    (cat, cost, saved) = db.execute("select cost_category, cost, saved_tokens from budget_ledger where request_id=?",
                                    (hit.headers["x-request-id"],)).fetchone()
    db.close()
    tokens = usage["prompt_tokens"] + usage["completion_tokens"]
    assert cat == "cache_hit" and cost == pytest.approx(tokens * RATE / 1e6) and saved == tokens
