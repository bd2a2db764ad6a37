"""Admin plane routes (/admin/...): CRUD for tenants, teams, projects, partners and keys.

Every route authenticates with `IdentityService.authenticate_admin`. Role "admin" sees everything;
"tenant_admin" sees only its own tenant: naming another tenant is 403, and a key id of another tenant is
404 (key ids are not confirmed to outsiders). Tenants and partners are created by platform admins only.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.errors import GatewayError
from gateway.identity.model import to_dict
from gateway.identity.service import IdentityService
from gateway.types import Principal

Handler = Callable[[Request, Principal], Awaitable[Any]]


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _error(e: GatewayError) -> Response:
    return Response(e.to_bytes(), status_code=e.status, media_type="application/json", headers=e.headers)


def is_admin(p: Principal) -> bool:
    return "admin" in p.roles


def require_admin(p: Principal) -> None:
    if not is_admin(p):
        raise GatewayError(403, "Only platform admins may do this.", code="admin_required")


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


def admin_routes(service: IdentityService) -> list[Route]:
    """Starlette routes for the admin plane, to mount under the app."""

    def wrap(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                addr = request.client.host if request.client else ""
                principal = await service.authenticate_admin(request.headers, addr)
                result = await handler(request, principal)
                if isinstance(result, Response):
                    return result
                return _json(result)
            except GatewayError as e:
                return _error(e)

        return endpoint

    # ---- tenants
    async def list_tenants(req: Request, p: Principal) -> Any:
        if is_admin(p):
            ts = await service.list_tenants()
        else:
            t = await service.get_tenant(p.tenant)
            ts = [t] if t else []
        return {"object": "list", "data": [to_dict(t) for t in ts]}

    async def create_tenant(req: Request, p: Principal) -> Any:
        require_admin(p)
        b = await _body(req)
        t = await service.create_tenant(b.get("id"), b.get("name") or "", b.get("labels"))
        return _json(to_dict(t), 201)

    async def get_tenant(req: Request, p: Principal) -> Any:
        tid = req.path_params["tenant"]
        require_tenant(p, tid)
        t = await service.get_tenant(tid)
        if t is None:
            raise _not_found("Tenant")
        return to_dict(t)

    async def patch_tenant(req: Request, p: Principal) -> Any:
        require_admin(p)
        tid = req.path_params["tenant"]
        b = await _body(req)
        t = await service.update_tenant_labels(tid, b.get("labels") or {})
        if t is None:
            raise _not_found("Tenant")
        return to_dict(t)

    # ---- teams
    async def list_teams(req: Request, p: Principal) -> Any:
        tid = req.path_params["tenant"]
        require_tenant(p, tid)
        return {"object": "list", "data": [to_dict(t) for t in await service.list_teams(tid)]}

    async def create_team(req: Request, p: Principal) -> Any:
        tid = req.path_params["tenant"]
        require_tenant(p, tid)
        b = await _body(req)
        t = await service.create_team(tid, b.get("id"), b.get("name") or "", b.get("labels"))
        return _json(to_dict(t), 201)

    # ---- projects
    def _tenant_of(req: Request, p: Principal, b: dict[str, Any] | None = None) -> str:
        tid = (b or {}).get("tenant") or req.query_params.get("tenant") or (None if is_admin(p) else p.tenant)
        if not isinstance(tid, str) or not tid:
            raise GatewayError(400, "tenant is required.", code="invalid_request", param="tenant")
        require_tenant(p, tid)
        return tid

    async def list_projects(req: Request, p: Principal) -> Any:
        tid = _tenant_of(req, p)
        ps = await service.list_projects(tid, req.query_params.get("team"))
        return {"object": "list", "data": [to_dict(x) for x in ps]}

    async def create_project(req: Request, p: Principal) -> Any:
        b = await _body(req)
        tid = _tenant_of(req, p, b)
        x = await service.create_project(tid, b.get("team"), b.get("id"), b.get("name") or "", b.get("labels"))
        return _json(to_dict(x), 201)

    # ---- partners
    async def list_partners(req: Request, p: Principal) -> Any:
        ps = await service.list_partners(None if is_admin(p) else p.tenant)
        return {"object": "list", "data": [to_dict(x) for x in ps]}

    async def create_partner(req: Request, p: Principal) -> Any:
        require_admin(p)
        b = await _body(req)
        x = await service.create_partner(b.get("id"), b.get("tenant") or b.get("id"), b.get("name") or "",
                                         b.get("labels"))
        return _json(to_dict(x), 201)

    # ---- keys
    async def list_keys(req: Request, p: Principal) -> Any:
        tid = req.query_params.get("tenant")
        if tid is not None:
            require_tenant(p, tid)
        elif not is_admin(p):
            tid = p.tenant
        return {"object": "list", "data": [k.public() for k in await service.list_keys(tid)]}

    async def create_key(req: Request, p: Principal) -> Any:
        b = await _body(req)
        tid = _tenant_of(req, p, b)
        k, secret = await service.create_key(
            tid, team=b.get("team"), project=b.get("project"), partner=b.get("partner"), name=b.get("name") or "",
            purpose=b.get("purpose") or "data", labels=b.get("labels"), scopes=b.get("scopes"),
            models=b.get("models"), expires_at=b.get("expires_at"))
        return _json({**k.public(), "key": secret}, 201)

    async def _own_key(req: Request, p: Principal) -> str:
        kid = req.path_params["key_id"]
        k = await service.get_key(kid)
        if k is None or (not is_admin(p) and k.tenant != p.tenant):
            raise _not_found("Key")
        return kid

    async def get_key(req: Request, p: Principal) -> Any:
        kid = await _own_key(req, p)
        k = await service.get_key(kid)
        assert k is not None
        return k.public()

    async def revoke_key(req: Request, p: Principal) -> Any:
        kid = await _own_key(req, p)
        k = await service.revoke_key(kid)
        assert k is not None
        return k.public()

    async def rotate_key(req: Request, p: Principal) -> Any:
        kid = await _own_key(req, p)
        b = await _body(req)
        overlap = b.get("overlap_s")
        if overlap is not None and not isinstance(overlap, (int, float)):
            raise GatewayError(400, "overlap_s must be a number.", code="invalid_request", param="overlap_s")
        res = await service.rotate_key(kid, overlap)
        if res is None:
            raise GatewayError(409, "Key is revoked or already rotated.", code="conflict")
        k, secret = res
        return _json({**k.public(), "key": secret}, 201)

    return [
        Route("/admin/tenants", wrap(list_tenants), methods=["GET"]),
        Route("/admin/tenants", wrap(create_tenant), methods=["POST"]),
        Route("/admin/tenants/{tenant}", wrap(get_tenant), methods=["GET"]),
        Route("/admin/tenants/{tenant}", wrap(patch_tenant), methods=["PATCH"]),
        Route("/admin/tenants/{tenant}/teams", wrap(list_teams), methods=["GET"]),
        Route("/admin/tenants/{tenant}/teams", wrap(create_team), methods=["POST"]),
        Route("/admin/projects", wrap(list_projects), methods=["GET"]),
        Route("/admin/projects", wrap(create_project), methods=["POST"]),
        Route("/admin/partners", wrap(list_partners), methods=["GET"]),
        Route("/admin/partners", wrap(create_partner), methods=["POST"]),
        Route("/admin/keys", wrap(list_keys), methods=["GET"]),
        Route("/admin/keys", wrap(create_key), methods=["POST"]),
        Route("/admin/keys/{key_id}", wrap(get_key), methods=["GET"]),
        Route("/admin/keys/{key_id}/revoke", wrap(revoke_key), methods=["POST"]),
        Route("/admin/keys/{key_id}/rotate", wrap(rotate_key), methods=["POST"]),
    ]
