"""Admin plane over HTTP (Starlette app + httpx ASGI transport), both stores: CRUD, roles, tenant isolation."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette

from gateway.errors import GatewayError
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


# ---------------------------------------------------------------- single-item GET / PATCH / DELETE

async def setup_hierarchy(c: httpx.AsyncClient) -> dict[str, Any]:
    """Two tenants (setup_two_tenants), plus alpha/core/p1, partner opper under alpha, a project key and a
    partner key in alpha, and partner beta-p under beta."""
    s = await setup_two_tenants(c)
    assert (await c.post("/admin/projects", json={"tenant": "alpha", "team": "core", "id": "p1",
                                                  "labels": {"retention": "30d"}}, headers=ADMIN)).status_code == 201
    assert (await c.post("/admin/partners", json={"id": "opper", "tenant": "alpha"}, headers=ADMIN)).status_code == 201
    assert (await c.post("/admin/partners", json={"id": "beta-p", "tenant": "beta"}, headers=ADMIN)).status_code == 201
    r = await c.post("/admin/keys", json={"tenant": "alpha", "team": "core", "project": "p1"}, headers=ADMIN)
    assert r.status_code == 201
    s["project_key"] = r.json()
    r = await c.post("/admin/keys", json={"tenant": "alpha", "partner": "opper"}, headers=ADMIN)
    assert r.status_code == 201
    s["partner_key"] = r.json()
    return s


def err_of(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The OpenAI-shaped error of `r`, checked for status, type, code and param."""
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) >= {"message", "type", "code"} and e["message"]
    assert e["type"] == {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
                         409: "invalid_request_error"}[status]
    if code is not None:
        assert e["code"] == code, e
    if param is not None:
        assert e["param"] == param, e
    return e


