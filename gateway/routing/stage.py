"""The route stage: candidates (residency first), per-engine TTFT prediction, plugin ordering, admission.

`candidates` is the hard filter (residency/retention of the policy decision, then health, then capability);
it runs before any plugin and cannot be configured away. `RouteStage` (plain round robin) stays for minimal
assemblies; `PredictiveRouteStage` is the product's router: it predicts each allowed engine's TTFT from the
KV index and engine load (when telemetry is attached) or the gateway's own in-flight counts, orders the
candidates with the configured strategy, refuses at once (429 ttft_slo_unattainable) what no engine can
serve in time, queues batch traffic, spills to partners where policy allows, and on finish feeds the observed
TTFT back into the chosen engine's learner.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import xxhash

from gateway.config import Config
from gateway.errors import GatewayError, retry_headers
from gateway.pipeline import RequestContext
from gateway.policy.residency import backend_allowed
from gateway.proxy.health import Health
from gateway.routing.admission import Admission, BatchQueue, QueueFull, decide, slo_ms
from gateway.routing.pending import PendingCache
from gateway.routing.plan import Candidate, RoutePlan
from gateway.routing.approx import ApproxPrefixIndex, text_blocks
from gateway.routing.plugin import EngineView, Scored, Strategy
from gateway.routing.registry import build_strategy, strategy_label
from gateway.routing.predictor import Features, Predictor, PredictorParams
from gateway.routing.view import Scrape, engine_view
from gateway.telemetry.index import RequestKeys
from gateway.types import Decision

APPROX_BLOCK_CHARS = 256
CHARS_PER_TOKEN = 4
_SALT_DEFAULT_SECRET = "policy-gateway-cache-salt-v1"


def residency_reason(decision: Decision | None, backend) -> str | None:
    """None when the backend may receive a request under this decision, else why not."""
    if decision is None:
        return None
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


def client_order(cands: list[Candidate], order: tuple[str, ...]) -> list[Candidate]:
    """The request's `provider.order` applied to the routed list: candidates whose backend name (or operator)
    is listed come first, in the client's order; the rest keep the router's order behind them. Stable, so
    among one listed name (an operator naming several backends) the router's choice still leads."""
    if not order:
        return cands
    rank = {name: i for i, name in reversed(list(enumerate(order)))}

    def key(c: Candidate) -> int:
        return min(rank.get(c.backend.name, len(order)), rank.get(c.backend.operator or "", len(order)))

    return sorted(cands, key=key)


def has_own_engine(config: Config, model_chain: tuple[str, ...] | list[str]) -> bool:
    """Does any of our own (non-partner) backends serve a model of the chain, whatever its health or residency?
    Only a model with none is partner-only (partners are then its route, not a spill)."""
    for model in model_chain:
        for name in config.models.get(model, ()):
            if config.backend(name).operator != "partner":
                return True
    return False


def split_partners(config: Config, ctx: RequestContext, plan: RoutePlan) -> tuple[list[Candidate], list[Candidate]]:
    """(own candidates, partner spill candidates). A model no own backend serves has its partners as the
    route (own). Otherwise partners are spill candidates only under `decision.spill_to_partner`, else dropped
    (filter "spill") - also when every own engine is excluded or down: then the request is refused (403/503)."""
    own = [c for c in plan.candidates if c.backend.operator != "partner"]
    partners = [c for c in plan.candidates if c.backend.operator == "partner"]
    if not own and not has_own_engine(config, ctx.model_chain):
        return partners, []
    d = ctx.decision
    if partners and not (d is not None and d.spill_to_partner):
        for c in partners:
            plan.dropped.append({"backend": c.backend.name, "model": c.model,
                                 "reason": "spill to partner not allowed by policy", "filter": "spill"})
        partners = []
    if not own and not partners:
        plan.candidates = []
        raise _no_candidates(ctx, plan)
    return own, partners


def _residency_rules(d: Decision | None, dropped: list[dict]) -> list[str]:
    """The policy rules behind residency drops: the residency rule for location reasons, the retention rule
    for retention reasons (each named once, in that order)."""
    if d is None:
        return []
    reasons = [x["reason"] for x in dropped if x["filter"] == "residency"]
    out = []
    if d.residency_rule and any(r.startswith("residency") for r in reasons):
        out.append(d.residency_rule)
    if d.retention_rule and any(r.startswith("retention") for r in reasons) and d.retention_rule not in out:
        out.append(d.retention_rule)
    return out


def _no_candidates(ctx: RequestContext, plan: RoutePlan) -> GatewayError:
    d = ctx.decision
    rules = _residency_rules(d, plan.dropped)
    named = " and ".join(f"'{r}'" for r in rules) or "the policy"
    # partners dropped because policy allows no spill are neither unavailable nor excluded by residency
    drops = [x for x in plan.dropped if x["filter"] != "spill"]
    spill = (" Partner routes serve this model only where policy sets spill_to_partner."
             if len(drops) < len(plan.dropped) else "")
    if drops and d is not None and all(x["filter"] == "residency" for x in drops):
        return GatewayError(403, f"No backend for '{ctx.model}' satisfies the residency/retention required by "
                            f"rule {named}.{spill}", code="residency_unsatisfiable")
    excluded = sum(1 for x in drops if x["filter"] == "residency")
    why = (f" ({excluded} other backend(s) are excluded by the residency/retention of rule {named}; the rest are "
           "unavailable right now)") if excluded else ""
    return GatewayError(503, f"No backend is available for model '{ctx.model}'.{why}{spill}",
                        code="no_backend_available", headers=retry_headers(1.0))


