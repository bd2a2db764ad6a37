"""The budget stage ("reserve"): reserve the worst case before dispatch, settle actual usage after.

run: no budgets in the Decision -> nothing (one attribute check). Otherwise reserve prompt estimate + max_tokens
(or the default cap) atomically over every scope x window, set x-ratelimit-* headers, evidence, and for an
uncapped request whose remaining budget is below the cap, `completion_token_allowance` so the proxy cuts the
stream at the budget. finish: settle with the real usage (or what was delivered) and queue a ledger row.

`charge_answer`: a response-cache hit (answered by the cache stage, before this stage would run) at a non-zero
cache price (`budgets.prices.<model>.cache_hit`) is charged here like any request: a reservation sized exactly
for its stored usage (a hit that does not fit is the same 429), settled at once, a ledger row with category
cache_hit. A free hit (the default) is not charged and files no row here (docs/cache.md#price).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from gateway.budget.dimensions import LEDGERED, SettleFacts, settled_values
from gateway.budget.pricing import find_price
from gateway.budget.service import BudgetService, Reservation, _NoLimits
from gateway.errors import GatewayError
from gateway.pipeline import Charge, RequestContext
from gateway.types import Usage

HIT = "cache_hit"  # the cost category (gateway/cost/model.py) of an answer from the response cache

log = logging.getLogger("gateway.budget.stage")


class BudgetStage:
    name = "reserve"

    def __init__(self, service: BudgetService) -> None:
        self.service = service

    async def run(self, ctx: RequestContext) -> None:
        d = ctx.decision
        if d is None or not d.budgets or ctx.principal is None:
            return
        models = ctx.model_chain or ((ctx.model,) if ctx.model else ())
        out = await self._reserve(ctx, models, max(ctx.prompt_tokens_est, ctx.prompt_tokens_max), ctx.max_tokens,
                                  d.max_tokens_cap, batch=ctx.batch is not None)
        if out is None:
            return
        if out.allowance is not None:
            ctx.completion_token_allowance = (out.allowance if ctx.completion_token_allowance is None
                                              else min(out.allowance, ctx.completion_token_allowance))
            self._send_allowance(ctx)

    async def _reserve(self, ctx: RequestContext, models: tuple[str, ...], prompt: int, max_tokens: int | None,
                       cap: int | None, batch: bool = False, cache_hit: bool = False) -> Any:
        """Reserve over the decision's budgets (None: no limit applies); headers and evidence on ctx."""
        d = ctx.decision
        assert d is not None and ctx.principal is not None
        try:
            out = await self.service.reserve(ctx.request_id, ctx.principal, d.budgets, models, prompt, max_tokens,
                                             cap, batch=batch, cache_hit=cache_hit, request=ctx)
        except _NoLimits:
            return None
        except GatewayError as e:
            # refusals carry headers + evidence; keep the evidence on the context for the record
            ev = (e.extra or {}).get("budget")
            if ev is not None:
                ctx.evidence["budget"] = {"refused": ev}
            ctx.extra_headers.update({k: v for k, v in (e.headers or {}).items() if k.startswith("x-ratelimit")})
            raise
        ctx.budget = out.reservation
        ctx.extra_headers.update(out.headers)
        ctx.evidence["budget"] = out.evidence
        return out

    async def charge_answer(self, ctx: RequestContext, recorded_cost: float | None) -> tuple[float, float]:
        """Charge a response-cache hit (ctx.usage is its stored usage). Returns (charged, saved) in the budget
        currency: saved = what it would have been charged at the normal price (`recorded_cost`, what the request
        that created the entry was charged; else the model's normal token price) minus what it was charged.

        A zero cache price (the default): nothing is reserved, settled or filed (charged 0; the cost meter
        files the hit's row in cost_unbilled). Otherwise, exactly as a normal request over the same scopes and
        windows: a reservation of the stored prompt + completion tokens at the cache price (a refusal raises the
        same 429), settled at once with that usage, `cost` evidence, a spend-ledger row with category cache_hit."""
        usage = ctx.usage or Usage()
        svc = self.service
        model = self._price_model(ctx, cache_hit=True)
        normal = recorded_cost if recorded_cost is not None else svc.price(model, usage)
        p = find_price(model, svc.cfg.prices, cache_hit=True)
        if p is None or p.input <= 0:
            return 0.0, normal
        d = ctx.decision
        resv = None
        if d is not None and d.budgets and ctx.principal is not None:
            out = await self._reserve(ctx, (model,), usage.prompt_tokens, usage.completion_tokens, None,
                                      cache_hit=True)
            resv = out.reservation if out is not None else None
        if resv is not None:
            so = await svc.settle(resv, usage, model, None, None, cache_hit=True, request=ctx)
            amount, ccy, settled = so.cost, so.currency, so.settled
            ev = ctx.evidence.get("budget")
            if isinstance(ev, dict):
                ev["settled"] = dict(settled)
        else:
            amount, ccy = svc.price(model, usage, cache_hit=True), svc.cfg.currency
            settled = settled_values(SettleFacts(usage, amount, 0.0, ctx))
        saved = normal - amount
        self._record(ctx, usage, model, amount, ccy, None, resv, settled, priced_as=HIT,
                     row={"status": ctx.status or 200, "cost_category": HIT,
                          "saved_tokens": usage.total_tokens, "saved_cost": saved})
        return amount, saved

    @staticmethod
    def _send_allowance(ctx: RequestContext) -> None:
        """The allowance goes upstream as the request's max_tokens when it is the binding limit: a JSON
        response cannot be cut part-way, so without it an engine generated past the budget (49 tokens left,
        102 generated). Streams are still cut at the allowance as well (docs/budgets.md)."""
        allowance = ctx.completion_token_allowance
        ep = ctx.ep
        if allowance is None or ep is None or not ep.generates:
            return
        # the length the engine would use: the request's max_tokens, else the endpoint's default (16 for
        # /v1/completions, the OpenAI and vLLM default), else none (chat runs to the context or a stop)
        implied = ep.implied_max_tokens(ctx.max_tokens)
        if implied is not None and implied <= allowance:
            return
        ctx.evidence["budget_max_tokens"] = {"requested": ctx.max_tokens, "set_max_tokens": allowance,
                                             "reason": "remaining completion budget"}
        ctx.max_tokens = allowance  # the exchange writes it into the endpoint's field (chat: as the client did)
        ctx.body_overrides.pop(ep.max_tokens_key(ctx.body), None)  # a lower value from here wins over a cap

    async def finish(self, ctx: RequestContext) -> None:
        """Settle (if reserved) and record the cost of every dispatched request in the ledger."""
        resv = ctx.budget if isinstance(ctx.budget, Reservation) else None
        if resv is not None and resv.settled:
            return
        usage = ctx.usage
        if usage is None:  # no usage from the engine (error, cut stream): charge what we know was delivered
            dispatched = ctx.backend is not None or ctx.delivered_completion_tokens > 0
            if resv is None and not dispatched:
                return  # refused before any engine saw it: nothing spent, nothing to record
            usage = Usage(ctx.prompt_tokens_est if dispatched else 0, ctx.delivered_completion_tokens)
        svc = self.service
        model = self._price_model(ctx)
        batch = ctx.batch is not None  # a batch-lane line: batch prices (docs/batch.md)
        price = find_price(model, svc.cfg.prices, ctx.backend, batch)
        gpu_s = None
        if price is not None and price.gpu_second is not None and ctx.backend is not None:
            metered = (ctx.outcome.unit_cost or {}).get("gpu_seconds")
            if metered is not None:  # the engine time apportioned to this request (gateway/cost, docs/cost.md)
                gpu_s = round(max(0.0, metered), 6)
            else:  # no meter wired: the gateway's wall time so far, an upper bound of the engine's time
                total = ctx.total_s if ctx.total_s is not None else time.perf_counter() - ctx.received_at
                gpu_s = round(max(0.0, total), 3)
        apportioned = self._apportioned(ctx)
        if resv is not None:
            out = await svc.settle(resv, usage, model, ctx.backend, gpu_s, batch, apportioned, request=ctx)
            amount, ccy, settled = out.cost, out.currency, out.settled
            ev = ctx.evidence.get("budget")
            if isinstance(ev, dict):  # what replaced the hold, next to what was reserved
                ev["settled"] = dict(settled)
        else:
            amount, ccy = svc.price(model, usage, ctx.backend, gpu_s, batch), svc.cfg.currency
            settled = settled_values(SettleFacts(usage, amount, apportioned, ctx))
        self._record(ctx, usage, model, amount, ccy, gpu_s, resv, settled, priced_as="batch" if batch else None)

    def _record(self, ctx: RequestContext, usage: Usage, model: str, amount: float, ccy: str,
                gpu_s: float | None, resv: Reservation | None, settled: dict[str, float],
                priced_as: str | None = None, row: dict[str, Any] | None = None) -> None:
        """The charge (the request's `outcome.charge`, its `cost` evidence) and a spend-ledger row (`row`: fields
        added or replaced). The budget dimensions' ledger columns (total_tokens, cost, ...) hold what the request
        used in each (`settled`, gateway/budget/dimensions.py)."""
        ctx.outcome.charge = Charge(amount, ccy)
        ctx.evidence["cost"] = {"amount": amount, "currency": ccy, "model": model,
                                "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                                "cached_tokens": usage.cached_tokens, "gpu_seconds": gpu_s,
                                **({"priced_as": priced_as} if priced_as else {})}
        p = ctx.principal
        self.service.ledger.enqueue({
            "request_id": ctx.request_id, "ts": ctx.received_wall, "principal_id": p.id if p else None,
            "tenant": p.tenant if p else None, "team": p.team if p else None, "project": p.project if p else None,
            "key_id": p.key_id if p else None, "partner": p.partner if p else None,
            "end_user": p.end_user if p else None, "model": model, "backend": ctx.backend,
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens, **{d.ledger: settled[d.name] for d in LEDGERED if d.ledger},
            "currency": ccy, "gpu_seconds": gpu_s, "status": ctx.status, "cut_by_budget": ctx.cut_by_budget,
            "budget_store": resv.store if resv is not None else None, "client_request_id": ctx.client_request_id,
            **(row or {}),
        })

    @staticmethod
    def _apportioned(ctx: RequestContext) -> float:
        """The engine GPU-seconds the cost meter apportioned to this request (its `close`, the meter stage's
        finish, ran before this one): what GPU-second budgets settle. 0 when no engine of ours served it: refused
        or failed before dispatch, or a partner route (priced by tokens, no GPU of ours)."""
        uc = ctx.outcome.unit_cost
        if uc is None or uc.get("method") != "apportioned":
            return 0.0
        v = uc.get("gpu_seconds")
        return max(0.0, float(v)) if isinstance(v, (int, float)) else 0.0

    def _price_model(self, ctx: RequestContext, cache_hit: bool = False) -> str:
        """The model name prices are looked up by: the first priced of served/concrete/requested names."""
        prices = self.service.cfg.prices
        names = [n for n in (ctx.backend_model, *ctx.model_chain, ctx.model) if n]
        for n in names:
            if find_price(n, prices, ctx.backend, cache_hit=cache_hit) is not None:
                return n
        return names[0] if names else ""
