"""Security pass against the real gateway process: the admin plane refuses data-plane credentials on every
admin route; the upstream credential and client keys never reach a client (headers, bodies, error bodies,
streams) nor the gateway's log, metrics or audit trail; client-sent hop-by-hop / identity headers are not
trusted."""
from __future__ import annotations

import httpx
import orjson
import pytest

from tests.resilience.stack import ADMIN_KEY, GW_KEY, write_config
from tests.support.procs import start_gateway, start_upstream

pytestmark = pytest.mark.e2e
UP_KEY = "upstream-secret-DO-NOT-LEAK-8f3a9c"
ADMIN_PATHS = [("GET", "/admin/tenants"), ("POST", "/admin/tenants"), ("POST", "/admin/reload"),
               ("GET", "/admin/fleet"), ("GET", "/admin/decisions/x"), ("GET", "/admin/keys"),
               ("GET", "/admin/partners")]


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sec")
    up, up_port = start_upstream(tmp, key=UP_KEY)
    backends = [{"name": "up", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1", "models": ["m"],
                 "api_key_env": "UP_KEY", "location": {"country": "DE"}, "retention": "zero",
                 "capabilities": ["chat", "completions", "embeddings"],
                 "timeouts": {"connect_s": 1, "first_token_s": 2, "idle_s": 2, "total_s": 10}}]
    cfg = write_config(tmp, backends)
    proc, port = start_gateway(cfg, env={"UP_KEY": UP_KEY})
    yield {"base": f"http://127.0.0.1:{port}", "proc": proc, "tmp": tmp}
    proc.stop()
    up.stop()


def _no_secret(blob: bytes | str, *secrets: str) -> None:
    text = blob.decode(errors="replace") if isinstance(blob, bytes) else blob
    for s in secrets:
        assert s not in text, f"secret {s[:6]}... leaked: {text[:300]}"


@pytest.mark.parametrize("method,path", ADMIN_PATHS)
def test_admin_plane_refuses_data_plane_credentials(gw, method, path):
    for headers in ({"authorization": f"Bearer {GW_KEY}"}, {"x-api-key": GW_KEY}, {}):
        r = httpx.request(method, gw["base"] + path, headers=headers, json={}, timeout=5)
        assert r.status_code in (401, 403), (path, headers, r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"] and "type" in err and "code" in err
    ok = httpx.request(method, gw["base"] + path, headers={"authorization": f"Bearer {ADMIN_KEY}"}, json={},
                       timeout=5)
    assert ok.status_code not in (401, 403), (path, ok.text)


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "x_test_fault": "error500"},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "x_test_fault": "error400"},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "x_test_fault": "bad_json"},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "x_test_fault": "die_mid"},
])
def test_upstream_credential_never_reaches_the_client(gw, body):
    r = httpx.post(gw["base"] + "/v1/chat/completions", content=orjson.dumps(body), timeout=15,
                   headers={"authorization": f"Bearer {GW_KEY}", "content-type": "application/json",
                            "x-forwarded-for": "1.2.3.4", "proxy-authorization": "Basic Zm9vOmJhcg=="})
    assert r.status_code < 500 or r.json()["error"]["message"]
    _no_secret(r.content, UP_KEY)
    _no_secret(str(dict(r.headers)), UP_KEY, GW_KEY)


def test_no_key_in_log_metrics_or_audit(gw):
    httpx.post(gw["base"] + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
               headers={"authorization": "Bearer gw_wrongid_wrongsecret-LEAKCHECK"}, timeout=5)
    httpx.post(gw["base"] + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
               headers={"authorization": f"Bearer {GW_KEY}"}, timeout=10)
    metrics = httpx.get(gw["base"] + "/metrics", timeout=5).text
    audit = (gw["tmp"] / "audit.jsonl").read_text() if (gw["tmp"] / "audit.jsonl").exists() else ""
    log = gw["proc"].log_path.read_text(errors="replace")
    for blob in (metrics, audit, log):
        _no_secret(blob, UP_KEY, GW_KEY, ADMIN_KEY, "wrongsecret-LEAKCHECK")