def last_chunk_from(n_tokens: int, cached: int, budget: int, block_size: int | None, held: int) -> int | None:
    """Where the last prefill chunk of a prompt starts, as an index into its blocks past the `held` ones the
    index holds (the pending cache's tail), or None when the prompt is computed in one step or in full chunks.
    The engine computes n_tokens - cached tokens in chunks of `budget` from `cached`; blocks that complete in the
    last (partial) chunk are the tail."""
    if not block_size or budget <= 0:
        return None
    work = n_tokens - cached
    if work <= budget or work % budget == 0:
        return None
    end = cached + (work // budget) * budget  # tokens computed before the last step
    return max(0, end // block_size - held)


def engine_part(ttft_s: float, elapsed_s: float) -> float:
    """What the engine learner is fit on: the TTFT after the prediction was made. The time from arrival to the
    prediction (parse, policy, the /tokenize round trip, this box's CPU contention) is known when predicting and
    is added to the prediction as measured; fitting it with engine features left it as noise (measured: the
    residuals' correlation with it was 0.84 at 32 req/s on 2 shared cores, where it was 21 ms p50, 56 ms p90)."""
    return max(1e-4, ttft_s - max(0.0, elapsed_s))


def early_refusal(target: float, lower_uppers_ms: list[float], lower_means_ms: list[float]) -> Admission | None:
    """The admission decision on lower bounds of every own engine's prediction (see
    PredictiveRouteStage._refuse_early): the Admission when it is a refusal, else None (decide after tokenizing).
    Realtime/standard traffic without a spill target only: batch queues and spills need the full prediction."""
    if not lower_uppers_ms:
        return None
    adm = decide(target, lower_uppers_ms, lower_means_ms, priority="standard", can_spill=False)
    return adm if adm.action == "reject" else None


def kv_view_evidence(stale: list[str], kv_view: Callable[[str], dict | None] | None) -> dict[str, dict]:
    """{engine: {stale, reason}} for the stale candidates' KV views (route.kv_views in the audit record).
    `kv_view` is TelemetryService.kv_view; an engine it has no state for (or a service without it) is
    recorded stale with reason None, since is_stale said so."""
    out: dict[str, dict] = {}
    for name in stale:
        v = kv_view(name) if kv_view is not None else None
        out[name] = {"stale": True, "reason": v.get("reason") if v else None}
    return out


def _unattainable(best: Candidate, target: float, retry_after_s: float, lower_bound: bool = False) -> GatewayError:
    """429 ttft_slo_unattainable with the best engine's prediction (a lower bound when refused before tokenizing)."""
    at_least = "at least " if lower_bound else ""
    return GatewayError(
        429, f"No allowed engine is predicted to meet the TTFT target of {target:g} ms "
             f"(best predicted {at_least}{best.predicted_ttft_ms:.0f} ms, "
             f"upper {best.predicted_ttft_upper_ms:.0f} ms).",
        code="ttft_slo_unattainable",
        headers={**retry_headers(retry_after_s), "x-predicted-ttft-ms": f"{best.predicted_ttft_ms:.0f}",
                 "x-predicted-ttft-upper-ms": f"{best.predicted_ttft_upper_ms:.0f}",
                 "x-ttft-slo-ms": f"{target:g}"},
        extra={"predicted_ttft_ms": best.predicted_ttft_ms, "ttft_slo_ms": target})


class RouteStage:
    """Builds the RoutePlan. Ordering within a model: round robin (minimal assemblies and tests)."""

    name = "route"

    def __init__(self, config: Callable[[], Config], health: Health) -> None:
        self._config = config
        self._health = health
        self._rr = itertools.count()

    async def run(self, ctx: RequestContext) -> None:
        if not ctx.model_chain:
            raise GatewayError(404, f"The model '{ctx.model}' does not exist or you do not have access to it.",
                               code="model_not_found", param="model")
        cfg = self._config()
        plan = candidates(cfg, ctx, self._health)
        ctx.evidence["dropped"] = plan.dropped
        if not plan.candidates:
            raise _no_candidates(ctx, plan)
        own, partners = split_partners(cfg, ctx, plan)  # partners after own: a fallback only where allowed
        plan.candidates = own + partners
        # rotate within each model group so load spreads; fallback models stay after primary ones
        n = next(self._rr)
        first_model = own[0].model
        primary = [c for c in own if c.model == first_model]
        rest = [c for c in own if c.model != first_model]
        k = n % len(primary)
        plan.candidates = primary[k:] + primary[:k] + rest + partners
        ctx.route = plan
        ctx.evidence["candidates"] = [c.to_evidence() for c in plan.candidates]

    async def finish(self, ctx: RequestContext) -> None:
        return None


# --------------------------------------------------------------------------------------------- pure helpers


def tenant_cache_salt(tenant: str, secret: str) -> str:
    """A per-tenant cache_salt vLLM accepts (<= 128 chars, no '@', '/', '\\' or NUL): a keyed hash, so the
    salt names no tenant and cannot be guessed by another tenant."""
    return "t" + xxhash.xxh3_128_hexdigest(secret.encode() + b"\x00" + tenant.encode())


def lora_name(cand: Candidate) -> str | None:
    """The LoRA adapter a candidate serves the request with (the KV index's lora key), or None for the base."""
    up = cand.backend.upstream_model(cand.model)
    return up if up in cand.backend.lora_adapters else None


def engine_cache_salt(ctx: RequestContext, secret_env: str | None) -> str | None:
    """The cache_salt the engine receives, or None (no salt: the shared prefix cache).

    Under the policy's cache isolation, the tenant's own salt (tenant_cache_salt). A client's own `cache_salt`
    is never forwarded as sent: it is namespaced by the caller's tenant (and, under isolation, combined with
    the tenant's salt), so no caller can present another tenant's salt - which is computable when
    `routing.cache_salt_secret_env` is unset - or share a prefix cache with another tenant by choosing the
    same string. Requests of one tenant with the same client salt still share their cache."""
    d = ctx.decision
    client = ctx.body.get("cache_salt")
    client = client if isinstance(client, str) else None
    isolate = d is not None and d.cache_isolation
    if not isolate and client is None:
        return None
    secret = (os.environ.get(secret_env, "") if secret_env else "") or _SALT_DEFAULT_SECRET
    tenant = ctx.principal.tenant if ctx.principal is not None else ""
    if client is None:
        return tenant_cache_salt(tenant, secret)
    return tenant_cache_salt(f"{tenant}\x00{'isolated' if isolate else 'shared'}\x00client:{client}", secret)


def session_id(headers: Any, names: list[str]) -> tuple[str, str] | None:
    """(header, value) of the first affinity header present with a usable id: 1-256 printable ASCII, so the
    affinity map and the audit record only ever hold bounded ids (a longer or binary value is ignored)."""
    if headers is None:
        return None
    for h in names:
        val = headers.get(h)
        if val:
            v = val.strip()
            if 0 < len(v) <= 256 and v.isascii() and v.isprintable():
                return h, v
    return None


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as plain text (for the approximate prefix tree)."""
    msgs = body.get("messages")
    if isinstance(msgs, list):
        from gateway.telemetry.tokens import render_messages_plain

        return render_messages_plain([m for m in msgs if isinstance(m, dict)])
    p = body.get("prompt", body.get("input", ""))
    return p if isinstance(p, str) else "".join(map(str, p)) if isinstance(p, list) else str(p)


@dataclass(slots=True)
class _Flight:
    """A request this gateway dispatched; counts as prefill work ahead until its first token."""

    ctx: RequestContext
    engine: str
    uncached: int
    started: float
    predicted_s: float
    features: dict[str, Features] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    blocks: list[int] = field(default_factory=list)
    telemetry: bool = False
    uppers: dict[str, float] = field(default_factory=dict)  # upper bound (s) admission used, per engine
    elapsed_s: float = 0.0  # time from arrival to the prediction: known, so not the learner's to predict

    def prefilling(self, now: float) -> bool:
        if self.ctx.ttft_s is not None:
            return False
        if self.ctx.stream:
            return True
        return now - self.started < self.predicted_s  # non-streamed: the prediction says when prefill ends


class PredictiveRouteStage:
    """Candidates -> views -> predictions -> strategy plugins -> admission; finish feeds the learner."""

    name = "route"

    def __init__(self, config: Callable[[], Config], health: Health, telemetry: Any = None,
                 clock: Callable[[], float] = time.perf_counter, predictor: Predictor | None = None) -> None:
        self._config = config
        self._health = health
        # the telemetry service, or a getter for it (wiring order: telemetry may be attached after routing)
        self._telemetry = telemetry
        self.clock = clock
        rc = config().raw.routing
        self.predictor = predictor or Predictor(PredictorParams(quantile=rc.admission_quantile,
                                                                cold_margin=rc.cold_margin), clock)
        self.approx = ApproxPrefixIndex()
        self.pending = PendingCache()  # own dispatched prefill whose BlockStored has not arrived (pending.py)
        self.flights: dict[str, dict[str, _Flight]] = {}
        self._by_rid: dict[str, _Flight] = {}
        self.avg_uncached: dict[str, float] = {}
        self.affinity: dict[str, str] = {}  # session/trace header value -> engine last used
        self.batch = BatchQueue(rc.batch_queue_size)
        self.stats = {"admitted": 0, "rejected": 0, "rejected_before_tokenize": 0,
                      "rejected_on_cached_prefix": 0, "spilled": 0, "queued": 0, "shed": 0}
        self._learning: set[asyncio.Task] = set()  # background /tokenize of message prefixes (_learn_prefix)
        self._strategies: dict[tuple, Strategy] = {}

    @property
    def telemetry(self) -> Any:
        t = self._telemetry
        if t is not None and not hasattr(t, "lookup") and callable(t):
            return t()
        return t

    # ---------------------------------------------------------------- state views
    def _strategy(self, cfg: Config) -> Strategy:
        rc = cfg.raw.routing
        spec = rc.strategy
        if isinstance(spec, str):
            name = "target_fit" if spec == "predicted_ttft" and rc.target_fit else spec
            key: Any = (name, rc.affinity_slack_ms, rc.affinity_rel)
        else:  # a plugin list: one built strategy per distinct list (a round robin keeps its counter on reload)
            key = msgspec.json.encode(spec)
        s = self._strategies.get(key)
        if s is None:
            s = self._strategies[key] = (build_strategy(*key) if isinstance(spec, str) else build_strategy(spec))
        return s

    def _telemetry_for(self, cand: Candidate) -> bool:
        return self.telemetry is not None and cand.backend.kind in ("vllm", "sim")

    def _view(self, name: str, now: float, has_tel: bool) -> EngineView:
        """`gateway.routing.view.engine_view` (shared with bench/routing_des.py) on this gateway's flights to
        the engine, drained at its learned rate, and its last scrape when fresh (other replicas' load)."""
        scrape = None
        if has_tel:
            load = self.telemetry.load(name)
            age = time.time() - load.scraped_at if load is not None else 1e9
            if load is not None and getattr(load, "healthy", False) and age < 5.0:
                scrape = Scrape(float(load.running), float(load.waiting), float(load.kv_usage), max(0.0, age))
        budget, _ = self.chunk_budget(name)
        return engine_view(((f.started, f.uncached, f.prefilling(now)) for f in self.flights.get(name, {}).values()),
                           now, self.predictor.drain(name, budget), scrape, self.avg_uncached.get(name, 512.0))

    def chunk_budget(self, name: str) -> tuple[int, str]:
        """The engine's chunked-prefill budget per step and where it comes from: `configured`
        (routing.prefill_token_budgets), `learned` (from its KV events, gateway/telemetry/chunk_budget.py), or
        `assumed` (routing.prefill_token_budget, until the engine showed one: shown as such in /admin/routing)."""
        rc = self._config().raw.routing
        b = rc.prefill_token_budgets.get(name)
        if b is not None:
            return b, "configured"
        index = getattr(self.telemetry, "index", None) if self.telemetry is not None else None
        learned = index.chunk_budget(name) if index is not None and hasattr(index, "chunk_budget") else None
        if learned:
            return learned, "learned"
        return rc.prefill_token_budget, "assumed"

    def facts(self, name: str) -> dict[str, Any]:
        """What the router models about one engine, with the source of each fact (for /admin/routing)."""
        budget, src = self.chunk_budget(name)
        tel = self.telemetry
        index = getattr(tel, "index", None) if tel is not None else None
        bs = index.block_size(name) if index is not None else None
        load = tel.load(name) if tel is not None and hasattr(tel, "load") else None
        cap = getattr(load, "num_gpu_blocks", None) if load is not None else None
        return {"chunk_budget": budget, "chunk_budget_source": src,
                "block_size": bs, "block_size_source": "kv events / metrics" if bs else "unknown",
                "kv_capacity_blocks": cap, "kv_capacity_source": "metrics (cache_config_info)" if cap else "unknown",
                "pending_blocks": self.pending.blocks(name),
                # what one request the engine's metrics count as waiting weighs in the view (view.engine_view)
                "mean_uncached_prompt": round(self.avg_uncached.get(name, 512.0), 1),
                "mean_uncached_prompt_source": "observed" if name in self.avg_uncached else "assumed"}

    async def _prompt(self, ctx: RequestContext, cands: list[Candidate], salt: str | None
                      ) -> tuple[int, dict[str, int], str, list[int], dict[str, tuple[int, list[int]]]]:
        """(prompt tokens, cached tokens per engine, token source, approx blocks, per engine (blocks its index
        holds, own keys of the prompt's full blocks): what a dispatch there will store, for the pending cache)."""
        text = prompt_text(ctx.body)
        blocks = text_blocks((salt or "") + text, APPROX_BLOCK_CHARS)
        n_tokens = max(1, ctx.prompt_tokens_est)
        cached: dict[str, int] = {}
        unstored: dict[str, tuple[int, list[int]]] = {}
        source = "estimate"
        tel = [c for c in cands if self._telemetry_for(c)]
        if tel:
            try:
                toks, source = await self.telemetry.tokens_for(tel[0].backend.name, None, ctx.body,
                                                               retain=not ctx.zero_retention)
                n_tokens = max(1, len(toks))
                if source == "engine":
                    self._learn_prefix(ctx, tel[0], toks, salt)
                by_lora: dict[str | None, list[str]] = {}
                for c in tel:  # engines serving the model as a LoRA adapter key their blocks by its name
                    by_lora.setdefault(lora_name(c), []).append(c.backend.name)
                index = getattr(self.telemetry, "index", None)
                for lora, names in by_lora.items():
                    rk = RequestKeys(toks, salt, lora)
                    found = self.telemetry.lookup(names, rk, salt=salt, lora=lora)
                    for k, v in found.items():
                        cached[k] = int(v.tokens)
                        bs = index.block_size(k) if index is not None else None
                        if bs:  # extend through blocks an earlier dispatch there is still prefilling
                            keys = rk.keys(bs)
                            limit = min(len(keys), (n_tokens - 1) // bs)
                            held = min(int(v.blocks), limit)
                            n = self.pending.extend(k, keys, held, limit, self.clock())
                            if n > held:
                                cached[k] = n * bs
                            unstored[k] = (held, keys)
            except Exception:  # telemetry trouble must never fail a request: fall back to the approx tree
                source = "estimate"
        for c in cands:
            n = c.backend.name
            if n not in cached:
                m = self.approx.match(n, blocks)
                cached[n] = min(n_tokens - 1, m * APPROX_BLOCK_CHARS // CHARS_PER_TOKEN) if m else 0
        return n_tokens, cached, source, blocks, unstored

    def _score(self, ctx: RequestContext, cands: list[Candidate], n_tokens: int, cached: dict[str, int],
               blocks: list[int], affinity_engine: str | None, elapsed_s: float = 0.0,
               target: float | None = None) -> tuple[list[Scored], dict[str, Features]]:
        """Predictions are of the TTFT from arrival: `elapsed_s` (arrival to now) plus the engine learner's
        prediction of the rest (engine_part)."""
        now = self.clock()
        items: list[Scored] = []
        feats: dict[str, Features] = {}
        for c in cands:
            name = c.backend.name
            v = self._view(name, now, self._telemetry_for(c))
            v.prompt_tokens = n_tokens
            v.cached_tokens = max(0, min(cached.get(name, 0), n_tokens - 1))
            v.approx_match = (self.approx.match(name, blocks) / len(blocks)) if blocks else 0.0
            v.affinity = affinity_engine == name
            v.ttft_target_ms = target
            f = Features(ahead_tokens=v.ahead_tokens, uncached_tokens=n_tokens - v.cached_tokens, running=v.running)
            feats[name] = f
            mean, upper = self.predictor.predict(name, f)
            c.predicted_ttft_ms = round((elapsed_s + mean) * 1000, 3)
            c.predicted_ttft_upper_ms = round((elapsed_s + upper) * 1000, 3)
            c.cached_tokens = v.cached_tokens
            c.info = {"predicted_ttft_upper_ms": c.predicted_ttft_upper_ms, "ahead_tokens": int(v.ahead_tokens),
                      "running": v.running, "waiting": v.waiting, "inflight": v.inflight,
                      "operator": c.backend.operator}
            items.append(Scored(c, v))
        return items, feats

    def _order(self, cfg: Config, items: list[Scored], n_tokens: int, dropped: list[dict]) -> list[Candidate]:
        """Strategy per model group, groups in alias-chain order."""
        strat = self._strategy(cfg)
        groups: dict[str, list[Scored]] = {}
        for s in items:
            groups.setdefault(s.cand.model, []).append(s)
        out: list[Candidate] = []
        for model, grp in groups.items():
            kept, drops = strat.run(grp, n_tokens)
            for s, fname, why in drops:
                dropped.append({"backend": s.cand.backend.name, "model": model, "reason": why, "filter": fname})
            out.extend(s.cand for s in kept)
        return out

    # ---------------------------------------------------------------- the stage
    async def run(self, ctx: RequestContext) -> None:
        t_start = time.perf_counter()
        if not ctx.model_chain:
            raise GatewayError(404, f"The model '{ctx.model}' does not exist or you do not have access to it.",
                               code="model_not_found", param="model")
        cfg = self._config()
        rc = cfg.raw.routing
        aff_key = None
        sess = session_id(ctx.headers, rc.affinity_headers)
        if sess is None and ctx.principal is not None and ctx.principal.end_user:
            sess = ("end_user", ctx.principal.end_user)  # a partner's end user: their turns share a prefix too
        if sess is not None:  # recorded (an id, never content) and used for affinity
            ctx.evidence["session"] = {"header": sess[0], "id": sess[1]}
            aff_key = f"{ctx.principal.tenant if ctx.principal else ''}|{sess[0]}|{sess[1]}"
        plan = candidates(cfg, ctx, self._health)  # residency first, always
        ctx.evidence["dropped"] = plan.dropped
        if not plan.candidates:
            raise _no_candidates(ctx, plan)
        d = ctx.decision
        own, partners = split_partners(cfg, ctx, plan)

        salt = engine_cache_salt(ctx, rc.cache_salt_secret_env)
        if salt is not None:
            ctx.body_overrides["cache_salt"] = salt  # and the index is looked up with the salt the engine sees
        if d is not None and ctx.endpoint != "embeddings":
            prio = rc.priority_values.get(d.priority)
            if prio is not None:
                ctx.body_overrides["priority"] = int(prio)

        priority = d.priority if d is not None else "standard"
        hdr = ctx.headers.get("x-ttft-slo-ms") if ctx.headers is not None else None
        target = slo_ms(hdr, d.ttft_slo_ms if d is not None else None, rc.default_ttft_slo_ms)
        if rc.admission and target is not None and not partners and priority != "batch":
            self._refuse_early(ctx, own, target, t_start, salt)  # before tokenizing: raises when surely late
        n_tokens, cached, source, blocks, unstored = await self._prompt(ctx, own + partners, salt)
        deadline = time.monotonic() + rc.batch_queue_timeout_s
        while True:
            prev_engine = self.affinity.get(aff_key) if aff_key else None  # re-read: a queued request waits
            elapsed = max(0.0, time.perf_counter() - ctx.received_at)
            items, feats = self._score(ctx, own + partners, n_tokens, cached, blocks, prev_engine, elapsed, target)
            own_names = {c.backend.name for c in own}
            ordered = self._order(cfg, items, n_tokens, plan.dropped)
            own_ord = [c for c in ordered if c.backend.name in own_names]
            part_ord = [c for c in ordered if c.backend.name not in own_names]
            if not own_ord and not part_ord:
                raise _no_candidates(ctx, plan)
            if rc.admission and target is not None and own_ord:
                adm = decide(target, [c.predicted_ttft_upper_ms for c in own_ord],  # type: ignore[misc]
                             [c.predicted_ttft_ms for c in own_ord], priority=priority,  # type: ignore[misc]
                             can_spill=bool(part_ord), batch_headroom=rc.batch_headroom,
                             batch_target_ms=rc.batch_ttft_target_ms)
            else:
                adm = decide(None, [], [], priority=priority, can_spill=False)
            if adm.action != "queue":
                break
            self.stats["queued"] += 1
            left = deadline - time.monotonic()
            try:
                woke = left > 0 and await self.batch.wait(min(left, 1.0))
            except QueueFull:
                woke = None
            if woke is None or (not woke and time.monotonic() >= deadline):
                self.stats["shed"] += 1
                self._evidence(ctx, ordered, target, adm.action, source, t_start, salt)
                raise GatewayError(429, "The fleet is above its batch headroom and the batch queue is "
                                   + ("full." if woke is None else "past its wait limit."), code="request_shed",
                                   headers={**retry_headers(max(1.0, adm.retry_after_s)),
                                            "x-predicted-ttft-ms": f"{adm.best_ms:.0f}"})
        if target is not None and len(own_ord) > 1:  # engines predicted to meet the target first (stable)
            own_ord.sort(key=lambda c: (c.predicted_ttft_upper_ms or 0) > target)
        if adm.action == "reject":
            self.stats["rejected"] += 1
            self._evidence(ctx, own_ord, target, "reject", source, t_start, salt)
            raise _unattainable(own_ord[0], target, adm.retry_after_s)
        if adm.action == "spill":
            self.stats["spilled"] += 1
            final = part_ord + own_ord
        else:
            self.stats["admitted"] += 1
            final = own_ord + part_ord
        if d is not None and d.providers_order:  # the client's own order wins over the router's (evidence says so)
            final = client_order(final, d.providers_order)
        plan.candidates = final
        ctx.route = plan
        pick = final[0]
        self._evidence(ctx, final, target, adm.action, source, t_start, salt)
        if aff_key:
            ctx.evidence["route"]["affinity_engine"] = prev_engine  # the session's previous engine, if any
        ctx.extra_headers["x-predicted-ttft-ms"] = f"{pick.predicted_ttft_ms:.0f}"
        ctx.extra_headers["x-gateway-backend"] = pick.backend.name
        name = pick.backend.name
        fl = _Flight(ctx, name, n_tokens - (pick.cached_tokens or 0), self.clock(),
                     max(0.0, (pick.predicted_ttft_ms or 0) / 1000 - elapsed), feats,
                     {c.backend.name: c.cached_tokens or 0 for c in final}, blocks, self._telemetry_for(pick),
                     {c.backend.name: max(0.0, (c.predicted_ttft_upper_ms or 0) / 1000 - elapsed) for c in final},
                     elapsed)
        if name in unstored:
            held, keys = unstored[name]
            bs = self.telemetry.index.block_size(name)
            budget = self.chunk_budget(name)[0]
            tail = last_chunk_from(n_tokens, pick.cached_tokens or 0, budget, bs, held)
            # the tail's fallback time (when KV events lag): the predicted first token, by which the last step
            # has started; before it only the index says so (it holds every block before the tail)
            self.pending.add(ctx.request_id, name, keys[held:], tail, fl.started + fl.predicted_s,
                             max(0, (n_tokens - budget) // bs) if bs else 0)
        self.flights.setdefault(name, {})[ctx.request_id] = fl
        self._by_rid[ctx.request_id] = fl
        if fl.telemetry:
            self.telemetry.begin(name, fl.uncached)
        if aff_key:
            self.affinity[aff_key] = name
            if len(self.affinity) > 100_000:
                self.affinity.pop(next(iter(self.affinity)))

    def _refuse_early(self, ctx: RequestContext, own: list[Candidate], target: float, t_start: float,
                      salt: str | None) -> None:
        """Refuse before the request is tokenized (no /tokenize round trip on the path of a refusal) when a
        lower bound on every own engine's TTFT is already over the target: the request's own prefill is at
        least one token (all the rest cached), while the work ahead and the running decodes are known without
        its tokens; the prediction and its upper bound grow with both (boxed coefficients >= 0), so the full
        prediction could only be higher and admission would refuse too. Returns when that is not certain."""
        now = self.clock()
        bounds = self._uncached_lower_bounds(ctx, own, salt, now)
        elapsed = max(0.0, time.perf_counter() - ctx.received_at)  # already spent: part of any TTFT from here
        lbs: list[tuple[Candidate, float, float, EngineView]] = []
        for c in own:
            v = self._view(c.backend.name, now, self._telemetry_for(c))
            mean, upper = self.predictor.predict(
                c.backend.name, Features(ahead_tokens=v.ahead_tokens, uncached_tokens=float(bounds.get(
                    c.backend.name, 1)), running=v.running))
            lbs.append((c, (elapsed + mean) * 1000, (elapsed + upper) * 1000, v))
        adm = early_refusal(target, [u for _, _, u, _ in lbs], [m for _, m, _, _ in lbs])
        if adm is None:
            return
        for c, m, u, v in lbs:
            c.predicted_ttft_ms, c.predicted_ttft_upper_ms = round(m, 3), round(u, 3)
            c.info = {"predicted_ttft_upper_ms": c.predicted_ttft_upper_ms, "lower_bound": True,
                      "uncached_tokens_at_least": int(bounds.get(c.backend.name, 1)),
                      "ahead_tokens": int(v.ahead_tokens), "running": v.running, "waiting": v.waiting,
                      "inflight": v.inflight, "operator": c.backend.operator}
        cands = sorted(own, key=lambda c: c.predicted_ttft_upper_ms or 0)
        self.stats["rejected"] += 1
        self.stats["rejected_before_tokenize"] += 1
        self.stats["rejected_on_cached_prefix"] += 1 if bounds else 0
        self._evidence(ctx, cands, target, "reject", "none (refused on a lower bound, before tokenizing"
                       + ("; message prefix's ids cached)" if bounds else ")"), t_start, salt)
        raise _unattainable(cands[0], target, adm.retry_after_s, lower_bound=True)

    def _uncached_lower_bounds(self, ctx: RequestContext, own: list[Candidate], salt: str | None, now: float
                               ) -> dict[str, int]:
        """Per engine, a lower bound on the request's uncached prompt tokens without tokenizing it, where one is
        known (else the caller assumes 1): when the ids of the chat's earlier messages are cached
        (TokenSource.cached_prefix) and an engine's chain of blocks (index, then own pending prefill) breaks
        inside that prefix, nothing past the break can be cached there (block keys are chained), so the request
        has at least len(prefix) + tail lower bound - cached-before-the-break uncached tokens there."""
        tel = self.telemetry
        ts = getattr(tel, "tokens", None) if tel is not None else None
        tc = [c for c in own if self._telemetry_for(c)]
        if ts is None or not tc or ctx.zero_retention or not hasattr(ts, "cached_prefix"):
            return {}
        try:
            hit = ts.cached_prefix(tc[0].backend.server_root, ctx.body, salt)
            if hit is None:
                return {}
            ids, tail_lb = hit
            n_lb = len(ids) + tail_lb
            index = getattr(tel, "index", None)
            by_lora: dict[str | None, list[str]] = {}
            for c in tc:
                by_lora.setdefault(lora_name(c), []).append(c.backend.name)
            out: dict[str, int] = {}
            for lora, names in by_lora.items():
                rk = RequestKeys(list(ids), salt, lora)
                found = tel.lookup(names, rk, salt=salt, lora=lora)
                for name in names:
                    bs = index.block_size(name) if index is not None else None
                    if not bs:
                        continue
                    full = len(ids) // bs
                    v = found.get(name)
                    # the longest prefix over every tier, in blocks (the full path counts v.tokens as cached)
                    held = min(max(int(v.blocks), -(-int(v.tokens) // bs)), full) if v is not None else 0
                    n = self.pending.extend(name, rk.keys(bs), held, full, now) if full else 0
                    if n < full:  # the chain breaks inside the known prefix on this engine
                        out[name] = max(1, n_lb - max(n * bs, int(v.tokens) if v is not None else 0))
            return out
        except Exception:  # a bound is an optimisation: trouble means no bound, never a failed request
            return {}

    def _learn_prefix(self, ctx: RequestContext, cand: Candidate, toks: list[int], salt: str | None) -> None:
        """Cache the ids of the chat's earlier messages off the request's path (one /tokenize of the prefix,
        once per distinct prefix), for the refusal before tokenizing of later requests sharing it."""
        ts = getattr(self.telemetry, "tokens", None)
        msgs = ctx.body.get("messages")
        if ts is None or ctx.zero_retention or not isinstance(msgs, list) or len(msgs) < 2 \
                or not hasattr(ts, "learn_prefix") or len(self._learning) >= 64:
            return
        try:
            t = asyncio.get_running_loop().create_task(ts.learn_prefix(cand.backend.server_root, ctx.body, toks,
                                                                       salt))
        except RuntimeError:
            return
        self._learning.add(t)
        t.add_done_callback(self._learning.discard)

    def _evidence(self, ctx: RequestContext, cands: list[Candidate], target: float | None,
                  action: str, source: str, t_start: float, salt: str | None) -> None:
        ctx.evidence["candidates"] = [c.to_evidence() for c in cands]
        if cands:
            ctx.evidence["predicted_ttft_ms"] = cands[0].predicted_ttft_ms
            ctx.evidence["predicted_cached_tokens"] = cands[0].cached_tokens
        ctx.evidence["route"] = {"strategy": strategy_label(self._config().raw.routing.strategy), "pick": cands[0].backend.name
                                 if cands else None, "ttft_slo_ms": target, "admission": action,
                                 "token_source": source, "cache_isolation": salt is not None,
                                 "decided_us": round((time.perf_counter() - t_start) * 1e6, 1),
                                 "since_arrival_ms": round((time.perf_counter() - ctx.received_at) * 1000, 3)}
        tel = self.telemetry
        if tel is not None:  # predictions made on a stale KV view say so, with why (silent, wrong topic, gap)
            stale = [c.backend.name for c in cands if self._telemetry_for(c) and tel.is_stale(c.backend.name)]
            if stale:
                ctx.evidence["route"]["stale_kv_views"] = stale
                ctx.evidence["route"]["kv_views"] = kv_view_evidence(stale, getattr(tel, "kv_view", None))

    async def finish(self, ctx: RequestContext) -> None:
        fl = self._by_rid.pop(ctx.request_id, None)
        if fl is None:
            return
        self.flights.get(fl.engine, {}).pop(ctx.request_id, None)
        self.pending.remove(ctx.request_id)
        self.batch.wake(2)
        served = ctx.backend or fl.engine
        if fl.telemetry:
            self.telemetry.end(fl.engine, fl.uncached)
        ev = ctx.evidence
        ev["actual_ttft_ms"] = round(ctx.ttft_s * 1000, 3) if ctx.ttft_s is not None else None
        ev["predicted_cached_tokens"] = fl.cached.get(served)
        actual_cached = ctx.usage.cached_tokens if ctx.usage is not None else None
        ev["actual_cached_tokens"] = actual_cached
        if ctx.backend is None or ctx.status not in (0, 200):
            return
        self.approx.insert(served, fl.blocks)
        uncached = (ctx.usage.prompt_tokens - (actual_cached or 0)) if ctx.usage and ctx.usage.prompt_tokens else fl.uncached
        a = self.avg_uncached.get(served)
        self.avg_uncached[served] = uncached if a is None else 0.9 * a + 0.1 * uncached
        failed_before = any("error" in x for x in ctx.attempts)
        f = fl.features.get(served)
        if ctx.ttft_s is not None and f is not None and not failed_before:
            rel = self.predictor.observe(served, f, engine_part(ctx.ttft_s, fl.elapsed_s),
                                         fl.uppers.get(served) or None)
            ev["ttft_prediction_error"] = round(rel, 4)
        done = ctx.usage.completion_tokens if ctx.usage is not None else 0
        if ctx.stream and ctx.ttft_s is not None and done and done > 1:  # mean inter-token time: the step
            total = ctx.total_s if ctx.total_s is not None else time.perf_counter() - ctx.received_at
            self.predictor.observe_step(served, (total - ctx.ttft_s) / (done - 1))
        if actual_cached is not None and self.telemetry is not None and served in fl.cached \
                and ctx.backend_model is not None and self._telemetry_for_name(served):
            try:
                self.telemetry.observe_cached(served, fl.cached[served], actual_cached)
            except Exception:
                pass

    def _telemetry_for_name(self, name: str) -> bool:
        try:
            return self.telemetry is not None and self._config().backend(name).kind in ("vllm", "sim")
        except KeyError:
            return False

    def snapshot(self) -> dict[str, Any]:
        """For /admin/routing: per engine the learned parameters, the guard's state, prediction quality out of
        sample (mape, mdare, calibration vs calibration_target) and the engine facts with their sources;
        admission counters, queue depth."""
        cfg = self._config()
        engines = self.predictor.snapshot()
        for b in cfg.backends:
            if b.kind in ("vllm", "sim") or b.name in engines:
                engines.setdefault(b.name, {})["facts"] = self.facts(b.name)
        return {"strategy": strategy_label(cfg.raw.routing.strategy), "engines": engines,
                "admission": dict(self.stats), "batch_queue": len(self.batch),
                "inflight": {k: len(v) for k, v in self.flights.items()}}
