"""/admin/adapters and /admin/tenants/{tenant}/adapter_sources (issue 38).

* `PUT /admin/tenants/{tenant}/adapter_sources {"prefixes": [...]}`: platform admin only; replaces the path/URI
  prefixes the tenant may register adapter sources under. `GET` the same: platform admin, or that tenant's admin.
* `POST /admin/adapters {"name", "base_model", "source", "owner": {"tenant", "team"?, "project"?}, "rank"?,
  "description"?}`: a platform admin for any tenant, a tenant admin for its own (owner.tenant defaults to it);
  the source must lie under a prefix granted to the owner tenant (403 adapter_source_forbidden).
* `GET /admin/adapters[?tenant=]`, `GET|PATCH|DELETE /admin/adapters/{name}`: a tenant admin sees and changes
  only its tenant's; another tenant's adapter is 404 like one that does not exist. PATCH changes `source`
  (re-checked against the grants), `rank`, `description`.
* `GET /admin/adapters/placement`: the dynamic engines and the adapters this process has resident on each (in
  flight, idle time, learned load time); a tenant admin sees every engine but only its own tenant's adapters.
  (`placement` is therefore not an adapter name.)
"""
from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.routing import Route

from gateway.adapters.model import Adapter
from gateway.adapters.service import AdapterService, bad, not_found
from gateway.admin_guard import PLATFORM_ADMIN, TENANT_ADMIN, AdminGuard
from gateway.identity.admin import _body, _deleted, _json, is_admin, require_tenant
from gateway.identity.directory import validate_id
from gateway.types import Principal


def adapter_routes(svc: AdapterService, guard: AdminGuard) -> list[Route]:
    async def get_sources(req: Request, p: Principal) -> Any:
        tid = req.path_params["tenant"]
        require_tenant(p, tid)
        return {"object": "adapter_sources", "tenant": tid, "prefixes": await svc.prefixes(tid)}

    async def put_sources(req: Request, p: Principal) -> Any:
        tid = req.path_params["tenant"]
        b = await _body(req)
        return {"object": "adapter_sources", "tenant": tid, "prefixes": await svc.set_prefixes(tid, b.get("prefixes"))}

    async def create(req: Request, p: Principal) -> Any:
        b = await _body(req)
        owner = b.get("owner", {})
        if not isinstance(owner, dict):
            raise bad("owner must be an object {tenant, team?, project?}.", "owner")
        tid = owner.get("tenant") or (None if is_admin(p) else p.tenant)
        tid = validate_id(tid, "owner.tenant")
        require_tenant(p, tid)
        a = await svc.create(tid, b)
        return _json(a.public(), 201)

    async def listing(req: Request, p: Principal) -> Any:
        tid = req.query_params.get("tenant")
        if tid is not None:
            require_tenant(p, tid)
        elif not is_admin(p):
            tid = p.tenant
        return {"object": "list", "data": [a.public() for a in await svc.list(tid)]}

    async def placement(req: Request, p: Principal) -> Any:
        return {"object": "adapter_placement", "data": await svc.placement_view(None if is_admin(p) else p.tenant)}

    async def _own(req: Request, p: Principal) -> Adapter:
        a = await svc.get(req.path_params["name"])
        if a is None or (not is_admin(p) and a.tenant != p.tenant):
            raise not_found()
        return a

    async def get(req: Request, p: Principal) -> Any:
        return (await _own(req, p)).public()

    async def patch(req: Request, p: Principal) -> Any:
        a = await _own(req, p)
        x = await svc.update(a.name, await _body(req))
        if x is None:
            raise not_found()
        return x.public()

    async def delete(req: Request, p: Principal) -> Any:
        a = await _own(req, p)
        if not await svc.delete(a.name):
            raise not_found()
        return _deleted("adapter", id=a.name)

    both = (PLATFORM_ADMIN, TENANT_ADMIN)
    return [
        guard.route("/admin/tenants/{tenant}/adapter_sources", get_sources, ["GET"], both),
        guard.route("/admin/tenants/{tenant}/adapter_sources", put_sources, ["PUT"], (PLATFORM_ADMIN,)),
        guard.route("/admin/adapters", listing, ["GET"], both),
        guard.route("/admin/adapters", create, ["POST"], both),
        guard.route("/admin/adapters/placement", placement, ["GET"], both),  # before {name:path}
        guard.route("/admin/adapters/{name:path}", get, ["GET"], both),
        guard.route("/admin/adapters/{name:path}", patch, ["PATCH"], both),
        guard.route("/admin/adapters/{name:path}", delete, ["DELETE"], both),
    ]
