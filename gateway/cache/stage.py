"""Stage "cache", after "decide" (the partition needs the decision) and before "reserve" (a hit costs no GPU
and no budget reservation). A hit sets `ctx.answer`: the pipeline stops there and the endpoint sends the
prepared result (JSON, or a replayed SSE stream) without dispatch. A miss remembers what to store; the stage's
finish stores the response the client received, when it was a complete 200 and the request may be retained.

Never stored, never served: zero or unknown retention, a residency the store's location does not satisfy,
per-request provider preferences, temperature above `cache.max_temperature`, endpoints other than chat and
completions, batch-lane lines (the lane dispatches itself), a store that fails (a lookup error is a bypass, a put
error stores nothing; never a failed request). Each of those is answered `x-gateway-cache: bypass` with the reason in evidence.

A hit's price: `charge` (wired to the budget stage's `charge_answer`, gateway/wiring.py) charges the hit at the
configured cache price (`budgets.prices.<model>.cache_hit`, default 0: free, not charged) over the principal's
budgets; a hit that does not fit them is refused with the budget's 429 and nothing is answered from the cache.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import orjson
from prometheus_client import Counter

from gateway.cache import guards as G
from gateway.cache.keys import exact_key, params_key, partition, temperature
from gateway.cache.replay import Capture, CachedStream
from gateway.cache.store import CacheStore, Entry
from gateway.pipeline import RequestContext
from gateway.types import Usage
from gateway.proxy.forward import JsonResult

HEADER = "x-gateway-cache"
log = logging.getLogger("gateway.cache")


class CacheMetrics:
    """Registered on the gateway's own registry (kept here so gateway/metrics.py stays untouched)."""

    def __init__(self, registry: Any) -> None:
        self.lookups = Counter("gateway_cache_lookups_total", "Response-cache lookups by result (hit, miss, bypass)"
                               " and tier", ["result", "tier"], registry=registry)
        self.guard_rejections = Counter("gateway_cache_guard_rejections_total", "Semantic matches above the "
                                        "threshold refused by a guard (near-miss intents)", ["guard"],
                                        registry=registry)
        self.saved_tokens = Counter("gateway_cache_saved_tokens_total", "Tokens answered from the cache instead "
                                    "of the GPU", ["token_type"], registry=registry)
        self.saved_cost = Counter("gateway_cache_saved_cost_total", "Money not spent thanks to hits (the original"
                                  " request's charge less the hit's)", ["currency"], registry=registry)
        self.stored = Counter("gateway_cache_stores_total", "Entries stored", ["tier"], registry=registry)


@dataclass(slots=True)
class Pending:
    """A miss that may be stored when the response completes."""

    spec: Any
    partition: str
    key: str
    capture: Capture
    vector: Any = None
    params: str = ""
    guards: dict[str, Any] = field(default_factory=dict)


