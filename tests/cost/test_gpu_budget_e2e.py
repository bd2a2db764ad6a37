"""End to end (issue 25): `python -m gateway serve` in front of a simulated fleet process, a tenant with a
GPU-second budget. Requests are admitted while the learned worst case fits, settled with the GPU-seconds the
cost meter apportioned to them, and refused with the budget's 429 once those are spent; the audit record and
the ledger carry the same apportioned figure the budget settled."""
from __future__ import annotations

import sqlite3
import time

import httpx
import pytest

from tests.support.stack import make_stack

pytestmark = pytest.mark.e2e
KEY = "gpu-budget-key-0123456789"
ADMIN = "gpu-budget-admin-0123456789"
LIMIT_S = 1.5


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-budget")
    with make_stack(tmp, profile="l40s-8b", kind="vllm", backend={"location": {"country": "DE"}},
                    keys={KEY: {"tenant": "smallco", "name": "k"}}, admin=ADMIN,
                    policy={"version": 1, "defaults": {"allow": True}, "rules": [
                        {"id": "gpu-day", "match": {"tenant": "smallco"},
                         "budgets": [{"window": "day", "scope": "tenant", "gpu_seconds": LIMIT_S}]}]},
                    budgets={"prices": {"sim-model": {"input": 1.0, "output": 4.0}}},
                    cost=lambda man: {"backends": {man["engines"][0]["name"]: {"gpu_hour": 3.6, "gpus": 1}}}) as s:
        yield {"base": s.base, "tmp": tmp, "engine": s.engines[0]}


def _record(c: httpx.Client, rid: str) -> dict:
    for _ in range(200):
        r = c.get(f"/admin/decisions/{rid}", headers={"authorization": f"Bearer {ADMIN}"})
        if r.status_code == 200:
            return r.json()
        time.sleep(0.05)
    raise AssertionError(f"no audit record for {rid}")


def test_gpu_second_budget_admits_until_the_apportioned_seconds_are_spent(stack):
    served: list[str] = []
    refusal = None
    remaining: list[float] = []
    with httpx.Client(base_url=stack["base"], timeout=60) as c:
        for i in range(60):
            r = c.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                       json={"model": "sim-model", "max_tokens": 16, "stream": i % 2 == 0,
                             "messages": [{"role": "user", "content": f"question {i}: " + "tell me more " * 10}]})
            if r.status_code == 429:
                refusal = r
                break
            assert r.status_code == 200, r.text
            if i % 2 == 0:
                r.read()
            assert r.headers["x-ratelimit-limit-gpu-seconds"] == "1.5"
            remaining.append(float(r.headers["x-ratelimit-remaining-gpu-seconds"]))
            served.append(r.headers["x-request-id"])
        assert refusal is not None, f"never refused after {len(served)} requests"
        assert len(served) >= 2  # admitted while the worst case fitted
        err = refusal.json()["error"]
        assert err["code"] == "insufficient_quota"  # the budget's 429 shape, as for money and day tokens
        assert err["budget"] == {"kind": "gpu_seconds", "scope": "tenant", "window": "day"}
        assert "gpu_seconds limit of 1.5 per day" in err["message"]
        assert refusal.headers["x-ratelimit-limit-gpu-seconds"] == "1.5"
        assert int(refusal.headers["retry-after"]) > 0
        assert remaining == sorted(remaining, reverse=True)  # each settle spent some of it
        records = [_record(c, rid) for rid in served]
        refused = _record(c, refusal.headers["x-request-id"])
    settled = []
    for rec in records:
        b, uc = rec["budget"], rec["unit_cost"]
        assert uc["method"] == "apportioned" and uc["engine"] == stack["engine"]["name"]
        assert b["settled"]["gpu_seconds"] == pytest.approx(uc["gpu_seconds"], abs=1e-6) and uc["gpu_seconds"] > 0
        assert b["reserved"]["gpu_seconds"] > 0 and b["gpu_worst_case"]["gpu_seconds_per_completion_token"] > 0
        (lim,) = b["limits"]
        assert lim["limit"]["gpu_seconds"] == LIMIT_S and lim["after"]["gpu_seconds"] <= LIMIT_S + 1e-6
        settled.append(b["settled"]["gpu_seconds"])
    # the refused one was counted against what the others were apportioned, and nothing was held for it
    assert refused["status"] == 429 and refused["budget"]["refused"]["kind"] == "gpu_seconds"
    assert refused["unit_cost"]["category"] == "rejected"
    # each admitted request fitted settled + its worst case; settled spend passes the limit by at most what
    # one request was apportioned beyond its reservation (the documented bound)
    assert sum(settled) <= LIMIT_S + max(settled)
    db = stack["tmp"] / "budgets.db"
    rows: list = []
    for _ in range(100):
        try:
            with sqlite3.connect(db) as con:
                rows = con.execute("select request_id, gpu_seconds_apportioned from budget_ledger "
                                   "where tenant = 'smallco'").fetchall()
        except sqlite3.OperationalError:
            rows = []
        if len(rows) == len(served):
            break
        time.sleep(0.05)
    assert {r[0] for r in rows} == set(served)  # the refusal spent nothing: no spend row
    by_id = dict(rows)
    for rid, s in zip(served, settled):
        assert by_id[rid] == pytest.approx(s, abs=1e-6)  # the ledger has the figure the budget settled
