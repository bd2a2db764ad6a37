"""The online cost meter: one processor-sharing clock per engine (gateway/cost/apportion.py), a stage that opens
a request's span when it is dispatched and closes it before the budget settles (so a GPU-second price charges
the apportioned time, not the gateway's wall time), and a finish hook that prices every request (served or
not), files a ledger row for those the budget stage does not record, and feeds /metrics and the dashboard.

The apportioned time is the request's `outcome.unit_cost` (what the budget settles and the finish prices); the
budget's charge is `outcome.charge`. Evidence (output only): `unit_cost`, lifted to the audit record, next to the
budget's `cost`.
Per adapter and per rollout arm (gateway/cost/dims.py): ledger columns `adapter` and `arm`, `by_dim` totals,
/metrics counters (`dims`, set by gateway/cost/wiring.py).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from gateway.cost.apportion import EngineClock
from gateway.cost.config import CostConfig
from gateway.cost.dims import DimCounters, adapter_of, arm_label, arm_of, ledger_dims
from gateway.cost.model import (
    Outcome,
    backend_cost,
    category,
    gpu_cost,
    margin,
    savings_and_waste,
    token_cost,
)

if TYPE_CHECKING:
    from gateway.budget.ledger import Ledger
    from gateway.config import Config
    from gateway.metrics import Metrics
    from gateway.pipeline import RequestContext
    from gateway.routing.plan import Candidate

log = logging.getLogger("gateway.cost")

PRIOR_S_PER_TOKEN = 0.125 / 1000.0  # the router's cold-start prefill prior (8k tokens/s) until it learned one
PRIOR_STEP_S = 0.015  # the router's cold-start engine step (PredictorParams.step_prior_s) until it learned one
DECODE_MIN_TOKENS = 8  # a request teaches the decode cost per completion token from this many tokens on
DECODE_WINDOW = 64  # per engine: the decode cost per completion token of its last this many requests
_NO_HIT_SAVINGS: dict[str, Any] = {"saved_tokens": 0, "saved_cost": 0.0}
_RECENT = ("t", "backend", "model", "category", "gpu_seconds", "cost", "charged", "tokens", "saved", "wasted")


class LearnedFacts(Protocol):
    """What the meter prices with of one engine's learner (gateway/routing/predictor.py EngineLearner)."""

    def s_per_token(self) -> float: ...

    def step(self) -> float: ...


class Learners(Protocol):
    """The router's learner per engine (gateway/routing/predictor.py Predictor)."""

    def learner(self, engine: str) -> LearnedFacts: ...


class CostStage:
    """Last stage before dispatch: its run opens the span, its finish (first of the finishes) closes it."""

    name = "meter"

    def __init__(self, meter: CostMeter) -> None:
        self.meter = meter

    async def run(self, ctx: RequestContext) -> None:
        return None  # spans open per attempt (the dispatcher calls attempt_begin / attempt_failed)

    async def finish(self, ctx: RequestContext) -> None:
        self.meter.close(ctx)
        self.meter.before_settle(ctx)


