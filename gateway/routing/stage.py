"""The route stage: hard candidate steps, prediction, the strategy's plugins, admission, and the accounting
around a dispatch. Each concern lives in its own module; this one composes them in order:

1. `candidates`: residency/retention, health, capability, partners (hard steps, never plugins);
2. `salts` / `affinity`: the engine's cache_salt and priority, the session's previous engine;
3. `early`: refuse before tokenizing what surely misses its TTFT target;
4. `prompt`: tokens and the tokens each engine holds; `prediction`: TTFT per candidate;
5. the strategy (`registry`, plugins under filters/ scorers/ pickers/) orders each model group;
6. `admission.decide`: admit, reject (429), queue batch traffic, spill to partners; `candidates.client_order`;
7. `inflight` / `pending`: what this dispatch adds to the engine's view; `feedback` on finish trains the
   learner; `evidence` writes the audit record's route.

`RouteStage` (plain round robin) stays for minimal assemblies; `PredictiveRouteStage` is the product's router.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, NoReturn

import msgspec

from gateway.config import BackendConfig, Config
from gateway.errors import GatewayError, retry_headers
from gateway.pipeline import RequestContext
from gateway.proxy.dialects import TELEMETRY_KINDS, publishes_kv_events
from gateway.proxy.health import Health
from gateway.routing.admission import Admission, BatchQueue, QueueFull, decide, slo_ms
from gateway.routing.affinity import Affinity, affinity_key, session_id
from gateway.routing.approx import ApproxPrefixIndex
from gateway.routing.candidates import (candidates, client_order, has_own_engine, no_candidates, require_model,
                                        residency_reason, residency_rules, split_partners)
from gateway.routing.early import early_refusal, learn_prefix, refuse_early, unattainable, uncached_lower_bounds
from gateway.routing.engines import _ASK, EngineModel
from gateway.routing.evidence import kv_view_evidence, route_evidence
from gateway.routing.feedback import Learn
from gateway.routing.flow import CLASSES as FLOW_CLASSES
from gateway.routing.flow import LongFlight, LongLimits, Waiter, lane_class
from gateway.routing.flowkey import flow_id, flow_weight
from gateway.routing.gate import FlowGate, FlowQueueFull, QueueTimeout
from gateway.routing.inflight import Flight, InFlight
from gateway.routing.limits import InflightLimits
from gateway.routing.mode import MODELLED_KINDS, Mode, ModeBook, Observed, load_order
from gateway.routing.pending import PendingCache, last_chunk_from
from gateway.routing.plan import Candidate, RoutePlan
from gateway.routing.plugin import EngineView, ResponseComplete, Scored, Strategy
from gateway.routing.prediction import predict_candidates
from gateway.routing.predictor import Features, Predictor, PredictorParams
from gateway.routing.view import Drain
from gateway.routing.prompt import (APPROX_BLOCK_CHARS, CHARS_PER_TOKEN, PromptFacts, lora_name, prompt_facts,
                                    prompt_text)
from gateway.routing.registry import build_strategy, strategy_label
from gateway.routing.room import Room
from gateway.routing.scorers.target_fit import target_fit_score
from gateway.routing.salts import _SALT_DEFAULT_SECRET, engine_cache_salt, tenant_cache_salt
from gateway.telemetry.service import TelemetryService

if TYPE_CHECKING:
    from gateway.routing.peers import PeerBus

# the names other modules import from here (kept when the stage was split into its concerns)
log = logging.getLogger("gateway.routing")

__all__ = ["APPROX_BLOCK_CHARS", "CHARS_PER_TOKEN", "PredictiveRouteStage", "RouteStage", "_SALT_DEFAULT_SECRET",
           "candidates", "client_order", "early_refusal", "engine_cache_salt", "has_own_engine",
           "kv_view_evidence", "last_chunk_from", "lora_name", "prompt_text", "residency_reason", "session_id",
           "split_partners", "tenant_cache_salt"]

# a long prompt goes to the engine whose upper prediction meets this share of its target with the least slack:
# its loose target is met on a slower engine, and the fast engines' prefill stays with the short prompts
LONG_FIT = 0.8
MODEL_STRATEGIES = ("predicted_ttft", "target_fit")  # presets that order by the model's prediction


@dataclass(slots=True)
class _FlowState:
    """One request's standing in flow control while the route stage runs."""

    flow: str = ""  # its flow (flowkey.flow_id); empty: flow control does not apply
    weight: float = 1.0
    cls: str = "standard"  # its priority class
    qcls: str = "standard"  # the queue it waits in: its class and lane (flow.lane_class)
    long: bool = False
    uncached: dict[str, int] = field(default_factory=dict)
    go: frozenset[str] = frozenset()  # the engines that may start it now
    released: frozenset[str] | None = None  # set once the gate released it from the queue
    waiter: Waiter | None = None
    enqueued: float = 0.0
    waited_s: float = 0.0
    predicted_wait_s: float = 0.0
    wait_upper_s: float = 0.0  # the predicted wait plus the upper quantile of the recent waits' error
    ahead_tokens: float = 0.0
    unheld: bool = False  # no engine opened within its target, and it was not held for one (_flow_plan)
    first_token_by: float | None = None  # a target's due time (clock) and per engine its own prefill's upper
    own_upper_s: dict[str, float] = field(default_factory=dict)  # bound unqueued: its budget in engine queues
    # dispatched past flow control: it waited past its target's slack (served, never refused after its wait), or
    # it has no target and its flow's queue is full (a plain proxy would serve it)
    late: bool = False


@dataclass(slots=True)
class _Attempt:
    """One request's route as it is decided, phase by phase (PredictiveRouteStage._run)."""

    ctx: RequestContext
    fs: _FlowState
    cfg: Config
    rc: Any  # RoutingConfig
    plan: RoutePlan
    own: list[Candidate]
    partners: list[Candidate]
    modelled: set[str]
    all_modelled: bool
    salt: str | None
    priority: str
    hdr: str | None
    target: float | None  # the TTFT target; after the decision, the goal admission held it to
    flow_on: bool
    aff_key: str | None
    t_start: float
    # set by the tokens phase
    n_tokens: int = 0
    cached: dict[str, int] = field(default_factory=dict)
    source: str = ""
    blocks: list[int] = field(default_factory=list)
    unstored: Any = None
    tokenize_s: float = 0.0
    # set by each pass of the decision
    prev_engine: str | None = None
    elapsed: float = 0.0
    tel: TelemetryService | None = None
    has_tel: Callable[[Candidate], bool] = lambda c: False
    feats: dict[str, Features] = field(default_factory=dict)


_no_candidates = no_candidates
_residency_rules = residency_rules
_unattainable = unattainable


class RouteStage:
    """Builds the RoutePlan. Ordering within a model: round robin (minimal assemblies and tests)."""

    name = "route"

    def __init__(self, config: Callable[[], Config], health: Health) -> None:
        self._config = config
        self._health = health
        self._rr = itertools.count()

    async def run(self, ctx: RequestContext) -> None:
        require_model(ctx)
        cfg = self._config()
        plan = candidates(cfg, ctx, self._health)
        ctx.evidence["dropped"] = plan.dropped
        if not plan.candidates:
            raise no_candidates(ctx, plan)
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


