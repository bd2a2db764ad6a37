"""End to end: a partner (Opper) calling the real gateway process in front of simulated engines in DE, SE and US,
under the shipped policies/tenants.yaml (rule `opper-partner-contract`).

Pins what docs/partners.md promises an aggregator: the partner principal comes from the identity layer (tenant,
partner and key created through the admin API; the tenant carries no residency label, so only the partner
contract can force it); its traffic never reaches the US engine and its decision says EEA + zero retention
whatever the request's headers or body claim; the end-user id and the trace/session header are recorded in the
audit record (ids only); the same session header sticks to one engine; the prompt of a zero-retention request
appears in no audit record or log; /v1/models labels EEA-only zero-retention models; our 429s and 503s carry
Retry-After and retry-after-ms.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import httpx
import pytest

from tests.resilience.stack import ADMIN_KEY, GW_KEY, sim_backends, start_fleet_proc, write_config
from tests.support.procs import ROOT, free_port, start_gateway
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e

END_USER_HEADER = "x-opper-end-user"   # identity.end_user_header, configured (not the default) on purpose
NAMES = {"DE": "sim-0", "SE": "sim-1", "US": "sim-2"}
EEA_ENGINES = {NAMES["DE"], NAMES["SE"]}
# headers a request might use to talk its way out of the contract; none of them may matter
ESCAPE_HEADERS = {"x-data-classification": "public", "x-residency": "us", "x-jurisdiction": "US",
                  "x-retention": "30d", "x-gateway-backend": NAMES["US"], "x-backend": NAMES["US"],
                  "x-zero-retention": "false", "x-priority": "realtime"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("partners")
    fleet, manifest = start_fleet_proc(tmp, 3, "DE,SE,US")
    gw = None
    try:
        by_country = {e["location"]["country"]: e["name"] for e in manifest["engines"]}
        assert by_country == NAMES, by_country
        backends = sim_backends(manifest)
        # every engine serves sim-model; eu-model only the EEA engines, us-model only the US one; de-model and
        # se-model one engine each (to put load on exactly one engine)
        only = {NAMES["DE"]: ["eu-model", "de-model"], NAMES["SE"]: ["eu-model", "se-model"],
                NAMES["US"]: ["us-model"]}
        for b in backends:
            b["models"] = [*b["models"], *only[b["name"]]]
            b["model_map"] = {m: "sim-model" for m in only[b["name"]]}
        # an EEA zero-retention route that is down: the partner's 503 path
        backends.append({"name": "fi-down", "kind": "openai", "url": f"http://127.0.0.1:{free_port()}/v1",
                         "models": ["down-model"], "location": {"country": "FI"}, "retention": "zero",
                         "timeouts": {"connect_s": 0.5, "first_token_s": 1, "idle_s": 1, "total_s": 2}})
        cfg = write_config(tmp, backends,
                           policy={"files": [str(ROOT / "policies" / "tenants.yaml")]},
                           identity={"end_user_header": END_USER_HEADER},
                           routing={"affinity_headers": ["x-opper-trace-id", "x-session-id"]})
        gw, port = start_gateway(cfg)
        base = f"http://127.0.0.1:{port}"
        # the partner principal, from the identity layer (admin API): tenant, partner, partner key
        tenant = "opper"
        assert admin(base, "POST", "/admin/tenants", {"id": tenant}).status_code == 201
        r = admin(base, "POST", "/admin/partners", {"id": "opper", "tenant": tenant})
        assert r.status_code == 201, r.text
        r = admin(base, "POST", "/admin/keys", {"tenant": tenant, "partner": "opper"})
        assert r.status_code == 201, r.text
        yield {"tmp": tmp, "base": base, "gw": gw, "key": r.json()["key"], "key_id": r.json()["id"],
               "manifest": manifest}
    finally:
        if gw is not None:
            gw.stop()
        fleet.stop()


def admin(base: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, base + path, json=body, headers={"authorization": f"Bearer {ADMIN_KEY}"},
                         timeout=10)


def chat(stack, content: str, model: str = "sim-model", key: str | None = None, headers: dict | None = None,
         **body) -> httpx.Response:
    h = {"authorization": f"Bearer {key or stack['key']}", **(headers or {})}
    payload = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **body}
    return httpx.post(stack["base"] + "/v1/chat/completions", json=payload, headers=h, timeout=15)


def decision(stack, rid: str, timeout: float = 5.0) -> dict:
    """The audit record of a finished request (GET /admin/decisions/{id})."""
    deadline = time.monotonic() + timeout
    while True:
        r = admin(stack["base"], "GET", f"/admin/decisions/{rid}")
        if r.status_code == 200 or time.monotonic() > deadline:
            assert r.status_code == 200, r.text
            return r.json()
        time.sleep(0.05)


def test_partner_principal_and_contract_decision(stack):
    r = chat(stack, "hello from an opper user", headers={END_USER_HEADER: "opper-user-42"})
    assert r.status_code == 200, r.text
    rec = decision(stack, r.headers["x-request-id"])
    p = rec["principal"]
    assert p["kind"] == "partner" and p["partner"] == "opper" and p["tenant"] == "opper"
    assert p["key_id"] == stack["key_id"]
    assert "residency" not in p["labels"]  # nothing but the partner contract can force EEA here
    assert "opper-partner-contract" in rec["matched_rules"]
    d = rec["decision"]
    assert d["jurisdiction"] == "EEA" and d["retention"] == "zero", d
    assert d["priority"] == "standard" and d["ttft_slo_ms"] == 1500 and d["cache_isolation"] is True
    assert rec["zero_retention"] is True
    assert rec["backend"] in EEA_ENGINES
    assert rec["backend_location"]["country"] in ("DE", "SE") and rec["backend_location"]["retention"] == "zero"
    dropped = {x["backend"]: x for x in rec["evidence"]["dropped"]}
    assert dropped[NAMES["US"]]["filter"] == "residency"


def test_partner_never_reaches_us_engine_whatever_the_request_says(stack):
    seen = Counter()
    for i in range(8):
        r = chat(stack, f"escape attempt {i} {uuid.uuid4().hex}", headers=ESCAPE_HEADERS,
                 metadata={"residency": "us", "retention": "30d"}, user="someone-in-the-us")
        assert r.status_code == 200, r.text
        assert r.headers["x-gateway-backend"] in EEA_ENGINES
        rec = decision(stack, r.headers["x-request-id"])
        seen[rec["backend"]] += 1
        assert rec["backend_location"]["country"] in ("DE", "SE"), rec["backend_location"]
        assert rec["decision"]["jurisdiction"] == "EEA" and rec["decision"]["retention"] == "zero"
        assert rec["zero_retention"] is True
        assert all(a.get("backend") != NAMES["US"] for a in rec["attempts"]), rec["attempts"]
    assert NAMES["US"] not in seen
    # a model only the US engine serves is refused outright for the partner: retrying will not help
    r = chat(stack, "us only please", model="us-model", headers=ESCAPE_HEADERS)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "residency_unsatisfiable"
    # ... while a plain static key (no contract) may use it: the refusal is the contract, not the model
    r = chat(stack, "us model for acme", model="us-model", key=GW_KEY)
    assert r.status_code == 200, r.text
    assert r.headers["x-gateway-backend"] == NAMES["US"]


def test_end_user_and_trace_ids_recorded_in_audit_record(stack):
    trace = f"trace-{uuid.uuid4().hex}"
    r = chat(stack, "record my ids please", headers={END_USER_HEADER: "eu-user-7", "x-opper-trace-id": trace})
    assert r.status_code == 200, r.text
    rec = decision(stack, r.headers["x-request-id"])
    assert rec["principal"]["end_user"] == "eu-user-7"
    assert rec["session"] == {"header": "x-opper-trace-id", "id": trace}, rec.get("session")
    # a bad end-user id is an OpenAI-shaped 400, not silently recorded
    bad = chat(stack, "x", headers={END_USER_HEADER: "u" * 300})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "end_user"
    # an oversized trace id is neither recorded nor used as an affinity key; the request is still served
    r = chat(stack, "long trace id", headers={"x-opper-trace-id": "t" * 300})
    assert r.status_code == 200, r.text
    assert decision(stack, r.headers["x-request-id"])["session"] is None
    # without a trace/session header, the partner's end-user id is the affinity key
    user = f"eu-user-{uuid.uuid4().hex[:6]}"
    r = chat(stack, "first turn of a user", headers={END_USER_HEADER: user})
    first = decision(stack, r.headers["x-request-id"])
    assert first["session"] == {"header": "end_user", "id": user} and first["route"].get("affinity_engine") is None
    r = chat(stack, "second turn of the user", headers={END_USER_HEADER: user})
    assert decision(stack, r.headers["x-request-id"])["route"]["affinity_engine"] == first["backend"]


def hold_stream(stack, model: str) -> tuple[threading.Event, threading.Thread]:
    """A long streamed request on `model` held open (read in a thread) until the returned event is set."""
    started, stop = threading.Event(), threading.Event()

    def run() -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "long"}], "max_tokens": 1000,
                "stream": True}
        with httpx.stream("POST", stack["base"] + "/v1/chat/completions", json=body, timeout=30,
                          headers={"authorization": f"Bearer {stack['key']}"}) as r:
            for _ in r.iter_bytes():
                started.set()
                if stop.is_set():
                    return  # closing the response disconnects: the gateway cancels the upstream request

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(10), "the held stream never started"
    return stop, t


def test_same_session_sticks_to_one_engine_when_loads_are_similar(stack):
    """A sessionless request moves to the other EEA engine when the session's engine carries one more stream;
    the session stays (its engine is within routing.affinity_slack_ms / affinity_rel of the best)."""
    sess = f"s-{uuid.uuid4().hex[:8]}"
    r = chat(stack, f"first turn {uuid.uuid4().hex}", headers={"x-opper-trace-id": sess})
    assert r.status_code == 200, r.text
    home = r.headers["x-gateway-backend"]
    assert home in EEA_ENGINES
    assert decision(stack, r.headers["x-request-id"])["route"].get("affinity_engine") is None  # new session
    stop, t = hold_stream(stack, "de-model" if home == NAMES["DE"] else "se-model")  # one more stream on home
    picks, control = [], []
    try:
        for i in range(4):
            r = chat(stack, f"turn {i} {uuid.uuid4().hex}", headers={"x-opper-trace-id": sess})
            assert r.status_code == 200, r.text
            picks.append(r.headers["x-gateway-backend"])
            rec = decision(stack, r.headers["x-request-id"])
            assert rec["session"] == {"header": "x-opper-trace-id", "id": sess}
            assert rec["route"]["affinity_engine"] == home
            r = chat(stack, f"no session {i} {uuid.uuid4().hex}")
            assert r.status_code == 200, r.text
            control.append(r.headers["x-gateway-backend"])
    finally:
        stop.set()
        t.join(10)
    print(f"\nsession home {home}; session picks {picks}; sessionless picks meanwhile {control}")
    assert picks == [home] * 4, f"session moved off {home}: {picks}"
    # not vacuous: the router did prefer the other engine for traffic without a session
    assert any(c != home for c in control), f"sessionless requests also stayed on {home}: {control}"
    assert set(control) <= EEA_ENGINES
    # another tenant's identical header value is a different session (keyed by tenant + header + value)
    r = chat(stack, "acme same header", key=GW_KEY, headers={"x-opper-trace-id": sess})
    assert r.status_code == 200
    assert decision(stack, r.headers["x-request-id"])["route"].get("affinity_engine") is None


def test_zero_retention_canary_appears_in_no_record_or_log(stack):
    canary = f"CANARY-{uuid.uuid4().hex}"
    rids = []
    for stream in (False, True):
        r = chat(stack, f"please remember {canary} forever", stream=stream, headers={"x-session-id": "canary-s"})
        assert r.status_code == 200, r.text
        rids.append(r.headers["x-request-id"])
    for rid in rids:
        rec = decision(stack, rid)
        assert rec["zero_retention"] is True and "content" not in rec
        assert canary not in str(rec)
    wait_until(lambda: all(rid in (stack["tmp"] / "audit.jsonl").read_text() for rid in rids),
               what="the writer flushing both records to audit.jsonl")
    audit_text = (stack["tmp"] / "audit.jsonl").read_text()
    assert all(rid in audit_text for rid in rids)
    assert canary not in audit_text
    assert canary not in stack["gw"].log()
    for p in stack["tmp"].rglob("*"):
        if p.is_file() and p.suffix in (".jsonl", ".log", ".json"):
            assert canary.encode() not in p.read_bytes(), p


def test_models_catalog_marks_eea_zero_retention_models(stack):
    r = httpx.get(stack["base"] + "/v1/models", headers={"authorization": f"Bearer {stack['key']}"}, timeout=5)
    assert r.status_code == 200, r.text
    models = {m["id"]: m for m in r.json()["data"]}
    eu = models["eu-model"]
    assert eu["jurisdiction"] == "EEA" and eu["zero_data_retention"] is True and eu["retention"] == "zero"
    assert sorted(eu["inference_locations"]) == ["DE", "SE"]
    assert {loc["backend"] for loc in eu["locations"]} == EEA_ENGINES
    # served (also) in the US: no EEA claim, although every engine keeps nothing
    assert models["sim-model"]["jurisdiction"] is None and models["sim-model"]["zero_data_retention"] is True
    assert models["us-model"]["jurisdiction"] is None


def test_partner_429_and_503_carry_retry_headers(stack):
    # 429: no EEA engine can meet a 1 ms TTFT target (the request may tighten its own target)
    r = chat(stack, "too fast for anyone", headers={"x-ttft-slo-ms": "0.001"})
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "ttft_slo_unattainable"
    assert int(r.headers["retry-after"]) >= 1 and float(r.headers["retry-after-ms"]) > 0
    # 503: the only EEA zero-retention route for this model is down
    r = chat(stack, "nobody home", model="down-model")
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1 and float(r.headers["retry-after-ms"]) > 0
