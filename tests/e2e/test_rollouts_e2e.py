"""Rollouts end to end: a real `gateway serve --workers 2` in front of a simulated fleet, the official openai SDK.

Engine v1 serves `support-v1`, engine v2 `support-v2`; the alias `support` splits them 50/50. Pins: one user
keeps one arm on every request whichever worker answers; /admin/aliases reads and changes the live weights and
every worker follows within the refresh; an error rate injected on engine v2 (the simulator's /sim/faults) rolls
its arm back to weight 0 within one window, clients still answered by the fallback arm, with the alarm in the
log, /metrics and the admin view; audit records name the alias and the arm."""
from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
import yaml

from backends.sim.fleet import FleetProcess
from tests.support.procs import audit_record, free_port, start_gateway

pytestmark = pytest.mark.e2e
KEY = "rollout-e2e-key-0123456789"
ADMIN = "rollout-admin-key-0123456789"
MSGS = [{"role": "user", "content": "hello"}]
WINDOW_S = 30.0


@pytest.fixture()
def stack(tmp_path):
    fleet = FleetProcess(["--engines", "2", "--profile", "tiny", "--base-port", "0"], tmp_path / "fleet.json")
    man = fleet.start()
    e1, e2 = man["engines"]
    port = free_port()
    cfg = {"server": {"host": "127.0.0.1", "port": port, "workers": 2},
           "backends": [
               {"name": "v1-engine", "url": e1["url"], "kind": "sim", "models": ["support-v1"],
                "model_map": {"support-v1": "sim-model"}, "health": {"enabled": False}},
               {"name": "v2-engine", "url": e2["url"], "kind": "sim", "models": ["support-v2"],
                "model_map": {"support-v2": "sim-model"}, "health": {"enabled": False}}],
           "aliases": [{"name": "support",
                        "targets": [{"model": "support-v2", "weight": 50}, {"model": "support-v1", "weight": 50,
                                                                                    "stable": True}],
                        "rollback": {"window_s": WINDOW_S, "min_requests": 10}}],
           "keys": [{"key": KEY, "tenant": "acme", "name": "k"}],
           "admin": {"key": ADMIN},
           "policy": {"audit_path": str(tmp_path / "audit.jsonl")},
           "identity": {"sqlite_path": str(tmp_path / "id.db")}}
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    gw, _ = start_gateway(path)
    base = f"http://127.0.0.1:{port}"
    yield {"base": base, "gw": gw, "tmp": tmp_path, "v2": e2,
           "client": openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)}
    gw.stop()
    fleet.stop()


def ask(client: openai.OpenAI, user: str) -> tuple[str, str]:
    """(the arm the gateway chose, the request id) for one chat request of `user`, on a fresh connection."""
    raw = client.with_options(http_client=httpx.Client()).chat.completions.with_raw_response.create(
        model="support", messages=MSGS, max_tokens=2, user=user)
    assert raw.parse().choices[0].message.content is not None
    return raw.headers["x-gateway-rollout-arm"], raw.headers["x-request-id"]


def admin(stack: dict[str, Any], method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, stack["base"] + path, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10,
                         **kw)


def test_one_user_keeps_one_arm_across_workers_and_the_audit_names_it(stack):
    arms_of: dict[str, set[str]] = {}
    rid = ""
    for rnd in range(3):
        for i in range(30):
            arm, rid = ask(stack["client"], f"user-{i}")
            arms_of.setdefault(f"user-{i}", set()).add(arm)
    assert all(len(a) == 1 for a in arms_of.values()), arms_of
    assert {next(iter(a)) for a in arms_of.values()} == {"support-v1", "support-v2"}
    rec = audit_record(stack["base"], rid, ADMIN)
    assert rec["evidence"]["rollout"] == {"alias": "support", "arm": arms_of["user-29"].pop()}
    assert rec["model"] == "support"


def test_admin_patch_moves_every_worker_and_reset_restores_the_config(stack):
    r = admin(stack, "GET", "/admin/aliases")
    assert r.status_code == 200
    [view] = r.json()["data"]
    assert [(a["model"], a["weight"], a["stable"]) for a in view["arms"]] == [
        ("support-v2", 50.0, False), ("support-v1", 50.0, True)]
    assert httpx.get(stack["base"] + "/admin/aliases").status_code == 401
    assert admin(stack, "GET", "/admin/aliases/nope").status_code == 404
    bad = admin(stack, "PATCH", "/admin/aliases/support", json={"weights": {"support-v9": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "weights.support-v9"
    assert admin(stack, "PATCH", "/admin/aliases/support", json={"weights": {"support-v2": -1}}).status_code == 400
    assert admin(stack, "PATCH", "/admin/aliases/support", content=b"{").status_code == 400
    r = admin(stack, "PATCH", "/admin/aliases/support", json={"weights": {"support-v2": 0}})
    assert r.status_code == 200 and r.json()["arms"][0]["weight"] == 0.0
    time.sleep(2.5)  # the other worker's refresh (REFRESH_S = 2)
    assert {ask(stack["client"], f"user-{i}")[0] for i in range(30)} == {"support-v1"}
    assert admin(stack, "POST", "/admin/aliases/support/reset").status_code == 200
    time.sleep(2.5)
    assert {ask(stack["client"], f"user-{i}")[0] for i in range(30)} == {"support-v1", "support-v2"}


def test_an_injected_error_rate_rolls_the_canary_back_within_one_window(stack):
    r = httpx.post(stack["v2"]["url"].removesuffix("/v1") + "/sim/faults", json={"error_rate": 0.6})
    assert r.status_code == 200
    t0 = time.monotonic()
    rolled = None
    n = 0
    while time.monotonic() - t0 < WINDOW_S:
        ask(stack["client"], f"u{n}")  # a failed v2 answer falls back to v1: the client still gets 200
        n += 1
        if n % 10 == 0:
            arms = admin(stack, "GET", "/admin/aliases/support").json()["arms"]
            if arms[0]["rolled_back"]:
                rolled = arms[0]
                break
    assert rolled is not None, f"no rollback after {n} requests"
    assert rolled["weight"] == 0.0 and "error rate" in rolled["rolled_back"]
    time.sleep(2.5)  # every worker has read the stored rollback
    assert {ask(stack["client"], f"after-{i}")[0] for i in range(30)} == {"support-v1"}
    metrics = httpx.get(stack["base"] + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    assert 'gateway_rollout_rollbacks_total{alias="support",arm="support-v2"}' in metrics
    assert "arm support-v2 rolled back" in stack["gw"].log()
    ui = admin(stack, "GET", "/admin/ui/data").json()["rollouts"]  # what the dashboard renders
    assert [(x["model"], x["weight"]) for x in ui["aliases"][0]["arms"]] == [("support-v2", 0.0), ("support-v1", 50.0)]
    assert ui["alarms"] == [{"alias": "support", "arm": "support-v2", "reason": rolled["rolled_back"]}]
