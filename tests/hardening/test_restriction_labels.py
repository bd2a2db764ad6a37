"""Issue 18.2 end to end: a tenant admin could lift its tenant's residency and retention (a key labelled
`residency: none, retention: none` under a `residency: eea` tenant was accepted and its traffic could reach a
US backend that keeps data). Now the admin API refuses it, and a key row loosened behind the API is still
decided under the tenant's EEA + zero-retention rule and never reaches the US backend."""
from __future__ import annotations

import sqlite3

import httpx
import orjson
import pytest

from tests.resilience.stack import ADMIN_KEY, wait_audit, write_config
from tests.support.procs import start_gateway, start_upstream

pytestmark = pytest.mark.e2e
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restrict")
    eu, eu_port = start_upstream(tmp)
    us, us_port = start_upstream(tmp)
    backends = [{"name": name, "kind": "openai", "url": f"http://127.0.0.1:{port}/v1", "models": ["m"],
                 "location": {"country": country}, "retention": retention, "capabilities": ["chat"]}
                for name, port, country, retention in (("eu", eu_port, "DE", "zero"), ("us", us_port, "US", "none"))]
    cfg = write_config(tmp, backends)
    proc, port = start_gateway(cfg)
    base = f"http://127.0.0.1:{port}"
    try:
        assert httpx.post(base + "/admin/tenants", json={"id": "eco", "labels": {"residency": "eea"}},
                          headers=ADMIN).status_code == 201
        r = httpx.post(base + "/admin/keys", json={"tenant": "eco", "purpose": "admin"}, headers=ADMIN)
        yield {"base": base, "tmp": tmp, "ta": {"authorization": f"Bearer {r.json()['key']}"}}
    finally:
        proc.stop()
        eu.stop()
        us.stop()


def test_tenant_admin_cannot_lift_residency_or_retention(gw):
    base, ta = gw["base"], gw["ta"]
    r = httpx.post(base + "/admin/keys", json={"tenant": "eco", "labels": {"residency": "none", "retention": "none"}},
                   headers=ta)
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "restriction_loosened" and err["param"] == "labels.residency" and "residency" in err["message"]
    r = httpx.post(base + "/admin/tenants/eco/teams", json={"id": "core", "labels": {"residency": "us"}}, headers=ta)
    assert r.status_code == 403, r.text


def test_a_loosened_row_is_still_decided_under_the_tenant_restriction(gw):
    base, ta = gw["base"], gw["ta"]
    k = httpx.post(base + "/admin/keys", json={"tenant": "eco"}, headers=ta).json()
    db = sqlite3.connect(gw["tmp"] / "gateway.db")
    try:  # what an older gateway (or SQL by hand) left in the store
        db.execute("UPDATE api_keys SET labels = ? WHERE id = ?",
                   (orjson.dumps({"residency": "none", "retention": "none"}).decode(), k["id"]))
        db.commit()
    finally:
        db.close()
    rids = set()
    for i in range(6):
        r = httpx.post(base + "/v1/chat/completions", json={"model": "m", "max_tokens": 4,
                                                           "messages": [{"role": "user", "content": f"hi {i}"}]},
                       headers={"authorization": f"Bearer {k['key']}"}, timeout=10)
        assert r.status_code == 200, r.text
        rids.add(r.headers["x-request-id"])
    recs = wait_audit(gw["tmp"], rids)
    for rid in rids:
        rec = recs[rid]
        assert rec["backend"] == "eu", rec["backend"]
        assert "eea-stays-in-eea" in rec["matched_rules"], rec["matched_rules"]
        assert rec["decision"]["retention"] == "zero"
