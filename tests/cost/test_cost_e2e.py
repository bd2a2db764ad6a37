"""End to end: `python -m gateway serve` in front of a simulated fleet process. A request's audit record
(/admin/decisions/{id}) carries its apportioned GPU-seconds and their cost next to the price charged, the
ledger row the same, /metrics the cost series, and `gateway report` over the ledger agrees."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.stack import make_stack

pytestmark = pytest.mark.e2e
KEY = "cost-e2e-key-0123456789"
ADMIN = "cost-e2e-admin-0123456789"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cost")
    with make_stack(tmp, profile="l40s-8b", kind="vllm", backend={"location": {"country": "DE"}},
                    keys={KEY: {"tenant": "acme", "team": "search", "name": "k"}}, admin=ADMIN,
                    policy={"version": 1, "defaults": {"allow": True}, "rules": []},
                    budgets={"prices": {"sim-model": {"input": 1.0, "output": 4.0}}},
                    cost=lambda man: {"backends": {man["engines"][0]["name"]: {"gpu_hour": 3.6, "gpus": 2}}}) as s:
        e = s.engines[0]
        yield {"base": s.base, "tmp": tmp, "config": s.config, "engine": e}


def test_audit_record_ledger_metrics_and_report_carry_the_apportioned_cost(stack):
    base = stack["base"]
    ids = []
    with httpx.Client(base_url=base, timeout=30) as c:
        for i in range(4):
            r = c.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                       json={"model": "sim-model", "max_tokens": 12, "stream": i % 2 == 0,
                             "stream_options": {"include_usage": True} if i % 2 == 0 else None,
                             "messages": [{"role": "user", "content": f"hello number {i} " * 20}]})
            assert r.status_code == 200, r.text
            ids.append(r.headers["x-request-id"])
        rec = None
        for _ in range(100):
            r = c.get(f"/admin/decisions/{ids[-1]}", headers={"authorization": f"Bearer {ADMIN}"})
            if r.status_code == 200:
                rec = r.json()
                break
            time.sleep(0.05)
        assert rec is not None
        uc = rec["unit_cost"]
        assert uc["engine"] == stack["engine"]["name"] and uc["method"] == "apportioned"
        assert uc["category"] == "served" and uc["gpus"] == 2
        assert 0 < uc["gpu_seconds"] < rec["total_ms"] / 1000 * 2  # GPUs x engine time, at most the wall time
        assert uc["cost"] == pytest.approx(uc["gpu_seconds"] * 3.6 / 3600, rel=1e-6)
        assert uc["charged"] == pytest.approx(rec["cost"]["amount"])  # next to the price charged
        assert uc["margin"] == pytest.approx(uc["charged"] - uc["cost"], rel=1e-6)
        metrics = c.get("/metrics").text
        snap = c.get("/admin/cost", headers={"authorization": f"Bearer {ADMIN}"}).json()
        assert c.get("/admin/cost", headers={"authorization": f"Bearer {KEY}"}).status_code == 403
    eng = snap["engines"][stack["engine"]["name"]]
    assert eng["charged_s"] > 0 and 0 < eng["utilisation"] <= 1
    assert sum(t["requests"] for t in snap["totals"]) >= 4
    assert 'gateway_cost_gpu_seconds_total{backend="%s"' % stack["engine"]["name"] in metrics
    assert "gateway_engine_busy_seconds_total" in metrics and "gateway_engine_apportioned_seconds_total" in metrics
    db = stack["tmp"] / "budgets.db"
    for _ in range(100):
        try:
            with sqlite3.connect(db) as con:
                rows = con.execute("select request_id, gpu_seconds_apportioned, engine_cost, cost_category, "
                                   "engine from budget_ledger").fetchall()
        except sqlite3.OperationalError:
            rows = []
        if len(rows) == 4:
            break
        time.sleep(0.05)
    assert len(rows) == 4
    assert all(r[1] > 0 and r[2] > 0 and r[3] == "served" and r[4] == stack["engine"]["name"] for r in rows)
    out = subprocess.run([sys.executable, "-m", "gateway", "report", "--config", str(stack["config"]),
                          "--group-by", "tenant", "--format", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (g,) = json.loads(out.stdout)["groups"]
    assert g["tenant"] == "acme" and g["requests"] == 4
    assert g["gpu_seconds"] == pytest.approx(sum(r[1] for r in rows))
    assert g["engine_cost"] == pytest.approx(sum(r[2] for r in rows))


def test_an_abandoned_stream_is_waste(stack):
    """The client leaves after the first chunk: status 499, its engine time so far is wasted GPU-seconds."""
    with httpx.Client(base_url=stack["base"], timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "sim-model", "max_tokens": 2000, "stream": True,
                            "messages": [{"role": "user", "content": "a long story please"}]}) as r:
            rid = r.headers["x-request-id"]
            for _ in r.iter_raw():
                break
        rec = None
        for _ in range(200):
            r = c.get(f"/admin/decisions/{rid}", headers={"authorization": f"Bearer {ADMIN}"})
            if r.status_code == 200:
                rec = r.json()
                break
            time.sleep(0.05)
    assert rec is not None and rec["status"] == 499
    uc = rec["unit_cost"]
    assert uc["category"] == "aborted" and uc["gpu_seconds"] > 0
    assert uc["wasted_gpu_seconds"] == {"aborted": uc["gpu_seconds"]}
