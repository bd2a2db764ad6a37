"""Admin plane routes (/admin/...): CRUD for tenants, teams, projects, partners and keys.

Every route is built by the admin guard (gateway/admin_guard.py), which authenticates with
`IdentityService.authenticate_admin`, admits only the roles the route declares and confines a tenant admin to a
`{tenant}` path parameter; the handlers scope the rest. Role "admin" sees everything;
"tenant_admin" sees only its own tenant: naming another tenant is 403, and a key or partner id of another
tenant is 404 (ids that are not under a tenant path are not confirmed to outsiders). Tenants and partners are
created, changed and deleted by platform admins only; teams, projects and keys by either within the tenant.

PATCH takes a JSON object of the fields to change (`name`, `labels`; keys also `scopes`, `models`,
`expires_at`); `labels` replaces the whole set. DELETE removes a tenant/team/project/partner only when nothing
depends on it any more (409 `resource_in_use` naming what is attached); DELETE of a key revokes it (the row
stays for audit) and is idempotent.
"""
from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admin_guard import PLATFORM_ADMIN, TENANT_ADMIN, AdminGuard
from gateway.errors import GatewayError
from gateway.identity.model import to_dict
from gateway.identity.directory import Directory, validate_id
from gateway.identity.service import IdentityService
from gateway.types import Principal


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def is_admin(p: Principal) -> bool:
    return "admin" in p.roles


