"""Issue 18.1: one admin authorization point. Every /admin/* route of the running gateway, read from the app's
own route table, is called with six credentials: platform admin, the tenant admin of the tenant the route
names (own), the tenant admin of another tenant (other), a data key, no key and a wrong key. The expected
outcome follows from the roles the route declares in TABLE; a new /admin route without a declared role (or
missing from TABLE) fails `test_every_admin_route_declares_its_roles`."""
from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.routing import Mount, Route, WebSocketRoute

from gateway.admin_guard import PLATFORM_ADMIN, PUBLIC, TENANT_ADMIN, declared_roles
from tests.resilience.stack import ADMIN_KEY, write_config
from tests.support.procs import start_gateway, start_upstream

pytestmark = pytest.mark.e2e
P, T = PLATFORM_ADMIN, TENANT_ADMIN
BOTH = frozenset({P, T})
PLATFORM = frozenset({P})
WRONG_KEY = "gw_zzzzzzzzzzzz_" + "Q" * 40

# (method, route path) -> declared roles. Tenant-admin routes are called on tenant ta's records.
TABLE: dict[tuple[str, str], frozenset[str]] = {
    ("POST", "/admin/reload"): PLATFORM,
    ("GET", "/admin/fleet"): PLATFORM,
    ("GET", "/admin/routing"): PLATFORM,
    ("GET", "/admin/batch"): PLATFORM,
    ("GET", "/admin/batches"): BOTH,  # a tenant admin lists only its own tenant's batches
    ("POST", "/admin/batches/{batch_id}/cancel"): BOTH,  # a tenant admin cancels only its own tenant's
    ("GET", "/admin/cost"): PLATFORM,
    ("GET", "/admin/aliases"): PLATFORM,  # weighted aliases are the platform's (gateway/rollouts)
    ("GET", "/admin/aliases/{alias}"): PLATFORM,
    ("PATCH", "/admin/aliases/{alias}"): PLATFORM,
    ("POST", "/admin/aliases/{alias}/reset"): PLATFORM,
    ("GET", "/admin/adapters"): BOTH,  # tenant-owned LoRA adapters (gateway/adapters): a tenant admin sees its own
    ("POST", "/admin/adapters"): BOTH,
    ("GET", "/admin/adapters/placement"): BOTH,  # every engine; a tenant admin sees only its own adapters on them
    ("GET", "/admin/adapters/{name:path}"): BOTH,
    ("PATCH", "/admin/adapters/{name:path}"): BOTH,
    ("DELETE", "/admin/adapters/{name:path}"): BOTH,
    ("GET", "/admin/tenants/{tenant}/adapter_sources"): BOTH,
    ("PUT", "/admin/tenants/{tenant}/adapter_sources"): PLATFORM,  # only the platform grants weight sources
    ("DELETE", "/admin/cache"): BOTH,  # a tenant admin purges only its own tenant's entries
    ("GET", "/admin/ui"): frozenset({PUBLIC}),
    ("GET", "/admin/ui/data"): PLATFORM,
    ("GET", "/admin/decisions/{request_id}"): BOTH,
    ("GET", "/admin/tenants"): BOTH,
    ("POST", "/admin/tenants"): PLATFORM,
    ("GET", "/admin/tenants/{tenant}"): BOTH,
    ("PATCH", "/admin/tenants/{tenant}"): PLATFORM,
    ("DELETE", "/admin/tenants/{tenant}"): PLATFORM,
    ("GET", "/admin/tenants/{tenant}/teams"): BOTH,
    ("POST", "/admin/tenants/{tenant}/teams"): BOTH,
    ("GET", "/admin/tenants/{tenant}/teams/{team}"): BOTH,
    ("PATCH", "/admin/tenants/{tenant}/teams/{team}"): BOTH,
    ("DELETE", "/admin/tenants/{tenant}/teams/{team}"): BOTH,
    ("GET", "/admin/tenants/{tenant}/teams/{team}/projects/{project}"): BOTH,
    ("PATCH", "/admin/tenants/{tenant}/teams/{team}/projects/{project}"): BOTH,
    ("DELETE", "/admin/tenants/{tenant}/teams/{team}/projects/{project}"): BOTH,
    ("GET", "/admin/projects"): BOTH,
    ("POST", "/admin/projects"): BOTH,
    ("GET", "/admin/partners"): BOTH,
    ("POST", "/admin/partners"): PLATFORM,
    ("GET", "/admin/partners/{partner}"): BOTH,
    ("PATCH", "/admin/partners/{partner}"): PLATFORM,
    ("DELETE", "/admin/partners/{partner}"): PLATFORM,
    ("GET", "/admin/keys"): BOTH,
    ("POST", "/admin/keys"): BOTH,
    ("GET", "/admin/keys/{key_id}"): BOTH,
    ("PATCH", "/admin/keys/{key_id}"): BOTH,
    ("DELETE", "/admin/keys/{key_id}"): BOTH,
    ("POST", "/admin/keys/{key_id}/revoke"): BOTH,
    ("POST", "/admin/keys/{key_id}/rotate"): BOTH,
}
# Routes a tenant admin of another tenant reaches with 200 because they list only its own records.
LISTS = {("GET", "/admin/tenants"), ("GET", "/admin/keys"), ("GET", "/admin/partners"), ("GET", "/admin/projects"),
         ("GET", "/admin/batches"), ("GET", "/admin/adapters"), ("GET", "/admin/adapters/placement")}
