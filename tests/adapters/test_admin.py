"""/admin/adapters and source grants over HTTP on both identity stores: who may register what, who sees what."""
from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway.adapters.service import AdapterService

from .conftest import ADMIN


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def two_tenants(c: httpx.AsyncClient) -> dict[str, Any]:
    """Tenants alpha and beta (team core each), each with a tenant-admin key; alpha granted /w/alpha/."""
    out: dict[str, Any] = {}
    for t in ("alpha", "beta"):
        assert (await c.post("/admin/tenants", json={"id": t}, headers=ADMIN)).status_code == 201
        assert (await c.post(f"/admin/tenants/{t}/teams", json={"id": "core"}, headers=ADMIN)).status_code == 201
        r = await c.post("/admin/keys", json={"tenant": t, "purpose": "admin"}, headers=ADMIN)
        out[t] = auth(r.json()["key"])
    r = await c.put("/admin/tenants/alpha/adapter_sources", json={"prefixes": ["/w/alpha/"]}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["prefixes"] == ["/w/alpha/"], r.text
    return out


def adapter(name: str, source: str, **owner: str) -> dict[str, Any]:
    return {"name": name, "base_model": "base", "source": source, "owner": owner, "rank": 8}


async def test_grants_are_set_by_the_platform_admin_and_read_by_the_tenant(client: httpx.AsyncClient) -> None:
    k = await two_tenants(client)
    r = await client.put("/admin/tenants/alpha/adapter_sources", json={"prefixes": ["/w/"]}, headers=k["alpha"])
    assert r.status_code == 403
    r = await client.get("/admin/tenants/alpha/adapter_sources", headers=k["alpha"])
    assert r.json()["prefixes"] == ["/w/alpha/"]
    assert (await client.get("/admin/tenants/alpha/adapter_sources", headers=k["beta"])).status_code == 403
    r = await client.put("/admin/tenants/nope/adapter_sources", json={"prefixes": ["/w/"]}, headers=ADMIN)
    assert r.status_code == 404
    r = await client.put("/admin/tenants/beta/adapter_sources", json={"prefixes": ["/w/../"]}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prefixes"


async def test_a_tenant_registers_only_under_its_granted_prefixes(client: httpx.AsyncClient) -> None:
    k = await two_tenants(client)
    r = await client.post("/admin/adapters", json=adapter("alpha-a", "/w/alpha/a"), headers=k["alpha"])
    assert r.status_code == 201, r.text
    assert r.json()["owner"] == {"tenant": "alpha", "team": None, "project": None}
    for src in ("/w/beta/b", "/w/alpha-x/b", "/w/alpha/../beta/b"):
        r = await client.post("/admin/adapters", json=adapter("alpha-b", src), headers=k["alpha"])
        assert r.status_code == 403 and r.json()["error"]["code"] == "adapter_source_forbidden", src
    # beta has no grant at all: not even the platform admin registers an adapter for it
    r = await client.post("/admin/adapters", json=adapter("beta-a", "/w/beta/a", tenant="beta"), headers=ADMIN)
    assert r.status_code == 403
    # a tenant admin cannot register for another tenant
    r = await client.post("/admin/adapters", json=adapter("x", "/w/alpha/x", tenant="alpha"), headers=k["beta"])
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_forbidden"


async def test_registration_refuses_bad_input_with_a_clear_error(client: httpx.AsyncClient) -> None:
    k = await two_tenants(client)
    cases = [
        ({**adapter("a b", "/w/alpha/a")}, "name"),
        ({**adapter("support", "/w/alpha/a")}, "name"),  # an alias
        ({**adapter("base", "/w/alpha/a")}, "name"),  # a base model
        ({**adapter("ok", "/w/alpha/a"), "base_model": "nope"}, "base_model"),
        ({**adapter("ok", "")}, "source"),
        ({**adapter("ok", "/w/alpha/a"), "rank": 0}, "rank"),
        ({**adapter("ok", "/w/alpha/a"), "rank": True}, "rank"),
        ({**adapter("ok", "/w/alpha/a"), "owner": "alpha"}, "owner"),
        ({**adapter("ok", "/w/alpha/a", project="p1")}, "owner.project"),
    ]
    for body, param in cases:
        r = await client.post("/admin/adapters", json=body, headers=k["alpha"])
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = await client.post("/admin/adapters", json=adapter("ok", "/w/alpha/a", team="ghost"), headers=k["alpha"])
    assert r.status_code == 404
    r = await client.post("/admin/adapters", content=b"{", headers=k["alpha"])
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # a name the config serves only as a static LoRA adapter may be claimed; twice is a conflict
    assert (await client.post("/admin/adapters", json=adapter("static-lora", "/w/alpha/s"),
                              headers=k["alpha"])).status_code == 201
    r = await client.post("/admin/adapters", json=adapter("static-lora", "/w/alpha/s"), headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "owner.tenant"  # a platform admin names it
    r = await client.post("/admin/adapters", json=adapter("static-lora", "/w/alpha/s", tenant="alpha"), headers=ADMIN)
    assert r.status_code == 409


async def test_each_tenant_admin_sees_and_changes_only_its_own(client: httpx.AsyncClient,
                                                              adapters: AdapterService) -> None:
    k = await two_tenants(client)
    await client.put("/admin/tenants/beta/adapter_sources", json={"prefixes": ["s3://w/beta"]}, headers=ADMIN)
    assert (await client.post("/admin/adapters", json=adapter("org/alpha-a", "/w/alpha/a", team="core"),
                              headers=k["alpha"])).status_code == 201
    assert (await client.post("/admin/adapters", json=adapter("beta-a", "s3://w/beta/a"),
                              headers=k["beta"])).status_code == 201
    ids = lambda r: [a["id"] for a in r.json()["data"]]  # noqa: E731
    assert ids(await client.get("/admin/adapters", headers=ADMIN)) == ["beta-a", "org/alpha-a"]
    assert ids(await client.get("/admin/adapters", headers=k["alpha"])) == ["org/alpha-a"]
    assert ids(await client.get("/admin/adapters?tenant=beta", headers=ADMIN)) == ["beta-a"]
    assert (await client.get("/admin/adapters?tenant=beta", headers=k["alpha"])).status_code == 403
    r = await client.get("/admin/adapters/org/alpha-a", headers=k["alpha"])
    assert r.status_code == 200 and r.json()["owner"]["team"] == "core"
    # another tenant's adapter is not found, exactly like one that does not exist
    missing = await client.get("/admin/adapters/none", headers=k["beta"])
    other = await client.get("/admin/adapters/org/alpha-a", headers=k["beta"])
    assert other.status_code == missing.status_code == 404 and other.json() == missing.json()
    assert (await client.patch("/admin/adapters/org/alpha-a", json={"rank": 4}, headers=k["beta"])).status_code == 404
    assert (await client.delete("/admin/adapters/org/alpha-a", headers=k["beta"])).status_code == 404
    # PATCH: rank and description freely, the source only under a grant, never the owner or base model
    r = await client.patch("/admin/adapters/org/alpha-a", json={"rank": 4, "description": "v2"}, headers=k["alpha"])
    assert r.status_code == 200 and r.json()["rank"] == 4 and r.json()["description"] == "v2"
    r = await client.patch("/admin/adapters/org/alpha-a", json={"source": "s3://w/beta/a"}, headers=k["alpha"])
    assert r.status_code == 403
    r = await client.patch("/admin/adapters/org/alpha-a", json={"owner": {"tenant": "beta"}}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "owner"
    r = await client.delete("/admin/adapters/org/alpha-a", headers=k["alpha"])
    assert r.json() == {"id": "org/alpha-a", "object": "adapter", "deleted": True}
    assert (await client.get("/admin/adapters/org/alpha-a", headers=ADMIN)).status_code == 404
    assert sorted(await adapters.registry()) == ["beta-a"]


async def test_the_request_path_registry_follows_changes_at_once(client: httpx.AsyncClient,
                                                                adapters: AdapterService) -> None:
    k = await two_tenants(client)
    assert dict(await adapters.registry()) == {}
    await client.post("/admin/adapters", json=adapter("alpha-a", "/w/alpha/a"), headers=k["alpha"])
    assert list(await adapters.registry()) == ["alpha-a"]  # the change event dropped the cached snapshot
    await client.delete("/admin/adapters/alpha-a", headers=k["alpha"])
    assert dict(await adapters.registry()) == {}


async def test_a_registration_on_one_replica_reaches_the_others_cache_at_once(tmp_path, adapters: AdapterService,
                                                                             client: httpx.AsyncClient) -> None:
    """Two services on one store (a second replica): its cached registry drops on the first one's change event
    (Postgres LISTEN/NOTIFY), though its cache_ttl_s would keep the stale snapshot much longer."""
    from gateway.identity.service import IdentityService

    from .conftest import adapter_config

    if type(adapters.identity.store).__name__ != "PostgresIdentityStore":
        pytest.skip("SQLite's change events are in-process: another process sees changes within cache_ttl_s")
    schema = adapters.identity.config.raw.identity.postgres_schema
    other_ident = IdentityService(adapter_config(tmp_path / "b", "postgres", schema))
    await other_ident.start()
    other = AdapterService(other_ident)
    await other.start()
    try:
        k = await two_tenants(client)
        assert dict(await other.registry()) == {}  # cached now, for cache_ttl_s (5 s)
        await client.post("/admin/adapters", json=adapter("alpha-a", "/w/alpha/a"), headers=k["alpha"])
        for _ in range(100):
            if other._snap is None:
                break
            await asyncio.sleep(0.01)
        assert list(await other.registry()) == ["alpha-a"]
    finally:
        await other_ident.close()


async def test_deleting_a_tenant_is_refused_while_it_owns_adapters_and_takes_its_grants_with_it(
        adapters: AdapterService, client: httpx.AsyncClient) -> None:
    """A tenant's adapters refuse its deletion like its teams do (409 resource_in_use naming them; DELETE each
    adapter first, which unloads it); its source grants are deleted with it in the same transaction, so a
    tenant created again under that id starts without them."""
    assert (await client.post("/admin/tenants", json={"id": "gamma"}, headers=ADMIN)).status_code == 201
    r = await client.put("/admin/tenants/gamma/adapter_sources", json={"prefixes": ["/w/gamma/"]}, headers=ADMIN)
    assert r.status_code == 200
    r = await client.post("/admin/adapters", json=adapter("gamma-a", "/w/gamma/a", tenant="gamma"), headers=ADMIN)
    assert r.status_code == 201, r.text
    r = await client.delete("/admin/tenants/gamma", headers=ADMIN)
    assert r.status_code == 409 and r.json()["error"]["code"] == "resource_in_use", r.text
    assert "1 adapter" in r.json()["error"]["message"]
    assert (await client.get("/admin/tenants/gamma", headers=ADMIN)).status_code == 200  # nothing changed
    assert await adapters.prefixes("gamma") == ["/w/gamma/"]
    assert [a.name for a in await adapters.list("gamma")] == ["gamma-a"]

    assert (await client.delete("/admin/adapters/gamma-a", headers=ADMIN)).status_code == 200
    r = await client.delete("/admin/tenants/gamma", headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"id": "gamma", "object": "tenant", "deleted": True}, r.text
    assert await adapters.prefixes("gamma") == []
    # the same id again: no grant inherited, so nothing can be registered under the old prefix
    assert (await client.post("/admin/tenants", json={"id": "gamma"}, headers=ADMIN)).status_code == 201
    assert (await client.get("/admin/tenants/gamma/adapter_sources", headers=ADMIN)).json()["prefixes"] == []
    r = await client.post("/admin/adapters", json=adapter("gamma-b", "/w/gamma/b", tenant="gamma"), headers=ADMIN)
    assert r.status_code == 403 and r.json()["error"]["code"] == "adapter_source_forbidden"


async def test_a_registration_racing_the_tenant_deletion_never_outlives_the_tenant(
        adapters: AdapterService, client: httpx.AsyncClient) -> None:
    """Registering an adapter and deleting its tenant at the same time serialise on the tenant row: either the
    adapter is registered and the deletion refused (409), or the tenant is gone and the registration refused
    (404). Never a tenant deleted with an adapter left behind."""
    for i in range(8):
        t = f"race{i}"
        assert (await client.post("/admin/tenants", json={"id": t}, headers=ADMIN)).status_code == 201
        assert (await client.put(f"/admin/tenants/{t}/adapter_sources", json={"prefixes": [f"/w/{t}/"]},
                                 headers=ADMIN)).status_code == 200
        reg, dele = await asyncio.gather(
            client.post("/admin/adapters", json=adapter(f"{t}-a", f"/w/{t}/a", tenant=t), headers=ADMIN),
            client.delete(f"/admin/tenants/{t}", headers=ADMIN))
        assert sorted((reg.status_code, dele.status_code)) in ([201, 409], [200, 404]), (reg.text, dele.text)
        tenant_left = (await client.get(f"/admin/tenants/{t}", headers=ADMIN)).status_code == 200
        assert tenant_left == (reg.status_code == 201)
        assert [a.name for a in await adapters.list(t)] == ([f"{t}-a"] if tenant_left else [])