class CacheStage:
    name = "cache"

    def __init__(self, config: Callable[[], Any], store: CacheStore, embedder: Any, metrics: CacheMetrics | None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config  # -> gateway Config (its raw.cache section)
        self.store = store
        self.embedder = embedder
        self.metrics = metrics
        self.clock = clock
        # (ctx with the hit's usage, the entry's recorded cost) -> (charged, saved); raises the budget's 429
        self.charge: Callable[[RequestContext, float | None], Awaitable[tuple[float, float]]] | None = None

    def _bypass(self, ctx: RequestContext, why: str, tier: str) -> None:
        ctx.extra_headers[HEADER] = "bypass"
        ctx.evidence["cache"] = {"result": "bypass", "reason": why, "tier": tier}
        if self.metrics is not None:
            self.metrics.lookups.labels("bypass", tier).inc()

    async def run(self, ctx: RequestContext) -> None:
        d = ctx.decision
        spec = d.cache if d is not None else None
        if spec is None or spec.mode == "off":
            return
        cc = self.config().raw.cache
        tier = spec.mode
        body = ctx.body
        if ctx.ep is None or not ctx.ep.cacheable or not isinstance(body, dict):
            return self._bypass(ctx, "endpoint", tier)
        if ctx.batch is not None:  # the batch lane dispatches on its own (gateway/batch): it never reads ctx.answer
            return self._bypass(ctx, "batch", tier)
        if not ctx.content_retainable or ctx.principal is None:
            return self._bypass(ctx, "zero_retention", tier)
        if body.get("provider") is not None:  # retention preferences: decide applied them; kept out regardless
            return self._bypass(ctx, "provider_preferences", tier)
        if temperature(body) > cc.max_temperature:
            return self._bypass(ctx, "temperature", tier)
        if not self.store.allows(d):
            return self._bypass(ctx, "residency", tier)
        part = partition(ctx, spec.scope)
        key = exact_key(part, body)
        now = self.clock()
        try:
            e = await self.store.get(key, now)
        except Exception as ex:  # a failing store is a bypass, never a failed request
            log.warning("cache store %s lookup failed: %s", self.store.name, ex)
            return self._bypass(ctx, "store_error", tier)
        if e is not None:
            return await self._hit(ctx, e, tier="exact", similarity=1.0, guards=["exact_key"])
        pending = Pending(spec=spec, partition=part, key=key, capture=Capture(ctx.endpoint, cc.max_entry_bytes))
        if spec.mode == "semantic":
            turns = G.conversation(body)
            t0 = time.perf_counter()
            vec = await self.embedder.embed(ctx, "\n".join(f"{r}: {t}" for r, t in turns))
            ctx.evidence["cache_embed_ms"] = round((time.perf_counter() - t0) * 1000, 3)
            if vec is not None:
                pending.vector, pending.params, pending.guards = vec, params_key(body), G.features(turns)
                try:
                    cand, sim = await self.store.nearest(part, pending.params, vec, now)
                except Exception as ex:
                    log.warning("cache store %s nearest failed: %s", self.store.name, ex)
                    cand, sim = None, -1.0
                threshold = spec.similarity if spec.similarity is not None else cc.default_similarity
                if cand is not None and sim >= threshold:
                    ok, passed, failed = G.compare(pending.guards, cand.guards)
                    if ok:
                        return await self._hit(ctx, cand, tier="semantic", similarity=sim,
                                               guards=["partition", "params", *passed])
                    ctx.evidence["cache_guard_rejected"] = {"entry": cand.key, "similarity": round(sim, 4),
                                                            "guard": failed}
                    if self.metrics is not None:
                        self.metrics.guard_rejections.labels(failed or "?").inc()
        ctx.cache = pending
        ctx.extra_headers[HEADER] = "miss"
        ctx.evidence["cache"] = {"result": "miss", "tier": tier, "key": key}
        if self.metrics is not None:
            self.metrics.lookups.labels("miss", tier).inc()

    async def _hit(self, ctx: RequestContext, e: Entry, tier: str, similarity: float, guards: list[str]) -> None:
        e.hits += 1
        ctx.usage = Usage(prompt_tokens=e.prompt_tokens, completion_tokens=e.completion_tokens)
        ctx.extra_headers[HEADER] = "hit"
        if tier == "semantic":
            ctx.extra_headers[HEADER + "-similarity"] = f"{similarity:.4f}"
        saved: dict[str, Any] = {"prompt_tokens": e.prompt_tokens, "completion_tokens": e.completion_tokens,
                                 "cost": e.cost, "currency": e.currency}
        ctx.evidence["cache"] = {"result": "hit", "tier": tier, "entry": e.key, "created_by": e.created_by,
                                 "similarity": round(similarity, 4), "guards_passed": guards, "cached": True,
                                 "age_s": round(self.clock() - e.created_at, 3), "saved": saved}
        m = self.metrics
        if m is not None:
            m.lookups.labels("hit", tier).inc()
        if self.charge is not None:
            try:
                charged, saved["cost"] = await self.charge(ctx, e.cost)
            except Exception:  # the budget refused (429): the hit is not served, nothing was saved
                ctx.usage = None
                ctx.evidence["cache"]["refused_by"] = "budget"
                raise
            saved["charged"] = charged
            if saved["currency"] is None and ctx.outcome.charge is not None:  # both in the budget currency
                saved["currency"] = ctx.outcome.charge.currency
        ctx.outcome.cache_saved_cost = float(saved["cost"] or 0.0)  # what the cost meter reports saved
        obj = e.response
        ctx.answer = CachedStream(obj, ctx.endpoint) if ctx.stream else JsonResult(200, orjson.dumps(obj), None)
        if m is not None:
            m.saved_tokens.labels("input").inc(e.prompt_tokens)
            m.saved_tokens.labels("output").inc(e.completion_tokens)
            if saved["cost"]:
                m.saved_cost.labels(e.currency or "EUR").inc(saved["cost"])

    async def finish(self, ctx: RequestContext) -> None:
        p = ctx.cache
        if not isinstance(p, Pending):
            return
        ctx.cache = None
        # re-checked: a later stage may have tightened the decision (retention) after the lookup
        if ctx.status not in (0, 200) or ctx.error or ctx.cut_by_budget or ctx.cut_by_shutdown:
            return
        # content_retainable already implies a known principal; checked here so the entry's tenant is one
        if ctx.principal is None or not ctx.content_retainable or not self.store.allows(ctx.decision):
            return
        obj = p.capture.result(ctx.usage)
        if obj is None:
            return
        cc = self.config().raw.cache
        if len(orjson.dumps(obj)) > cc.max_entry_bytes:
            return
        u = ctx.usage or Usage()
        charge = ctx.outcome.charge
        now = self.clock()
        ttl = p.spec.ttl_s if p.spec.ttl_s is not None else cc.default_ttl_s
        d = ctx.decision
        residency = sorted(d.allowed_countries) if d is not None and d.allowed_countries is not None else None
        try:
            stored = await self.store.put(Entry(
                key=p.key, partition=p.partition, tenant=ctx.principal.tenant, model=ctx.model, response=obj,
                created_by=ctx.request_id, created_at=now, expires_at=now + ttl, prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens, cost=charge.amount if charge else None,
                currency=charge.currency if charge else None,
                vector=p.vector, params=p.params, guards=p.guards, residency=residency))
        except Exception as ex:
            log.warning("cache store %s put failed: %s", self.store.name, ex)
            stored = False
        ev = ctx.evidence.get("cache")
        if isinstance(ev, dict):
            ev["stored"] = stored
        if not stored:
            return
        if self.metrics is not None:
            self.metrics.stored.labels(p.spec.mode).inc()
