"""The one authorization point of the admin plane: every /admin/* route is built by `AdminGuard.route`, which
declares the roles it admits, and the guard alone authenticates and authorizes it.

Per request the guard: authenticates the admin credential with the client address (so the failed-login
limiter counts per address), admits only the declared roles (403 `admin_required` otherwise), confines a
tenant admin to the tenant a `{tenant}` path parameter names (403 `tenant_forbidden`), reads the body within
`server.max_body_bytes` (413), and answers every refusal OpenAI-shaped with `x-request-id` and, on 429/503,
`Retry-After`. The handler receives `(request, principal)` and scopes what it returns to that principal (a
tenant admin sees its own tenant's records only; others' ids are 404).

Roles: `PLATFORM_ADMIN` (the config admin key), `TENANT_ADMIN` (a stored `purpose: admin` key, within its
tenant), `PUBLIC` (no credential: only the dashboard's page shell, which carries no data). A route without a
declared role cannot be built; `declared_roles(route)` reads the declaration back (the route table test).
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Final, Iterable, Literal, Mapping, overload

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api.reply import request_id
from gateway.errors import GatewayError, retry_headers
from gateway.types import Principal

PLATFORM_ADMIN: Final = "admin"
TENANT_ADMIN: Final = "tenant_admin"
PUBLIC: Final = "public"
ROLES = frozenset({PLATFORM_ADMIN, TENANT_ADMIN, PUBLIC})

Authenticate = Callable[[Mapping[str, str], str], Awaitable[Principal]]
# A handler gets the authenticated principal; one of a PUBLIC route (no credential) gets None.
Handler = Callable[[Request, Principal], Awaitable[Any]]
PublicHandler = Callable[[Request, None], Awaitable[Any]]
_AnyHandler = Callable[[Request, Any], Awaitable[Any]]  # either: the route's roles say which argument it gets


def client_address(request: Request) -> str:
    """The peer address as the server saw it (uvicorn rewrites it from X-Forwarded-For only for the
    configured `server.trusted_proxies`)."""
    return request.client.host if request.client else ""


def error_response(e: GatewayError, rid: str | None = None) -> Response:
    headers = dict(e.headers)
    if e.status in (429, 503) and "retry-after" not in {k.lower() for k in headers}:
        headers.update(retry_headers(1.0))
    if rid:
        headers["x-request-id"] = rid
    return Response(e.to_bytes(), status_code=e.status, media_type="application/json", headers=headers)


def json_response(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json", headers=dict(headers or {}))


async def read_limited(request: Request, limit: int) -> bytes:
    """The request body, refusing (413 `request_too_large`) past `limit` bytes, declared or streamed."""
    cl = request.headers.get("content-length")
    if cl is not None and cl.strip().isdigit() and int(cl) > limit:
        raise GatewayError(413, f"Request body is larger than the limit of {limit} bytes.", code="request_too_large")
    size = 0
    chunks: list[bytes] = []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"Request body is larger than the limit of {limit} bytes.",
                               code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class AdminRoute(Route):
    """A route `AdminGuard.route` built: its handler runs behind the guard, for the roles it was declared with."""

    def __init__(self, path: str, endpoint: Callable[[Request], Awaitable[Response]], methods: list[str],
                 roles: frozenset[str]) -> None:
        super().__init__(path, endpoint, methods=methods)
        self.roles = roles


def declared_roles(route: Any) -> frozenset[str] | None:
    """The roles a route was declared with by `AdminGuard.route`, or None for a route built some other way."""
    return route.roles if isinstance(route, AdminRoute) else None


class AdminGuard:
    """Builds guarded admin routes. `authenticate(headers, client_addr)` returns the admin principal or raises
    GatewayError (401/403/429); `max_body_bytes()` is read per request so a reload applies at once."""

    def __init__(self, authenticate: Authenticate, max_body_bytes: Callable[[], int],
                 request_id: Callable[[Mapping[str, str]], str] | None = None) -> None:
        self.authenticate = authenticate
        self.max_body_bytes = max_body_bytes
        self.request_id = request_id

    @overload
    def route(self, path: str, handler: PublicHandler, methods: Iterable[str],
              roles: tuple[Literal["public"]]) -> Route: ...

    @overload
    def route(self, path: str, handler: Handler, methods: Iterable[str], roles: Iterable[str]) -> Route: ...

    def route(self, path: str, handler: _AnyHandler, methods: Iterable[str], roles: Iterable[str]) -> Route:
        if not path.startswith("/admin"):
            raise ValueError(f"{path}: the admin guard only builds /admin routes")
        declared = frozenset(roles)
        if not declared or not declared <= ROLES or (PUBLIC in declared and len(declared) > 1):
            raise ValueError(f"{path}: roles must be PUBLIC alone or a non-empty subset of {sorted(ROLES - {PUBLIC})}")
        return AdminRoute(path, self._endpoint(handler, declared), list(methods), declared)

    def _endpoint(self, handler: _AnyHandler, roles: frozenset[str]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            rid = self.request_id(request.headers) if self.request_id is not None else None
            try:
                principal: Principal | None = None
                if PUBLIC not in roles:
                    principal = await self.authenticate(request.headers, client_address(request))
                    self.authorize(principal, roles, request)
                if request.method in ("POST", "PUT", "PATCH", "DELETE"):
                    # Starlette's Request.body() returns this cached copy, so handlers read the bounded body.
                    request._body = await read_limited(request, self.max_body_bytes())
                result = await handler(request, principal)
            except GatewayError as e:
                return error_response(e, rid)
            if isinstance(result, Response):
                if rid and "x-request-id" not in result.headers:
                    result.headers["x-request-id"] = rid
                return result
            return json_response(result, headers={"x-request-id": rid} if rid else None)

        return endpoint

    @staticmethod
    def authorize(p: Principal, roles: frozenset[str], request: Request) -> None:
        if PLATFORM_ADMIN in p.roles:
            if PLATFORM_ADMIN in roles:
                return
        elif TENANT_ADMIN in p.roles and TENANT_ADMIN in roles:
            tenant = request.path_params.get("tenant")
            if tenant is not None and tenant != p.tenant:
                raise GatewayError(403, "You may not access this tenant.", code="tenant_forbidden")
            return
        raise GatewayError(403, "Only platform admins may do this.", code="admin_required")


def gateway_guard(gw: Any) -> AdminGuard:
    """The guard of a Gateway: its identity service authenticates (503 `identity_unavailable` without one)."""
    guard = gw.admin_guard
    if guard is not None:
        return guard

    async def authenticate(headers: Mapping[str, str], addr: str) -> Principal:
        svc = gw.identity
        if svc is None:
            return await gw.admin_auth(headers, addr)  # the Gateway's placeholder: 503 until identity is wired
        return await svc.authenticate_admin(headers, addr)

    guard = AdminGuard(authenticate, lambda: gw.config.server.max_body_bytes, request_id)
    gw.admin_guard = guard
    return guard
