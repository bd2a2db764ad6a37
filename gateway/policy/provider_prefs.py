"""Per-request provider preferences, OpenRouter-style and tighten-only: a request body's
`provider: {zdr, data_collection, ...}` can narrow what policy allows for this one request, never widen it.

Stage "provider_prefs", right after "decide": `zdr: true` or `data_collection: "deny"` make the decision's
retention zero (only zero-retention backends, on the first try, retries and fallbacks; no content in audit,
logs or spans), whatever the policy said. `zdr: false`, `data_collection: "allow"` and `allow_fallbacks: true`
ask for nothing policy does not already give, so they change nothing (a policy's zero retention stays zero).

`only`, `ignore`, `order` and `allow_fallbacks: false` would need the router to read a per-request backend set;
it does not yet, so they are refused (400) rather than silently ignored: a client that asks for `only` must
not believe it got it. The field never reaches a backend: `gateway.proxy.forward.upstream_body` drops it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from gateway.errors import GatewayError
from gateway.pipeline import RequestContext

FIELD = "provider"
KNOWN = ("zdr", "data_collection", "allow_fallbacks", "only", "ignore", "order")
NOT_HONOURED = ("only", "ignore", "order")  # need routing to read an allowed-backend set (not wired)


def _bad(message: str, param: str) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_provider_preferences")


def parse_preferences(prefs: Any) -> dict[str, Any]:
    """Validate `provider` and return what it asks for ({"zero_retention": bool}); raises a 400 naming the
    field for a bad value or a preference the gateway cannot honour."""
    if not isinstance(prefs, dict):
        raise _bad("'provider' must be an object of provider preferences.", FIELD)
    unknown = sorted(set(prefs) - set(KNOWN))
    if unknown:
        raise _bad(f"Unknown provider preference(s): {', '.join(unknown)}; supported: zdr, data_collection, "
                   "allow_fallbacks (true).", f"{FIELD}.{unknown[0]}")
    for k in NOT_HONOURED:
        if k in prefs and prefs[k] not in (None, []):
            raise _bad(f"provider.{k} is not supported by this gateway (backends are chosen by policy and "
                       "routing); use zdr or data_collection to narrow retention.", f"{FIELD}.{k}")
    zdr = prefs.get("zdr")
    if zdr is not None and not isinstance(zdr, bool):
        raise _bad("provider.zdr must be a boolean.", f"{FIELD}.zdr")
    dc = prefs.get("data_collection")
    if dc is not None and dc not in ("allow", "deny"):
        raise _bad("provider.data_collection must be 'allow' or 'deny'.", f"{FIELD}.data_collection")
    fb = prefs.get("allow_fallbacks")
    if fb is not None and not isinstance(fb, bool):
        raise _bad("provider.allow_fallbacks must be a boolean.", f"{FIELD}.allow_fallbacks")
    if fb is False:
        raise _bad("provider.allow_fallbacks: false is not supported by this gateway (a failed backend is "
                   "retried on another allowed one).", f"{FIELD}.allow_fallbacks")
    return {"zero_retention": zdr is True or dc == "deny"}


class ProviderPrefsStage:
    """Stage "provider_prefs": tighten ctx.decision with the request's provider preferences (never loosen)."""

    name = "provider_prefs"

    async def run(self, ctx: RequestContext) -> None:
        prefs = ctx.body.get(FIELD) if isinstance(ctx.body, dict) else None
        if prefs is None:
            return
        asked = parse_preferences(prefs)
        d = ctx.decision
        if d is None:  # "decide" runs first and always sets one; without it there is nothing to tighten
            raise GatewayError(503, "No policy decision to apply provider preferences to.", code="policy_unavailable")
        applied: list[str] = []
        if asked["zero_retention"] and d.retention != "zero":
            d = dataclasses.replace(d, retention="zero", retention_rule="request:provider")
            applied.append("retention: zero")
        ctx.decision = d
        ctx.evidence["provider_preferences"] = {"requested": {k: prefs[k] for k in KNOWN if k in prefs},
                                                "applied": applied}
        if applied:
            ctx.evidence["decision"] = d.to_evidence()

    async def finish(self, ctx: RequestContext) -> None:
        return None
