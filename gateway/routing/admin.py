"""GET /admin/routing: the router's learned per-engine parameters, prediction error and admission counters."""
from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.errors import GatewayError


def routing_admin_route(gw: Any, stage: Any) -> Route:
    """A Starlette route behind the gateway's admin authentication."""

    async def endpoint(request: Request) -> Response:
        try:
            await gw.admin_auth(request.headers)
        except GatewayError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        return JSONResponse(stage.snapshot())

    return Route("/admin/routing", endpoint, methods=["GET"])