class PredictiveRouteStage:
    """Candidates -> views -> predictions -> strategy plugins -> admission; finish feeds the learner."""

    name = "route"

    def __init__(self, config: Callable[[], Config], health: Health,
                 telemetry: TelemetryService | Callable[[], TelemetryService | None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, predictor: Predictor | None = None) -> None:
        self._config = config
        self._health = health
        # the telemetry service, or a getter for it (wiring order: telemetry may be attached after routing)
        if telemetry is None or isinstance(telemetry, TelemetryService):
            svc = telemetry
            self._telemetry: Callable[[], TelemetryService | None] = lambda: svc
        else:
            self._telemetry = telemetry
        self.clock = clock
        rc = config().raw.routing
        self.predictor = predictor or Predictor(PredictorParams(quantile=rc.admission_quantile,
                                                                cold_margin=rc.cold_margin), clock)
        self.approx = ApproxPrefixIndex()
        self.pending = PendingCache()  # own dispatched prefill whose BlockStored has not arrived (pending.py)
        self.inflight = InFlight()
        # what an engine must do before it can start a request, per own candidate (seconds), counted in the
        # prediction: a registered adapter's load where it is not resident (wiring sets Placement.setup_s)
        self.setup: Callable[[RequestContext, list[Candidate]], Mapping[str, float]] | None = None
        self.avg_uncached: dict[str, float] = {}
        self.engines = EngineModel(config, lambda: self.telemetry, self.predictor, self.inflight, self.pending,
                                   self.avg_uncached)
        self.affinity = Affinity()  # session/trace header value -> engine last used
        self.peers: PeerBus | None = None  # the peer bus when replicas route as one; wired by gateway.wiring
        self.batch = BatchQueue(rc.batch_queue_size)
        self.stats = {"admitted": 0, "rejected": 0, "rejected_before_tokenize": 0,
                      "rejected_on_cached_prefix": 0, "spilled": 0, "queued": 0, "shed": 0,
                      "refused_after_wait": 0, "served_late": 0, "pass_through": 0, "released_to_pass_through": 0,
                      "rejected_inflight_limit": 0, "target_not_held": 0,
                      "pass_through_held_for_fairness": 0}
        self.modes = ModeBook()  # each upstream's mode: modelled or pass-through (mode.py)
        self._mode_memo: dict[str, tuple[float, Mode, Any]] = {}
        self.room = Room()  # the harmful-hold check's samples (room.py)
        # told of every finished request, in order (plugin.py ResponseComplete): the learners first; an extension
        # (a custom learner, a counter) appends its own
        self.on_response: list[ResponseComplete] = [Learn(self)]
        self.limits = InflightLimits()  # backends[].max_inflight (limits.py)
        self._slots: dict[str, str] = {}  # request id -> the upstream whose in-flight slot it holds
        self._learning: set[asyncio.Task] = set()  # background /tokenize of message prefixes (early.learn_prefix)
        self._strategies: dict[Any, Strategy] = {}
        # (routing config, its strategy, its label) of the last config seen: a config is immutable, so its
        # strategy is looked up (and a plugin list encoded) once per reload, not once per request
        self._strategy_memo: tuple[Any, Strategy, str] | None = None
        self._longs: dict[str, dict[str, Flight]] = {}  # engine -> request id -> a long prompt's flight
        self.flow = FlowGate(lambda: self._config().raw.routing.flow_control, self.clock, self._engine_state,
                             self._long_flights, self.chunk_budget, self._gate_predict, self._room_of)
        self.inflight.long_threshold = lambda name: self.flow.limits(name).long_prompt_tokens  # the peers' longs

    @property
    def telemetry(self) -> TelemetryService | None:
        return self._telemetry()

    @property
    def flights(self) -> dict[str, dict[str, Flight]]:
        """engine -> request id -> Flight (read by the batch lane's pacer)."""
        return self.inflight.by_engine

    def typical_ttft_upper_s(self, backend: BackendConfig, now: float) -> float:
        """The upper-bound TTFT (s) a typical realtime request would get on `backend` now: the engine's view
        (own and the peers' flights) and its mean uncached prompt, predicted without dispatching anything (the
        batch lane's pacer, gateway/batch/scheduler.py)."""
        name = backend.name
        v = self.engines.view(name, now, self.telemetry is not None and publishes_kv_events(backend))
        f = Features(ahead_tokens=v.ahead_tokens, uncached_tokens=self.avg_uncached.get(name, 512.0),
                     running=v.running)
        return self.predictor.predict(name, f)[1]

    @property
    def _by_rid(self) -> dict[str, Flight]:
        return self.inflight.by_rid

    # ---------------------------------------------------------------- state views
    def _strategy(self, cfg: Config) -> Strategy:
        return self._strategy_and_label(cfg)[1]

    def _strategy_label(self, cfg: Config) -> str:
        return self._strategy_and_label(cfg)[2]

    def _strategy_and_label(self, cfg: Config) -> tuple[Any, Strategy, str]:
        rc = cfg.raw.routing
        memo = self._strategy_memo
        if memo is None or memo[0] is not rc:
            memo = self._strategy_memo = (rc, self._build_strategy(rc), strategy_label(rc.strategy))
        return memo

    def _build_strategy(self, rc: Any) -> Strategy:
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
        return self.engines.has_telemetry(cand)

    def _telemetry_for_name(self, name: str) -> bool:
        return self.engines.has_telemetry_name(name)

    def _view(self, name: str, now: float, has_tel: bool) -> EngineView:
        """The engine's view now (engines.EngineModel.view)."""
        return self.engines.view(name, now, has_tel)

    def _engine_state(self, name: str, now: float) -> tuple[float, float, float, Any]:
        """The flow gate's view of an engine: (prefill tokens ahead on it now as the drain model has it, own
        prompt tokens without a first token yet, running decodes, how fast it drains). The second is observed,
        not modelled: when the learned rate is off (a slow engine behind a long queue), the first says idle."""
        tel = self.telemetry
        d = self.engines.drain(name, tel)
        v = self.engines.view(name, now, self.engines.has_telemetry_name(name, tel), d, tel)
        return v.ahead_tokens, float(v.prefilling_tokens), v.running, d

    def _room_of(self, name: str, now: float) -> tuple[int, int]:
        """(requests in flight on the engine now, own and the peers', the most it recently served without its
        TTFT rising): the flow gate's harmful-hold check."""
        n = len(self.inflight.by_engine.get(name, ())) + len(self.inflight.remote.get(name, ()))
        return n, self.room.peak(name, now)

    # ---------------------------------------------------------------- modes (mode.py)
    def mode(self, backend: BackendConfig, tel: TelemetryService | None, now: float) -> Mode:
        """The upstream's mode now (memoised for 0.25 s: read once per candidate per request)."""
        memo = self._mode_memo.get(backend.name)
        if memo is not None and now - memo[0] < 0.25 and memo[2] is backend:
            return memo[1]
        m = self.modes.update(backend.name, self._observed(backend, tel),
                              self._config().raw.routing.model_validity)
        self._mode_memo[backend.name] = (now, m, backend)
        return m

    def _observed(self, b: BackendConfig, tel: TelemetryService | None) -> Observed:
        """What the gateway observes about upstream `b`: its kind, its telemetry's freshness, its fit."""
        if b.kind not in MODELLED_KINDS or tel is None:
            return Observed(b.kind, tel is not None)
        load = tel.load(b.name)
        age: float | None = None
        err: str | None = None
        if load is not None:
            if load.healthy:
                age = max(0.0, time.time() - load.scraped_at)
            else:
                err = load.error
        lr = self.predictor.engines.get(b.name)
        return Observed(b.kind, True, age, err, tel.is_stale(b.name), len(lr.residuals) if lr is not None else 0,
                        lr.mdare() if lr is not None else None)

    def _gate_predict(self, name: str, ahead: float, uncached: float, running: float) -> float:
        return self.predictor.predict(name, Features(ahead_tokens=ahead, uncached_tokens=uncached, running=running))[0]

    def _long_flights(self, now: float, limits: Callable[[str], LongLimits]) -> dict[str, list[LongFlight]]:
        """Per engine, the long prompts on it still prefilling, this gateway's and (with the peer bus) the other
        replicas', with their predicted prefill end (from the indexes of long flights `_dispatched` and
        `InFlight.add_remote` keep: O(long prompts in flight), not O(all flights))."""
        out: dict[str, list[LongFlight]] = {}
        for name, fls in self._longs.items():
            for fl in fls.values():
                if fl.prefilling(now):
                    out.setdefault(name, []).append(LongFlight(fl.uncached, max(now, fl.started + fl.predicted_s)))
        for name, rfs in self.inflight.remote_long.items():  # the other replicas' (peers.py): one guard for all
            for rf in rfs.values():
                if rf.prefilling(now):
                    out.setdefault(name, []).append(LongFlight(rf.uncached, max(now, rf.started + rf.predicted_s)))
        return out

    def chunk_budget(self, name: str) -> tuple[int, str]:
        """The engine's chunked-prefill budget and its source: configured, learned or assumed."""
        return self.engines.chunk_budget(name)

    def facts(self, name: str) -> dict[str, Any]:
        """What the router models about one engine, with the source of each fact (for /admin/routing)."""
        return self.engines.facts(name)

    async def _prompt(self, ctx: RequestContext, cands: list[Candidate], salt: str | None, tel: TelemetryService | None,
                      has_tel: Callable[[Candidate], bool]) -> PromptFacts:
        return await prompt_facts(ctx, cands, salt, telemetry=tel, has_telemetry=has_tel,
                                  pending=self.pending, approx=self.approx, clock=self.clock,
                                  learn=lambda c, toks: self._learn_prefix(ctx, c, toks, salt))

    def _score(self, cands: list[Candidate], n_tokens: int, cached: dict[str, int], blocks: list[int],
               affinity_engine: str | None, elapsed_s: float, target: float | None, tel: TelemetryService | None,
               has_tel: Callable[[Candidate], bool], setup_s: Mapping[str, float] | None = None
               ) -> tuple[list[Scored], dict[str, Features], dict[str, Drain]]:
        """Predictions per candidate (prediction.predict_candidates) on the engines' views now, and each
        engine's drain those views were taken with (flow control reads them, not taken again)."""
        now = self.clock()
        drains: dict[str, Drain] = {}
        views: list[EngineView] = []
        for c in cands:
            name = c.backend.name
            d = drains[name] = self.engines.drain(name, tel)
            views.append(self.engines.view(name, now, has_tel(c), d, tel))
        items, feats = predict_candidates(cands, n_tokens, cached, blocks, affinity_engine, elapsed_s, target,
                                          views, self.predictor, self.approx, setup_s)
        return items, feats, drains

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
        fs = _FlowState()
        try:
            await self._run(ctx, fs)
        finally:
            if fs.waiter is not None and self.flow.releasing is fs.waiter:  # released, then did not dispatch
                self.flow.done(fs.waiter)

    async def _run(self, ctx: RequestContext, fs: "_FlowState") -> None:
        """The phases of one request's route: candidates, refusal before tokenizing, tokens, the decision
        (score, order, flow, admit: looped while it waits), then the refusal or the commit."""
        a = self._begin(ctx, fs)
        self._refuse_before_tokens(a)
        await self._tokens(a)
        adm, own_ord, part_ord, must_wait = await self._decide(a)
        if adm.action == "reject":
            self._reject(a, adm, own_ord, must_wait)
        self._commit(a, adm, await self._final(a, adm, own_ord, part_ord))

    def _begin(self, ctx: RequestContext, fs: "_FlowState") -> "_Attempt":
        """Candidates (residency first, always), modes, the engine cache salt and priority, the target, and
        whether flow control applies."""
        t_start = time.perf_counter()
        require_model(ctx)
        cfg = self._config()
        rc = cfg.raw.routing
        plan = candidates(cfg, ctx, self._health)
        ctx.evidence["dropped"] = plan.dropped
        if not plan.candidates:
            raise no_candidates(ctx, plan)
        d = ctx.decision
        own, partners = split_partners(cfg, ctx, plan)
        modelled = self._modes_of(own + partners, self.telemetry)  # the upstreams the gateway has a model of
        salt = engine_cache_salt(ctx, rc.cache_salt_secret_env)
        if salt is not None:
            ctx.body_overrides["cache_salt"] = salt  # and the index is looked up with the salt the engine sees
        if d is not None and ctx.ep is not None and ctx.ep.generates:  # vLLM schedules generation by priority
            prio = rc.priority_values.get(d.priority)
            if prio is not None:
                ctx.body_overrides["priority"] = int(prio)
        priority = d.priority if d is not None else "standard"
        hdr = ctx.headers.get("x-ttft-slo-ms") if ctx.headers is not None else None
        target = slo_ms(hdr, d.ttft_slo_ms if d is not None else None, rc.default_ttft_slo_ms)
        flow_on = (rc.flow_control.enabled and priority in FLOW_CLASSES
                   and bool(modelled & {c.backend.name for c in own}))
        if flow_on:
            fs.flow, fs.weight, fs.cls = flow_id(ctx.principal, d), flow_weight(d), priority
        return _Attempt(ctx=ctx, fs=fs, cfg=cfg, rc=rc, plan=plan, own=own, partners=partners, modelled=modelled,
                        all_modelled=all(c.backend.name in modelled for c in own), salt=salt, priority=priority,
                        hdr=hdr, target=target, flow_on=flow_on, aff_key=affinity_key(ctx, rc), t_start=t_start)

    def _refuse_before_tokens(self, a: "_Attempt") -> None:
        """Raise when the request is surely late before its tokens are known. A prompt that may be long gets the
        long target, unless the client's x-ttft-slo-ms sets it (_long_target): only then does the target checked
        before tokenizing hold for it too."""
        rc, ctx, own, target = a.rc, a.ctx, a.own, a.target
        if not rc.admission or target is None or a.partners:
            return
        if not a.all_modelled:
            self._refuse_spent(ctx, own, target, a.t_start, a.salt)  # no model: only a certainty refuses
            return
        may_long = a.flow_on and self._maybe_long(ctx, own)
        if not may_long or slo_ms(a.hdr, None, None) is not None:
            if a.priority != "batch":
                self._refuse_early(ctx, own, target, a.t_start, a.salt)  # before tokenizing: raises when surely late
            if a.flow_on:
                self._refuse_queued(ctx, a.fs, own, target, a.t_start, a.salt, may_long)  # its flow's queue alone

    async def _tokens(self, a: "_Attempt") -> None:
        tel = self.telemetry  # resolved once per stretch without an await (and again after each)
        has_tel = self.engines.telemetry_test(tel)
        t_tok = time.perf_counter()
        a.n_tokens, a.cached, a.source, a.blocks, a.unstored = await self._prompt(
            a.ctx, a.own + a.partners, a.salt, tel, has_tel)
        a.tokenize_s = time.perf_counter() - t_tok

    async def _decide(self, a: "_Attempt") -> tuple[Admission, list[Candidate], list[Candidate], bool]:
        """Score, order, flow control and admission, again after each wait (in the fair queue or the batch
        queue): (the admission, own candidates in order, partner candidates in order, must it wait first)."""
        ctx, fs, rc, fc = a.ctx, a.fs, a.rc, a.rc.flow_control
        deadline = time.monotonic() + rc.batch_queue_timeout_s
        own_names = {c.backend.name for c in a.own}
        while True:
            a.prev_engine = self.affinity.get(a.aff_key) if a.aff_key else None  # re-read: a queued request waits
            a.elapsed = max(0.0, time.perf_counter() - ctx.received_at)
            a.tel = self.telemetry
            a.has_tel = self.engines.telemetry_test(a.tel)
            setup = self.setup(ctx, a.own) if self.setup is not None else None  # e.g. an adapter's load
            items, a.feats, drains = self._score(a.own + a.partners, a.n_tokens, a.cached, a.blocks, a.prev_engine,
                                                 a.elapsed, a.target, a.tel, a.has_tel, setup)
            ordered = self._order(a.cfg, items, a.n_tokens, a.plan.dropped)
            own_ord = [c for c in ordered if c.backend.name in own_names]
            part_ord = [c for c in ordered if c.backend.name not in own_names]
            if not own_ord and not part_ord:
                raise no_candidates(ctx, a.plan)
            if not a.all_modelled and rc.strategy in MODEL_STRATEGIES:  # a model's order, without the model:
                load_order(own_ord, a.modelled, items)  # load-aware instead (a chosen model-free strategy stays)
            goal = a.target
            must_wait = False
            if a.flow_on and own_ord and not fs.late:
                must_wait, own_ord, goal = self._flow_mixed(ctx, fs, fc, own_ord, a.modelled, a.feats, a.n_tokens,
                                                            a.target, a.hdr, a.elapsed, items, drains)
            adm = self._admit(a, goal, own_ord, part_ord)
            if must_wait and adm.action == "admit":
                await self._flow_wait(ctx, fs, fc, own_ord, goal, a.target, a.source, a.t_start, a.salt)
                continue  # released: re-score with the engines' views as they are now
            if adm.action != "queue":
                a.target = goal
                return adm, own_ord, part_ord, must_wait
            self.stats["queued"] += 1
            await self._batch_wait(a, adm, ordered, deadline)

    def _admit(self, a: "_Attempt", goal: float | None, own_ord: list[Candidate],
               part_ord: list[Candidate]) -> Admission:
        """Admission on the predictions, where there is a target and a model; a request admitted with its wait
        in its prediction is never refused after it (the promise is made on arrival)."""
        rc, fs = a.rc, a.fs
        # judged where every engine it may go to is modelled: the request's own engines, or only the modelled ones
        # when flow control holds it for them (a pass-through engine takes only the head of the fair order)
        judged = a.all_modelled or all(c.backend.name in a.modelled for c in own_ord)
        if rc.admission and goal is not None and own_ord and judged and not fs.late:
            adm = decide(goal, [c.predicted_ttft_upper_ms for c in own_ord],  # type: ignore[misc]
                         [c.predicted_ttft_ms for c in own_ord], priority=a.priority,  # type: ignore[misc]
                         can_spill=bool(part_ord), batch_headroom=rc.batch_headroom,
                         batch_target_ms=rc.batch_ttft_target_ms)
        else:  # no target, or an upstream without a model (pass-through), or late: nothing to judge
            adm = decide(None, [], [], priority=a.priority, can_spill=False)
        if adm.action == "reject" and fs.waiter is not None:
            self.stats["served_late"] += 1
            adm = decide(None, [], [], priority=a.priority, can_spill=False)
        return adm

    async def _batch_wait(self, a: "_Attempt", adm: Admission, ordered: list[Candidate], deadline: float) -> None:
        """A batch request above the fleet's headroom waits for room; shed (429) when the queue is full or
        past its wait limit."""
        left = deadline - time.monotonic()
        try:
            woke = left > 0 and await self.batch.wait(min(left, 1.0))
        except QueueFull:
            woke = None
        if woke is None or (not woke and time.monotonic() >= deadline):
            self.stats["shed"] += 1
            self._evidence(a.ctx, ordered, a.target, adm.action, a.source, a.t_start, a.salt, a.tel, a.has_tel)
            raise GatewayError(429, "The fleet is above its batch headroom and the batch queue is "
                               + ("full." if woke is None else "past its wait limit."), code="request_shed",
                               headers={**retry_headers(max(1.0, adm.retry_after_s)),
                                        "x-predicted-ttft-ms": f"{adm.best_ms:.0f}"})

    def _reject(self, a: "_Attempt", adm: Admission, own_ord: list[Candidate], must_wait: bool) -> NoReturn:
        """No allowed engine is predicted to meet the target: 429 with the best prediction (and the wait in
        the gateway's fair queue it includes)."""
        target, fs = a.target, a.fs
        assert target is not None  # decide() rejects only against a target
        if len(own_ord) > 1 and not fs.go and a.all_modelled:  # engines predicted to meet the target first
            own_ord.sort(key=lambda c: (c.predicted_ttft_upper_ms or 0) > target)
        self.stats["rejected"] += 1
        self._evidence(a.ctx, own_ord, target, "reject", a.source, a.t_start, a.salt, a.tel, a.has_tel)
        self._flow_evidence(a.ctx, fs, "refused")
        if must_wait:
            self.flow.refuse(fs.flow, "predicted_wait")
            err = unattainable(own_ord[0], target, adm.retry_after_s)
            err.message += (f" That includes {fs.predicted_wait_s * 1000:.0f} ms waiting in the gateway's fair "
                            f"queue behind {fs.ahead_tokens:.0f} prompt tokens.")
            raise err
        raise unattainable(own_ord[0], target, adm.retry_after_s)

    async def _final(self, a: "_Attempt", adm: Admission, own_ord: list[Candidate],
                     part_ord: list[Candidate]) -> list[Candidate]:
        """The candidates in the order the dispatcher tries them: engines predicted to meet the target first,
        partners first on a spill, the client's own provider order over the router's, an operator's in-flight
        limit (the one hold kept)."""
        target = a.target
        if target is not None and len(own_ord) > 1 and not a.fs.go and a.all_modelled:
            own_ord.sort(key=lambda c: (c.predicted_ttft_upper_ms or 0) > target)
        if adm.action == "spill":
            self.stats["spilled"] += 1
            final = part_ord + own_ord
        else:
            self.stats["admitted"] += 1
            final = own_ord + part_ord
        d = a.ctx.decision
        if d is not None and d.providers_order:  # the client's own order wins over the router's (evidence says so)
            final = client_order(final, d.providers_order)
        if any(c.backend.max_inflight is not None for c in final):  # an operator's limit: the one hold we keep
            final = await self._inflight_slot(a.ctx, final, target, a.rc.flow_control.max_wait_s, a.source,
                                              a.t_start, a.salt)
        return final

    def _commit(self, a: "_Attempt", adm: Admission, final: list[Candidate]) -> None:
        """The route is decided: the plan, the evidence (decided_us split into queue wait, tokenize and compute),
        the prediction header where there is a model, the dispatch's accounting, flow and affinity."""
        ctx, fs, modelled = a.ctx, a.fs, a.modelled
        a.plan.candidates = final
        ctx.route = a.plan
        pick = final[0]
        name = pick.backend.name
        self._evidence(ctx, final, a.target, adm.action, a.source, a.t_start, a.salt, a.tel, a.has_tel)
        route = ctx.evidence["route"]  # decided_us, split: waiting in the gateway, awaiting tokens, the rest
        route["queue_wait_us"] = round(fs.waited_s * 1e6, 1)
        route["tokenize_us"] = round(a.tokenize_s * 1e6, 1)
        route["compute_us"] = round(max(0.0, route["decided_us"] - route["queue_wait_us"] - route["tokenize_us"]), 1)
        route["mode"] = "modelled" if name in modelled else "pass_through"
        if name not in modelled:
            self.stats["pass_through"] += 1
        self._flow_evidence(ctx, fs, "spilled" if adm.action == "spill" else "dispatched")
        if a.aff_key:
            route["affinity_engine"] = a.prev_engine  # the session's previous engine, if any
        if name in modelled:  # a prediction is a promise only where there is a model
            ctx.extra_headers["x-predicted-ttft-ms"] = f"{pick.predicted_ttft_ms:.0f}"
        ctx.extra_headers["x-gateway-backend"] = name
        fl = self._dispatched(ctx, pick, final, a.n_tokens, a.elapsed, a.feats, a.blocks, a.unstored, a.tel,
                              a.has_tel(pick))
        if fs.flow and name in modelled and name in {c.backend.name for c in a.own}:
            self.flow.started(fs.flow, fs.weight, float(a.n_tokens - (pick.cached_tokens or 0)), fs.waiter,
                              fs.waited_s, fs.qcls)
            fl.flow = fs.flow
        elif fs.waiter is not None:
            self.flow.done(fs.waiter)
        if a.aff_key:
            if self.peers is not None and a.prev_engine != name:
                self.peers.remembered(a.aff_key, name)
            self.affinity.remember(a.aff_key, name)

    # ---------------------------------------------------------------- flow control (gate.py, flow.py)
    def _maybe_long(self, ctx: RequestContext, own: list[Candidate]) -> bool:
        """Whether the prompt may be long on some own engine (its estimate is at least half the smallest
        threshold): then the short target's refusal before tokenizing does not apply to it."""
        est = ctx.prompt_tokens_est or 0
        return any(est * 2 >= self.flow.limits(c.backend.name).long_prompt_tokens for c in own)

    def _refuse_queued(self, ctx: RequestContext, fs: "_FlowState", own: list[Candidate], target: float,
                       t_start: float, salt: str | None, may_long: bool = False) -> None:
        """Refuse before tokenizing when the work its flow's fair queue already puts ahead of it, at the rate
        the gateway has been handing work out, passes the target: the full prediction (which adds the time an
        engine needs to open and the engine's own part) could only be later. A flooding flow's excess is
        refused here, for the price of a dict lookup, not a /tokenize. A prompt that `may_long` be long waits
        in one of the two lanes, not known before tokenizing: the shorter of the two floors."""
        wait_s, ahead = self.flow.queue_floor(fs.cls, fs.flow, fs.weight)
        if may_long and wait_s > 0.0:
            lw, la = self.flow.queue_floor(lane_class(fs.cls, True), fs.flow, fs.weight)
            if lw < wait_s:
                wait_s, ahead, fs.long = lw, la, True
        elapsed = max(0.0, time.perf_counter() - ctx.received_at)
        if (elapsed + wait_s) * 1000.0 <= target:
            return
        fs.predicted_wait_s, fs.ahead_tokens = wait_s, ahead
        self.stats["rejected"] += 1
        self.stats["rejected_before_tokenize"] += 1
        self.flow.refuse(fs.flow, "predicted_wait")
        self._evidence(ctx, [], target, "reject", "none (refused on its flow's queue, before tokenizing)", t_start,
                       salt)
        ctx.evidence["candidates"] = [c.to_evidence() for c in own]
        self._flow_evidence(ctx, fs, "refused")
        best_ms = (elapsed + wait_s) * 1000.0
        raise GatewayError(
            429, f"No allowed engine is predicted to meet the TTFT target of {target:g} ms: the gateway's fair "
                 f"queue holds {ahead:.0f} prompt tokens ahead of this request for its flow {fs.flow!r} "
                 f"(about {wait_s * 1000:.0f} ms), before any engine time.",
            code="ttft_slo_unattainable",
            headers={**retry_headers(max(0.05, min(30.0, (best_ms - target) / 1000.0))),
                     "x-predicted-ttft-ms": f"{best_ms:.0f}", "x-ttft-slo-ms": f"{target:g}"},
            extra={"predicted_ttft_ms": round(best_ms, 3), "ttft_slo_ms": target})

    def _modes_of(self, cands: list[Candidate], tel: TelemetryService | None) -> set[str]:
        """The names of the modelled upstreams among `cands`; each candidate's mode and why go to its evidence."""
        now = self.clock()
        out: set[str] = set()
        for c in cands:
            m = self.mode(c.backend, tel, now)
            c.mode, c.mode_reason = m.name, m.reason
            if m.modelled:
                out.add(c.backend.name)
        return out

    def _refuse_spent(self, ctx: RequestContext, own: list[Candidate], target: float, t_start: float,
                      salt: str | None) -> None:
        """Without a model of every allowed upstream only a certainty refuses: the time already spent since the
        request arrived is past its target."""
        spent_ms = (time.perf_counter() - ctx.received_at) * 1000.0
        if spent_ms <= target or not own:
            return
        for c in own:
            c.predicted_ttft_ms = c.predicted_ttft_upper_ms = round(spent_ms, 3)
        self.stats["rejected"] += 1
        self.stats["rejected_before_tokenize"] += 1
        self._evidence(ctx, own, target, "reject", "none (the time spent since arrival is past the target)",
                       t_start, salt)
        raise unattainable(own[0], target, 1.0, lower_bound=True)

    def _flow_mixed(self, ctx: RequestContext, fs: "_FlowState", fc: Any, own_ord: list[Candidate],
                    modelled: set[str], feats: dict[str, Features], n_tokens: int, target: float | None,
                    hdr: str | None, elapsed: float, items: list[Scored], drains: dict[str, Drain]
                    ) -> tuple[bool, list[Candidate], float | None]:
        """`_flow_plan` over the modelled candidates only: flow control acts where there is a model. When the
        modelled engines are closed, a request goes to a pass-through upstream with fewer requests in flight than
        every modelled one (load-aware, as it would be routed without flow control; a cold slow engine is not
        flooded with the modelled engines' overflow), else waits for a modelled one; while they are open,
        pass-through upstreams keep their places in the strategy's order (a cold engine gets the traffic it
        learns from)."""
        mod = [c for c in own_ord if c.backend.name in modelled]
        if not mod:
            return False, own_ord, target
        must_wait, mod_sorted, goal = self._flow_plan(ctx, fs, fc, mod, feats, n_tokens, target, hdr, elapsed,
                                                      items, drains)
        if len(mod) == len(own_ord):
            return must_wait, mod_sorted, goal
        if must_wait and goal is not None and not (fs.released or self.flow.first_in_line(fs.qcls, fs.flow)):
            # a request with a target that others go before in fair order: it is held for the modelled engines like
            # them, so admission judges it with its wait in the fair queue (refused on arrival when that misses its
            # target). A pass-through engine takes only a request at the head of the fair order: else a flooding
            # flow's excess, which admission would refuse, floods the pass-through engines unjudged, and the flows
            # within their share sent there wait behind it (bench.flow_control tenants: A kept 0.26x of its solo
            # goodput). Without a target nothing is promised: it keeps the load-aware way below
            self.stats["pass_through_held_for_fairness"] += 1
            return True, mod_sorted, goal
        if must_wait or fs.unheld:  # load-aware: a pass-through upstream takes it while it has fewer in flight than
            inflight = {it.cand.backend.name: it.view.inflight for it in items}  # every modelled one (a cold
            least = min(inflight.get(c.backend.name, 0) for c in mod)  # engine is not flooded with their overflow)
            pt = [c for c in own_ord if c.backend.name not in modelled and inflight.get(c.backend.name, 0) < least]
            if not pt and must_wait:
                return True, mod_sorted, goal  # it waits for a modelled engine
            if not pt:  # not held: the best modelled engine, the pass-through ones after it
                return False, mod_sorted + [c for c in own_ord if c.backend.name not in modelled], goal
            self.stats["released_to_pass_through"] += 1
            fs.go, fs.predicted_wait_s, fs.ahead_tokens = frozenset(), 0.0, 0.0
            return False, pt + [c for c in own_ord if c.backend.name not in modelled and c not in pt] + mod_sorted, \
                goal
        go = fs.go
        return False, ([c for c in own_ord if c.backend.name in go or c.backend.name not in modelled]
                       + [c for c in mod_sorted if c.backend.name not in go]), goal

    async def _inflight_slot(self, ctx: RequestContext, final: list[Candidate], target: float | None,
                             max_wait_s: float, source: str, t_start: float, salt: str | None) -> list[Candidate]:
        """Take an in-flight slot (`backends[].max_inflight`) on the first candidate that has one free (it goes
        first); when none has, wait for one (a request with a TTFT target is refused at once: limits.py)."""
        lim = self.limits
        deadline = self.clock() + max_wait_s
        waited = False
        while True:
            free = [c for c in final if lim.free(c.backend.name, c.backend.max_inflight)]
            if free:
                pick = free[0]
                lim.take(pick.backend.name)
                self._slots[ctx.request_id] = pick.backend.name
                if waited:
                    ctx.evidence.setdefault("inflight_limit", {})["waited"] = True
                return [pick] + [c for c in final if c is not pick]
            left = deadline - self.clock()
            if target is None and left > 0:
                waited = True
                lim.stats["waited"] += 1
                if await lim.wait(left):
                    continue
                lim.stats["timeouts"] += 1
            lim.stats["refused"] += 1
            self.stats["rejected_inflight_limit"] += 1
            self._evidence(ctx, final, target, "reject", source, t_start, salt)
            full = {c.backend.name: c.backend.max_inflight for c in final}
            ctx.evidence["route"]["inflight_limit"] = full
            raise GatewayError(429, "Every allowed upstream is at the in-flight limit its operator set ("
                               + ", ".join(f"{n}: {m}" for n, m in full.items()) + ")"
                               + (" and none freed a slot in time." if target is None else "."),
                               code="backend_inflight_limit", headers=retry_headers(1.0))

    def _flow_plan(self, ctx: RequestContext, fs: "_FlowState", fc: Any, own_ord: list[Candidate],
                   feats: dict[str, Features], n_tokens: int, target: float | None, hdr: str | None,
                   elapsed: float, items: list[Scored], drains: dict[str, Drain]
                   ) -> tuple[bool, list[Candidate], float | None]:
        """(must wait in the gateway, own candidates in order, the target admission holds it to). The engines
        that may start it now go first; with none (or others ahead of it in fair order) it waits, and its
        predictions are made to include the wait."""
        now = self.clock()
        fs.unheld = False
        unc = {c.backend.name: n_tokens - (c.cached_tokens or 0) for c in own_ord}
        fs.uncached = unc
        longs = self.flow.long_on(unc)
        fs.long = all(longs.values())
        fs.qcls = lane_class(fs.cls, fs.long)
        goal = self._long_target(ctx, fc, own_ord, feats, target, hdr) if fs.long else target
        states = {}  # the views (and drains) the prediction just took, not taken again
        for it in items:
            name = it.cand.backend.name
            if name in unc:
                v = it.view
                states[name] = (v.ahead_tokens, float(v.prefilling_tokens), v.running, drains[name])
        budget = self._queue_budget(fs, own_ord, feats, goal, elapsed, now)
        go = self.flow.may_start(unc, now, {"state": states}, longs, budget)
        if go and (fs.released or self.flow.first_in_line(fs.qcls, fs.flow)):
            fs.go = go
            first = [c for c in own_ord if c.backend.name in go]
            if fs.long and goal is not None:  # best fit: the slowest engine that meets its (loose) target
                first.sort(key=lambda c: target_fit_score(c.predicted_ttft_ms, c.predicted_ttft_upper_ms, goal,
                                                          LONG_FIT))
            return False, first + [c for c in own_ord if c.backend.name not in go], goal
        fs.go = frozenset()
        if budget is not None and not go and not fs.long and fs.waiter is None:
            # one flow alone and no engine's queue drains within its target: waiting in the gateway could only
            # spend the target (the engines serve their queues in order), so admission judges it now on the
            # engines' own predictions, full queues included (refused on arrival, or sent where it fits)
            self.stats["target_not_held"] += 1
            fs.unheld = True
            return False, own_ord, goal
        wait_s, ahead = self.flow.predicted_wait(fs.qcls, fs.flow, fs.weight, unc, now)
        fs.predicted_wait_s, fs.ahead_tokens = wait_s, ahead
        fs.wait_upper_s = wait_up = wait_s + self.flow.wait_margin()  # the bound counts the wait's own error
        queue_s = fc.engine_queue_ms / 1000.0
        for c in own_ord:  # from arrival: elapsed + the wait + the engine's part once it is open again
            name = c.backend.name
            f = feats.get(name)
            if f is None:
                continue
            dr = drains[name]
            gate_tokens = queue_s / max(1e-9, dr.s_per_token + dr.step_s / max(1, dr.budget))
            g = Features(ahead_tokens=min(f.ahead_tokens, gate_tokens), uncached_tokens=f.uncached_tokens,
                         running=f.running)
            mean, upper = self.predictor.predict(name, g)
            setup = c.info.get("adapter_load_ms", 0.0) / 1000.0
            c.predicted_ttft_ms = round((elapsed + wait_s + setup + mean) * 1000, 3)
            c.predicted_ttft_upper_ms = round((elapsed + wait_up + setup + upper) * 1000, 3)
            c.info["queue_wait_ms"] = round(wait_s * 1000, 3)
            c.info["queue_wait_upper_ms"] = round(wait_up * 1000, 3)
        own_ord.sort(key=lambda c: c.predicted_ttft_upper_ms or 0.0)
        return True, own_ord, goal

    def _queue_budget(self, fs: "_FlowState", own_ord: list[Candidate], feats: dict[str, Features],
                      goal: float | None, elapsed: float, now: float) -> dict[str, float] | None:
        """A request with a target: per engine, how long it may wait in that engine's queue and still meet it (its
        due time less its own prefill's upper bound there with nothing queued, and an adapter's load): the gate
        opens an engine for it within that while one flow alone is served (FlowGate.may_start)."""
        if goal is None:
            fs.first_token_by = None
            return None
        fs.first_token_by = now + goal / 1000.0 - elapsed
        own: dict[str, float] = {}
        for c in own_ord:
            f = feats.get(c.backend.name)
            if f is None:
                continue
            upper = self.predictor.predict(c.backend.name, Features(0.0, f.uncached_tokens, f.running))[1]
            own[c.backend.name] = upper + c.info.get("adapter_load_ms", 0.0) / 1000.0
        fs.own_upper_s = own  # kept for its waiter, if it waits: the gate may release it on them later
        if not self.flow.alone(fs.flow, now):
            return None  # others to be fair to: the engines' queues stay short, the fair queue decides
        left = fs.first_token_by - now
        return {e: left - u for e, u in own.items()}

    def _long_target(self, ctx: RequestContext, fc: Any, own_ord: list[Candidate], feats: dict[str, Features],
                     target: float | None, hdr: str | None) -> float | None:
        """A long prompt's TTFT target: the client's x-ttft-slo-ms, else policy's long_ttft_slo_ms, else
        routing.flow_control.long_ttft_slo_ms, else its target plus its own prefill on an idle engine."""
        if hdr and slo_ms(hdr, None, None) is not None:
            return target
        d = ctx.decision
        v = d.long_ttft_slo_ms if d is not None else None
        if v:
            return float(v)
        if fc.long_ttft_slo_ms:
            return float(fc.long_ttft_slo_ms)
        if target is None:
            return None
        own = [self.predictor.predict(c.backend.name, Features(0.0, feats[c.backend.name].uncached_tokens, 0.0))[0]
               for c in own_ord if c.backend.name in feats]
        return target + (min(own) * 1000 if own else 0.0)

    async def _flow_wait(self, ctx: RequestContext, fs: "_FlowState", fc: Any, own_ord: list[Candidate],
                         goal: float | None, target: float | None, source: str, t_start: float,
                         salt: str | None) -> None:
        """Wait in the fair queue until an engine may start the request; 429 when its flow's queue is full
        or its target's slack runs out first."""
        now = self.clock()
        if fs.waiter is None:
            best = min((c.predicted_ttft_upper_ms or 0.0) for c in own_ord) / 1000.0
            slack = fc.max_wait_s if goal is None else (goal / 1000.0) - (best - fs.wait_upper_s)
            fs.waiter = Waiter(fs.flow, fs.qcls, float(min(fs.uncached.values())), fs.long,
                               frozenset(fs.uncached), now, now + max(0.0, min(fc.max_wait_s, slack)),
                               uncached=fs.uncached, predicted_s=fs.predicted_wait_s,
                               first_token_by=fs.first_token_by if goal is not None else None,
                               own_upper_s=fs.own_upper_s)
            fs.enqueued = now
            front = False
        else:  # released, but the engines closed again before it dispatched: back to the head of its flow
            front = True
        try:
            fs.released = await self.flow.wait(fs.waiter, fs.weight, front=front)
        except (FlowQueueFull, QueueTimeout) as e:
            full = isinstance(e, FlowQueueFull)
            fs.waited_s = self.clock() - fs.enqueued
            if not full and goal is None:  # refused below: it waited at least this long (the wait's error; a late
                self.flow.observe_wait(fs.waiter, fs.waited_s)  # one is counted when it is dispatched)
            if not full and goal is not None:  # admitted with this wait in its prediction: served, never refused
                fs.late = True  # after it (the route stage dispatches it on its next pass, past flow control)
                self.flow.stats["late"] += 1
                return
            if full and goal is None:  # nothing promised, and a plain proxy would serve it: the engine queues it
                fs.late = True  # (its flow already has max_queue_per_flow waiting here: it goes past flow control)
                fs.waiter = None  # never queued
                self.flow.stats["overflow"] += 1
                return
            reason = "queue_full" if full else "queue_timeout"
            if not full:
                self.stats["refused_after_wait"] += 1  # without a target, after max_wait_s: counted apart
            self.flow.refuse(fs.flow, reason)
            self.stats["rejected"] += 1
            self._evidence(ctx, own_ord, goal, "reject", source, t_start, salt)
            self._flow_evidence(ctx, fs, reason)
            retry = max(1.0, fs.predicted_wait_s)
            why = (f"its flow {fs.flow!r} already has {fc.max_queue_per_flow} requests waiting" if full else
                   f"no engine could start it within its TTFT target ({goal:g} ms)" if goal is not None else
                   f"no engine could start it within {fc.max_wait_s:g} s")
            raise GatewayError(429, f"Flow control: the request was not dispatched: {why}.",
                               code="flow_queue_full" if full else "flow_queue_timeout",
                               headers={**retry_headers(retry),
                                        "x-predicted-ttft-ms": f"{min(c.predicted_ttft_ms or 0 for c in own_ord):.0f}"},
                               extra={"flow": fs.flow, "waited_ms": round(fs.waited_s * 1000, 3)}) from None
        fs.waited_s = self.clock() - fs.enqueued

    def _flow_evidence(self, ctx: RequestContext, fs: "_FlowState", outcome: str) -> None:
        if not fs.flow:
            return
        route = ctx.evidence.setdefault("route", {})
        route["queue"] = {"class": fs.cls, "flow": fs.flow, "share": fs.weight,
                          "lane": "long" if fs.long else "short", "queued": fs.waiter is not None,
                          "waited_ms": round(fs.waited_s * 1000, 3),
                          "predicted_wait_ms": round(fs.predicted_wait_s * 1000, 3),
                          "ahead_tokens": round(fs.ahead_tokens, 1), "outcome": outcome}

    def _dispatched(self, ctx: RequestContext, pick: Candidate, final: list[Candidate], n_tokens: int,
                    elapsed: float, feats: dict[str, Features], blocks: list[int],
                    unstored: dict[str, tuple[int, list[int]]], tel: TelemetryService | None, has_tel: bool) -> Flight:
        """Account the routed request as in flight on its pick: own prefill work ahead there until its first
        token, and its blocks the index does not hold yet as pending (with the last chunk's tail)."""
        name = pick.backend.name
        fl = Flight(ctx, name, n_tokens - (pick.cached_tokens or 0), self.clock(),
                    max(0.0, (pick.predicted_ttft_ms or 0) / 1000 - elapsed), feats,
                    {c.backend.name: c.cached_tokens or 0 for c in final}, blocks, has_tel,
                    {c.backend.name: max(0.0, (c.predicted_ttft_upper_ms or 0) / 1000 - elapsed) for c in final},
                    elapsed)
        if name in unstored and tel is not None:  # unstored blocks come from the KV index's lookup
            held, keys = unstored[name]
            bs = tel.index.block_size(name)
            budget = self.engines.chunk_budget(name, tel)[0]
            tail = last_chunk_from(n_tokens, pick.cached_tokens or 0, budget, bs, held)
            # the tail's fallback time (when KV events lag): the predicted first token, by which the last step
            # has started; before it only the index says so (it holds every block before the tail)
            self.pending.add(ctx.request_id, name, keys[held:], tail, fl.started + fl.predicted_s,
                             max(0, (n_tokens - budget) // bs) if bs else 0)
        fl.concurrency = 1 + len(self.inflight.by_engine.get(name, ())) + len(self.inflight.remote.get(name, ()))
        self.inflight.add(fl)
        if self.peers is not None:
            self.peers.dispatched(fl)
        if fl.uncached >= self.flow.limits(name).long_prompt_tokens:  # the prefill guard's index
            self._longs.setdefault(name, {})[ctx.request_id] = fl
        if fl.telemetry and tel is not None:
            tel.begin(name, fl.uncached)
        return fl

    def _refuse_early(self, ctx: RequestContext, own: list[Candidate], target: float, t_start: float,
                      salt: str | None) -> None:
        """Refuse before the request is tokenized when a lower bound on every own engine's TTFT is already
        over the target (early.py says why that is safe). Returns when that is not certain."""
        now = self.clock()
        bounds = self._uncached_lower_bounds(ctx, own, salt, now)
        elapsed = max(0.0, time.perf_counter() - ctx.received_at)  # already spent: part of any TTFT from here
        views = {c.backend.name: self._view(c.backend.name, now, self._telemetry_for(c)) for c in own}
        r = refuse_early(own, target, elapsed, bounds, views, self.predictor)
        if r is None:
            return
        self.stats["rejected"] += 1
        self.stats["rejected_before_tokenize"] += 1
        self.stats["rejected_on_cached_prefix"] += 1 if bounds else 0
        self._evidence(ctx, r.cands, target, "reject", "none (refused on a lower bound, before tokenizing"
                       + ("; message prefix's ids cached)" if bounds else ")"), t_start, salt)
        raise unattainable(r.cands[0], target, r.admission.retry_after_s, lower_bound=True)

    def _uncached_lower_bounds(self, ctx: RequestContext, own: list[Candidate], salt: str | None, now: float
                               ) -> dict[str, int]:
        return uncached_lower_bounds(ctx, own, salt, now, self.telemetry, self._telemetry_for, self.pending)

    def _learn_prefix(self, ctx: RequestContext, cand: Candidate, toks: list[int], salt: str | None) -> None:
        learn_prefix(ctx, cand, toks, salt, self.telemetry, self._learning)

    def _evidence(self, ctx: RequestContext, cands: list[Candidate], target: float | None,
                  action: str, source: str, t_start: float, salt: str | None, tel: Any = _ASK,
                  has_tel: Callable[[Candidate], bool] | None = None) -> None:
        """`tel`, `has_tel`: the telemetry service and its test where the caller resolved them already."""
        if tel is _ASK:
            tel = self.telemetry
            has_tel = self.engines.telemetry_test(tel)
        route_evidence(ctx, cands, target, action, source, t_start, salt, self._strategy_label(self._config()), tel,
                       has_tel or self.engines.telemetry_test(tel))

    async def finish(self, ctx: RequestContext) -> None:
        slot = self._slots.pop(ctx.request_id, None)
        if slot is not None:
            self.limits.give(slot)
        fl = self.inflight.pop(ctx.request_id)
        if fl is None:
            return
        longs = self._longs.get(fl.engine)
        if longs is not None and longs.pop(ctx.request_id, None) is not None and not longs:
            del self._longs[fl.engine]
        self.pending.remove(ctx.request_id)
        self.batch.wake(2)
        if fl.flow:
            u = ctx.usage
            self.flow.finished(fl.flow, (u.completion_tokens or 0) if u is not None else ctx.delivered_completion_tokens)
        tel = self.telemetry
        if fl.telemetry and tel is not None:
            tel.end(fl.engine, fl.uncached)
        for plugin in self.on_response:  # what the response teaches (gateway/routing/plugin.py ResponseComplete)
            try:
                plugin.response_complete(ctx, fl)
            except Exception:
                log.exception("routing: response-complete plugin %s failed", plugin.name)

    def snapshot(self) -> dict[str, Any]:
        """For /admin/routing: per engine the learned parameters, the guard's state, prediction quality out of
        sample (mape, mdare, calibration vs calibration_target) and the engine facts with their sources;
        admission counters, queue depth."""
        cfg = self._config()
        engines = self.predictor.snapshot()
        now = self.clock()
        for b in cfg.backends:
            if b.kind in TELEMETRY_KINDS or b.name in engines:
                e = engines.setdefault(b.name, {})
                e["facts"] = self.facts(b.name)
                v = self._view(b.name, now, self.engines.has_telemetry_name(b.name))  # own + the peers' flights
                e["view"] = {"inflight": v.inflight, "ahead_tokens": round(v.ahead_tokens, 1),
                             "prefilling_tokens": v.prefilling_tokens, "running": v.running}
        tel = self.telemetry
        modes = {b.name: self.mode(b, tel, now).to_dict() for b in cfg.backends}  # every upstream, and why
        for name, e in engines.items():
            if name in modes:
                e["mode"] = modes[name]
        out = {"strategy": strategy_label(cfg.raw.routing.strategy), "engines": engines, "modes": modes,
               "room": self.room.snapshot(now), "inflight_limits": self.limits.snapshot(),
               "admission": dict(self.stats), "batch_queue": len(self.batch),
               "inflight": self.inflight.counts(), "flow": self.flow.snapshot()}
        if self.peers is not None:
            out["peers"] = self.peers.snapshot()
        return out

