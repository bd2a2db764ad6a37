"""Admin plane over HTTP (Starlette app + httpx ASGI transport), both stores: CRUD, roles, tenant isolation."""
from __future__ import annotations

from typing import Any, AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette

from gateway.identity.admin import admin_routes
from gateway.identity.service import IdentityService

from .conftest import ADMIN_KEY, STATIC_KEY

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
async def client(service: IdentityService) -> AsyncIterator[httpx.AsyncClient]:
    app = Starlette(routes=admin_routes(service))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        yield c


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def setup_two_tenants(c: httpx.AsyncClient) -> dict[str, Any]:
    for t in ("alpha", "beta"):
        r = await c.post("/admin/tenants", json={"id": t, "labels": {"residency": "eea"}}, headers=ADMIN)
        assert r.status_code == 201, r.text
        r = await c.post(f"/admin/tenants/{t}/teams", json={"id": "core"}, headers=ADMIN)
        assert r.status_code == 201, r.text
    out: dict[str, Any] = {}
    for t in ("alpha", "beta"):
        r = await c.post("/admin/keys", json={"tenant": t, "purpose": "admin", "name": f"{t}-admin"}, headers=ADMIN)
        assert r.status_code == 201, r.text
        out[f"{t}_admin"] = r.json()["key"]
        r = await c.post("/admin/keys", json={"tenant": t, "team": "core"}, headers=ADMIN)
        out[f"{t}_data"] = r.json()
    return out


async def test_admin_crud_and_key_shown_once(client: httpx.AsyncClient, service: IdentityService) -> None:
    s = await setup_two_tenants(client)
    r = await client.post("/admin/projects", json={"tenant": "alpha", "team": "core", "id": "p1"}, headers=ADMIN)
    assert r.status_code == 201
    r = await client.get("/admin/projects?tenant=alpha", headers=ADMIN)
    assert [p["id"] for p in r.json()["data"]] == ["p1"]
    r = await client.post("/admin/partners", json={"id": "opper", "tenant": "alpha"}, headers=ADMIN)
    assert r.status_code == 201
    r = await client.get("/admin/tenants", headers=ADMIN)
    assert [t["id"] for t in r.json()["data"]] == ["alpha", "beta"]
    r = await client.patch("/admin/tenants/alpha", json={"labels": {"residency": "eea", "retention": "zero"}},
                           headers=ADMIN)
    assert r.json()["labels"]["retention"] == "zero"
    key = s["alpha_data"]
    secret = key["key"]
    assert secret.startswith(key["prefix"])
    listing = (await client.get("/admin/keys", headers=ADMIN)).text
    assert key["id"] in listing and secret not in listing and "secret_hash" not in listing
    got = await client.get(f"/admin/keys/{key['id']}", headers=ADMIN)
    assert "key" not in got.json() and got.json()["id"] == key["id"]
    p = await service.authenticate(auth(secret), "c")
    assert p.labels["retention"] == "zero"  # label edit reached the cached hierarchy
    r = await client.post(f"/admin/keys/{key['id']}/rotate", json={"overlap_s": 60}, headers=ADMIN)
    assert r.status_code == 201 and r.json()["rotated_from"] == key["id"]
    new_secret = r.json()["key"]
    assert (await service.authenticate(auth(new_secret), "c")).tenant == "alpha"
    r = await client.post(f"/admin/keys/{key['id']}/revoke", headers=ADMIN)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    with pytest.raises(Exception) as ei:
        await service.authenticate(auth(secret), "c")
    assert getattr(ei.value, "code", None) == "revoked_api_key"


async def test_tenant_isolation(client: httpx.AsyncClient) -> None:
    s = await setup_two_tenants(client)
    a = auth(s["alpha_admin"])
    r = await client.get("/admin/tenants", headers=a)
    assert [t["id"] for t in r.json()["data"]] == ["alpha"]
    keys = (await client.get("/admin/keys", headers=a)).json()["data"]
    assert keys and {k["tenant"] for k in keys} == {"alpha"}
    for method, path, body in [
        ("GET", "/admin/tenants/beta", None),
        ("GET", "/admin/tenants/beta/teams", None),
        ("POST", "/admin/tenants/beta/teams", {"id": "x"}),
        ("GET", "/admin/keys?tenant=beta", None),
        ("POST", "/admin/keys", {"tenant": "beta"}),
        ("GET", "/admin/projects?tenant=beta", None),
        ("POST", "/admin/projects", {"tenant": "beta", "team": "core", "id": "p"}),
    ]:
        r = await client.request(method, path, json=body, headers=a)
        assert r.status_code == 403, (method, path, r.text)
        assert r.json()["error"]["type"] == "permission_error"
    beta_key = s["beta_data"]["id"]
    for path in (f"/admin/keys/{beta_key}", f"/admin/keys/{beta_key}/revoke", f"/admin/keys/{beta_key}/rotate"):
        r = await client.request("GET" if path.endswith(beta_key) else "POST", path, headers=a)
        assert r.status_code == 404, path
    # beta's key is untouched
    r = await client.get(f"/admin/keys/{beta_key}", headers=ADMIN)
    assert r.json()["revoked_at"] is None
    # platform-only operations
    assert (await client.post("/admin/tenants", json={"id": "gamma"}, headers=a)).status_code == 403
    assert (await client.post("/admin/partners", json={"id": "p", "tenant": "alpha"}, headers=a)).status_code == 403
    # within its own tenant a tenant admin can work
    r = await client.post("/admin/keys", json={"team": "core"}, headers=a)
    assert r.status_code == 201 and r.json()["tenant"] == "alpha"
    r = await client.post("/admin/tenants/alpha/teams", json={"id": "ml"}, headers=a)
    assert r.status_code == 201


async def test_admin_401_vs_403_and_errors(client: httpx.AsyncClient) -> None:
    s = await setup_two_tenants(client)
    r = await client.get("/admin/tenants")
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    r = await client.get("/admin/tenants", headers=auth("wrong"))
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert "wrong" not in r.text
    for k in (s["alpha_data"]["key"], STATIC_KEY):
        r = await client.get("/admin/tenants", headers=auth(k))
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
        assert k not in r.text
    r = await client.post("/admin/tenants", content=b"{not json", headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = await client.post("/admin/tenants", json={"id": "alpha"}, headers=ADMIN)
    assert r.status_code == 409
    r = await client.post("/admin/keys", json={"tenant": "alpha", "team": "nope"}, headers=ADMIN)
    assert r.status_code == 404
    r = await client.post("/admin/keys/doesnotexist/revoke", headers=ADMIN)
    assert r.status_code == 404
