"""Per-request provider preferences (OpenRouter-style `provider: {...}`), tighten-only, against a real
`python -m gateway serve` in front of two upstreams: one that keeps data (`retention: none`), one that keeps
nothing (`retention: zero`). `zdr` / `data_collection: deny` narrow a request to zero retention; nothing in
`provider` widens what policy decided; the field never reaches a backend; `only` / `ignore` narrow the
backends (with residency, on every try), `order` puts the listed backends first and `allow_fallbacks: false`
allows one attempt; a bad value is a 400, not a silent no-op."""
from __future__ import annotations

import time

import httpx
import orjson
import pytest
import yaml

from tests.support.procs import free_port, start_gateway, start_upstream

pytestmark = pytest.mark.e2e
KEY = "prefs-key-0123456789"
ZR_KEY = "prefs-zr-key-0123456789"
CANARY = "PREFS-CANARY-5d1e prompt text"
NO_BREAKER = {"failures_to_open": 1000}  # the fault tests' 5xx must not open a breaker for the tests after them


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefs")
    (keeps, kport), (zr, zport) = start_upstream(tmp), start_upstream(tmp)
    (tmp / "policy.yaml").write_text(yaml.safe_dump({"version": 1, "rules": [
        {"id": "zr-tenant", "match": {"tenant": "zr"}, "require": {"retention": "zero"}}]}))
    port = free_port()
    cfg = {"server": {"host": "127.0.0.1", "port": port},
           "backends": [{"name": "keeps", "kind": "openai", "url": f"http://127.0.0.1:{kport}/v1",
                         "models": ["m", "keeps-only"], "location": {"country": "DE"}, "retention": "none",
                         "health": NO_BREAKER},
                        {"name": "zr", "kind": "openai", "url": f"http://127.0.0.1:{zport}/v1",
                         "models": ["m"], "location": {"country": "DE"}, "retention": "zero", "health": NO_BREAKER}],
           "keys": [{"key": KEY, "tenant": "plain", "name": "p"}, {"key": ZR_KEY, "tenant": "zr", "name": "z"}],
           "policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / "audit.jsonl")},
           "observability": {"capture_content": True},
           "identity": {"sqlite_path": str(tmp / "id.db")},
           "budgets": {"sqlite_path": str(tmp / "budgets.db")}}
    path = tmp / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    g, _ = start_gateway(path)
    yield {"base": f"http://127.0.0.1:{port}", "ups": {"keeps": kport, "zr": zport}, "audit": tmp / "audit.jsonl"}
    g.stop()
    keeps.stop()
    zr.stop()


def chat(gw, model: str = "m", key: str = KEY, **extra) -> httpx.Response:
    return httpx.post(gw["base"] + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=10,
                      json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": CANARY}],
                            **extra})


def last_body(gw, backend: str) -> dict:
    return httpx.get(f"http://127.0.0.1:{gw['ups'][backend]}/stats").json()["last_body"]


