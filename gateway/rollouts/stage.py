"""The rollout stage (after authenticate): a request to a weighted alias gets the chain its sticky key hashes to,
the chosen arm first, the other arms after it as fallbacks; on finish the chosen arm's outcome feeds the
rollback watch."""
from __future__ import annotations

from gateway.pipeline import ArmChoice, RequestContext
from gateway.rollouts import arms
from gateway.rollouts.service import RolloutService
from gateway.rollouts.shadow import ShadowRunner


def arm_outcome(ctx: RequestContext, arm: str | None) -> tuple[bool, float | None] | None:
    """(ok, ttft) of the chosen arm, or None when the request never reached an upstream (refused, cached)."""
    tried = [a for a in ctx.attempts if "skipped" not in a]
    if not tried:
        return None
    if ctx.backend_model == arm and 0 < ctx.status < 500:
        return True, ctx.ttft_s
    return False, None


class RolloutStage:
    name = "rollout"

    def __init__(self, svc: RolloutService, shadows: ShadowRunner | None = None) -> None:
        self.svc = svc
        self.shadows = shadows

    async def run(self, ctx: RequestContext) -> None:
        r = self.svc.rollouts.get(ctx.model)
        if r is None:
            return
        p = ctx.principal
        key = arms.sticky_key(ctx.headers.get(r.sticky_header) if r.sticky_header else None,
                              p.end_user if p is not None else None, ctx.body.get("user"),
                              (p.key_id or p.id) if p is not None else ctx.client_addr)
        ctx.model_chain = self.svc.order(ctx.model, key)
        ctx.rollout = ArmChoice(ctx.model, ctx.model_chain[0])
        ctx.evidence["rollout"] = {"alias": ctx.model, "arm": ctx.model_chain[0]}
        ctx.extra_headers["x-gateway-rollout-arm"] = ctx.model_chain[0]

    async def finish(self, ctx: RequestContext) -> None:
        ro = ctx.rollout
        if ro is None or ctx.answer is not None:
            return
        out = arm_outcome(ctx, ro.arm)
        if out is not None and ro.arm is not None:
            self.svc.observe(ro.alias, ro.arm, *out)
        r = self.svc.rollouts.get(ro.alias)
        if r is not None and r.shadows and self.shadows is not None:
            copies = self.shadows.maybe_copy(ctx, r.alias, r.shadows)
            if copies:
                ctx.evidence["rollout"]["shadow"] = copies  # the audit record of the primary names its copies