def require_tenant(p: Principal, tenant: str) -> None:
    """Tenant isolation: a tenant admin acts only within its own tenant."""
    if not is_admin(p) and p.tenant != tenant:
        raise GatewayError(403, "You may not access this tenant.", code="tenant_forbidden")


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise GatewayError(400, "Request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise GatewayError(400, "Request body must be a JSON object.", code="invalid_request")
    return data


def _not_found(what: str) -> GatewayError:
    return GatewayError(404, f"{what} not found.", code="not_found")


def _deleted(obj: str, **ids: str) -> dict[str, Any]:
    """OpenAI's delete response shape: {"id", "object", "deleted": true} (+ the parent ids of the record)."""
    return {**ids, "object": obj, "deleted": True}


def _team_path(req: Request, p: Principal) -> tuple[str, str]:
    tid = req.path_params["tenant"]
    require_tenant(p, tid)
    return tid, req.path_params["team"]


def _project_path(req: Request, p: Principal) -> tuple[str, str, str]:
    tid, team = _team_path(req, p)
    return tid, team, req.path_params["project"]


def _tenant_of(req: Request, p: Principal, b: dict[str, Any] | None = None) -> str:
    """The tenant a project or key request acts in: the body's, the query's, or a tenant admin's own."""
    tid = (b or {}).get("tenant") or req.query_params.get("tenant") or (None if is_admin(p) else p.tenant)
    if not isinstance(tid, str) or not tid:
        raise GatewayError(400, "tenant is required.", code="invalid_request", param="tenant")
    require_tenant(p, tid)
    return tid


_PLATFORM = (PLATFORM_ADMIN,)
_BOTH = (PLATFORM_ADMIN, TENANT_ADMIN)


class _Tenants:
    """/admin/tenants: created, changed and deleted by platform admins; a tenant admin reads its own."""

    def __init__(self, service: Directory) -> None:
        self.service = service

    async def list_tenants(self, req: Request, p: Principal) -> Any:
        if is_admin(p):
            ts = await self.service.list_tenants()
        else:
            t = await self.service.get_tenant(p.tenant)
            ts = [t] if t else []
        return {"object": "list", "data": [to_dict(t) for t in ts]}

    async def create_tenant(self, req: Request, p: Principal) -> Any:
        b = await _body(req)
        # ids are validated here, as the service would (same errors), so what it is given is a str
        t = await self.service.create_tenant(validate_id(b.get("id"), "id"), b.get("name"), b.get("labels"))
        return _json(to_dict(t), 201)

    async def get_tenant(self, req: Request, p: Principal) -> Any:
        tid = req.path_params["tenant"]
        require_tenant(p, tid)
        t = await self.service.get_tenant(tid)
        if t is None:
            raise _not_found("Tenant")
        return to_dict(t)

    async def patch_tenant(self, req: Request, p: Principal) -> Any:
        tid = req.path_params["tenant"]
        t = await self.service.update_tenant(tid, await _body(req))
        if t is None:
            raise _not_found("Tenant")
        return to_dict(t)

    async def delete_tenant(self, req: Request, p: Principal) -> Any:
        tid = req.path_params["tenant"]
        if not await self.service.delete_tenant(tid):
            raise _not_found("Tenant")
        return _deleted("tenant", id=tid)


def _tenant_routes(service: IdentityService, guard: AdminGuard) -> list[Route]:
    h = _Tenants(service.directory)
    return [
        guard.route("/admin/tenants", h.list_tenants, ["GET"], _BOTH),
        guard.route("/admin/tenants", h.create_tenant, ["POST"], _PLATFORM),
        guard.route("/admin/tenants/{tenant}", h.get_tenant, ["GET"], _BOTH),
        guard.route("/admin/tenants/{tenant}", h.patch_tenant, ["PATCH"], _PLATFORM),
        guard.route("/admin/tenants/{tenant}", h.delete_tenant, ["DELETE"], _PLATFORM),
    ]


class _Teams:
    """/admin/tenants/{tenant}/teams: managed by platform admins and the tenant's own admins."""

    def __init__(self, service: Directory) -> None:
        self.service = service

    async def list_teams(self, req: Request, p: Principal) -> Any:
        tid = req.path_params["tenant"]
        require_tenant(p, tid)
        return {"object": "list", "data": [to_dict(t) for t in await self.service.list_teams(tid)]}

    async def create_team(self, req: Request, p: Principal) -> Any:
        tid = req.path_params["tenant"]
        require_tenant(p, tid)
        b = await _body(req)
        t = await self.service.create_team(tid, validate_id(b.get("id"), "id"), b.get("name"), b.get("labels"))
        return _json(to_dict(t), 201)

    async def get_team(self, req: Request, p: Principal) -> Any:
        t = await self.service.get_team(*_team_path(req, p))
        if t is None:
            raise _not_found("Team")
        return to_dict(t)

    async def patch_team(self, req: Request, p: Principal) -> Any:
        tid, team = _team_path(req, p)
        t = await self.service.update_team(tid, team, await _body(req))
        if t is None:
            raise _not_found("Team")
        return to_dict(t)

    async def delete_team(self, req: Request, p: Principal) -> Any:
        tid, team = _team_path(req, p)
        if not await self.service.delete_team(tid, team):
            raise _not_found("Team")
        return _deleted("team", id=team, tenant=tid)


def _team_routes(service: IdentityService, guard: AdminGuard) -> list[Route]:
    h = _Teams(service.directory)
    return [
        guard.route("/admin/tenants/{tenant}/teams", h.list_teams, ["GET"], _BOTH),
        guard.route("/admin/tenants/{tenant}/teams", h.create_team, ["POST"], _BOTH),
        guard.route("/admin/tenants/{tenant}/teams/{team}", h.get_team, ["GET"], _BOTH),
        guard.route("/admin/tenants/{tenant}/teams/{team}", h.patch_team, ["PATCH"], _BOTH),
        guard.route("/admin/tenants/{tenant}/teams/{team}", h.delete_team, ["DELETE"], _BOTH),
    ]


class _Projects:
    """Projects: by path under their team, listed and created under /admin/projects."""

    def __init__(self, service: Directory) -> None:
        self.service = service

    async def list_projects(self, req: Request, p: Principal) -> Any:
        tid = _tenant_of(req, p)
        ps = await self.service.list_projects(tid, req.query_params.get("team"))
        return {"object": "list", "data": [to_dict(x) for x in ps]}

    async def create_project(self, req: Request, p: Principal) -> Any:
        b = await _body(req)
        tid = _tenant_of(req, p, b)
        team = validate_id(b.get("team"), "team")
        x = await self.service.create_project(tid, team, validate_id(b.get("id"), "id"), b.get("name"),
                                              b.get("labels"))
        return _json(to_dict(x), 201)

    async def get_project(self, req: Request, p: Principal) -> Any:
        x = await self.service.get_project(*_project_path(req, p))
        if x is None:
            raise _not_found("Project")
        return to_dict(x)

    async def patch_project(self, req: Request, p: Principal) -> Any:
        tid, team, pid = _project_path(req, p)
        x = await self.service.update_project(tid, team, pid, await _body(req))
        if x is None:
            raise _not_found("Project")
        return to_dict(x)

    async def delete_project(self, req: Request, p: Principal) -> Any:
        tid, team, pid = _project_path(req, p)
        if not await self.service.delete_project(tid, team, pid):
            raise _not_found("Project")
        return _deleted("project", id=pid, tenant=tid, team=team)


def _project_routes(service: IdentityService, guard: AdminGuard) -> list[Route]:
    h = _Projects(service.directory)
    path = "/admin/tenants/{tenant}/teams/{team}/projects/{project}"
    return [
        guard.route(path, h.get_project, ["GET"], _BOTH),
        guard.route(path, h.patch_project, ["PATCH"], _BOTH),
        guard.route(path, h.delete_project, ["DELETE"], _BOTH),
        guard.route("/admin/projects", h.list_projects, ["GET"], _BOTH),
        guard.route("/admin/projects", h.create_project, ["POST"], _BOTH),
    ]


class _Partners:
    """/admin/partners: changed by platform admins; a tenant admin sees its own tenant's (others' are 404)."""

    def __init__(self, service: Directory) -> None:
        self.service = service

    async def list_partners(self, req: Request, p: Principal) -> Any:
        ps = await self.service.list_partners(None if is_admin(p) else p.tenant)
        return {"object": "list", "data": [to_dict(x) for x in ps]}

    async def create_partner(self, req: Request, p: Principal) -> Any:
        b = await _body(req)
        pid = validate_id(b.get("id"), "id")
        x = await self.service.create_partner(pid, validate_id(b.get("tenant") or pid, "tenant"), b.get("name"),
                                              b.get("labels"))
        return _json(to_dict(x), 201)

    async def get_partner(self, req: Request, p: Principal) -> Any:
        x = await self.service.get_partner(req.path_params["partner"])
        if x is None or (not is_admin(p) and x.tenant != p.tenant):
            raise _not_found("Partner")
        return to_dict(x)

    async def patch_partner(self, req: Request, p: Principal) -> Any:
        x = await self.service.update_partner(req.path_params["partner"], await _body(req))
        if x is None:
            raise _not_found("Partner")
        return to_dict(x)

    async def delete_partner(self, req: Request, p: Principal) -> Any:
        pid = req.path_params["partner"]
        if not await self.service.delete_partner(pid):
            raise _not_found("Partner")
        return _deleted("partner", id=pid)


def _partner_routes(service: IdentityService, guard: AdminGuard) -> list[Route]:
    h = _Partners(service.directory)
    return [
        guard.route("/admin/partners", h.list_partners, ["GET"], _BOTH),
        guard.route("/admin/partners", h.create_partner, ["POST"], _PLATFORM),
        guard.route("/admin/partners/{partner}", h.get_partner, ["GET"], _BOTH),
        guard.route("/admin/partners/{partner}", h.patch_partner, ["PATCH"], _PLATFORM),
        guard.route("/admin/partners/{partner}", h.delete_partner, ["DELETE"], _PLATFORM),
    ]


class _Keys:
    """/admin/keys: a tenant admin manages its own tenant's keys (another tenant's key id is 404)."""

    def __init__(self, service: Directory) -> None:
        self.service = service

    async def list_keys(self, req: Request, p: Principal) -> Any:
        tid = req.query_params.get("tenant")
        if tid is not None:
            require_tenant(p, tid)
        elif not is_admin(p):
            tid = p.tenant
        return {"object": "list", "data": [k.public() for k in await self.service.list_keys(tid)]}

    async def create_key(self, req: Request, p: Principal) -> Any:
        b = await _body(req)
        tid = _tenant_of(req, p, b)
        k, secret = await self.service.create_key(
            tid, team=b.get("team"), project=b.get("project"), partner=b.get("partner"), name=b.get("name"),
            purpose=b.get("purpose") or "data", labels=b.get("labels"), scopes=b.get("scopes"),
            models=b.get("models"), expires_at=b.get("expires_at"))
        return _json({**k.public(), "key": secret}, 201)

    async def _own_key(self, req: Request, p: Principal) -> str:
        kid = req.path_params["key_id"]
        k = await self.service.get_key(kid)
        if k is None or (not is_admin(p) and k.tenant != p.tenant):
            raise _not_found("Key")
        return kid

    async def get_key(self, req: Request, p: Principal) -> Any:
        kid = await self._own_key(req, p)
        k = await self.service.get_key(kid)
        assert k is not None
        return k.public()

    async def patch_key(self, req: Request, p: Principal) -> Any:
        kid = await self._own_key(req, p)
        k = await self.service.update_key(kid, await _body(req))
        if k is None:
            raise _not_found("Key")
        return k.public()

    async def revoke_key(self, req: Request, p: Principal) -> Any:  # POST .../revoke and DELETE: idempotent
        kid = await self._own_key(req, p)
        k = await self.service.revoke_key(kid)
        assert k is not None
        return k.public()

    async def rotate_key(self, req: Request, p: Principal) -> Any:
        kid = await self._own_key(req, p)
        b = await _body(req)
        overlap = b.get("overlap_s")
        if overlap is not None and not isinstance(overlap, (int, float)):
            raise GatewayError(400, "overlap_s must be a number.", code="invalid_request", param="overlap_s")
        res = await self.service.rotate_key(kid, overlap)
        if res is None:
            raise GatewayError(409, "Key is revoked or already rotated.", code="conflict")
        k, secret = res
        return _json({**k.public(), "key": secret}, 201)


def _key_routes(service: IdentityService, guard: AdminGuard) -> list[Route]:
    h = _Keys(service.directory)
    return [
        guard.route("/admin/keys", h.list_keys, ["GET"], _BOTH),
        guard.route("/admin/keys", h.create_key, ["POST"], _BOTH),
        guard.route("/admin/keys/{key_id}", h.get_key, ["GET"], _BOTH),
        guard.route("/admin/keys/{key_id}", h.patch_key, ["PATCH"], _BOTH),
        guard.route("/admin/keys/{key_id}", h.revoke_key, ["DELETE"], _BOTH),
        guard.route("/admin/keys/{key_id}/revoke", h.revoke_key, ["POST"], _BOTH),
        guard.route("/admin/keys/{key_id}/rotate", h.rotate_key, ["POST"], _BOTH),
    ]


def admin_routes(service: IdentityService, guard: AdminGuard | None = None) -> list[Route]:
    """Starlette routes for the admin plane, to mount under the app (behind `guard`; by default one that
    authenticates with `service` and bounds bodies by its config's `server.max_body_bytes`). Each route
    declares the roles it admits (the guard enforces them; handlers scope to the tenant)."""
    if guard is None:
        guard = AdminGuard(service.authenticate_admin, lambda: service.config.server.max_body_bytes)
    return [*_tenant_routes(service, guard), *_team_routes(service, guard), *_project_routes(service, guard),
            *_partner_routes(service, guard), *_key_routes(service, guard)]
