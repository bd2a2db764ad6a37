"""The `decide` pipeline stage: turn the principal and request into a Decision, refuse early on deny.

The policy comes from a zero-arg provider so a hot reload swaps the whole compiled snapshot between
requests; a request keeps the snapshot it started with.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from gateway.errors import GatewayError
from gateway.pipeline import RequestContext, RequestHeaders
from gateway.policy.engine import model_permitted, principal_models_permit
from gateway.policy.model import RequestAttrs
from gateway.types import Decision


def lower_headers(headers: Any) -> dict[str, str]:
    """A plain dict with lower-case names from starlette Headers, a dict, or None."""
    if not headers:
        return {}
    if type(headers) is RequestHeaders:  # already lower-case (the data plane's headers); read-only here
        return headers
    items = headers.items() if isinstance(headers, Mapping) or hasattr(headers, "items") else headers
    return {str(k).lower(): str(v) for k, v in items}


class PolicyStage:
    """Stage "decide": sets ctx.decision and ctx.evidence["decision"]; caps max_tokens; 403 on deny."""

    name = "decide"

    def __init__(self, policy_provider: Callable[[], Any]) -> None:
        self._provider = policy_provider

    async def run(self, ctx: RequestContext) -> None:
        p = ctx.principal
        if p is None:
            raise GatewayError(401, "authentication required before policy evaluation", code="unauthenticated")
        if p.allowed_models and not principal_models_permit(p.allowed_models, ctx.model):
            raise GatewayError(403, f"this key may not use model {ctx.model!r}", code="model_not_allowed",
                               param="model")
        attrs = RequestAttrs(model=ctx.model, headers=lower_headers(ctx.headers), max_tokens=ctx.max_tokens,
                             stream=ctx.stream, now=ctx.received_wall)
        policy = self._provider()
        adecide = getattr(policy, "adecide", None)
        d: Decision = await adecide(p, attrs) if adecide is not None else policy.decide(p, attrs)
        ctx.decision = d
        ctx.evidence["decision"] = d.to_evidence()
        if not d.allow:
            if d.deny_status == 403:
                raise GatewayError(403, f"denied by policy rule {d.deny_rule}: {d.reason}", code="policy_denied",
                                   extra={"rule": d.deny_rule})
            raise GatewayError(d.deny_status, f"policy decision unavailable ({d.deny_rule}): {d.reason}",
                               code="policy_unavailable", extra={"rule": d.deny_rule})
        cap = d.max_tokens_cap
        if cap is not None and (ctx.max_tokens is None or ctx.max_tokens > cap):
            ctx.evidence["max_tokens_capped"] = {"requested": ctx.max_tokens, "cap": cap}
            ctx.max_tokens = cap
            key = "max_completion_tokens" if "max_completion_tokens" in (ctx.body or {}) else "max_tokens"
            ctx.body_overrides[key] = cap
        if ctx.model_chain and (len(ctx.model_chain) > 1 or ctx.model_chain[0] != ctx.model):
            chain = self._filter_chain(policy, p, attrs, d, ctx.model_chain)
            if not chain:
                raise GatewayError(403, f"no model behind {ctx.model!r} is allowed by policy", code="model_not_allowed",
                                   param="model")
            if chain != ctx.model_chain:
                ctx.evidence["model_chain_dropped"] = [m for m in ctx.model_chain if m not in chain]
                ctx.model_chain = chain

    @staticmethod
    def _filter_chain(policy: Any, p: Any, attrs: RequestAttrs, d: Decision, chain: tuple[str, ...]) -> tuple[str, ...]:
        """Alias targets the key and the policy both allow (a synchronous policy re-decides per target)."""
        out = []
        for m in chain:
            if p.allowed_models and not principal_models_permit(p.allowed_models, m):
                continue
            if not model_permitted(d, m):
                continue
            decide = getattr(policy, "decide", None)
            if decide is not None and m != attrs.model and not getattr(policy, "is_remote", False):
                sub = decide(p, RequestAttrs(model=m, headers=attrs.headers, max_tokens=attrs.max_tokens,
                                             stream=attrs.stream, now=attrs.now))
                if not sub.allow:
                    continue
                # routing enforces the request's decision on every target; drop a target whose own rules are stricter
                if sub.allowed_countries is not None and (
                        d.allowed_countries is None or not d.allowed_countries <= sub.allowed_countries):
                    continue
                if sub.retention == "zero" and d.retention != "zero":
                    continue
            out.append(m)
        return tuple(out)

    async def finish(self, ctx: RequestContext) -> None:
        return None