# Bodies for the routes that take one (harmless: names, labels within the tenant, a project in ta).
BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/admin/tenants/{tenant}/teams"): {"id": "newteam"},
    ("PATCH", "/admin/tenants/{tenant}/teams/{team}"): {"name": "renamed"},
    ("PATCH", "/admin/tenants/{tenant}/teams/{team}/projects/{project}"): {"name": "renamed"},
    ("POST", "/admin/projects"): {"tenant": "ta", "team": "core", "id": "newproj"},
    ("POST", "/admin/keys"): {"tenant": "ta", "team": "core"},
    ("PATCH", "/admin/keys/{key_id}"): {"name": "renamed"},
    ("PATCH", "/admin/tenants/{tenant}"): {"name": "renamed"},
    ("PATCH", "/admin/partners/{partner}"): {"name": "renamed"},
    ("POST", "/admin/adapters"): {"name": "ta-lora", "base_model": "m", "source": "/weights/ta/lora",
                                  "owner": {"tenant": "ta"}},
    ("PATCH", "/admin/adapters/{name:path}"): {"description": "renamed"},
    ("PUT", "/admin/tenants/{tenant}/adapter_sources"): {"prefixes": ["/weights/ta/"]},
}


def _adm(base: str, method: str, path: str, key: str, body: Any = None) -> httpx.Response:
    return httpx.request(method, base + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=10)


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guard")
    up, up_port = start_upstream(tmp)
    backends = [{"name": "up", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1", "models": ["m"],
                 "location": {"country": "DE"}, "retention": "zero", "capabilities": ["chat"],
                 "timeouts": {"connect_s": 1, "first_token_s": 2, "idle_s": 2, "total_s": 10}}]
    cfg = write_config(tmp, backends, identity={"auth_fail_limit_per_minute": 100_000})
    proc, port = start_gateway(cfg)
    base = f"http://127.0.0.1:{port}"
    try:
        ids: dict[str, Any] = {"cfg": cfg}
        for t in ("ta", "tb"):
            assert _adm(base, "POST", "/admin/tenants", ADMIN_KEY, {"id": t}).status_code == 201
            assert _adm(base, "POST", f"/admin/tenants/{t}/teams", ADMIN_KEY, {"id": "core"}).status_code == 201
            r = _adm(base, "POST", "/admin/keys", ADMIN_KEY, {"tenant": t, "purpose": "admin"})
            ids[f"{t}_admin"] = r.json()["key"]
            r = _adm(base, "POST", "/admin/keys", ADMIN_KEY, {"tenant": t, "team": "core"})
            ids[f"{t}_data"] = r.json()["key"]
            chat = httpx.post(base + "/v1/chat/completions", json={"model": "m", "max_tokens": 4,
                                                                    "messages": [{"role": "user", "content": "hi"}]},
                              headers={"authorization": f"Bearer {ids[f'{t}_data']}"}, timeout=10)
            assert chat.status_code == 200, chat.text
            ids[f"{t}_rid"] = chat.headers["x-request-id"]
        assert _adm(base, "POST", "/admin/projects", ADMIN_KEY, {"tenant": "ta", "team": "core", "id": "p"}
                    ).status_code == 201
        assert _adm(base, "POST", "/admin/partners", ADMIN_KEY, {"id": "pa", "tenant": "ta"}).status_code == 201
        ids["victim"] = _adm(base, "POST", "/admin/keys", ADMIN_KEY, {"tenant": "ta"}).json()["id"]
        assert _adm(base, "PUT", "/admin/tenants/ta/adapter_sources", ADMIN_KEY, {"prefixes": ["/weights/ta/"]}
                    ).status_code == 200
        assert _adm(base, "POST", "/admin/adapters", ADMIN_KEY, {"name": "ta-lora0", "base_model": "m",
                    "source": "/weights/ta/lora0", "owner": {"tenant": "ta"}}).status_code == 201
        yield {"base": base, "proc": proc, **ids}
    finally:
        proc.stop()
        up.stop()


