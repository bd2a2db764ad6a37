"""Shadow traffic end to end: a real gateway in front of a simulated fleet, the official openai SDK.

Alias `support` answers from `support-v1` (engine in DE) and copies every answered request (sample 1.0) to the
shadow `support-v3`, served only by an engine in the US, charged to tenant `shadow-ops`. Pins: the client only
ever gets the primary's answer; an EEA-bound caller's copies never reach the US engine (routing refuses them, as
it would the primary); an unrestricted caller's copies do, run as `shadow-ops` with their own audit records, and
the primary's record names its copy; the copies are charged to the budget of `shadow-ops`, not the caller's."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import yaml

from backends.sim.fleet import FleetProcess
from tests.support.procs import free_port, start_gateway

pytestmark = pytest.mark.e2e
KEY, EU_KEY = "shadow-e2e-key-0123456789", "shadow-eu-key-0123456789"
MSGS = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shadow")
    fleet = FleetProcess(["--engines", "2", "--profile", "tiny", "--base-port", "0", "--locations", "DE,US"],
                         tmp / "fleet.json")
    de, us = fleet.start()["engines"]
    (tmp / "policy.yaml").write_text(yaml.safe_dump({"version": 1, "defaults": {"allow": True}, "rules": [
        {"id": "eu-stays-in-eea", "match": {"tenant": "eu"}, "require": {"jurisdiction": "EEA"}},
        {"id": "shadow-budget", "match": {"tenant": "shadow-ops"}, "budgets": [{"window": "day", "tokens": 100000}]},
        {"id": "acme-budget", "match": {"tenant": "acme"}, "budgets": [{"window": "day", "tokens": 100000}]}]}))
    port = free_port()
    cfg = {"server": {"host": "127.0.0.1", "port": port},
           "backends": [
               {"name": "v1-de", "url": de["url"], "kind": "sim", "models": ["support-v1"],
                "model_map": {"support-v1": "sim-model"}, "location": {"country": "DE"}},
               {"name": "v3-us", "url": us["url"], "kind": "sim", "models": ["support-v3"],
                "model_map": {"support-v3": "sim-model"}, "location": {"country": "US"}}],
           "aliases": [{"name": "support", "targets": [
               {"model": "support-v1", "weight": 100},
               {"model": "support-v3", "shadow": {"sample": 1.0, "budget_scope": "shadow-ops"}}]}],
           "keys": [{"key": KEY, "tenant": "acme", "name": "k"}, {"key": EU_KEY, "tenant": "eu", "name": "e"}],
           "admin": {"key": "shadow-admin-0123456789"},
           "policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / "audit.jsonl")},
           "identity": {"sqlite_path": str(tmp / "id.db")}}
    (tmp / "gw.yaml").write_text(yaml.safe_dump(cfg))
    gw, _ = start_gateway(tmp / "gw.yaml")
    yield {"base": f"http://127.0.0.1:{port}", "tmp": tmp, "us": us, "gw": gw}
    gw.stop()
    fleet.stop()


def us_requests(stack) -> int:
    return len(httpx.get(stack["us"]["url"].removesuffix("/v1") + "/sim/costs").json()["costs"])


def records(stack) -> list[dict]:
    p = stack["tmp"] / "audit.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def ask(stack, key: str, n: int) -> list[str]:
    client = openai.OpenAI(base_url=stack["base"] + "/v1", api_key=key, max_retries=0)
    rids = []
    for i in range(n):
        raw = client.chat.completions.with_raw_response.create(model="support", messages=MSGS, max_tokens=4,
                                                               user=f"u{i}")
        assert raw.headers["x-gateway-backend"] == "v1-de"  # the primary's answer, never the shadow's
        assert raw.headers["x-gateway-rollout-arm"] == "support-v1"
        assert raw.parse().choices[0].message.content
        rids.append(raw.headers["x-request-id"])
    return rids


def copies_of(stack, rids: list[str], n: int) -> list[dict]:
    """The audit records of the shadow copies of `rids`, once all `n` are written."""
    def got():
        out = [r for r in records(stack) if (r.get("evidence") or {}).get("rollout", {}).get("of") in rids]
        return out if len(out) == n else None
    return wait_for(got) or []


def wait_for(pred, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    return pred()


def test_an_eea_callers_copies_never_reach_a_backend_outside_the_eea(stack):
    before = us_requests(stack)
    rids = ask(stack, EU_KEY, 8)
    # each copy was tried and refused by routing, as the primary would have been
    shadows = copies_of(stack, rids, 8)
    assert len(shadows) == 8
    assert all(r["backend"] is None and r["error"] == "residency_unsatisfiable" for r in shadows), \
        [(r["status"], r["error"]) for r in shadows]
    assert all(r["decision"]["jurisdiction"] == "EEA" for r in shadows)
    assert us_requests(stack) == before


def test_an_unrestricted_callers_copies_reach_the_shadow_charged_to_the_operator_scope(stack):
    before = us_requests(stack)
    rids = ask(stack, KEY, 5)
    assert wait_for(lambda: us_requests(stack) - before == 5)
    shadows = copies_of(stack, rids, 5)
    assert len(shadows) == 5 and all(r["backend"] == "v3-us" and r["status"] == 200 for r in shadows)
    assert {r["principal"]["tenant"] for r in shadows} == {"shadow-ops"}
    # charged to the operator's scope only, never to the caller's budgets
    for r in shadows:
        assert [(lim["scope"], lim["id"]) for lim in r["budget"]["limits"]] == [("tenant", "shadow-ops")]
        assert r["budget"]["settled"]["tokens"] > 0
    assert all(r["evidence"]["rollout"]["shadow"] is True for r in shadows)
    primaries = {r["request_id"]: r for r in records(stack) if r["request_id"] in rids}
    assert all(p["evidence"]["rollout"] == {"alias": "support", "arm": "support-v1", "shadow": ["support-v3"]}
               for p in primaries.values())


def test_a_hung_shadow_engine_never_holds_up_the_primary(stack):
    faults = stack["us"]["url"].removesuffix("/v1") + "/sim/faults"
    assert httpx.post(faults, json={"hang": True}).status_code == 200
    try:
        # each copy waits on the hung engine; every primary is answered regardless (the copy starts after it)
        client = openai.OpenAI(base_url=stack["base"] + "/v1", api_key=KEY, max_retries=0, timeout=10)
        for i in range(3):
            r = client.chat.completions.create(model="support", messages=MSGS, max_tokens=4, user=f"h{i}")
            assert r.choices[0].message.content
    finally:
        httpx.post(faults, json={"hang": False})


def test_gateway_report_gives_gpu_seconds_per_arm_and_for_the_shadow(stack):
    import subprocess
    import sys

    ask(stack, KEY, 3)
    wait_for(lambda: len(records(stack)) >= 6)

    def report() -> dict:
        out = subprocess.run([sys.executable, "-m", "gateway", "report", "--config", str(stack["tmp"] / "gw.yaml"),
                              "--group-by", "tenant,model", "--format", "json"], capture_output=True, text=True,
                             check=True).stdout
        return {(g["tenant"], g["model"]): g for g in json.loads(out)["groups"]}

    groups = wait_for(lambda: (lambda g: g if ("shadow-ops", "support-v3") in g and ("acme", "support-v1") in g
                               else None)(report()))
    assert groups, report()
    assert groups[("acme", "support-v1")]["gpu_seconds"] > 0  # the arm, charged to the caller
    assert groups[("shadow-ops", "support-v3")]["gpu_seconds"] > 0  # the shadow, charged to the operator's scope
    assert ("acme", "support-v3") not in groups
