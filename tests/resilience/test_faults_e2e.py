"""End to end under faults: the gateway process in front of simulated engines (DE, SE, US) and local
OpenAI-compatible upstreams (one of ours, one partner), faults injected through POST /sim/faults and the
upstream's per-request faults. Pins: 500 storms are retried inside the residency class only; an engine killed
mid-stream ends the stream with an error event and [DONE] and comes back by itself; a hanging engine leaves
the candidate set (active probes open its circuit) and returns when it recovers; a slow partner is cut at its
per-route timeout with a clear 504; alias fallback chains follow the same rules; one ledger row per request."""
from __future__ import annotations

import time

import httpx
import orjson
import pytest

from tests.resilience.stack import (ADMIN_KEY, EEA_KEY, GW_KEY, ledger_rows, set_faults, sim_backends,
                                    start_fleet_proc, wait_audit, wait_engines_up, write_config)
from tests.support.procs import start_gateway, start_upstream

pytestmark = pytest.mark.e2e
CHAT = {"messages": [{"role": "user", "content": "tell me something"}], "max_tokens": 8}
NAMES = {"DE": "sim-0", "SE": "sim-1", "US": "sim-2"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    fleet, manifest = start_fleet_proc(tmp, 3, "DE,SE,US")
    up, up_port = start_upstream(tmp)
    partner, partner_port = start_upstream(tmp, key="partner-secret-xyz")
    fast = {"connect_s": 1, "first_token_s": 3, "idle_s": 2, "total_s": 30}
    health = {"interval_s": 0.3, "failures_to_open": 2, "open_s": 1.0}
    backends = sim_backends(manifest, timeouts=fast, health=health)
    backends += [
        {"name": "ours-openai", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1", "models": ["up-model"],
         "location": {"country": "FI"}, "retention": "zero", "timeouts": fast, "health": health},
        {"name": "partner-nl", "kind": "openai", "operator": "partner", "url": f"http://127.0.0.1:{partner_port}/v1",
         "models": ["partner-model"], "model_map": {"partner-model": "vendor/partner-model"},
         "api_key_env": "PARTNER_KEY", "location": {"country": "NL"}, "retention": "zero",
         "timeouts": {"connect_s": 1, "first_token_s": 1.0, "idle_s": 1.0, "total_s": 5}, "health": health},
    ]
    cfg = write_config(tmp, backends, aliases=[{"name": "chain", "targets": ["up-model", "sim-model"]}])
    env = {"PARTNER_KEY": "partner-secret-xyz"}
    gw, port = start_gateway(cfg, env=env)
    yield {"tmp": tmp, "manifest": manifest, "base": f"http://127.0.0.1:{port}", "gw": gw,
           "partner_port": partner_port}
    gw.stop()
    up.stop()
    partner.stop()
    fleet.stop()


@pytest.fixture(autouse=True)
def clear_faults(stack):
    yield
    for i in range(3):
        try:
            set_faults(stack["manifest"], i, error_rate=0.0, hang=False, slow_factor=1.0)
        except httpx.HTTPError:
            pass
    wait_all_closed(stack)


def wait_all_closed(stack, timeout: float = 8.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = fleet_health(stack)
        if all(v["state"] == "closed" for v in h.values()) or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


def fleet_health(stack) -> dict:
    r = httpx.get(stack["base"] + "/admin/fleet", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=5)
    return r.json()["health"]


def post(stack, body: dict, key: str = GW_KEY, rid: str | None = None, timeout: float = 15) -> httpx.Response:
    h = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    if rid:
        h["x-request-id"] = rid
    return httpx.post(stack["base"] + "/v1/chat/completions", content=orjson.dumps(body), headers=h, timeout=timeout)


def attempted(rec: dict) -> list[str]:
    return [a["backend"] for a in rec["attempts"] if "skipped" not in a]


def test_500_storm_is_retried_inside_the_residency_class_only(stack):
    set_faults(stack["manifest"], 0, error_rate=1.0)  # DE answers every generation with HTTP 500
    ids = set()
    for i in range(10):
        rid = f"storm-{i}-{time.monotonic_ns()}"
        ids.add(rid)
        r = post(stack, {**CHAT, "model": "sim-model"}, key=EEA_KEY, rid=rid)
        assert r.status_code == 200, r.text  # DE failed -> retried on SE (same residency class)
    recs = wait_audit(stack["tmp"], ids)
    assert ids <= set(recs)
    for rid in ids:
        tried = attempted(recs[rid])
        assert NAMES["US"] not in tried, tried  # never outside the EEA, on the first try or on retries
        assert recs[rid]["backend"] == NAMES["SE"]
    # the storm opened DE's circuit: DE left the candidate set, so most requests did not try it at all
    tried_de = sum(NAMES["DE"] in attempted(recs[rid]) for rid in ids)
    assert tried_de <= 5, tried_de
    # one ledger row per request, none charged twice
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not ids <= {r[0] for r in ledger_rows(stack["tmp"])}:
        time.sleep(0.05)
    rows = [r for r in ledger_rows(stack["tmp"]) if r[0] in ids]
    assert len(rows) == len(ids) == len({r[0] for r in rows})
    assert all(r[2] == NAMES["SE"] for r in rows)


def test_when_every_allowed_engine_fails_the_client_gets_a_clear_error_never_a_quiet_send_elsewhere(stack):
    set_faults(stack["manifest"], 0, error_rate=1.0)
    set_faults(stack["manifest"], 1, error_rate=1.0)
    ids = set()
    for i in range(6):
        rid = f"eea-down-{i}-{time.monotonic_ns()}"
        ids.add(rid)
        r = post(stack, {**CHAT, "model": "sim-model"}, key=EEA_KEY, rid=rid)
        assert r.status_code in (502, 503), r.text
        err = r.json()["error"]
        assert err["code"] and err["message"]
        if r.status_code == 503:
            assert r.headers["retry-after"] and r.headers["retry-after-ms"]
    recs = wait_audit(stack["tmp"], ids)
    for rid in ids:
        assert NAMES["US"] not in attempted(recs[rid])
    r = post(stack, {**CHAT, "model": "sim-model"})  # a tenant without residency still gets served (US)
    assert r.status_code == 200, r.text


def stream_lines(stack, body: dict, key: str = GW_KEY, on_first=None, rid: str | None = None) -> str:
    out = []
    h = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    if rid:
        h["x-request-id"] = rid
    with httpx.stream("POST", stack["base"] + "/v1/chat/completions", timeout=30, headers=h,
                      content=orjson.dumps(body)) as r:
        assert r.status_code == 200, r.read()
        for chunk in r.iter_text():
            out.append(chunk)
            if on_first is not None and '"content"' in "".join(out):
                on_first()
                on_first = None
    return "".join(out)


def test_engine_killed_mid_stream_ends_with_error_event_and_done_then_recovers(stack):
    m = stack["manifest"]
    for i in range(3):
        set_faults(m, i, slow_factor=8.0)

    def kill_all() -> None:
        for i in range(3):
            set_faults(m, i, crash=True, restart_after_s=1.0)

    rid = f"killed-{time.monotonic_ns()}"
    text = stream_lines(stack, {**CHAT, "model": "sim-model", "max_tokens": 400, "stream": True}, on_first=kill_all,
                        rid=rid)
    assert '"content"' in text  # part of the answer arrived
    assert '"error"' in text and '"upstream_' in text  # then a clear error event
    assert text.rstrip().endswith("data: [DONE]")
    # evidence and spend survive the fault: one audit record saying what happened, one ledger row charging
    # what was delivered before the engine died (not zero, not the whole max_tokens)
    rec = wait_audit(stack["tmp"], {rid})[rid]
    assert rec["status"] in (502, 504) and rec["error"] in ("upstream_stream_broken", "upstream_timeout")
    assert rec["backend"] is not None and rec["cost"]["completion_tokens"] > 0
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and rid not in {r[0] for r in ledger_rows(stack["tmp"])}:
        time.sleep(0.05)
    rows = [r for r in ledger_rows(stack["tmp"]) if r[0] == rid]
    assert len(rows) == 1 and 0 < rows[0][1] < 400 + 200 and rows[0][3] in (502, 504), rows
    # the engines come back by themselves and the gateway uses them again without intervention
    deadline = time.monotonic() + 10
    while True:
        r = post(stack, {**CHAT, "model": "sim-model"}, timeout=5)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    # one engine back is enough for that request; the next test needs all three (it set faults on engine 0
    # while it was still restarting: connection refused)
    wait_engines_up(m)
    wait_all_closed(stack)


def test_hanging_engine_leaves_the_candidate_set_and_comes_back(stack):
    set_faults(stack["manifest"], 0, hang=True)  # DE stops answering, /health included
    deadline = time.monotonic() + 5
    while fleet_health(stack)[NAMES["DE"]]["state"] == "closed" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fleet_health(stack)[NAMES["DE"]]["state"] != "closed"
    t0 = time.monotonic()
    for _ in range(6):
        r = post(stack, {**CHAT, "model": "sim-model"}, key=EEA_KEY)
        assert r.status_code == 200, r.text
    assert time.monotonic() - t0 < 5  # nobody waited for the hung engine's first-token timeout
    set_faults(stack["manifest"], 0, hang=False)
    assert wait_all_closed(stack)[NAMES["DE"]]["state"] == "closed"  # half-open probe closed it again


def test_slow_partner_is_cut_at_its_route_timeout_with_a_clear_error(stack):
    t0 = time.monotonic()
    r = post(stack, {**CHAT, "model": "partner-model", "stream": True, "x_test_fault": "slow_first:4"})
    took = time.monotonic() - t0
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    assert took < 3.5  # the partner route's first_token_s (1 s), not the partner's 4 s
    r = post(stack, {**CHAT, "model": "partner-model"})
    assert r.status_code == 200, r.text
    stats = httpx.get(f"http://127.0.0.1:{stack['partner_port']}/stats").json()
    assert stats["last_body"]["model"] == "vendor/partner-model"  # model-name mapping
    assert stats["last_headers"]["authorization"] == "Bearer partner-secret-xyz"
    assert "partner-secret-xyz" not in stack["gw"].log()  # the credential never reaches the logs


def test_alias_fallback_chain_under_faults_keeps_the_residency_rules(stack):
    ids = set()
    for i in range(4):
        rid = f"chain-{i}-{time.monotonic_ns()}"
        ids.add(rid)
        # up-model (FI) answers 503 -> the chain falls back to sim-model, inside the EEA for the EEA tenant
        r = post(stack, {**CHAT, "model": "chain", "x_test_fault": "error503"}, key=EEA_KEY, rid=rid)
        assert r.status_code == 200, r.text
    recs = wait_audit(stack["tmp"], ids)
    ordered = sorted(ids, key=lambda x: int(x.split("-")[2]))
    first = attempted(recs[ordered[0]])
    assert first[0] == "ours-openai" and len(first) == 2, first  # tried the chain's head, then fell back
    for rid in ordered:
        tried = attempted(recs[rid])
        assert recs[rid]["backend"] in (NAMES["DE"], NAMES["SE"]) and NAMES["US"] not in tried, tried
    # two 503s opened the head's circuit: the last request did not waste an attempt on it
    assert attempted(recs[ordered[-1]]) == [recs[ordered[-1]]["backend"]]


def test_catalog_carries_what_an_aggregator_lists(stack):
    r = httpx.get(stack["base"] + "/v1/models", headers={"authorization": f"Bearer {GW_KEY}"})
    models = {m["id"]: m for m in r.json()["data"]}
    sim = models["sim-model"]
    assert sim["inference_locations"] == ["DE", "SE", "US"] and sim["jurisdiction"] is None
    assert sim["retention"] == "zero" and sim["context_window"] == 4096 and "chat" in sim["capabilities"]
    p = models["partner-model"]
    assert p["jurisdiction"] == "EEA" and p["storage_locations"] == ["NL"]
    assert p["locations"][0]["operator"] == "partner"
    assert models["chain"]["alias_of"] == ["up-model", "sim-model"]