def admin_route_roles(routes) -> dict[tuple[str, str], frozenset[str] | None]:
    """(method, path) -> declared roles of every /admin route in `routes`; None for one the guard did not build.
    A mount, a websocket route or a route for any method under /admin is reported as ("*", path) -> None."""
    out: dict[tuple[str, str], frozenset[str] | None] = {}
    for r in routes:
        path = getattr(r, "path", "")
        if not path.startswith("/admin"):
            continue
        methods = getattr(r, "methods", None)
        if not isinstance(r, Route) or not methods:
            out[("*", path)] = None
            continue
        for m in sorted(methods - {"HEAD"}):
            out[(m, path)] = declared_roles(r)
    return out


def _app_admin_routes(cfg_path) -> dict[tuple[str, str], frozenset[str] | None]:
    """The /admin routes of the app the gateway process runs (built from the same config, not started)."""
    from gateway.app import Gateway, build_app
    from gateway.config import load_config
    from gateway.wiring import wire

    gw = Gateway(load_config(cfg_path))
    wire(gw)
    return admin_route_roles(build_app(gw).routes)


def test_the_route_check_reports_every_admin_route_the_guard_did_not_build():
    """The check itself: a plain route, a mount, an any-method route and a websocket under /admin are all
    reported undeclared; a guarded one carries its roles; routes outside /admin are not admin routes."""
    from gateway.admin_guard import AdminGuard

    async def h(request, principal=None):
        return {}

    async def auth(headers, addr):
        raise AssertionError("not called")

    class AsgiApp:  # an ASGI app as endpoint (as the data plane's are): a route for any method
        async def __call__(self, scope, receive, send):
            pass

    guarded = AdminGuard(auth, lambda: 1000).route("/admin/ok", h, ["GET"], (PLATFORM_ADMIN,))
    routes = [guarded, Route("/admin/plain", h, methods=["POST"]), Route("/admin/any", AsgiApp()),
              Mount("/admin/sub", routes=[Route("/x", h)]), WebSocketRoute("/admin/ws", h),
              Route("/v1/other", h, methods=["GET"])]
    assert admin_route_roles(routes) == {("GET", "/admin/ok"): PLATFORM, ("POST", "/admin/plain"): None,
                                         ("*", "/admin/any"): None, ("*", "/admin/sub"): None,
                                         ("*", "/admin/ws"): None}


