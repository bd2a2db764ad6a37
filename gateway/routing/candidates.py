"""Candidates: the hard steps before any routing plugin, which no strategy can configure away.

Residency/retention of the policy decision, then health, then capability (`candidates`); partners as a route or
a spill only where policy allows (`split_partners`); the client's provider order after routing
(`client_order`); and the refusals when nothing is left (403 residency_unsatisfiable / 503).
"""
from __future__ import annotations

from gateway.config import Config
from gateway.adapters.placement import adapter_backends
from gateway.errors import GatewayError, retry_headers
from gateway.pipeline import RequestContext
from gateway.policy.residency import backend_allowed
from gateway.proxy.dialects import dialect_for
from gateway.proxy.health import Health
from gateway.routing.plan import Candidate, RoutePlan
from gateway.types import Decision


_SERVES: dict[tuple[str, str], bool] = {}  # (backend kind, endpoint name) -> its dialect serves it (static)


def kind_serves(kind: str, ep) -> bool:
    """Does a backend of this kind serve this endpoint at all (its dialect has an exchange for it)?"""
    key = (kind, ep.name)
    got = _SERVES.get(key)
    if got is None:
        got = _SERVES[key] = dialect_for(kind).serves(ep)
    return got


def require_model(ctx: RequestContext) -> None:
    """404 model_not_found when the request's model resolved to nothing this caller may use."""
    if not ctx.model_chain:
        raise GatewayError(404, f"The model '{ctx.model}' does not exist or you do not have access to it.",
                           code="model_not_found", param="model")


def residency_reason(decision: Decision | None, backend) -> str | None:
    """None when the backend may receive a request under this decision, else why not."""
    if decision is None:
        return None
    return backend_allowed(decision, backend)


def candidates(config: Config, ctx: RequestContext, health: Health) -> RoutePlan:
    """Every (backend, model) pair that may serve this request, in alias-chain order, with drop reasons."""
    kept: list[Candidate] = []
    dropped: list[dict] = []
    ep = ctx.ep
    need = ep.capability if ep is not None else None  # e.g. pooling APIs need a pooling model
    for model in ctx.model_chain:
        for b in adapter_backends(config, ctx, model):  # a registered adapter: the dynamic engines of its base
            name = b.name
            why, kind = residency_reason(ctx.decision, b), "residency"
            if why is None and not health.available(name):
                why, kind = "circuit open", "health"
            if why is None and need is not None and need not in b.capabilities:
                why, kind = f"backend does not serve {need}", "capability"
            if why is None and ep is not None and not kind_serves(b.kind, ep):  # e.g. /tokenize on openai
                why, kind = f"backend kind {b.kind} does not serve {ep.path}", "capability"
            if why is not None:
                dropped.append({"backend": name, "model": model, "reason": why, "filter": kind})
            else:
                kept.append(Candidate(backend=b, model=model))
    return RoutePlan(candidates=kept, dropped=dropped)


def client_order(cands: list[Candidate], order: tuple[str, ...]) -> list[Candidate]:
    """The request's `provider.order` applied to the routed list: candidates whose backend name (or operator)
    is listed come first, in the client's order; the rest keep the router's order behind them. Stable, so
    among one listed name (an operator naming several backends) the router's choice still leads."""
    if not order:
        return cands
    rank = {name: i for i, name in reversed(list(enumerate(order)))}

    def key(c: Candidate) -> int:
        return min(rank.get(c.backend.name, len(order)), rank.get(c.backend.operator or "", len(order)))

    return sorted(cands, key=key)


def has_own_engine(config: Config, model_chain: tuple[str, ...] | list[str]) -> bool:
    """Does any of our own (non-partner) backends serve a model of the chain, whatever its health or residency?
    Only a model with none is partner-only (partners are then its route, not a spill)."""
    for model in model_chain:
        for name in config.models.get(model, ()):
            if config.backend(name).operator != "partner":
                return True
    return False


def split_partners(config: Config, ctx: RequestContext, plan: RoutePlan) -> tuple[list[Candidate], list[Candidate]]:
    """(own candidates, partner spill candidates). A model no own backend serves has its partners as the
    route (own). Otherwise partners are spill candidates only under `decision.spill_to_partner`, else dropped
    (filter "spill") - also when every own engine is excluded or down: then the request is refused (403/503)."""
    own = [c for c in plan.candidates if c.backend.operator != "partner"]
    partners = [c for c in plan.candidates if c.backend.operator == "partner"]
    if not own and not has_own_engine(config, ctx.model_chain):
        return partners, []
    d = ctx.decision
    if partners and not (d is not None and d.spill_to_partner):
        for c in partners:
            plan.dropped.append({"backend": c.backend.name, "model": c.model,
                                 "reason": "spill to partner not allowed by policy", "filter": "spill"})
        partners = []
    if not own and not partners:
        plan.candidates = []
        raise no_candidates(ctx, plan)
    return own, partners


def residency_rules(d: Decision | None, dropped: list[dict]) -> list[str]:
    """The policy rules behind residency drops: the residency rule for location reasons, the retention rule
    for retention reasons (each named once, in that order)."""
    if d is None:
        return []
    reasons = [x["reason"] for x in dropped if x["filter"] == "residency"]
    out = []
    if d.residency_rule and any(r.startswith("residency") for r in reasons):
        out.append(d.residency_rule)
    if d.retention_rule and any(r.startswith("retention") for r in reasons) and d.retention_rule not in out:
        out.append(d.retention_rule)
    return out


def no_candidates(ctx: RequestContext, plan: RoutePlan) -> GatewayError:
    d = ctx.decision
    rules = residency_rules(d, plan.dropped)
    named = " and ".join(f"'{r}'" for r in rules) or "the policy"
    # partners dropped because policy allows no spill are neither unavailable nor excluded by residency
    drops = [x for x in plan.dropped if x["filter"] != "spill"]
    spill = (" Partner routes serve this model only where policy sets spill_to_partner."
             if len(drops) < len(plan.dropped) else "")
    if drops and all(x["filter"] == "capability" for x in drops):  # permanent: retrying cannot help
        ep = ctx.ep
        need = f" (it needs the '{ep.capability}' capability)" if ep.capability else ""
        return GatewayError(400, f"No backend serving '{ctx.model}' can serve {ep.path}{need}.", param="model",
                            code="model_not_supported")
    if drops and d is not None and all(x["filter"] == "residency" for x in drops):
        return GatewayError(403, f"No backend for '{ctx.model}' satisfies the residency/retention required by "
                            f"rule {named}.{spill}", code="residency_unsatisfiable")
    excluded = sum(1 for x in drops if x["filter"] == "residency")
    why = (f" ({excluded} other backend(s) are excluded by the residency/retention of rule {named}; the rest are "
           "unavailable right now)") if excluded else ""
    return GatewayError(503, f"No backend is available for model '{ctx.model}'.{why}{spill}",
                        code="no_backend_available", headers=retry_headers(1.0))
