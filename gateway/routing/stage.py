"""The route stage: candidate (backend, model) pairs for the request, filtered, then ordered by a strategy.

Filters run first and cannot be configured away: model served, residency/retention of the policy decision,
circuit state. Residency is a filter, never a score.
"""
from __future__ import annotations

import itertools
from typing import Callable

from gateway.config import Config
from gateway.errors import GatewayError, retry_headers
from gateway.pipeline import RequestContext
from gateway.proxy.health import Health
from gateway.routing.plan import Candidate, RoutePlan
from gateway.types import Decision


def residency_reason(decision: Decision | None, backend) -> str | None:
    """None when the backend may receive a request under this decision, else why not."""
    if decision is None:
        return None
    from gateway.policy.residency import backend_allowed

    return backend_allowed(decision, backend)


def candidates(config: Config, ctx: RequestContext, health: Health) -> RoutePlan:
    """Every (backend, model) pair that may serve this request, in alias-chain order, with drop reasons."""
    kept: list[Candidate] = []
    dropped: list[dict] = []
    for model in ctx.model_chain:
        for name in config.models.get(model, ()):
            b = config.backend(name)
            why, kind = residency_reason(ctx.decision, b), "residency"
            if why is None and not health.available(name):
                why, kind = "circuit open", "health"
            if why is None and ctx.endpoint == "embeddings" and "embeddings" not in b.capabilities:
                why, kind = "backend does not serve embeddings", "capability"
            if why is not None:
                dropped.append({"backend": name, "model": model, "reason": why, "filter": kind})
            else:
                kept.append(Candidate(backend=b, model=model))
    return RoutePlan(candidates=kept, dropped=dropped)


class RouteStage:
    """Builds the RoutePlan. Ordering within a model: round robin (the predictor-based picker replaces this)."""

    name = "route"

    def __init__(self, config: Callable[[], Config], health: Health) -> None:
        self._config = config
        self._health = health
        self._rr = itertools.count()

    async def run(self, ctx: RequestContext) -> None:
        if not ctx.model_chain:
            raise GatewayError(404, f"The model '{ctx.model}' does not exist or you do not have access to it.",
                               code="model_not_found", param="model")
        plan = candidates(self._config(), ctx, self._health)
        ctx.evidence["dropped"] = plan.dropped
        if not plan.candidates:
            d = ctx.decision
            if plan.dropped and d is not None and all(x["filter"] == "residency" for x in plan.dropped):
                rule = d.residency_rule or d.retention_rule
                raise GatewayError(403, f"No backend for '{ctx.model}' satisfies the residency/retention required by "
                                   f"rule '{rule}'.", code="residency_unsatisfiable")
            raise GatewayError(503, f"No backend is available for model '{ctx.model}'.", code="no_backend_available",
                               headers=retry_headers(1.0))
        # rotate within each model group so load spreads; fallback models stay after primary ones
        n = next(self._rr)
        first_model = plan.candidates[0].model
        primary = [c for c in plan.candidates if c.model == first_model]
        rest = [c for c in plan.candidates if c.model != first_model]
        k = n % len(primary)
        plan.candidates = primary[k:] + primary[:k] + rest
        ctx.route = plan
        ctx.evidence["candidates"] = [c.to_evidence() for c in plan.candidates]

    async def finish(self, ctx: RequestContext) -> None:
        return None
