"""The `decide` pipeline stage: turn the principal and request into a Decision, refuse early on deny.

The policy comes from a zero-arg provider so a hot reload swaps the whole compiled snapshot between
requests; a request keeps the snapshot it started with.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from gateway.errors import GatewayError
from gateway.pipeline import RequestContext, RequestHeaders
from gateway.policy.engine import CompiledPolicy, model_permitted
from gateway.policy.model import RequestAttrs
from gateway.policy.provider_prefs import apply_provider_preferences
from gateway.types import Decision

if TYPE_CHECKING:
    from gateway.policy.opa import OPAPolicy


def lower_headers(headers: Any) -> dict[str, str]:
    """A plain dict with lower-case names from starlette Headers, a dict, or None."""
    if not headers:
        return {}
    if type(headers) is RequestHeaders:  # already lower-case (the data plane's headers); read-only here
        return headers
    items = headers.items() if isinstance(headers, Mapping) else headers
    return {str(k).lower(): str(v) for k, v in items}



def _max_tokens_key(ctx: RequestContext) -> str:
    """The body field a max_tokens override goes into (the endpoint's; chat: the one the client used)."""
    key = ctx.ep.max_tokens_key if ctx.ep is not None else None
    return key(ctx.body or {}) if key is not None else "max_tokens"


def _setting_rule(policy: CompiledPolicy | OPAPolicy, d: Decision, key: str) -> str:
    """The rule that set a single value of the decision, for messages and evidence."""
    return policy.setting_rule(d, key) or "(unknown)"


def _implied_max_tokens(ctx: RequestContext) -> int | None:
    """The completion length the engine will use: the request's max_tokens, else the endpoint's default (16 for
    /v1/completions), else None (chat: until the context or a stop ends it)."""
    return ctx.ep.implied_max_tokens(ctx.max_tokens) if ctx.ep is not None else ctx.max_tokens


class PolicyStage:
    """Stage "decide": sets ctx.decision and ctx.evidence["decision"]; caps max_tokens; 403 on deny; 400 when
    the request does not fit the decision's max_context."""

    name = "decide"

    def __init__(self, policy_provider: Callable[[], CompiledPolicy | OPAPolicy]) -> None:
        self._provider = policy_provider

    async def run(self, ctx: RequestContext) -> None:
        p = ctx.principal
        if p is None:
            raise GatewayError(401, "authentication required before policy evaluation", code="unauthenticated")
        # The key's own model list (Principal.allowed_models) is enforced once, by the authenticate stage
        # (gateway.identity.stage.model_allowed: the name, or every model an alias resolves to); checking it
        # here again, on the alias name only, refused aliases the key was allowed (issue 18).
        attrs = RequestAttrs(model=ctx.model, headers=lower_headers(ctx.headers), max_tokens=ctx.max_tokens,
                             stream=ctx.stream, now=ctx.received_wall)
        policy = self._provider()
        # the compiled policy decides in place (no coroutine per request); OPA is asked over HTTP
        d = policy.decide(p, attrs) if isinstance(policy, CompiledPolicy) else await policy.adecide(p, attrs)
        ctx.decision = d
        ctx.evidence["decision"] = d.to_evidence()
        if not d.allow:
            if d.deny_status == 403:
                raise GatewayError(403, f"denied by policy rule {d.deny_rule}: {d.reason}", code="policy_denied",
                                   extra={"rule": d.deny_rule})
            raise GatewayError(d.deny_status, f"policy decision unavailable ({d.deny_rule}): {d.reason}",
                               code="policy_unavailable", extra={"rule": d.deny_rule})
        apply_provider_preferences(ctx)  # the request's own provider: {zdr, data_collection}: tighten only
        d = ctx.decision or d
        client_max_tokens = ctx.max_tokens is not None
        cap = d.max_tokens_cap
        implied = _implied_max_tokens(ctx)  # completions' default of 16 is within any cap of 16 or more
        if cap is not None and (implied is None or implied > cap):
            ctx.evidence["max_tokens_capped"] = {"requested": ctx.max_tokens, "cap": cap}
            ctx.max_tokens = cap
            ctx.body_overrides[_max_tokens_key(ctx)] = cap
        if ctx.model_chain and (len(ctx.model_chain) > 1 or ctx.model_chain[0] != ctx.model):
            chain = self._filter_chain(policy, p, attrs, d, ctx.model_chain)
            if not chain:
                raise GatewayError(403, f"no model behind {ctx.model!r} is allowed by policy", code="model_not_allowed",
                                   param="model")
            if chain != ctx.model_chain:
                ctx.evidence["model_chain_dropped"] = [m for m in ctx.model_chain if m not in chain]
                ctx.model_chain = chain
        if d.max_context is not None:
            self._limit_context(ctx, policy, d, client_max_tokens)

    @staticmethod
    def _limit_context(ctx: RequestContext, policy: Any, d: Decision, client_max_tokens: bool) -> None:
        """Enforce `set.max_context`: estimated prompt tokens + max_tokens must fit (docs/policy.md).

        The prompt is counted with ctx.prompt_tokens_est (4 characters per token; exact for token-id prompts),
        not the byte-level upper bound the budget stage reserves with: that bound counts every byte as a token
        and would refuse ordinary English prompts at about a quarter of the limit. A max_tokens the client sent
        (after the max_tokens cap) that does not fit is a 400 `context_length_exceeded`; when the client sent
        none, the gateway picks the completion length (the cap, the engine default of 16 for completions, or
        for chat the rest of the context) and lowers it to what fits. Embeddings count the input only.
        """
        limit = int(d.max_context)  # type: ignore[arg-type]
        prompt = ctx.prompt_tokens_est
        room = limit - prompt  # completion tokens that still fit
        if not ctx.ep.generates:
            completion = 0
            if prompt <= limit:
                return
        elif client_max_tokens:
            completion = ctx.max_tokens or 0
            if room >= 1 and completion <= room:
                return
        else:  # the gateway picks the completion length: lower it to what fits
            completion = 0
            if room >= 1:
                implied = _implied_max_tokens(ctx)
                if implied is None or implied > room:
                    ctx.evidence["max_context"] = {
                        "rule": _setting_rule(policy, d, "max_context"), "max_context": limit,
                        "prompt_tokens_est": prompt, "max_tokens": implied, "outcome": "max_tokens_lowered",
                        "set_max_tokens": room}
                    ctx.max_tokens = room
                    ctx.body_overrides[_max_tokens_key(ctx)] = room
                return
        rule = _setting_rule(policy, d, "max_context")
        ctx.evidence["max_context"] = {"rule": rule, "max_context": limit, "prompt_tokens_est": prompt,
                                       "max_tokens": ctx.max_tokens, "requested_context": prompt + completion,
                                       "outcome": "refused"}
        if not ctx.ep.generates:
            msg = (f"This request's input is about {prompt} tokens (estimated), over the context limit of {limit} "
                   f"tokens set by policy rule {rule}.")
            param = ctx.ep.prompt_param
        elif room < 1:
            msg = (f"This request's prompt is about {prompt} tokens (estimated), which leaves no room for a "
                   f"completion within the context limit of {limit} tokens set by policy rule {rule}.")
            param = ctx.ep.prompt_param
        else:
            msg = (f"This request needs about {prompt + completion} tokens of context ({prompt} in the prompt, "
                   f"estimated, + {completion} max_tokens), over the limit of {limit} tokens set by policy rule "
                   f"{rule}. Lower max_tokens to at most {room} or shorten the prompt.")
            param = _max_tokens_key(ctx)
        raise GatewayError(400, msg, code="context_length_exceeded", param=param, extra={"rule": rule})

    @staticmethod
    def _filter_chain(policy: CompiledPolicy | OPAPolicy, p: Any, attrs: RequestAttrs, d: Decision,
                      chain: tuple[str, ...]) -> tuple[str, ...]:
        """Alias targets the policy allows (a synchronous policy re-decides per target). The key's own model list
        was checked by the authenticate stage, for the alias as a whole."""
        out = []
        for m in chain:
            if not model_permitted(d, m):
                continue
            if isinstance(policy, CompiledPolicy) and m != attrs.model:  # OPA is not asked once per target
                sub = policy.decide(p, RequestAttrs(model=m, headers=attrs.headers, max_tokens=attrs.max_tokens,
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
