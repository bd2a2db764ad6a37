"""Issue 18.3 and the admin-plane parts of 18.8, against the real gateway process: the failed-login limiter
counts per client address on every operator route (never locking a right key out from another address) and
believes X-Forwarded-For only from `server.trusted_proxies`; admin bodies are bounded by
`server.max_body_bytes`; names are strings of at most 256 characters; the 429 of /admin/reload carries
Retry-After; a rotation overlap is at most 30 days. Clients bind distinct loopback source addresses
(127.0.0.x) so each test has its own limiter bucket."""
from __future__ import annotations

import httpx
import pytest

from tests.resilience.stack import ADMIN_KEY, write_config
from tests.support.procs import start_gateway, start_upstream

pytestmark = pytest.mark.e2e
BAD = "gw_zzzzzzzzzzzz_" + "Q" * 40
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
MAX_BODY = 100_000


def client_from(addr: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=addr), timeout=10)


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    up, up_port = start_upstream(tmp)
    backends = [{"name": "up", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1", "models": ["m"],
                 "location": {"country": "DE"}, "retention": "zero", "capabilities": ["chat"]}]
    cfg = write_config(tmp, backends, server={"max_body_bytes": MAX_BODY, "trusted_proxies": ["127.0.0.9"]})
    proc, port = start_gateway(cfg)
    yield {"base": f"http://127.0.0.1:{port}", "proc": proc}
    proc.stop()
    up.stop()


def _guess(c: httpx.Client, base: str, n: int, method: str = "GET", path: str = "/admin/tenants",
           headers: dict[str, str] | None = None) -> list[httpx.Response]:
    return [c.request(method, base + path, headers={"authorization": f"Bearer {BAD}", **(headers or {})})
            for _ in range(n)]


def test_guesses_from_one_address_do_not_lock_the_admin_out_elsewhere(gw):
    """18.3: 30 bad guesses from any address locked the platform admin (right key, other address) out."""
    base = gw["base"]
    with client_from("127.0.0.21") as attacker, client_from("127.0.0.22") as operator:
        rs = _guess(attacker, base, 15, path="/admin/fleet") + _guess(attacker, base, 15, path="/admin/keys")
        assert {r.status_code for r in rs} == {401}
        locked = attacker.get(base + "/admin/tenants", headers=ADMIN)
        assert locked.status_code == 429 and locked.json()["error"]["code"] == "auth_rate_limited"
        assert int(locked.headers["retry-after"]) >= 1
        for path in ("/admin/tenants", "/admin/fleet", "/admin/routing", "/admin/ui/data"):
            r = operator.get(base + path, headers=ADMIN)
            assert r.status_code == 200, (path, r.status_code, r.text)
        assert operator.post(base + "/admin/reload", headers=ADMIN).status_code == 200


def test_x_forwarded_for_names_the_client_behind_a_trusted_proxy(gw):
    base = gw["base"]
    with client_from("127.0.0.9") as proxy:
        _guess(proxy, base, 30, headers={"x-forwarded-for": "203.0.113.7"})
        assert proxy.get(base + "/admin/tenants", headers={**ADMIN, "x-forwarded-for": "203.0.113.7"}
                         ).status_code == 429
        assert proxy.get(base + "/admin/tenants", headers={**ADMIN, "x-forwarded-for": "203.0.113.8"}
                         ).status_code == 200


def test_rate_limited_reload_has_retry_after(gw):
    base = gw["base"]
    with client_from("127.0.0.24") as c:
        _guess(c, base, 30, method="POST", path="/admin/reload")
        r = c.post(base + "/admin/reload", headers=ADMIN)
        assert r.status_code == 429 and r.json()["error"]["code"] == "auth_rate_limited"
        assert int(r.headers["retry-after"]) >= 1 and "retry-after-ms" in r.headers


@pytest.mark.parametrize("name", [{"a": 1}, ["x"], 7, "n" * 257])
def test_bad_names_are_400_not_500(gw, name):
    base = gw["base"]
    suffix = str(abs(hash(str(name))) % 10_000)
    assert httpx.post(base + "/admin/tenants", json={"id": "nt" + suffix}, headers=ADMIN).status_code == 201
    for path, body in (("/admin/tenants", {"id": "n" + suffix, "name": name}),
                       (f"/admin/tenants/nt{suffix}/teams", {"id": "t1", "name": name}),
                       ("/admin/partners", {"id": "np" + suffix, "tenant": "nt" + suffix, "name": name}),
                       ("/admin/keys", {"tenant": "nt" + suffix, "name": name})):
        r = httpx.post(base + path, json=body, headers=ADMIN, timeout=10)
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert r.json()["error"]["param"] == "name"


def test_admin_bodies_are_bounded_by_max_body_bytes(gw):
    base = gw["base"]
    big = {"id": "bigname", "name": "ok", "pad": "x" * (MAX_BODY + 10)}
    r = httpx.post(base + "/admin/tenants", json=big, headers=ADMIN, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

    def chunks():  # no Content-Length: the limit holds on the streamed body too
        yield b'{"id": "bigname2", "name": "'
        for _ in range(20):
            yield b"y" * 10_000
        yield b'"}'

    r = httpx.post(base + "/admin/tenants", content=chunks(), headers={**ADMIN, "content-type": "application/json"},
                   timeout=10)
    assert r.status_code == 413, r.text
    ids = {t["id"] for t in httpx.get(base + "/admin/tenants", headers=ADMIN).json()["data"]}
    assert not ids & {"bigname", "bigname2"}


@pytest.mark.parametrize("overlap", [1e308, 30 * 86400 + 1, -1, True, "10"])
def test_rotation_overlap_is_bounded(gw, overlap):
    base = gw["base"]
    httpx.post(base + "/admin/tenants", json={"id": "rot"}, headers=ADMIN)
    k = httpx.post(base + "/admin/keys", json={"tenant": "rot"}, headers=ADMIN).json()
    r = httpx.post(base + f"/admin/keys/{k['id']}/rotate", json={"overlap_s": overlap}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "overlap_s", r.text
    ok = httpx.post(base + f"/admin/keys/{k['id']}/rotate", json={"overlap_s": 30 * 86400}, headers=ADMIN)
    assert ok.status_code == 201, ok.text


def test_x_forwarded_for_is_not_trusted_from_an_unconfigured_peer(gw):
    """18.8: uvicorn believed X-Forwarded-For from 127.0.0.1 (its default forwarded_allow_ips), so a local
    guesser named a new address each time. Last in the file: it locks 127.0.0.1 out for a minute."""
    base = gw["base"]
    with client_from("127.0.0.1") as c:
        for i in range(30):
            r = c.post(base + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                       headers={"authorization": f"Bearer {BAD}", "x-forwarded-for": f"10.9.{i // 250}.{i % 250}"})
            assert r.status_code == 401, r.text
        r = c.get(base + "/admin/tenants", headers={**ADMIN, "x-forwarded-for": "10.250.0.1"})
        assert r.status_code == 429, r.text
