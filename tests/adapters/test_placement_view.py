"""GET /admin/adapters/placement in process (the real Placement against a simulated engine with runtime LoRA, the
real admin routes on a SQLite identity store): the platform admin sees every dynamic engine and every resident
adapter with its owner; a tenant admin sees the same engines but only its own tenant's adapters, another tenant's
left out entirely (neither its name nor its owner appears anywhere in the answer); an engine no request reached
yet is listed empty; `placement` cannot be registered as an adapter name (the route's path)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from backends.sim.fleet import start_fleet
from backends.sim.lora import LoraConfig
from gateway.adapters.admin import adapter_routes
from gateway.adapters.placement import Placement, adapter_backends
from gateway.adapters.service import AdapterService
from gateway.admin_guard import AdminGuard
from gateway.config import parse_config
from gateway.identity.admin import admin_routes
from gateway.identity.service import IdentityService
from gateway.pipeline import AdapterUse, RequestContext
from gateway.routing.plan import Candidate
from tests.identity.conftest import ADMIN_KEY

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def ctx_for(rid: str, name: str) -> RequestContext:
    ctx = RequestContext(request_id=rid, endpoint="chat", headers={}, body={})
    ctx.adapter = AdapterUse(name, "base")  # what the adapters stage sets
    ctx.evidence["adapter"] = {"name": name, "base_model": "base"}
    return ctx


async def test_tenant_admin_sees_engines_but_only_its_own_adapters(tmp_path: Path) -> None:
    async with start_fleet(1, profiles=["tiny"], lora=LoraConfig(max_loras=4, load_s=0.01)) as fleet:
        lora = {"dynamic": True, "max_loras": 4, "refresh_s": 3600.0}
        cfg = parse_config(yaml.safe_dump({
            "identity": {"sqlite_path": str(tmp_path / "id.db")},
            "admin": {"key": ADMIN_KEY},
            "backends": [
                {"name": "e1", "url": fleet[0].url, "kind": "sim", "models": ["base"],
                 "model_map": {"base": "sim-model"}, "lora": lora},
                # a second dynamic engine no request reaches (its URL is never contacted)
                {"name": "e2", "url": "http://127.0.0.1:9/v1", "kind": "sim", "models": ["other"], "lora": lora}],
        }), source="test.yaml", base_dir=tmp_path)
        ident = IdentityService(cfg)
        await ident.start()
        svc = AdapterService(ident)
        await svc.start()
        pl = Placement(lambda: cfg, lambda b: {}, svc.registry, registry=CollectorRegistry())
        svc.placement = pl
        await pl.start()
        guard = AdminGuard(ident.authenticate_admin, lambda: cfg.server.max_body_bytes)
        app = Starlette(routes=admin_routes(ident, guard) + adapter_routes(svc, guard))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
                keys: dict[str, dict[str, str]] = {}
                for t in ("alpha", "beta"):
                    assert (await c.post("/admin/tenants", json={"id": t}, headers=ADMIN)).status_code == 201
                    r = await c.put(f"/admin/tenants/{t}/adapter_sources", json={"prefixes": [f"/w/{t}/"]},
                                    headers=ADMIN)
                    assert r.status_code == 200
                    r = await c.post("/admin/keys", json={"tenant": t, "purpose": "admin"}, headers=ADMIN)
                    keys[t] = {"authorization": f"Bearer {r.json()['key']}"}
                for name, t in (("alpha-a", "alpha"), ("beta-secret", "beta")):
                    r = await c.post("/admin/adapters", json={"name": name, "base_model": "base",
                                                              "source": f"/w/{t}/{name}"}, headers=keys[t])
                    assert r.status_code == 201, r.text
                r = await c.post("/admin/adapters", json={"name": "placement", "base_model": "base",
                                                          "source": "/w/alpha/p"}, headers=keys["alpha"])
                assert r.status_code == 400 and r.json()["error"]["param"] == "name"

                # one request of each tenant places its adapter on e1; alpha's is still in flight
                held = {}
                for rid, name in (("r1", "alpha-a"), ("r2", "beta-secret")):
                    ctx = ctx_for(rid, name)
                    (b,) = adapter_backends(cfg, ctx, name)
                    await pl.prepare(ctx, Candidate(backend=b, model=name))
                    held[name] = ctx
                await pl.finish(held["beta-secret"])

                r = await c.get("/admin/adapters/placement", headers=ADMIN)
                assert r.status_code == 200, r.text
                view = r.json()
                assert view["object"] == "adapter_placement"
                assert [e["backend"] for e in view["data"]] == ["e1", "e2"]
                e1, e2 = view["data"]
                assert e1["max_loras"] == 4 and e1["read_age_s"] is not None
                assert {a["name"]: (a["inflight"], a["owner"]["tenant"], a["base_model"]) for a in e1["adapters"]} \
                    == {"alpha-a": (1, "alpha", "base"), "beta-secret": (0, "beta", "base")}
                assert e2["adapters"] == [] and e2["read_age_s"] is None and e2["max_loras"] == 4

                r = await c.get("/admin/adapters/placement", headers=keys["alpha"])
                assert r.status_code == 200
                mine = r.json()["data"]
                assert [e["backend"] for e in mine] == ["e1", "e2"]
                assert [(a["name"], a["inflight"], a["owner"]) for a in mine[0]["adapters"]] == [
                    ("alpha-a", 1, {"tenant": "alpha", "team": None, "project": None})]
                raw = orjson.dumps(r.json()).decode()
                assert "beta" not in raw  # neither the name nor the owner of another tenant's adapter

                r = await c.get("/admin/adapters/placement", headers=keys["beta"])
                theirs: list[dict[str, Any]] = r.json()["data"]
                assert [[a["name"] for a in e["adapters"]] for e in theirs] == [["beta-secret"], []]
                assert "alpha" not in orjson.dumps(theirs).decode()
                await pl.finish(held["alpha-a"])
        finally:
            await pl.close()
            await ident.close()
