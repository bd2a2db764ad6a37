"""Per-request provider preferences, OpenRouter-style and tighten-only: a request body's
`provider: {zdr, data_collection, ...}` can narrow what policy allows for this one request, never widen it.

Applied by the "decide" stage itself, as the last step of its decision (`apply_provider_preferences`), so
every later stage (the response cache's partition, budgets, routing, dispatch, evidence) sees only the
tightened decision, whatever order later stages are wired in: `zdr: true` or `data_collection: "deny"` make the
decision's retention zero (only zero-retention backends, on the first try, retries and fallbacks; no content in audit,
logs or spans), whatever the policy said. `zdr: false`, `data_collection: "allow"` and `allow_fallbacks: true`
ask for nothing policy does not already give, so they change nothing (a policy's zero retention stays zero).

`only` and `ignore` (backend names, or the operators `self` / `partner`) become hard filters of the
decision, applied with residency on the first try, retries and fallbacks: a request that leaves no backend
is refused (403), never sent elsewhere. `order` puts the listed backends first, in the client's order, ahead of
the router's own ranking (the others follow as fallbacks); it cannot reach a backend the filters exclude.
`allow_fallbacks: false` allows one attempt (with `order`: only the listed backends, in order, as OpenRouter
means it). The field never reaches a backend: `gateway.proxy.forward.upstream_body` drops it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from gateway.errors import GatewayError
from gateway.pipeline import RequestContext

FIELD = "provider"
KNOWN = ("zdr", "data_collection", "allow_fallbacks", "only", "ignore", "order")
MAX_NAMES = 64


def _bad(message: str, param: str) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_provider_preferences")


def parse_preferences(prefs: Any) -> dict[str, Any]:
    """Validate `provider` and return what it asks for ({"zero_retention", "only", "ignore", "no_fallbacks"});
    raises a 400 naming the field for a bad value or a preference the gateway cannot honour."""
    if not isinstance(prefs, dict):
        raise _bad("'provider' must be an object of provider preferences.", FIELD)
    unknown = sorted(set(prefs) - set(KNOWN))
    if unknown:
        raise _bad(f"Unknown provider preference(s): {', '.join(unknown)}; supported: zdr, data_collection, "
                   "only, ignore, order, allow_fallbacks.", f"{FIELD}.{unknown[0]}")
    zdr = prefs.get("zdr")
    if zdr is not None and not isinstance(zdr, bool):
        raise _bad("provider.zdr must be a boolean.", f"{FIELD}.zdr")
    dc = prefs.get("data_collection")
    if dc is not None and dc not in ("allow", "deny"):
        raise _bad("provider.data_collection must be 'allow' or 'deny'.", f"{FIELD}.data_collection")
    fb = prefs.get("allow_fallbacks")
    if fb is not None and not isinstance(fb, bool):
        raise _bad("provider.allow_fallbacks must be a boolean.", f"{FIELD}.allow_fallbacks")
    order = prefs.get("order")
    if order is not None:
        _names(prefs, "order")
        if len(set(order)) != len(order):
            raise _bad("provider.order must not name a backend twice.", f"{FIELD}.order")
    only = _names(prefs, "only")
    no_fallbacks = fb is False
    if no_fallbacks and order:  # OpenRouter's meaning: the listed providers, in order, and no others
        only = frozenset(order) if only is None else only & frozenset(order)
        no_fallbacks = False
    return {"zero_retention": zdr is True or dc == "deny", "only": only, "ignore": _names(prefs, "ignore"),
            "no_fallbacks": no_fallbacks, "order": tuple(order or ())}


def _names(prefs: dict[str, Any], key: str) -> frozenset[str] | None:
    """provider.only / ignore / order: a list of 1-64 non-empty strings (backend names or operators)."""
    v = prefs.get(key)
    if v is None:
        return None
    if (not isinstance(v, list) or not v or len(v) > MAX_NAMES
            or not all(isinstance(x, str) and 0 < len(x) <= 256 for x in v)):
        raise _bad(f"provider.{key} must be a list of 1-{MAX_NAMES} backend names (or the operators "
                   "'self' / 'partner').", f"{FIELD}.{key}")
    return frozenset(v)


def apply_provider_preferences(ctx: RequestContext) -> None:
    """Tighten ctx.decision with the body's `provider` preferences (never loosen); 400 for what cannot be
    honoured. Called by PolicyStage once the decision allows the request."""
    prefs = ctx.body.get(FIELD) if isinstance(ctx.body, dict) else None
    d = ctx.decision
    if prefs is None or d is None:
        return
    asked = parse_preferences(prefs)
    applied: list[str] = []
    if asked["zero_retention"] and d.retention != "zero":
        d = dataclasses.replace(d, retention="zero", retention_rule="request:provider")
        applied.append("retention: zero")
    only = asked["only"]
    if only is not None:  # intersect with any set already narrowed: never widen
        only = only if d.providers_only is None else only & d.providers_only
        d = dataclasses.replace(d, providers_only=only)
        applied.append("only: " + ",".join(sorted(only)))
    if asked["ignore"]:
        d = dataclasses.replace(d, providers_ignored=d.providers_ignored | asked["ignore"])
        applied.append("ignore: " + ",".join(sorted(asked["ignore"])))
    if asked["order"]:
        d = dataclasses.replace(d, providers_order=asked["order"])
        applied.append("order: " + ",".join(asked["order"]))
    if asked["no_fallbacks"] and not d.no_fallbacks:
        d = dataclasses.replace(d, no_fallbacks=True)
        applied.append("no fallbacks")
    ctx.decision = d
    ctx.evidence["provider_preferences"] = {"requested": {k: prefs[k] for k in KNOWN if k in prefs},
                                            "applied": applied}
    if applied:
        ctx.evidence["decision"] = d.to_evidence()
