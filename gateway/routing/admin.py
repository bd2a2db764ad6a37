"""GET /admin/routing: the router's learned per-engine parameters, each engine's view (own and the other replicas'
flights), prediction error, admission counters and, with the peer bus on, its `peers` section (peers.py)."""
from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin_guard import PLATFORM_ADMIN, gateway_guard


def routing_admin_route(gw: Any, stage: Any) -> Route:
    """A Starlette route behind the gateway's admin guard (platform admins only: it describes the whole fleet)."""

    async def endpoint(request: Request, principal: Any) -> Response:
        return JSONResponse(stage.snapshot())

    return gateway_guard(gw).route("/admin/routing", endpoint, ["GET"], (PLATFORM_ADMIN,))
