"""The `adapters` pipeline stage, right after authentication: a registered adapter is callable only inside its
owner scope. For anyone else it is dropped from the request's model chain, so the request then goes exactly the
way a request for an unknown model goes (the same 404 model_not_found, no existence oracle); for the owner the
audit record names the adapter. Policy, budgets and routing then treat the adapter name like any model."""
from __future__ import annotations

import dataclasses

from gateway.adapters.model import visible_chain
from gateway.adapters.placement import dynamic_backends
from gateway.adapters.service import AdapterService
from gateway.pipeline import AdapterUse, RequestContext


class AdapterStage:
    name = "adapters"

    def __init__(self, svc: AdapterService) -> None:
        self.svc = svc

    async def run(self, ctx: RequestContext) -> None:
        p = ctx.principal
        if p is None or not ctx.model:
            return
        reg = await self.svc.registry()
        if not reg:
            return
        names = (ctx.model, *ctx.model_chain)
        if not any(n in reg for n in names):
            return
        if not ctx.model_chain and ctx.model in reg and dynamic_backends(self.svc.config, reg[ctx.model].base_model):
            ctx.model_chain = (ctx.model,)  # served by loading it where routing sends it (gateway/adapters/placement)
        before = ctx.model_chain
        ctx.model_chain = visible_chain(p, before, reg)
        if ctx.model_chain != before:
            hide_dropped_arm(ctx)
        used = [m for m in ctx.model_chain if m in reg]
        if used:
            ctx.adapter = AdapterUse(used[0], reg[used[0]].base_model)
            ctx.evidence["adapter"] = {"name": used[0], "base_model": reg[used[0]].base_model}


def hide_dropped_arm(ctx: RequestContext) -> None:
    """A rollout arm chosen before this stage (gateway/rollouts) that the caller may not use is not named to it:
    the arm header and the audit record name the arm the request now goes to (none when nothing is left)."""
    ro = ctx.rollout
    if ro is None or ro.arm in ctx.model_chain:
        return
    arm = ctx.model_chain[0] if ctx.model_chain else None
    ctx.rollout = dataclasses.replace(ro, arm=arm)
    ctx.evidence["rollout"] = {**ctx.evidence["rollout"], "arm": arm}
    if arm is None:
        ctx.extra_headers.pop("x-gateway-rollout-arm", None)
    else:
        ctx.extra_headers["x-gateway-rollout-arm"] = arm
