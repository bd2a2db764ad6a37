"""BudgetService: turns a Decision's BudgetSpecs into an atomic reserve/settle against the configured store,
applies the store-failure mode (fail closed with 503, or fail open to per-replica local limits), builds the
x-ratelimit-* headers, 429s and evidence, and hands spend rows to the ledger outbox. Every dimension-specific step
(units, worst case, usage, header, 429 code, message) comes from the table in gateway/budget/dimensions.py.
"""
from __future__ import annotations

import asyncio
import functools
import os
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable
from zoneinfo import ZoneInfo

from gateway.budget.config import BudgetsConfig, ModelPrice, counters_path, effective_store
from gateway.budget.dimensions import (BY_NAME, CONCURRENCY, COUNTED, HELD, NANO, Dimension, ReserveFacts,
                                       SettleFacts, settled_values)
from gateway.budget.ledger import Ledger
from gateway.budget.model import COUNTED_AT, HELD_AT, ReserveArgs, ReserveResult, ScopePlan, SettleArgs, WindowPlan, by_counted
from gateway.budget.pricing import convert, cost, find_price
from gateway.budget.store import BudgetStore, MemoryBudgetStore, RedisBudgetStore, SqliteBudgetStore, StoreUnavailable
from gateway.budget.windows import ROLLING, format_reset, resolve
from gateway.errors import GatewayError, retry_headers
from gateway.types import BudgetSpec, Principal, Usage

if TYPE_CHECKING:
    from gateway.pipeline import RequestContext

log = logging.getLogger("gateway.budget")

REQUEST_SLACK_S = 60.0
"""Added to the longest request the backends allow (longest `timeouts.total_s` + routing's batch queue wait):
connect failures and retries before the serving attempt, and the settle itself. See `longest_request_s`."""
_DEFAULT_TOTAL_S = 600.0  # gateway.config.Timeouts.total_s: what a backend without its own timeouts gets


Limits = tuple[tuple[str, str, "int | None", tuple[tuple[str, tuple["int | None", ...]], ...]], ...]
"""Per scope of the principal with a limit: (scope, id, concurrency, ((window, limit in store units per counted
dimension, None where not limited), ...)), most specific scope first."""

GpuEstimate = Callable[[tuple[str, ...]], tuple[float, float]]
"""The learned worst case of a request's apportioned GPU-seconds over the given backends (every backend that may
serve the chain; empty: the whole fleet): (GPU-seconds per prompt token, GPU-seconds per completion token).
Provided by the cost meter (gateway/cost/meter.py CostMeter.gpu_worst_case, wired in gateway/cost/wiring.py)."""


@dataclass(slots=True)
class Reservation:
    """The handle the stage keeps in ctx.budget until settle."""

    rid: str
    store: str  # "primary" | "local"
    limits: Limits
    scale: float
    reserved: tuple[int, ...]  # per held dimension: the units held
    completion: int
    result: ReserveResult
    args: ReserveArgs
    settled: bool = False


@dataclass(slots=True)
class ReserveOutcome:
    reservation: Reservation
    headers: dict[str, str]
    evidence: dict[str, Any]
    allowance: int | None  # completion tokens the response may still produce when uncapped


@dataclass(slots=True)
class SettleOutcome:
    cost: float
    currency: str
    tokens: int
    row: dict[str, Any] = field(default_factory=dict)
    gpu_seconds: float | None = None  # the GPU-seconds charged (given, or measured from reserve to settle)
    settled: dict[str, float] = field(default_factory=dict)  # per held dimension: what replaced the hold


def _min(a: Any, b: Any) -> Any:
    return b if a is None else a if b is None else min(a, b)