def test_every_admin_route_declares_its_roles(gw):
    routes = _app_admin_routes(gw["cfg"])
    undeclared = sorted(k for k, v in routes.items() if v is None)
    assert not undeclared, f"/admin routes without declared roles (build them with AdminGuard.route): {undeclared}"
    assert set(routes) == set(TABLE), (f"not in TABLE: {sorted(set(routes) - set(TABLE))}; "
                                       f"in TABLE but not served: {sorted(set(TABLE) - set(routes))}")
    for k, roles in routes.items():
        assert roles == TABLE[k], (k, roles, TABLE[k])


def _concrete(gw, path: str) -> str:
    return (path.replace("{tenant}", "ta").replace("{team}", "core").replace("{project}", "p")
            .replace("{partner}", "pa").replace("{key_id}", gw["victim"]).replace("{request_id}", gw["ta_rid"])
            .replace("{name:path}", "ta-lora0"))


# The order matters for the mutating routes: refusals first, then the tenant admin of ta, then the platform admin.
CREDS = ["none", "wrong", "data", "other", "own", "platform"]


@pytest.mark.parametrize("method,path", sorted(TABLE))
def test_admin_route_admits_exactly_its_roles(gw, method, path):
    roles = TABLE[(method, path)]
    url = gw["base"] + _concrete(gw, path)
    body = BODIES.get((method, path), {} if method in ("POST", "PATCH") else None)
    keys = {"wrong": WRONG_KEY, "data": gw["ta_data"], "other": gw["tb_admin"], "own": gw["ta_admin"],
            "platform": ADMIN_KEY}
    for who in CREDS:
        headers = {"authorization": f"Bearer {keys[who]}"} if who in keys else {}
        r = httpx.request(method, url, json=body, headers=headers, timeout=10)
        st = r.status_code
        assert st < 500, (who, method, path, st, r.text)
        if "json" in r.headers.get("content-type", "") and st >= 400:
            err = r.json()["error"]
            assert err["message"] and "type" in err and "code" in err, (who, path, r.text)
        if roles == {PUBLIC}:
            assert st == 200, (who, path, st)
            continue
        if who in ("none", "wrong"):
            assert st == 401, (who, method, path, st, r.text)
        elif who == "data":
            assert st == 403, (who, method, path, st, r.text)
        elif who == "platform":
            assert st not in (401, 403), (who, method, path, st, r.text)  # 404/409 once an earlier DELETE ran
        elif who == "own":
            if T in roles:
                assert st not in (401, 403), (who, method, path, st, r.text)
            else:
                assert st == 403 and r.json()["error"]["code"] == "admin_required", (who, method, path, st, r.text)
        elif who == "other":
            if T not in roles:
                assert st == 403 and r.json()["error"]["code"] == "admin_required", (who, method, path, st, r.text)
            elif (method, path) in LISTS:
                assert st == 200, (who, method, path, st, r.text)
                data = r.json()["data"]
                assert all(x.get("tenant", x.get("id")) == "tb" for x in data), (path, data)
            elif (method, path) == ("DELETE", "/admin/cache"):  # scoped to the caller's own tenant, never ta's
                assert st == 200 and r.json()["tenant"] == "tb", (who, method, path, st, r.text)
            else:  # another tenant's record: refused, or not confirmed to exist
                assert st in (403, 404), (who, method, path, st, r.text)


def test_tenant_admin_reads_only_its_own_decisions(gw):
    """The issue's case: ta's admin key read tb's full audit record (200)."""
    base = gw["base"]
    assert _adm(base, "GET", f"/admin/decisions/{gw['tb_rid']}", gw["ta_admin"]).status_code == 404
    own = _adm(base, "GET", f"/admin/decisions/{gw['ta_rid']}", gw["ta_admin"])
    assert own.status_code == 200 and own.json()["principal"]["tenant"] == "ta"
    assert _adm(base, "GET", f"/admin/decisions/{gw['tb_rid']}", ADMIN_KEY).status_code == 200
    for path in ("/admin/ui/data", "/admin/fleet", "/admin/routing"):
        assert _adm(base, "GET", path, gw["ta_admin"]).status_code == 403, path
    assert _adm(base, "POST", "/admin/reload", gw["ta_admin"]).status_code == 403