class CostMeter:
    """Per-engine clocks and running totals. `config` and `predictor` are callables (hot reload, late wiring)."""

    def __init__(self, config: Callable[[], Config], predictor: Callable[[], Learners | None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, ledger: Callable[[], Ledger | None] | None = None,
                 metrics: Metrics | None = None) -> None:
        self._config = config
        self._predictor = predictor or (lambda: None)
        self._ledger = ledger or (lambda: None)
        self.clock = clock
        self.metrics = metrics
        self.engines: dict[str, EngineClock] = {}
        # request id -> (engine, clock token, prompt estimate, learned prefill cost per token at begin)
        self._open: dict[str, tuple[str, int, int, float]] = {}
        self._est_ratio: dict[str, float] = {}  # engine -> EWMA of prompt tokens counted / estimated at dispatch
        # engine -> apportioned decode GPU-seconds per completion token of its last DECODE_WINDOW requests
        self._decode: dict[str, deque[float]] = {}
        self._facts: dict[str, dict[str, Any]] = {}  # request id -> ledger fields until its row is enqueued
        self._priced: dict[str, dict[str, Any]] = {}  # request id -> its priced facts, before_settle -> finish
        self._retry: dict[str, list[Any]] = {}  # request id -> [engine, GPU-seconds of its failed attempts]
        self._dims: dict[str, dict[str, str | None]] = {}  # request id -> its adapter/arm columns, until filed
        self.dims: DimCounters | None = None  # per adapter and per arm on /metrics (set by gateway/cost/wiring.py)
        # ("adapter", name) / ("arm", "<alias>:<arm>[ (shadow)]") -> requests, tokens, GPU-seconds, cost
        self.by_dim: dict[tuple[str, str], dict[str, float]] = {}
        self._children: dict[tuple[str, str, str], tuple[Any, ...]] = {}  # (backend, model, category) -> series
        self.stage = CostStage(self)
        # fleet-wide GPU-seconds per token of served requests (a response-cache hit's saving is priced with it)
        self.gpu_per_token = 0.0
        self.totals: dict[tuple[str, str, str], dict[str, float]] = {}  # (backend, model, category) -> sums
        # the dashboard's recent requests, as tuples in _RECENT order (dicts are built when snapshot reads them)
        self.recent: deque[tuple[Any, ...]] = deque(maxlen=512)
        self.started = clock()  # utilisation = busy time / time since the meter started
        self.started_at = time.time()  # ... the same instant on the wall clock (the dashboard divides by it)

    @property
    def cfg(self) -> CostConfig:
        return self._config().raw.cost

    # ------------------------------------------------------------------ engine clocks
    def clock_of(self, engine: str) -> EngineClock:
        c = self.engines.get(engine)
        if c is None:
            c = self.engines[engine] = EngineClock()
        return c

    def _learned(self, engine: str, fact: Callable[[LearnedFacts], float], prior: float) -> float:
        """A fact the router's learner of this engine has learned, else the prior (no router, nothing learned)."""
        learners = self._predictor()
        if learners is None:
            return prior
        v = float(fact(learners.learner(engine)))
        return v if v > 0 else prior

    def s_per_token(self, engine: str) -> float:
        """The router's learned prefill cost per token on this engine, else the prior."""
        return self._learned(engine, lambda lr: lr.s_per_token(), PRIOR_S_PER_TOKEN)

    def step_s(self, engine: str) -> float:
        """The router's learned engine step (EWMA of mean inter-token time) on this engine, else its prior."""
        return self._learned(engine, lambda lr: lr.step(), PRIOR_STEP_S)

    def gpu_worst_case(self, backends: tuple[str, ...] = ()) -> tuple[float, float]:
        """The learned worst case of a request's apportioned GPU-seconds over `backends` (empty: every
        configured backend), for GPU-second budgets (gateway/budget/service.py reserves with it):
        (GPU-seconds per prompt token, GPU-seconds per completion token), each the largest over the engines of
        ours among them (partner routes use no GPU of ours; none of ours: (0, 0)).

        Per prompt token: the prefill cost per token `s_per_token` x gpus (prefill is charged at most that).
        Per completion token: the larger of the engine's step x gpus (a decoding sequence is charged at most
        the whole step it shares, all of it when it runs alone) and the largest apportioned decode time per
        completion token (`shared_gpu_seconds / completion tokens`) of the engine's last DECODE_WINDOW
        requests with DECODE_MIN_TOKENS or more (it adds what is charged besides the steps: HTTP, queueing).
        Before anything is learned: the router's priors, 0.125 ms per prompt token and a 15 ms step."""
        cfg = self._config()
        names = backends or tuple(b.name for b in cfg.raw.backends)
        per_prompt = per_completion = 0.0
        for name in names:
            if not self._own(name):
                continue
            bc = backend_cost(self.cfg, name)
            gpus = bc.gpus if bc is not None else 1
            seen = self._decode.get(name)
            per_prompt = max(per_prompt, self.s_per_token(name) * gpus)
            per_completion = max(per_completion, self.step_s(name) * gpus, max(seen) if seen else 0.0)
        return per_prompt, per_completion

    def _own(self, name: str) -> bool:
        try:
            b = self._config().backend(name)
        except KeyError:
            return False
        return b.operator != "partner"

    def open(self, ctx: RequestContext) -> None:
        """A span on the engine the route plan tries first (what the dispatcher's first attempt does)."""
        cands = ctx.route.candidates if ctx.route is not None else ()
        if cands:
            self.attempt_begin(ctx, cands[0])

    def attempt_begin(self, ctx: RequestContext, cand: Candidate) -> None:
        """The dispatcher sends the request to `cand`: its span begins on that engine (ours only)."""
        b = cand.backend
        if b.operator == "partner" or ctx.request_id in self._open or not self._config().raw.cost.enabled:
            return  # a partner route uses no GPU of ours
        engine = b.name
        # what it will prefill: the gateway's prompt estimate, scaled by how far it ran from the engine's own
        # count on this engine lately (chars/4 counted 2x the sim's tokens), less the cached tokens routing
        # predicted (the KV index counts engine tokens), times the learned cost per token
        est = ctx.prompt_tokens_est
        expected = max(0.0, est * self._est_ratio.get(engine, 1.0) - (cand.cached_tokens or 0))
        spt = self.s_per_token(engine)
        token = self.clock_of(engine).begin(self.clock(), expected * spt)
        self._open[ctx.request_id] = (engine, token, est, spt)

    def attempt_failed(self, ctx: RequestContext, cand: Candidate) -> None:
        """The attempt on `cand` failed (the dispatcher tries the next candidate or gives up): its engine time
        ends now and is the request's retry waste (`wasted_gpu_seconds.retry`), not part of what it is charged."""
        span = self._open.pop(ctx.request_id, None)
        if span is None:
            return
        engine, token, _, _ = span
        c = self.clock_of(engine).end(self.clock(), token)
        bc = backend_cost(self.cfg, engine)
        w = self._retry.setdefault(ctx.request_id, [engine, 0.0])
        w[0] = engine
        w[1] += c.seconds * (bc.gpus if bc is not None else 1)

    def close(self, ctx: RequestContext) -> None:
        """The response is complete (or failed, or cut): the span ends and the request is charged."""
        span = self._open.pop(ctx.request_id, None)
        retry = self._retry.pop(ctx.request_id, None)
        if span is None:
            if retry is not None:  # every attempt failed: all its engine time was retry waste
                ctx.outcome.unit_cost = ctx.evidence["unit_cost"] = {
                    "engine": retry[0], "method": "apportioned", "gpu_seconds": 0.0, "prefill_gpu_seconds": 0.0,
                    "shared_gpu_seconds": 0.0, "retry_gpu_seconds": retry[1]}
            return
        engine, token, est, spt = span  # spt: the learned prefill cost per token its begin used
        ec = self.clock_of(engine)
        c = ec.end(self.clock(), token)
        u = ctx.usage
        dispatched = ctx.backend is not None or ctx.delivered_completion_tokens > 0
        if u is not None:
            prompt, cached = u.prompt_tokens, min(max(u.cached_tokens or 0, 0), u.prompt_tokens)
        else:
            prompt, cached = (ctx.prompt_tokens_est if dispatched else 0), 0
        if u is not None and est > 0:  # the gateway's prompt estimate vs the engine's count, on this engine
            r = min(max(prompt / est, 0.05), 20.0)
            self._est_ratio[engine] = 0.9 * self._est_ratio.get(engine, 1.0) + 0.1 * r
        bc = backend_cost(self.cfg, engine)
        gpus = bc.gpus if bc is not None else 1
        completion = u.completion_tokens if u is not None else ctx.delivered_completion_tokens
        if completion >= DECODE_MIN_TOKENS:  # the decode cost per completion token GPU-second budgets reserve
            d = self._decode.get(engine)
            if d is None:
                d = self._decode[engine] = deque(maxlen=DECODE_WINDOW)
            d.append(c.shared_s * gpus / completion)
        facts = {
            "engine": engine, "method": "apportioned",
            "gpu_seconds": c.seconds * gpus, "prefill_gpu_seconds": c.prefill_s * gpus,
            "shared_gpu_seconds": c.shared_s * gpus, "engine_prefill_share": ec.prefill_share(),
            "s_per_prefill_token": spt, "gpus": gpus,
            "cached_prefill_gpu_seconds": cached * spt * gpus,
        }
        if retry is not None:
            facts["retry_gpu_seconds"] = retry[1]
        ctx.outcome.unit_cost = ctx.evidence["unit_cost"] = facts

    # ------------------------------------------------------------------ pricing (finish hook)
    def outcome(self, ctx: RequestContext) -> Outcome:
        failed = sum(1 for a in ctx.attempts if isinstance(a, dict) and "error" in a)
        return Outcome(dispatched=ctx.backend is not None or ctx.outcome.unit_cost is not None,
                       status=ctx.status or 200, cache_hit=ctx.answer is not None, batch=ctx.batch is not None,
                       cut=bool(ctx.cut_by_budget or ctx.cut_by_shutdown), retries=failed)

    def price(self, ctx: RequestContext, charged: bool = True) -> dict[str, Any]:
        """The request's unit-cost facts (apportioned time, platform cost, charge, margin, savings, waste);
        `charged=False` before the budget settled (the charge and margin are added by the finish hook)."""
        raw = self._config().raw
        cfg = raw.cost
        fx = raw.budgets.fx_rates
        uc = ctx.outcome.unit_cost or {}  # read only: `out` below is a new dict
        o = self.outcome(ctx)
        cat = category(o)
        u = ctx.usage
        prompt = u.prompt_tokens if u is not None else 0
        completion = u.completion_tokens if u is not None else ctx.delivered_completion_tokens
        cached = (u.cached_tokens or 0) if u is not None else 0
        gpu_s = uc.get("gpu_seconds")
        backend = ctx.backend or uc.get("engine")
        bc = backend_cost(cfg, backend) if backend is not None else None
        amount = gpu_cost(gpu_s, bc, cfg.currency, fx)
        basis = "gpu_hour" if amount is not None else None
        if amount is None and backend is not None and cat not in ("cache_hit", "rejected"):
            amount = token_cost(prompt, cached, completion, bc, cfg.currency, fx)
            basis = "partner_tokens" if amount is not None else None
        if cat in ("cache_hit", "rejected"):
            amount, gpu_s = 0.0, 0.0
        estimate = self.gpu_per_token * (prompt + completion) if cat == "cache_hit" else None
        saved, wasted = savings_and_waste(cat, gpu_s, float(uc.get("cached_prefill_gpu_seconds") or 0.0), estimate,
                                          float(uc.get("retry_gpu_seconds") or 0.0))
        out = {**uc, "category": cat, "backend": backend, "gpu_seconds": gpu_s, "cost": amount,
               "cost_basis": basis, "currency": cfg.currency, "retries": o.retries,
               "saved_gpu_seconds": saved, "wasted_gpu_seconds": wasted, **self._hit_savings(ctx, cat)}
        if charged:
            self._charge(out, ctx)
        return out

    @staticmethod
    def _hit_savings(ctx: RequestContext, cat: str) -> dict[str, Any]:
        """Tokens a response-cache hit answered without the GPU and the money it saved (its normal price less
        what it was charged, in the budget currency: the cache stage's `saved` evidence); 0 for the others."""
        if cat != "cache_hit":
            return _NO_HIT_SAVINGS  # merged into a new dict by the caller, never changed
        u = ctx.usage
        tokens = u.total_tokens if u is not None else 0
        return {"saved_tokens": tokens, "saved_cost": ctx.outcome.cache_saved_cost}

    def _charge(self, facts: dict[str, Any], ctx: RequestContext) -> None:
        """What the budget charged (known only after it settled): the charge and the margin against the cost."""
        ch = ctx.outcome.charge
        charged, ccy = (ch.amount, ch.currency) if ch is not None else (None, None)
        facts["charged"] = charged
        facts["charged_currency"] = ccy
        facts["margin"] = margin(charged, facts["cost"]) if ccy in (None, facts["currency"]) else None

    def _learn_per_token(self, facts: dict[str, Any], ctx: RequestContext) -> None:
        """Fleet-wide GPU-seconds per token of served requests (what a response-cache hit is said to save)."""
        gpu_s = facts.get("gpu_seconds")
        u = ctx.usage
        tokens = (u.prompt_tokens + u.completion_tokens) if u is not None else ctx.delivered_completion_tokens
        if facts["category"] in ("served", "batch") and gpu_s and tokens > 0:
            a = 0.05
            per = gpu_s / tokens
            self.gpu_per_token = per if self.gpu_per_token == 0 else (1 - a) * self.gpu_per_token + a * per

    def ledger_fields(self, facts: dict[str, Any]) -> dict[str, Any]:
        return {"engine": facts.get("engine") if facts.get("method") else None,
                "gpu_seconds_apportioned": facts.get("gpu_seconds"), "engine_cost": facts.get("cost"),
                "cost_basis": facts.get("cost_basis"), "cost_category": facts.get("category"),
                "saved_gpu_seconds": float(sum((facts.get("saved_gpu_seconds") or {}).values(), 0.0)),
                "wasted_gpu_seconds": float(sum((facts.get("wasted_gpu_seconds") or {}).values(), 0.0)),
                "retries": facts.get("retries") or 0, "saved_tokens": facts.get("saved_tokens") or 0,
                "saved_cost": float(facts.get("saved_cost") or 0.0)}

    def enrich(self, row: dict[str, Any]) -> None:
        """Ledger hook (gateway/budget/ledger.py): a row the budget stage files gets this request's cost. A
        priced response-cache hit (category cache_hit, filed by the budget stage, which also set its saved
        tokens and money) never reached an engine: no engine time, no cost, the GPU-seconds a like request costs
        saved (what the meter's own row for a free hit says)."""
        rid = row.get("request_id")
        f = self._facts.pop(rid, None) if isinstance(rid, str) else None
        d = self._dims.pop(rid, None) if isinstance(rid, str) else None
        row.update(d if d is not None else self._dims_of_current(rid))
        if f is not None:
            row.update(f)
        elif row.get("cost_category") == "cache_hit":
            tokens = int(row.get("prompt_tokens") or 0) + int(row.get("completion_tokens") or 0)
            saved, _ = savings_and_waste("cache_hit", 0.0, 0.0, self.gpu_per_token * tokens)
            row.update({"engine": None, "gpu_seconds_apportioned": 0.0, "engine_cost": 0.0, "cost_basis": None,
                        "saved_gpu_seconds": float(sum(saved.values(), 0.0)), "wasted_gpu_seconds": 0.0,
                        "retries": 0})

    @staticmethod
    def _dims_of_current(rid: object) -> dict[str, str | None]:
        """The adapter/arm columns of a row the budget stage files for a request whose meter stage never ran (a
        priced response-cache hit answers before it): read from the request this task is finishing."""
        from gateway.observability.logs import current_request

        ctx = current_request.get()
        if ctx is None or ctx.request_id != rid:
            return {"adapter": None, "arm": None}
        return ledger_dims(ctx)

    def before_settle(self, ctx: RequestContext) -> None:
        """Runs after `close`, before the budget finish files the row: prices what is known and parks the
        ledger fields (the charge is added when the finish hook reprices)."""
        self._dims[ctx.request_id] = ledger_dims(ctx)
        if ctx.outcome.unit_cost is None:
            return
        facts = self.price(ctx, charged=False)
        self._priced[ctx.request_id] = facts
        self._facts[ctx.request_id] = self.ledger_fields(facts)

    async def finish(self, ctx: RequestContext) -> None:
        """Finish hook (after the budget settled and filed its row, before the audit record is written)."""
        self._facts.pop(ctx.request_id, None)
        self._dims.pop(ctx.request_id, None)
        facts = self._priced.pop(ctx.request_id, None)  # priced before the budget settled (before_settle)
        if not self.cfg.enabled:
            return
        if facts is None:
            if ctx.principal is None and ctx.outcome.unit_cost is None:
                return  # refused before anyone was identified: nothing to attribute
            facts = self.price(ctx)
        else:
            self._charge(facts, ctx)
        self._learn_per_token(facts, ctx)
        ctx.evidence["unit_cost"] = facts
        self._observe(ctx, facts)
        if ctx.outcome.charge is None:  # the budget stage filed no row (free cache hit, early refusal): file one
            self._file_row(ctx, facts)

    def _file_row(self, ctx: RequestContext, facts: dict[str, Any]) -> None:
        ledger = self._ledger()
        if ledger is None:
            return
        p = ctx.principal
        u = ctx.usage
        row = {
            "request_id": ctx.request_id, "ts": ctx.received_wall, "principal_id": p.id if p else None,
            "tenant": p.tenant if p else None, "team": p.team if p else None, "project": p.project if p else None,
            "key_id": p.key_id if p else None, "partner": p.partner if p else None,
            "end_user": p.end_user if p else None, "model": ctx.backend_model or ctx.model,
            "backend": ctx.backend, "prompt_tokens": u.prompt_tokens if u else 0,
            "completion_tokens": u.completion_tokens if u else 0, "cached_tokens": u.cached_tokens if u else None,
            "total_tokens": u.total_tokens if u else 0, "cost": 0.0, "currency": self.cfg.currency,
            "gpu_seconds": None, "status": ctx.status, "cut_by_budget": ctx.cut_by_budget, "budget_store": None,
            "client_request_id": ctx.client_request_id, **self.ledger_fields(facts), **ledger_dims(ctx),
        }
        try:
            ledger.enqueue(row)
        except Exception:
            log.exception("ledger row for %s failed", ctx.request_id)

    def _observe(self, ctx: RequestContext, f: dict[str, Any]) -> None:
        backend = f.get("backend") or "none"
        model = ctx.backend_model or ctx.model or ""
        cat = f["category"]
        key = (backend, model, cat)
        t = self.totals.get(key)
        if t is None:
            t = self.totals[key] = {"requests": 0, "gpu_seconds": 0.0, "cost": 0.0, "charged": 0.0, "tokens": 0,
                                    "saved_gpu_seconds": 0.0, "wasted_gpu_seconds": 0.0, "saved_tokens": 0,
                                    "saved_cost": 0.0}
        u = ctx.usage
        tokens = u.total_tokens if u is not None else 0
        saved_by, wasted_by = f["saved_gpu_seconds"], f["wasted_gpu_seconds"]
        saved = sum(saved_by.values()) if saved_by else 0.0
        wasted = sum(wasted_by.values()) if wasted_by else 0.0
        gpu_s = f.get("gpu_seconds") or 0.0
        cost = f.get("cost") or 0.0
        charged = f.get("charged") or 0.0
        t["requests"] += 1
        t["gpu_seconds"] += gpu_s
        t["cost"] += cost
        t["charged"] += charged
        t["tokens"] += tokens
        t["saved_gpu_seconds"] += saved
        t["wasted_gpu_seconds"] += wasted
        t["saved_tokens"] += int(f.get("saved_tokens") or 0)  # response-cache hits (docs/cache.md#price)
        t["saved_cost"] += float(f.get("saved_cost") or 0.0)
        self.recent.append((time.time(), backend, model, cat, gpu_s, cost, charged, tokens, saved, wasted))
        self._observe_dims(ctx, gpu_s, cost, tokens)
        m = self.metrics
        if m is None:
            return
        ch = self._children.get(key)
        if ch is None:
            if len(self._children) > 10_000:  # bounded: label values are bounded, this is a safety net
                self._children.clear()
            ch = self._children[key] = tuple(
                metric.labels(backend, model, cat)
                for metric in (m.cost_requests, m.cost_gpu_seconds, m.cost_amount, m.cost_charged, m.cost_tokens))
        ch[0].inc()
        if gpu_s:
            ch[1].inc(gpu_s)
        if cost:
            ch[2].inc(cost)
        if charged:
            ch[3].inc(charged)
        if tokens:
            ch[4].inc(tokens)
        c = m.child
        for reason, v in saved_by.items():
            c(m.cost_saved, backend, model, reason).inc(v)
        for reason, v in wasted_by.items():
            c(m.cost_wasted, backend, model, reason).inc(v)

    def _observe_dims(self, ctx: RequestContext, gpu_s: float, cost: float, tokens: int) -> None:
        """Per adapter and per arm: the running totals (/admin/cost `by_adapter`, `by_arm`) and /metrics."""
        adapter, arm = adapter_of(ctx), arm_of(ctx)
        for key in ((("adapter", adapter),) if adapter is not None else ()) + \
                   ((("arm", arm_label(*arm)),) if arm is not None else ()):
            t = self.by_dim.get(key)
            if t is None:
                t = self.by_dim[key] = {"requests": 0, "tokens": 0, "gpu_seconds": 0.0, "cost": 0.0}
            t["requests"] += 1
            t["tokens"] += tokens
            t["gpu_seconds"] += gpu_s
            t["cost"] += cost
        if self.dims is not None and (adapter is not None or arm is not None):
            self.dims.observe(adapter, arm, gpu_s)

    # ------------------------------------------------------------------ views
    def dim_snapshot(self, dim: str) -> list[dict[str, Any]]:
        """Totals per adapter (`dim` "adapter") or per arm ("arm"), ordered by name."""
        return [{dim: name, **{k: round(v, 9) if isinstance(v, float) else v for k, v in t.items()}}
                for (d, name), t in sorted(self.by_dim.items()) if d == dim]

    def engines_snapshot(self) -> dict[str, dict[str, float]]:
        """Per engine: busy time this gateway saw, GPU-seconds charged, prefill share, requests on it now."""
        now = self.clock()
        out = {}
        for name, ec in sorted(self.engines.items()):
            ec._advance(now)
            out[name] = {"busy_s": round(ec.busy_s, 6), "charged_s": round(ec.charged_s, 6),
                         "prefill_s": round(ec.prefill_paid_s, 6), "prefill_share": round(ec.prefill_share(), 4),
                         "in_flight": ec.n}
        return out

    def by_model(self) -> list[dict[str, Any]]:
        """Per (backend, model), all categories together: the unit economics the dashboard and report show."""
        acc: dict[tuple[str, str], dict[str, Any]] = {}
        for (b, m, cat), t in self.totals.items():
            a = acc.setdefault((b, m), {"backend": b, "model": m, "requests": 0, "tokens": 0, "gpu_seconds": 0.0,
                                        "cost": 0.0, "charged": 0.0, "saved_gpu_seconds": 0.0,
                                        "wasted_gpu_seconds": 0.0, "saved_tokens": 0, "saved_cost": 0.0,
                                        "categories": {}})
            for k in ("requests", "tokens", "gpu_seconds", "cost", "charged", "saved_gpu_seconds",
                      "wasted_gpu_seconds", "saved_tokens", "saved_cost"):
                a[k] += t[k]
            a["categories"][cat] = a["categories"].get(cat, 0) + t["requests"]
        out = []
        for key in sorted(acc):
            a = acc[key]
            tok = a["tokens"]
            a["cost_per_1m_tokens"] = a["cost"] / tok * 1e6 if tok else None
            a["charged_per_1m_tokens"] = a["charged"] / tok * 1e6 if tok else None
            a["margin"] = a["charged"] - a["cost"]
            out.append(a)
        return out

    def snapshot(self) -> dict[str, Any]:
        rows = [{"backend": b, "model": m, "category": c, **{k: round(v, 9) for k, v in t.items()}}
                for (b, m, c), t in sorted(self.totals.items())]
        up = max(self.clock() - self.started, 1e-9)
        engines = {n: {**e, "utilisation": round(min(1.0, e["busy_s"] / up), 4)}
                   for n, e in self.engines_snapshot().items()}
        return {"currency": self.cfg.currency, "started_at": self.started_at, "engines": engines, "totals": rows,
                "by_model": self.by_model(), "by_adapter": self.dim_snapshot("adapter"),
                "by_arm": self.dim_snapshot("arm"), "recent": [dict(zip(_RECENT, r)) for r in self.recent]}
