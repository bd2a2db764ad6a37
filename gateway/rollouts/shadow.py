"""Shadow traffic: a sampled copy of a weighted alias's answered request, sent to a shadow target after the
primary's answer is complete (so it never delays it), its answer read and discarded.

The copy runs through the gateway's own pipeline, minus authentication and the rollout stage, as a principal of
the tenant the operator names (`shadow.budget_scope`): that tenant's policy rules give its budgets, and its
ledger rows and audit records carry the copies. Its decision is then the caller's own for everything that
filters where it may go (allowed countries, jurisdiction, retention, model restrictions), with the cache off:
a request that must stay in the EEA never shadows to a backend outside it, and no copy is ever cached or
answered from the cache. A copy that no allowed backend serves is refused by routing like any request, and
dropped."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.pipeline import ArmChoice, Lifecycle, Pipeline, RequestContext, RequestHeaders
from gateway.rollouts import arms
from gateway.rollouts.config import ShadowConfig
from gateway.types import Decision, Principal

log = logging.getLogger("gateway.rollouts")
SKIPPED_STAGES = frozenset({"authenticate", "rollout"})


def sampled(alias: str, model: str, request_id: str, sample: float) -> bool:
    """Whether a request is copied: fixed by its id (sha256), so a retry of the decision agrees with itself."""
    return arms.unit(f"{alias}\x00shadow\x00{model}", request_id) < sample


def shadow_body(body: dict[str, Any], model: str) -> dict[str, Any]:
    """The copy's body: the same request to the shadow model, not streamed."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["model"] = model
    return out


def shadow_principal(caller: Principal, alias: str, scope: str) -> Principal:
    """The copy runs as the operator's budget scope (a tenant), keeping the caller's end user for the record."""
    return Principal(id=f"shadow:{alias}", kind=caller.kind, tenant=scope, end_user=caller.end_user)


def shadow_decision(caller: Decision, own: Decision) -> Decision:
    """The caller's decision for where the copy may go, the budget scope's budgets, the cache off."""
    return dataclasses.replace(caller, budgets=own.budgets, cache=None,
                               matched_rules=tuple(dict.fromkeys((*caller.matched_rules, *own.matched_rules))))


class ShadowDecisionStage:
    """After `decide` in the copy's pipeline: the caller's residency and retention, the scope's budgets."""

    name = "shadow_decision"

    def __init__(self, caller: Decision) -> None:
        self.caller = caller

    async def run(self, ctx: RequestContext) -> None:
        assert ctx.decision is not None
        ctx.decision = shadow_decision(self.caller, ctx.decision)
        ctx.evidence["decision"] = ctx.decision.to_evidence()


class ShadowRunner:
    """Starts copies as background tasks, at most `max_inflight` per shadow target at once."""

    def __init__(self, gw: Any, pipeline_for: Callable[[Decision], Pipeline]) -> None:
        self.gw = gw
        self.pipeline_for = pipeline_for  # a copy's pipeline (gateway/wiring.py `shadow_pipeline`)
        self.inflight: dict[str, int] = {}
        self.tasks: set[asyncio.Task] = set()
        self.stats = {"sent": 0, "skipped_full": 0, "refused": 0, "failed": 0}

    def maybe_copy(self, ctx: RequestContext, alias: str, shadows: tuple[tuple[str, ShadowConfig], ...]) -> list[str]:
        """Start the sampled copies of an answered request; the shadow models copied."""
        if ctx.decision is None or ctx.principal is None or ctx.status != 200 or ctx.batch is not None:
            return []
        out = []
        for model, sh in shadows:
            if not sampled(alias, model, ctx.request_id, sh.sample):
                continue
            if self.inflight.get(model, 0) >= sh.max_inflight:
                self.stats["skipped_full"] += 1
                continue
            self.inflight[model] = self.inflight.get(model, 0) + 1
            t = asyncio.get_running_loop().create_task(self._run(ctx, alias, model, sh))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)
            out.append(model)
        return out

    def pipeline(self, caller: Decision) -> Pipeline:
        """A copy's pipeline, as gateway/wiring.py declares it (`shadow_pipeline`, set there as `pipeline_for`)."""
        return self.pipeline_for(caller)

    async def _run(self, primary: RequestContext, alias: str, model: str, sh: ShadowConfig) -> None:
        from gateway.api.endpoints import prepare
        from gateway.api.ingress import new_request_id
        from gateway.proxy.forward import JsonResult

        assert primary.decision is not None and primary.principal is not None
        life = None
        try:
            body = shadow_body(primary.body, model)
            ctx = RequestContext(request_id=new_request_id(), endpoint=primary.endpoint, headers=RequestHeaders(),
                                 body=body, client_addr="shadow")
            prepare(ctx, ctx.ep.parse(body), ctx.ep.media.encode(body), self.gw.config)
            ctx.stream = False
            ctx.principal = shadow_principal(primary.principal, alias, sh.budget_scope)
            ctx.rollout = ArmChoice(alias, model, shadow=True)
            ctx.evidence["rollout"] = {"alias": alias, "arm": model, "shadow": True, "of": primary.request_id}
            life = Lifecycle(self.pipeline(primary.decision), ctx)
            result = await life.run()
            if isinstance(result, JsonResult):
                ctx.status = result.status
                if result.status == 200:
                    with contextlib.suppress(Exception):
                        obj = orjson.loads(result.body)
                        ctx.usage = ctx.ep.wire.usage(obj)
                        ctx.ep.wire.facts(ctx, obj)
            else:  # a stream although none was asked: closed unread
                with contextlib.suppress(Exception):
                    await result.response.aclose()
                ctx.status, ctx.error = 502, "upstream_stream"
            self.stats["sent"] += 1
        except GatewayError as e:
            self.stats["refused"] += 1
            log.info("shadow copy of %s to %s refused: %s %s", primary.request_id, model, e.status, e.code)
        except Exception:
            self.stats["failed"] += 1
            log.exception("shadow copy of %s to %s failed", primary.request_id, model)
        finally:
            self.inflight[model] -= 1
            if life is not None:
                await life.finish()

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