def record(gw, rid: str) -> dict:
    """The audit record of `rid` (written off the request path: wait for it, bounded)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in gw["audit"].read_bytes().splitlines():
            r = orjson.loads(line)
            if r["request_id"] == rid:
                return r
        time.sleep(0.05)
    raise AssertionError(f"no audit record {rid}")


def test_without_preferences_the_backend_that_keeps_data_serves(gw):
    seen = {chat(gw).headers["x-gateway-backend"] for _ in range(8)}
    assert "keeps" in seen  # the control: retention none is allowed to this tenant, and routing picks it
    assert chat(gw, model="keeps-only").status_code == 200


@pytest.mark.parametrize("prefs", [{"zdr": True}, {"data_collection": "deny"}])
def test_zdr_and_deny_narrow_to_zero_retention_and_the_field_is_not_forwarded(gw, prefs):
    for _ in range(8):
        r = chat(gw, provider=prefs)
        assert r.status_code == 200, r.text
        assert r.headers["x-gateway-backend"] == "zr"
    assert "provider" not in last_body(gw, "zr")
    rec = record(gw, r.headers["x-request-id"])
    assert rec["zero_retention"] is True and rec["decision"]["retention"] == "zero"
    assert rec["evidence"]["provider_preferences"]["applied"] == ["retention: zero"]
    # zero retention: no captured content, although capture_content is on
    assert "content" not in rec and CANARY not in orjson.dumps(rec).decode()
    # nothing left once narrowed: a 403 the SDKs do not retry, never a quiet send to the backend that keeps data
    r = chat(gw, model="keeps-only", provider=prefs)
    assert r.status_code == 403 and r.json()["error"]["code"] == "residency_unsatisfiable", r.text
    assert r.headers["x-should-retry"] == "false"


def test_preferences_never_widen_the_policy(gw):
    for _ in range(6):
        r = chat(gw, key=ZR_KEY, provider={"zdr": False, "data_collection": "allow", "allow_fallbacks": True})
        assert r.status_code == 200 and r.headers["x-gateway-backend"] == "zr", r.text
    r = chat(gw, model="keeps-only", key=ZR_KEY, provider={"data_collection": "allow"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "residency_unsatisfiable"


@pytest.mark.parametrize("prefs,backend", [({"only": ["keeps"]}, "keeps"), ({"only": ["zr"]}, "zr"),
                                           ({"ignore": ["keeps"]}, "zr"), ({"ignore": ["zr"]}, "keeps"),
                                           ({"only": ["zr", "keeps"], "ignore": ["keeps"]}, "zr")])
def test_only_and_ignore_narrow_the_backends(gw, prefs, backend):
    for _ in range(6):
        r = chat(gw, provider=prefs)
        assert r.status_code == 200 and r.headers["x-gateway-backend"] == backend, r.text
    assert "provider" not in last_body(gw, backend)
    rec = record(gw, r.headers["x-request-id"])
    assert any(a.startswith(("only:", "ignore:")) for a in rec["evidence"]["provider_preferences"]["applied"])


def test_only_never_widens_and_none_left_is_a_403(gw):
    # the zero-retention tenant asks for the backend that keeps data only: policy's retention still holds
    r = chat(gw, key=ZR_KEY, provider={"only": ["keeps"]})
    assert r.status_code == 403 and r.json()["error"]["code"] == "residency_unsatisfiable", r.text
    r = chat(gw, provider={"only": ["no-such-backend"]})
    assert r.status_code == 403 and r.json()["error"]["code"] == "residency_unsatisfiable", r.text
    r = chat(gw, model="keeps-only", provider={"ignore": ["self"]})  # by operator: every own backend
    assert r.status_code == 403, r.text


def test_allow_fallbacks_false_makes_one_attempt(gw):
    # both upstreams answer 503 to this fault: by default the gateway retries on the other backend
    fault = {"x_test_fault": "error503"}
    r = chat(gw, **fault)
    assert r.status_code == 502, r.text  # the upstream's 503, answered as the gateway's upstream_error
    tried = [a for a in record(gw, r.headers["x-request-id"])["attempts"] if "status" in a]
    assert len(tried) == 2, tried  # the control: a retry on the other backend
    r = chat(gw, provider={"allow_fallbacks": False}, **fault)
    assert r.status_code == 502, r.text
    attempts = record(gw, r.headers["x-request-id"])["attempts"]
    assert len([a for a in attempts if "status" in a]) == 1, attempts
    assert {"skipped": "provider.allow_fallbacks: false"}.items() <= attempts[-1].items()


@pytest.mark.parametrize("order", [["zr", "keeps"], ["keeps", "zr"]])
def test_order_is_tried_in_the_clients_order(gw, order):
    for _ in range(6):
        r = chat(gw, provider={"order": order})
        assert r.status_code == 200 and r.headers["x-gateway-backend"] == order[0], r.text
    # the first listed fails: the next listed one serves (fallbacks allowed by default)
    r = chat(gw, provider={"order": order}, x_test_fault="error503")
    tried = [a["backend"] for a in record(gw, r.headers["x-request-id"])["attempts"] if "status" in a]
    assert tried == order, tried
    rec = record(gw, chat(gw, provider={"order": order}).headers["x-request-id"])
    assert rec["decision"]["providers_order"] == order


def test_order_with_allow_fallbacks_false_uses_the_listed_backends_only(gw):
    r = chat(gw, provider={"order": ["zr"], "allow_fallbacks": False}, x_test_fault="error503")
    tried = [a["backend"] for a in record(gw, r.headers["x-request-id"])["attempts"] if "status" in a]
    assert tried == ["zr"], tried


@pytest.mark.parametrize("prefs,param", [({"order": ["zr", "zr"]}, "provider.order"),
                                         ({"order": "zr"}, "provider.order"),
                                         ({"only": []}, "provider.only"), ({"only": "keeps"}, "provider.only"),
                                         ({"ignore": [5]}, "provider.ignore"),
                                         ({"allow_fallbacks": "no"}, "provider.allow_fallbacks"),
                                         ({"zdr": "yes"}, "provider.zdr"), ({"sort": "price"}, "provider.sort"),
                                         ("zr", "provider")])
def test_what_cannot_be_honoured_is_refused_not_ignored(gw, prefs, param):
    r = chat(gw, provider=prefs)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_provider_preferences" and err["param"] == param
    assert err["type"] == "invalid_request_error"