async def test_single_item_get_and_patch_take_effect_at_once(client: httpx.AsyncClient,
                                                             service: IdentityService) -> None:
    s = await setup_hierarchy(client)
    team_url, proj_url = "/admin/tenants/alpha/teams/core", "/admin/tenants/alpha/teams/core/projects/p1"
    r = await client.get(team_url, headers=ADMIN)
    assert r.status_code == 200 and (r.json()["tenant"], r.json()["id"]) == ("alpha", "core")
    r = await client.get(proj_url, headers=ADMIN)
    assert r.status_code == 200 and r.json()["labels"] == {"retention": "30d"}
    r = await client.get("/admin/partners/opper", headers=ADMIN)
    assert r.status_code == 200 and r.json()["tenant"] == "alpha"

    proj_secret, partner_secret = s["project_key"]["key"], s["partner_key"]["key"]
    p = await service.authenticate(auth(proj_secret), "c")  # now cached (TTL 5 s)
    assert p.labels == {"residency": "eea", "retention": "30d"}
    assert (await service.authenticate(auth(partner_secret), "c")).labels == {"residency": "eea"}

    r = await client.patch(team_url, json={"name": "Core platform", "labels": {"tier": "realtime"}}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["name"] == "Core platform" and r.json()["labels"] == {"tier": "realtime"}
    r = await client.patch(proj_url, json={"labels": {"retention": "zero"}}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["labels"] == {"retention": "zero"}
    r = await client.patch("/admin/partners/opper", json={"labels": {"residency": "de"}, "name": "Opper"},
                           headers=ADMIN)
    assert r.status_code == 200 and r.json()["name"] == "Opper"
    assert (await client.get(team_url, headers=ADMIN)).json()["labels"] == {"tier": "realtime"}

    # the cached principals were dropped: the next request sees the new labels without waiting for the TTL
    p = await service.authenticate(auth(proj_secret), "c")
    assert p.labels == {"residency": "eea", "tier": "realtime", "retention": "zero"}
    assert (await service.authenticate(auth(partner_secret), "c")).labels == {"residency": "de"}  # narrower: kept

    # PATCH changes only the fields sent: a name-only tenant patch keeps its labels; {} is a no-op
    r = await client.patch("/admin/tenants/alpha", json={"name": "Alpha AB"}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["name"] == "Alpha AB" and r.json()["labels"] == {"residency": "eea"}
    r = await client.patch(team_url, json={}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["labels"] == {"tier": "realtime"}
    r = await client.patch("/admin/tenants/alpha", json={"labels": {}}, headers=ADMIN)  # explicit clear
    assert r.json()["labels"] == {}
    assert (await service.authenticate(auth(proj_secret), "c")).labels == {"tier": "realtime", "retention": "zero"}


async def test_patch_key(client: httpx.AsyncClient, service: IdentityService) -> None:
    s = await setup_hierarchy(client)
    key, secret = s["alpha_data"], s["alpha_data"]["key"]
    url = f"/admin/keys/{key['id']}"
    assert (await service.authenticate(auth(secret), "c")).allowed_models == ()
    exp = time.time() + 3600
    r = await client.patch(url, json={"name": "ci", "labels": {"owner": "ml"}, "scopes": ["batch"],
                                      "models": ["qwen*"], "expires_at": exp}, headers=ADMIN)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["name"], body["labels"], body["scopes"], body["models"]) == ("ci", {"owner": "ml"}, ["batch"],
                                                                              ["qwen*"])
    assert body["expires_at"] == pytest.approx(exp) and "key" not in body and "secret_hash" not in body
    p = await service.authenticate(auth(secret), "c")  # same secret still works, new attributes at once
    assert p.allowed_models == ("qwen*",) and p.scopes == ("batch",) and p.labels["owner"] == "ml"
    r = await client.patch(url, json={"expires_at": None, "models": []}, headers=ADMIN)
    assert r.json()["expires_at"] is None and r.json()["models"] == []
    assert (await service.authenticate(auth(secret), "c")).allowed_models == ()
    assert (await client.get(url, headers=ADMIN)).json()["name"] == "ci"

    # never the secret, the hierarchy or the purpose; unknown fields are named too
    for field, value in [("key", "gw_x"), ("secret_hash", "00"), ("tenant", "beta"), ("team", "other"),
                         ("project", "p1"), ("partner", "opper"), ("purpose", "admin"), ("revoked_at", None),
                         ("id", "abc"), ("lables", {})]:
        err_of(await client.patch(url, json={field: value}, headers=ADMIN), 400, "invalid_request", field)
    for field, value in [("models", "qwen*"), ("scopes", [1]), ("labels", ["a"]), ("name", ""),
                         ("expires_at", time.time() - 10), ("expires_at", "tomorrow"), ("expires_at", True)]:
        err_of(await client.patch(url, json={field: value}, headers=ADMIN), 400, "invalid_request", field)
    err_of(await client.patch(url, content=b"{nope", headers=ADMIN), 400, "invalid_json")
    err_of(await client.patch(url, json=["labels"], headers=ADMIN), 400, "invalid_request")
    assert (await client.get(url, headers=ADMIN)).json()["tenant"] == "alpha"

    # a rotated-away key keeps the end the rotation gave it; its labels may still change
    r = await client.post(f"/admin/keys/{s['project_key']['id']}/rotate", json={"overlap_s": 60}, headers=ADMIN)
    assert r.status_code == 201
    old = f"/admin/keys/{s['project_key']['id']}"
    err_of(await client.patch(old, json={"expires_at": None}, headers=ADMIN), 409, "conflict")
    assert (await client.patch(old, json={"labels": {"note": "rotated"}}, headers=ADMIN)).status_code == 200
    # a revoked key is an audit record: no edits
    assert (await client.delete(url, headers=ADMIN)).status_code == 200
    err_of(await client.patch(url, json={"labels": {"a": "b"}}, headers=ADMIN), 409, "conflict")
    err_of(await client.patch("/admin/keys/doesnotexist", json={"name": "x"}, headers=ADMIN), 404, "not_found")


async def test_delete_key_revokes_idempotently(client: httpx.AsyncClient, service: IdentityService) -> None:
    s = await setup_two_tenants(client)
    key, secret = s["alpha_data"], s["alpha_data"]["key"]
    await service.authenticate(auth(secret), "c")  # cached
    r = await client.delete(f"/admin/keys/{key['id']}", headers=ADMIN)
    assert r.status_code == 200 and r.json()["id"] == key["id"] and r.json()["revoked_at"] is not None
    revoked_at = r.json()["revoked_at"]
    with pytest.raises(GatewayError) as ei:
        await service.authenticate(auth(secret), "c")
    assert ei.value.code == "revoked_api_key"
    r = await client.delete(f"/admin/keys/{key['id']}", headers=ADMIN)  # again: same answer, first time kept
    assert r.status_code == 200 and r.json()["revoked_at"] == revoked_at
    assert (await client.get(f"/admin/keys/{key['id']}", headers=ADMIN)).json()["revoked_at"] == revoked_at
    assert key["id"] in (await client.get("/admin/keys?tenant=alpha", headers=ADMIN)).text  # row kept for audit
    r = await client.post(f"/admin/keys/{key['id']}/revoke", headers=ADMIN)  # the old route agrees
    assert r.status_code == 200 and r.json()["revoked_at"] == revoked_at
    err_of(await client.delete("/admin/keys/doesnotexist", headers=ADMIN), 404, "not_found")


async def test_delete_refused_while_dependents_then_removed(client: httpx.AsyncClient,
                                                           service: IdentityService) -> None:
    s = await setup_hierarchy(client)
    team_url, proj_url = "/admin/tenants/alpha/teams/core", "/admin/tenants/alpha/teams/core/projects/p1"
    e = err_of(await client.delete("/admin/tenants/alpha", headers=ADMIN), 409, "resource_in_use")
    for word in ("1 team", "1 project", "1 partner", "4 unrevoked keys"):
        assert word in e["message"], e
    e = err_of(await client.delete(team_url, headers=ADMIN), 409, "resource_in_use")
    assert "1 project" in e["message"] and "2 unrevoked keys" in e["message"], e  # data key + project key
    e = err_of(await client.delete(proj_url, headers=ADMIN), 409, "resource_in_use")
    assert "1 unrevoked key " in e["message"], e
    e = err_of(await client.delete("/admin/partners/opper", headers=ADMIN), 409, "resource_in_use")
    assert "1 unrevoked key " in e["message"], e
    # nothing was removed by the refusals
    for url in (team_url, proj_url, "/admin/partners/opper", "/admin/tenants/alpha"):
        assert (await client.get(url, headers=ADMIN)).status_code == 200

    # an expired key that was never revoked still counts: it could be given a new expiry
    r = await client.post("/admin/keys", json={"tenant": "alpha", "team": "core", "project": "p1",
                                               "expires_at": time.time() + 0.5}, headers=ADMIN)
    expiring = r.json()["id"]
    # bottom up: revoke the project's keys, then the project goes
    assert (await client.delete(f"/admin/keys/{s['project_key']['id']}", headers=ADMIN)).status_code == 200
    e = err_of(await client.delete(proj_url, headers=ADMIN), 409, "resource_in_use")
    assert "1 unrevoked key " in e["message"]
    assert (await client.delete(f"/admin/keys/{expiring}", headers=ADMIN)).status_code == 200
    r = await client.delete(proj_url, headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"id": "p1", "tenant": "alpha", "team": "core", "object": "project",
                                                 "deleted": True}
    err_of(await client.get(proj_url, headers=ADMIN), 404, "not_found")
    err_of(await client.delete(proj_url, headers=ADMIN), 404, "not_found")
    assert (await client.get("/admin/projects?tenant=alpha", headers=ADMIN)).json()["data"] == []

    assert (await client.delete(f"/admin/keys/{s['alpha_data']['id']}", headers=ADMIN)).status_code == 200
    r = await client.delete(team_url, headers=ADMIN)
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert (await client.delete(f"/admin/keys/{s['partner_key']['id']}", headers=ADMIN)).status_code == 200
    r = await client.delete("/admin/partners/opper", headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"id": "opper", "object": "partner", "deleted": True}
    e = err_of(await client.delete("/admin/tenants/alpha", headers=ADMIN), 409, "resource_in_use")
    assert e["message"].count("unrevoked key") == 1 and "team" not in e["message"]  # only the admin key is left
    admin_key_id = next(k["id"] for k in (await client.get("/admin/keys?tenant=alpha", headers=ADMIN)).json()["data"]
                        if k["purpose"] == "admin")
    assert (await client.delete(f"/admin/keys/{admin_key_id}", headers=ADMIN)).status_code == 200
    r = await client.delete("/admin/tenants/alpha", headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"id": "alpha", "object": "tenant", "deleted": True}
    err_of(await client.get("/admin/tenants/alpha", headers=ADMIN), 404, "not_found")
    assert [t["id"] for t in (await client.get("/admin/tenants", headers=ADMIN)).json()["data"]] == ["beta"]
    # the revoked keys outlive their tenant as the audit trail, and still do not authenticate
    old = (await client.get(f"/admin/keys/{s['project_key']['id']}", headers=ADMIN)).json()
    assert old["tenant"] == "alpha" and old["revoked_at"] is not None
    with pytest.raises(GatewayError) as ei:
        await service.authenticate(auth(s["project_key"]["key"]), "c")
    assert ei.value.code == "revoked_api_key"
    # a new key cannot be created under the deleted parents
    for body in ({"tenant": "alpha"}, {"tenant": "beta", "partner": "opper"}, {"tenant": "beta", "team": "nope"}):
        err_of(await client.post("/admin/keys", json=body, headers=ADMIN), 404, "not_found")


async def test_unknown_ids_and_bad_bodies(client: httpx.AsyncClient) -> None:
    await setup_hierarchy(client)
    for url in ("/admin/tenants/nope", "/admin/tenants/alpha/teams/nope", "/admin/tenants/nope/teams/core",
                "/admin/tenants/alpha/teams/core/projects/nope", "/admin/tenants/alpha/teams/nope/projects/p1",
                "/admin/partners/nope"):
        for method in ("GET", "PATCH", "DELETE"):
            r = await client.request(method, url, json={} if method == "PATCH" else None, headers=ADMIN)
            err_of(r, 404, "not_found")
    for url in ("/admin/tenants/alpha", "/admin/tenants/alpha/teams/core",
                "/admin/tenants/alpha/teams/core/projects/p1", "/admin/partners/opper"):
        err_of(await client.patch(url, content=b"{bad", headers=ADMIN), 400, "invalid_json")
        err_of(await client.patch(url, json="labels", headers=ADMIN), 400, "invalid_request")
        err_of(await client.patch(url, json={"labels": {"k": 1}}, headers=ADMIN), 400, "invalid_request", "labels")
        err_of(await client.patch(url, json={"name": 5}, headers=ADMIN), 400, "invalid_request", "name")
        for field in ("id", "tenant", "created_at", "models"):
            err_of(await client.patch(url, json={field: "x"}, headers=ADMIN), 400, "invalid_request", field)
    # unauthenticated and data-plane credentials never reach the handlers
    for method, url in (("DELETE", "/admin/tenants/alpha"), ("PATCH", "/admin/partners/opper"),
                        ("DELETE", "/admin/keys/x"), ("GET", "/admin/tenants/alpha/teams/core")):
        assert (await client.request(method, url)).status_code == 401
        assert (await client.request(method, url, headers=auth(STATIC_KEY))).status_code == 403
    assert (await client.get("/admin/tenants/alpha", headers=ADMIN)).json()["labels"] == {"residency": "eea"}


async def test_tenant_isolation_on_item_routes(client: httpx.AsyncClient, service: IdentityService) -> None:
    s = await setup_hierarchy(client)
    a = auth(s["alpha_admin"])
    for method, path, body in [
        ("GET", "/admin/tenants/beta/teams/core", None),
        ("PATCH", "/admin/tenants/beta/teams/core", {"labels": {"x": "y"}}),
        ("DELETE", "/admin/tenants/beta/teams/core", None),
        ("GET", "/admin/tenants/beta/teams/core/projects/p1", None),
        ("PATCH", "/admin/tenants/beta/teams/core/projects/p1", {"name": "x"}),
        ("DELETE", "/admin/tenants/beta/teams/core/projects/p1", None),
    ]:
        err_of(await client.request(method, path, json=body, headers=a), 403, "tenant_forbidden")
    # tenants and partners are the platform's: not even its own tenant's record may be changed or deleted
    for method, path, body in [
        ("PATCH", "/admin/tenants/alpha", {"labels": {"residency": "us"}}),
        ("PATCH", "/admin/tenants/beta", {"labels": {"residency": "us"}}),
        ("DELETE", "/admin/tenants/alpha", None),
        ("DELETE", "/admin/tenants/beta", None),
        ("PATCH", "/admin/partners/opper", {"labels": {"x": "y"}}),
        ("PATCH", "/admin/partners/beta-p", {"labels": {"x": "y"}}),
        ("DELETE", "/admin/partners/opper", None),
        ("DELETE", "/admin/partners/beta-p", None),
    ]:
        err_of(await client.request(method, path, json=body, headers=a), 403, "admin_required")
    # ids not under a tenant path are not confirmed to outsiders
    err_of(await client.get("/admin/partners/beta-p", headers=a), 404, "not_found")
    assert (await client.get("/admin/partners/opper", headers=a)).json()["id"] == "opper"
    beta_key = s["beta_data"]["id"]
    err_of(await client.patch(f"/admin/keys/{beta_key}", json={"models": ["*"]}, headers=a), 404, "not_found")
    err_of(await client.delete(f"/admin/keys/{beta_key}", headers=a), 404, "not_found")
    # beta's records are untouched
    bk = (await client.get(f"/admin/keys/{beta_key}", headers=ADMIN)).json()
    assert bk["revoked_at"] is None and bk["models"] == []
    assert (await service.authenticate(auth(s["beta_data"]["key"]), "c")).tenant == "beta"
    for path in ("/admin/tenants/beta/teams/core", "/admin/tenants/beta", "/admin/partners/beta-p"):
        assert (await client.get(path, headers=ADMIN)).status_code == 200
    assert (await client.get("/admin/tenants/beta/teams/core", headers=ADMIN)).json()["labels"] == {}

    # within its own tenant a tenant admin reads, changes and deletes teams, projects and keys
    assert (await client.get("/admin/tenants/alpha/teams/core", headers=a)).status_code == 200
    r = await client.patch("/admin/tenants/alpha/teams/core", json={"labels": {"tier": "batch"}}, headers=a)
    assert r.status_code == 200 and r.json()["labels"] == {"tier": "batch"}
    r = await client.patch("/admin/tenants/alpha/teams/core/projects/p1", json={"name": "Ranker"}, headers=a)
    assert r.status_code == 200 and r.json()["name"] == "Ranker"
    r = await client.patch(f"/admin/keys/{s['alpha_data']['id']}", json={"models": ["qwen*"]}, headers=a)
    assert r.status_code == 200 and r.json()["models"] == ["qwen*"]
    r = await client.delete(f"/admin/keys/{s['alpha_data']['id']}", headers=a)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    assert (await client.post("/admin/tenants/alpha/teams", json={"id": "ml"}, headers=a)).status_code == 201
    assert (await client.delete("/admin/tenants/alpha/teams/ml", headers=a)).json()["deleted"] is True
    err_of(await client.delete("/admin/tenants/alpha/teams/core", headers=a), 409, "resource_in_use")


async def test_create_and_delete_race_leaves_no_orphan(service: IdentityService) -> None:
    """A key created while its tenant/team is being deleted: exactly one of them wins, never both
    (the create locks its parents, the delete locks the row and counts dependents, in one transaction each)."""
    for i in range(12):
        t = f"race{i}"
        await service.directory.create_tenant(t)
        await service.directory.create_team(t, "core")
        delete = service.directory.delete_team(t, "core") if i % 2 else service.directory.delete_tenant(t)
        if i % 2 == 0:
            await service.directory.delete_team(t, "core")
        res = await asyncio.gather(delete, service.directory.create_key(t, team="core" if i % 2 else None),
                                   return_exceptions=True)
        deleted, created = res[0] is True, isinstance(res[1], tuple)
        assert deleted != created, res
        for r in res:
            assert r is True or isinstance(r, tuple) or (isinstance(r, GatewayError) and r.status in (404, 409)), r
        live = [k for k in await service.directory.list_keys(t) if k.revoked_at is None]
        if deleted and i % 2 == 0:
            assert await service.directory.get_tenant(t) is None and live == []
        if deleted and i % 2:
            assert await service.directory.get_team(t, "core") is None and live == []
