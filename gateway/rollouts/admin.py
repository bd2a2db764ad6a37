"""`/admin/aliases`: the live state of each weighted alias (platform admins: aliases are the platform's).

GET /admin/aliases                     every weighted alias: arms, live and config weights, rollbacks, window stats
GET /admin/aliases/{alias}             one
PATCH /admin/aliases/{alias}           {"weights": {"<arm model>": <number >= 0>, ...}}: set live weights (an arm
                                       given a weight is no longer rolled back)
POST /admin/aliases/{alias}/reset      drop the live state: the config's weights, nothing rolled back
"""
from __future__ import annotations

import math
from typing import Any

import orjson
from starlette.requests import Request
from starlette.routing import Route

from gateway.admin_guard import PLATFORM_ADMIN, AdminGuard
from gateway.errors import GatewayError
from gateway.rollouts.service import RolloutService
from gateway.types import Principal


def _bad(msg: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, msg, code="invalid_request", param=param)


def parse_weights(body: bytes, arms: tuple[str, ...]) -> dict[str, float]:
    """The weights of a PATCH body, or a 400 naming what is wrong."""
    try:
        doc = orjson.loads(body or b"null")
    except orjson.JSONDecodeError:
        raise _bad("The body is not valid JSON.") from None
    if not isinstance(doc, dict) or set(doc) != {"weights"} or not isinstance(doc["weights"], dict) \
            or not doc["weights"]:
        raise _bad('The body must be {"weights": {"<arm model>": <weight>, ...}}.', "weights")
    out: dict[str, float] = {}
    for k, v in doc["weights"].items():
        if k not in arms:
            raise _bad(f"{k!r} is not an arm of this alias (arms: {', '.join(arms)}).", f"weights.{k}"[:200])
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise _bad("A weight must be a finite number >= 0.", f"weights.{k}")
        out[k] = float(v)
    return out


def alias_admin_routes(svc: RolloutService, guard: AdminGuard) -> list[Route]:
    def find(request: Request) -> str:
        alias = request.path_params["alias"]
        if alias not in svc.rollouts:
            raise GatewayError(404, f"No weighted alias {alias!r}.", code="not_found", param="alias")
        return alias

    def need_store() -> None:
        if svc.store is None:
            raise GatewayError(503, "The identity store is not available.", code="identity_unavailable")

    async def list_aliases(request: Request, p: Principal) -> Any:
        return {"object": "list", "data": [svc.view(a) for a in sorted(svc.rollouts)]}

    async def get_alias(request: Request, p: Principal) -> Any:
        return svc.view(find(request))

    async def patch_alias(request: Request, p: Principal) -> Any:
        alias = find(request)
        weights = parse_weights(await request.body(), svc.rollouts[alias].arms)
        st = svc.state(alias)
        if sum({**st.weights, **weights}.values()) <= 0:
            raise _bad("At least one arm needs a weight > 0.", "weights")
        need_store()
        await svc.set_weights(alias, weights)
        return svc.view(alias)

    async def reset_alias(request: Request, p: Principal) -> Any:
        alias = find(request)
        need_store()
        await svc.reset(alias)
        return svc.view(alias)

    admin = (PLATFORM_ADMIN,)
    return [guard.route("/admin/aliases", list_aliases, ["GET"], admin),
            guard.route("/admin/aliases/{alias}", get_alias, ["GET"], admin),
            guard.route("/admin/aliases/{alias}", patch_alias, ["PATCH"], admin),
            guard.route("/admin/aliases/{alias}/reset", reset_alias, ["POST"], admin)]