class BudgetService:
    """Owns the store(s), the ledger and the failure mode. Built once per process; `swap_config` on reload."""

    def __init__(self, config: Any, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._config = config
        self.cfg: BudgetsConfig = config.raw.budgets
        self.tz = ZoneInfo(self.cfg.timezone)
        self.primary: BudgetStore = self._make_store(self.cfg)
        self.local = MemoryBudgetStore(None)  # fail-open fallback (per replica)
        self.ledger = Ledger.from_config(config)
        self._down_until = 0.0
        self._pending: list[SettleArgs] = []  # settles the primary could not take yet, replayed in order
        self._retry_task: asyncio.Task[None] | None = None
        # (scopes, budgets, scale) -> merged limits and the dimensions they limit; cleared on swap
        self._limits_cache: dict[tuple[object, ...], tuple[Limits, frozenset[str]]] = {}
        self._period_cache: dict[str, Any] = {}  # calendar window -> WindowRef valid until its end
        self._price_cache: dict[tuple[str, ...], tuple[float, float, float]] = {}  # model chain -> worst price
        self.hold_ttl_s = self._hold_ttl()
        self._gpu_estimate: GpuEstimate | None = None  # the cost meter's learned worst case (set_gpu_estimator)

    def set_gpu_estimator(self, estimate: GpuEstimate | None) -> None:
        """The read-only hook GPU-second budgets reserve with (the cost meter's learned worst case). Without one
        a GPU-second limit cannot be enforced (settle would have no apportioned figure): reserve refuses it."""
        self._gpu_estimate = estimate

    def _make_store(self, cfg: BudgetsConfig) -> BudgetStore:
        # a worker of `gateway serve --workers N` is told N by its supervisor (gateway/workers.py)
        self.store_kind = effective_store(cfg, int(os.environ.get("GATEWAY_WORKERS") or 1))
        if self.store_kind == "redis":
            # ${VAR} in the URL is expanded so a password can come from a Secret, not the ConfigMap
            return RedisBudgetStore(os.path.expandvars(cfg.redis_url), cfg.redis_timeout_s)
        if self.store_kind == "sqlite":  # shared by the workers of this host
            return SqliteBudgetStore(counters_path(self._config.resolve_path(cfg.sqlite_path)))
        return MemoryBudgetStore(self._config.resolve_path(cfg.sqlite_path), cfg.snapshot_interval_s)

    async def start(self) -> None:
        log.info("budget store: %s%s", self.store_kind,
                 f" ({counters_path(self._config.resolve_path(self.cfg.sqlite_path))}, shared by this host's workers)"
                 if self.store_kind == "sqlite" else "")
        await self.primary.start()
        await self.ledger.start()
        self._retry_task = asyncio.create_task(self._retry_loop(), name="budget-settle-retry")

    async def close(self) -> None:
        if self._retry_task is not None:
            self._retry_task.cancel()
            try:
                await self._retry_task
            except asyncio.CancelledError:
                pass
        await self._flush_pending()
        await self.primary.close()
        await self.ledger.close()

    def check_config(self, config: Any) -> None:
        """A reload (gateway.app.Reloadable): what load_config validated is all (the store is kept as it is)."""

    def swap_config(self, config: Any) -> None:
        """Take new limits/prices/timezone now; the store itself is kept (a store change needs a restart)."""
        self._config = config
        self.cfg = config.raw.budgets
        self.tz = ZoneInfo(self.cfg.timezone)
        self._limits_cache = {}
        self._period_cache = {}
        self._price_cache = {}
        self.hold_ttl_s = self._hold_ttl()

    def longest_request_s(self, backends: Iterable[str] | None = None) -> float:
        """The longest a request may run between its reservation and its settle, over `backends` (names; None
        = every configured backend): the longest `timeouts.total_s` (one attempt's limit, streams included) +
        `routing.batch_queue_timeout_s` (admission may queue it after the reservation) + REQUEST_SLACK_S."""
        raw = self._config.raw
        names = None if backends is None else set(backends)
        totals = [b.timeouts.total_s for b in raw.backends if names is None or b.name in names]
        if not totals:  # nothing known serves it: every configured backend, else the default timeout
            totals = [b.timeouts.total_s for b in raw.backends] or [_DEFAULT_TOTAL_S]
        return max(totals) + raw.routing.batch_queue_timeout_s + REQUEST_SLACK_S

    def _hold_ttl(self) -> float:
        """Holds must outlive the longest request, else a slow request's hold lapses while it runs and the
        concurrency/token/money checks of other requests no longer see it. So the effective hold expiry is
        max(reservation_ttl_s, longest_request_s()): a shorter reservation_ttl_s is raised, not refused, so
        every config that loaded before still loads. One value for all requests (a per-request value would let
        a short hold shorten the expiry of a scope's hold keys under a long one)."""
        floor = self.longest_request_s()
        ttl = max(self.cfg.reservation_ttl_s, floor)
        if ttl > self.cfg.reservation_ttl_s:
            log.info("budget holds expire after %.0fs: budgets.reservation_ttl_s=%gs is raised to the longest "
                     "request the backends allow (longest timeouts.total_s + routing.batch_queue_timeout_s + %gs)",
                     ttl, self.cfg.reservation_ttl_s, REQUEST_SLACK_S)
        return ttl

    @property
    def available(self) -> bool:
        return self.clock() >= self._down_until

    # ------------------------------------------------------------------------------------ planning (pure)

    def limits_for(self, principal: Principal, budgets: tuple[BudgetSpec, ...], scale: float = 1.0) -> Limits:
        """Merge specs per (scope, window) (the tightest wins) over the principal's scopes, most specific first."""
        return self._limits(principal, budgets, scale)[0]

    def _limits(self, principal: Principal, budgets: tuple[BudgetSpec, ...], scale: float
                ) -> tuple[Limits, frozenset[str]]:
        """limits_for, and the dimensions some window of them limits (cached together)."""
        ids = tuple(principal.budget_scopes())
        ck = (ids, budgets, scale)
        hit = self._limits_cache.get(ck)
        if hit is not None:
            return hit
        limits = self._merge(ids, budgets, scale)
        out = limits, frozenset(d.name for _, _, _, wins in limits for _, lim in wins
                                for d, v in zip(COUNTED, lim) if v is not None)
        if len(self._limits_cache) > 10_000:
            self._limits_cache.clear()
        self._limits_cache[ck] = out
        return out

    def _merge(self, ids: tuple[tuple[str, str], ...], budgets: tuple[BudgetSpec, ...], scale: float) -> Limits:
        out = []
        for scope, sid in ids:
            conc: int | None = None
            wins: dict[str, dict[str, int]] = {}
            for b in budgets:
                if b.scope != scope:
                    continue
                lim: dict[str, int] = {}
                for name, value in b.limits:
                    if name == CONCURRENCY.name:
                        conc = _min(conc, self._units(CONCURRENCY, value, b, scale))
                    else:
                        lim[name] = self._units(BY_NAME[name], value, b, scale)
                if not lim:
                    continue
                resolve(b.window, 0.0, self.tz)  # validates the window name
                old = wins.get(b.window)
                if old is not None:  # the tightest of each dimension, in table order
                    lim = {d.name: _min(old.get(d.name), lim.get(d.name)) for d in COUNTED
                           if d.name in old or d.name in lim}
                wins[b.window] = lim
            if conc is not None or wins:
                out.append((scope, sid, conc, tuple((w, by_counted(lim)) for w, lim in
                                                    sorted(wins.items(), key=lambda kv: _WORDER[kv[0]]))))
        return tuple(out)

    def _units(self, d: Dimension, value: float, spec: BudgetSpec, scale: float) -> int:
        """A policy limit in store units, scaled (fail-open: the local fraction); money in the budget currency."""
        if d.currency:
            value = convert(value, spec.currency, self.cfg.currency, self.cfg.fx_rates)
        return max(0, math.floor(value * d.unit * scale))

    def _scopes(self, limits: Any, now: float) -> tuple[ScopePlan, ...]:
        pre = self.cfg.key_prefix
        plans = []
        for scope, sid, conc, wins in limits:
            base = f"{pre}:{scope}:{sid}"
            wps = []
            for window, lim in wins:
                ref = self._resolve(window, now)
                if ref.rolling:
                    ttl = ref.bucket_s * ref.buckets * 2
                elif math.isfinite(ref.end):
                    ttl = int(ref.end - now) + 86400
                else:
                    ttl = 0
                wps.append(WindowPlan(window, f"{base}:{ref.key_suffix()}", ref.rolling, ref.bucket, ref.buckets,
                                      ref.bucket_s, ref.end, ttl, lim))
            plans.append(ScopePlan(scope, sid, f"{base}:hold", conc, tuple(wps)))
        return tuple(plans)

    def _resolve(self, window: str, now: float) -> Any:
        """resolve() with calendar periods cached until they end (zoneinfo arithmetic is the slow part)."""
        if window in ROLLING:
            return resolve(window, now, self.tz)
        ref = self._period_cache.get(window)
        if ref is None or not (ref.start <= now < ref.end):
            r = resolve(window, now, self.tz)
            ref = _Period(r, r.start_ts, r.end)
            self._period_cache[window] = ref
        return ref.ref

    def _price(self, models: tuple[str, ...], batch: bool = False, cache_hit: bool = False
               ) -> tuple[float, float, float]:
        """Worst-case (input, output, fixed) nano-units (per token; fixed per request) over every (backend,
        model) the request may be charged at: each model of the chain with each backend serving any of them
        (the route is not planned yet, and retries or spills may land on any of them), each pair priced as
        settle prices it (`<backend>:<model>`, else `<model>`). A model no configured backend serves is also
        priced without a backend. `cache_hit`: a response-cache hit, priced at each model's `cache_hit` rate with
        no backend and nothing per GPU-second. Cached per chain until the next config swap."""
        ck = (*models, "\x00batch") if batch else (*models, "\x00hit") if cache_hit else models
        hit = self._price_cache.get(ck)
        if hit is not None:
            return hit
        cfg = self.cfg
        serving = self._config.models  # model -> names of the backends serving it
        backends = sorted({b for m in models for b in serving.get(m, ())})
        gpu_s = cfg.reserve_gpu_seconds
        if gpu_s is None:
            gpu_s = self.longest_request_s(backends)
        pin = pout = fixed = 0.0
        for m in models:
            for b in ((None,) if cache_hit else backends if m in serving else (*backends, None)):
                p: ModelPrice | None = find_price(m, cfg.prices, b, batch, cache_hit)
                if p is None:
                    continue
                fx = convert(1.0, p.currency, cfg.currency, cfg.fx_rates)
                pin = max(pin, p.input * fx * 1000)  # per million tokens == nano-units per token / 1000
                pout = max(pout, p.output * fx * 1000)
                if p.gpu_second is not None:
                    fixed = max(fixed, p.gpu_second * fx * gpu_s * NANO)
        out = (pin, pout, fixed)
        if len(self._price_cache) > 10_000:
            self._price_cache.clear()
        self._price_cache[ck] = out
        return out

    # ------------------------------------------------------------------------------------ reserve

    async def reserve(self, rid: str, principal: Principal, budgets: tuple[BudgetSpec, ...],
                      models: tuple[str, ...], prompt_tokens: int, max_tokens: int | None,
                      max_tokens_cap: int | None = None, batch: bool = False, cache_hit: bool = False,
                      request: RequestContext | None = None) -> ReserveOutcome:
        """Reserve the worst case over every scope x window, or raise GatewayError 429/503. `cache_hit`: an
        answer from the response cache (its usage is known: `prompt_tokens` and `max_tokens` are the stored
        usage), priced at the cache price and using no GPU-seconds. `request`: the RequestContext, for the
        dimensions' worst cases (ReserveFacts.request)."""
        cfg = self.cfg
        now = self.clock()
        default_cap = _min(cfg.default_max_tokens, max_tokens_cap)
        max_c = max_tokens if max_tokens is not None else default_cap
        min_c = max_c if max_tokens is not None else min(cfg.min_completion_tokens, max_c)
        store_name, store, scale = "primary", self.primary, 1.0
        if now < self._down_until:
            store_name, store, scale = self._fallback(now)
        limits, limited = self._limits(principal, budgets, scale)
        if not limits:
            raise _NoLimits()
        facts = ReserveFacts(prompt_tokens, self._price(models, batch, cache_hit), limited, cache_hit,
                             functools.partial(self._gpu_per_token, models), request)
        worst = [d.reserve(facts) for d in HELD]  # type: ignore[misc]
        args = self._reserve_args(rid, now, limits, max_c, min_c, worst)
        try:
            res = await store.reserve(args)
        except StoreUnavailable as e:
            if store_name != "primary":
                raise
            self._down_until = self.clock() + cfg.redis_retry_s
            log.warning("budget store unavailable (%s); mode=%s", e, cfg.on_store_error)
            store_name, store, scale = self._fallback(now)
            limits = self.limits_for(principal, budgets, scale)
            args = self._reserve_args(rid, now, limits, max_c, min_c, worst)
            res = await store.reserve(args)
        resv = Reservation(rid, store_name, limits, scale, args.held(res.completion), res.completion, res, args)
        headers = self._headers(args, res, resv, now)
        evidence = self._evidence(args, res, resv)
        if not res.ok:
            raise self._refusal(args, res, now, headers, evidence)
        allowance = res.completion if (max_tokens is None and res.completion < default_cap) else None
        return ReserveOutcome(resv, headers, evidence, allowance)

    def _fallback(self, now: float) -> tuple[str, BudgetStore, float]:
        if self.cfg.on_store_error != "open":
            raise GatewayError(503, "The budget store is unavailable; the request was not sent (fail-closed).",
                               code="budget_store_unavailable", headers=retry_headers(self.cfg.redis_retry_s))
        return "local", self.local, self.cfg.fail_open_fraction

    def _reserve_args(self, rid: str, now: float, limits: Limits, max_c: int, min_c: int,
                      worst: list[tuple[int, int]]) -> ReserveArgs:
        """`worst`: per held dimension, (units held whatever the completion, units per completion token)."""
        ttl = self.hold_ttl_s
        return ReserveArgs(
            rid=rid, now=round(now, 3), expires=round(now + ttl, 3), hold_ttl_s=int(ttl) + 60, max_completion=max_c,
            min_completion=min_c, scopes=self._scopes(limits, now), fixed=tuple([f for f, _ in worst]),
            per_token=tuple([p for _, p in worst]))

    def _gpu_per_token(self, models: tuple[str, ...]) -> tuple[float, float]:
        """The GPU-seconds a request may be apportioned per prompt token and per completion token: the cost
        meter's learned worst case over every backend that may serve the chain (the route is not planned yet;
        retries and spills may land on any). Asked only when a limit of the request is in GPU-seconds (its
        holds carry none otherwise, and settle still counts what it used)."""
        if self._gpu_estimate is None:
            raise GatewayError(500, "A GPU-second budget applies but the cost meter that measures GPU-seconds is "
                               "not running (cost.enabled: false).", code="budget_misconfigured")
        serving = self._config.models  # model -> names of the backends serving it
        backends = tuple(sorted({b for m in models for b in serving.get(m, ())}))
        return self._gpu_estimate(backends)

    # ------------------------------------------------------------------------------------ settle

    async def settle(self, resv: Reservation, usage: Usage, model: str, backend: str | None = None,
                     gpu_seconds: float | None = None, batch: bool = False,
                     apportioned_gpu_seconds: float = 0.0, cache_hit: bool = False,
                     request: RequestContext | None = None) -> SettleOutcome:
        """Replace the hold with actual usage. Never loses spend: a failed primary settle is queued and replayed.

        A GPU-second-priced model served by `backend` without `gpu_seconds` given is charged the wall time
        from this reservation to now (what the gateway held the request for: it bounds the engine's time).
        `apportioned_gpu_seconds` (the engine time the cost meter apportioned to the request; 0 when no engine
        of ours served it) is what every window's GPU-seconds counter is charged. `cache_hit`: priced at the
        cache price (find_price). `request`: the RequestContext, for the dimensions' usage (SettleFacts.request)."""
        if resv.settled:
            raise RuntimeError(f"reservation {resv.rid} settled twice")
        resv.settled = True
        now = self.clock()
        p = find_price(model, self.cfg.prices, backend, batch, cache_hit)
        if gpu_seconds is None and backend is not None and p is not None and p.gpu_second is not None:
            gpu_seconds = max(0.0, round(now - resv.args.now, 3))
        ccy = self.cfg.currency
        amount = cost(model, usage, self.cfg.prices, gpu_seconds, backend, batch, cache_hit)
        if p is not None:
            amount = convert(amount, p.currency, ccy, self.cfg.fx_rates)
        # the in-process fail-open store cannot lose a reply: no marker there (it would never be purged)
        marker = ("", 0) if resv.store == "local" else self._done_marker(resv.rid)
        settled = settled_values(SettleFacts(usage, amount, apportioned_gpu_seconds, request))
        args = SettleArgs(resv.rid, round(now, 3), tuple([round(settled[d.name] * d.unit) for d in HELD]),
                          self._scopes(resv.limits, now), *marker)
        if resv.store == "local":
            await self.local.settle(args)
        else:
            if self._pending:
                self._pending.append(args)
            else:
                try:
                    await self.primary.settle(args)
                except StoreUnavailable as e:
                    log.warning("budget settle of %s deferred: %s", resv.rid, e)
                    self._down_until = self.clock() + self.cfg.redis_retry_s
                    self._pending.append(args)
        return SettleOutcome(amount, ccy, usage.total_tokens, gpu_seconds=gpu_seconds, settled=settled)

    def _done_marker(self, rid: str) -> tuple[str, int]:
        """Idempotency marker of a settle on the shared store (Redis), so a settle replayed after its reply was
        lost is not charged twice. It lives `reservation_ttl_s` + 5 minutes from the settle (the configured
        value, not the raised hold expiry: the marker guards replays after an outage, not the hold, and its
        life is memory per settled request); a replay later than that (a store outage that began between
        executing a settle and answering it, and lasted longer) may charge twice: spend is over-counted, never
        lost. The in-process stores cannot lose a reply and get no marker."""
        if self.cfg.store != "redis":
            return "", 0
        return f"{self.cfg.key_prefix}:settled:{rid}", int(self.cfg.reservation_ttl_s) + 300

    def price(self, model: str, usage: Usage, backend: str | None = None, gpu_seconds: float | None = None,
              batch: bool = False, cache_hit: bool = False) -> float:
        """Cost of `usage` in the budget currency (for requests without a reservation)."""
        p = find_price(model, self.cfg.prices, backend, batch, cache_hit)
        if p is None:
            return 0.0
        return convert(cost(model, usage, self.cfg.prices, gpu_seconds, backend, batch, cache_hit), p.currency,
                       self.cfg.currency, self.cfg.fx_rates)

    async def _flush_pending(self) -> None:
        while self._pending:
            try:
                applied = await self.primary.settle(self._pending[0])
            except StoreUnavailable:
                return
            if not applied:  # the first try executed but its reply was lost: the marker kept it from counting twice
                log.info("budget settle of %s had already landed; replay ignored", self._pending[0].rid)
            self._pending.pop(0)

    async def _retry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.redis_retry_s / 2)
            if self._pending:
                await self._flush_pending()

    # ------------------------------------------------------------------------------------ headers/evidence

    def _iter(self, args: ReserveArgs, res: ReserveResult):
        for s, st in zip(args.scopes, res.scopes):
            for w, ws in zip(s.windows, st.windows):
                yield s, st, w, ws

    def _reset_s(self, w: WindowPlan, ws: Any, now: float) -> float | None:
        if w.rolling:
            return max((ws.oldest_bucket + w.buckets) * w.bucket_s - now, 0.001)
        return w.end - now if math.isfinite(w.end) else None

    def _headers(self, args: ReserveArgs, res: ReserveResult, resv: Reservation, now: float) -> dict[str, str]:
        """x-ratelimit-{limit,remaining,reset}-<header> of the binding (least remaining) limit of each dimension
        with a header (requests, tokens, gpu-seconds: in seconds, to the millisecond)."""
        best: dict[str, tuple[int, int, float | None, Callable[[int, str], str]]] = {}
        ok = res.ok
        for s, st, w, ws in self._iter(args, res):
            reset = self._reset_s(w, ws, now)
            lims, used, held = w.limits, ws.used, st.held
            for i, j, header, text in _HEADED:
                lim = lims[i]
                if lim is None:
                    continue
                if j is None:  # a count: this request is counted when admitted
                    rem = lim - used[i] - (1 if ok else 0)
                else:  # settled + held + (its own hold when admitted)
                    rem = lim - used[i] - held[j] - (resv.reserved[j] if ok else 0)
                if header not in best or rem < best[header][1]:
                    best[header] = (lim, rem, reset, text)
        h: dict[str, str] = {}
        ccy = self.cfg.currency
        for kind, (lim, rem, reset, text) in best.items():
            h[f"x-ratelimit-limit-{kind}"] = text(lim, ccy)
            h[f"x-ratelimit-remaining-{kind}"] = text(max(0, rem), ccy)
            if reset is not None:
                h[f"x-ratelimit-reset-{kind}"] = format_reset(reset)
        return h

    def _evidence(self, args: ReserveArgs, res: ReserveResult, resv: Reservation) -> dict[str, Any]:
        """Per window of each scope, in every counted dimension: its limit, and settled + held before and after
        this request (a count counts it, an amount holds its reservation), in policy units."""
        ok = res.ok
        adds = [(i, j, name, unit, (1 if j is None else resv.reserved[j]) if ok else 0)
                for i, j, name, unit in _COUNTED]
        limits = []
        for s, st, w, ws in self._iter(args, res):
            used, held, lims = ws.used, st.held, w.limits
            before: dict[str, float] = {}
            after: dict[str, float] = {}
            limit: dict[str, float | None] = {}
            for i, j, name, unit, add in adds:
                v = used[i] if j is None else used[i] + held[j]
                lim = lims[i]
                if unit == 1:
                    before[name], after[name], limit[name] = v, v + add, lim
                else:
                    before[name], after[name] = v / unit, (v + add) / unit
                    limit[name] = None if lim is None else lim / unit
            limits.append({"scope": s.scope, "id": s.scope_id, "window": w.window, "limit": limit,
                           "before": before, "after": after})
        for s, st in zip(args.scopes, res.scopes):
            if s.concurrency is not None:
                limits.append({"scope": s.scope, "id": s.scope_id, "window": "concurrent",
                               "limit": {CONCURRENCY.name: s.concurrency}, "before": {CONCURRENCY.name: st.holds},
                               "after": {CONCURRENCY.name: st.holds + (1 if res.ok else 0)}})
        ev: dict[str, Any] = {"store": resv.store, "currency": self.cfg.currency, "limits": limits,
                              "reserved": {**{d.name: d.value(v) for d, v in zip(HELD, resv.reserved)},
                                           "completion_tokens": resv.completion}}
        for d, fixed, per in zip(HELD, args.fixed, args.per_token):  # a learned worst case used (GPU-seconds:
            if d.worst_case and (fixed or per):  # only when such a limit applies)
                ev[d.worst_case] = {f"prompt_{d.name}": d.value(fixed), f"{d.name}_per_completion_token": d.value(per)}
        if not res.ok:
            ev["refused"] = {"kind": res.fail_kind, "scope": args.scopes[res.fail_scope].scope,
                             "window": "concurrent" if res.fail_window < 0
                             else args.scopes[res.fail_scope].windows[res.fail_window].window}
        return ev

    def _refusal(self, args: ReserveArgs, res: ReserveResult, now: float, headers: dict[str, str],
                 evidence: dict[str, Any]) -> GatewayError:
        s = args.scopes[res.fail_scope]
        kind = res.fail_kind
        if res.fail_window < 0:
            retry, what = 1.0, f"{s.scope} concurrency limit of {s.concurrency} requests"
            code = "rate_limit_exceeded"
        else:
            w = s.windows[res.fail_window]
            ws = res.scopes[res.fail_scope].windows[res.fail_window]
            reset = self._reset_s(w, ws, now)
            retry = reset if reset is not None else 86400.0
            d = BY_NAME[kind]
            what = f"{s.scope} {kind} limit of {d.text(w.limit(kind) or 0, self.cfg.currency)} per {w.window}"
            quota = d.quota == "always" or (d.quota == "calendar" and w.window not in ROLLING)
            code = "insufficient_quota" if quota else "rate_limit_exceeded"
        msg = (f"Rate limit reached: {what} for {s.scope} {s.scope_id!r}."
               if code == "rate_limit_exceeded" else
               f"You exceeded your current quota: {what} for {s.scope} {s.scope_id!r}.")
        hdrs = dict(headers)
        hdrs.update(retry_headers(retry))
        return GatewayError(429, msg, code=code, headers=hdrs, extra={"budget": evidence.get("refused")})


@dataclass(frozen=True, slots=True)
class _Period:
    ref: Any
    start: float
    end: float


class _NoLimits(Exception):
    """No spec applies to this principal's scopes; the stage does nothing."""


_WORDER = {w: i for i, w in enumerate(("minute", "hour", "day", "month", "lifetime"))}
# the dimensions whose binding limit is sent as x-ratelimit-{limit,remaining,reset}-<header>: (position among the
# counted ones, among the held ones (None: a count), header, how a value reads)
_HEADED = tuple((COUNTED_AT[d.name], HELD_AT.get(d.name), d.header, d.text) for d in COUNTED if d.header)
# every counted dimension: (position, position among the held ones or None, name, store units per policy unit)
_COUNTED = tuple((i, HELD_AT.get(d.name), d.name, d.unit) for i, d in enumerate(COUNTED))
