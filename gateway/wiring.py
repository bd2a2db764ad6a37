"""Builds the subsystems a config asks for and plugs them into a Gateway: services, stages, routes, hooks.

Each `_wire_<subsystem>` builds one typed subsystem, registers its services, routes and finish hooks, and
returns its stage (if it has one); `wire` then declares the pipeline as one literal stage list, so the order
of the request path reads in one place:
observe -> authenticate -> decide -> cache -> reserve -> route (predict, admit) [-> trace] -> dispatch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admin_guard import PLATFORM_ADMIN, TENANT_ADMIN, gateway_guard
from gateway.app import Gateway, ObserveStage
from gateway.config import Config, ConfigError
from gateway.completion import Completion, Step, finish_of
from gateway.observability.tracing import UpstreamTraceStage
from gateway.pipeline import Pipeline
from gateway.proxy.forward import DispatchStage

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from gateway.adapters.holds import SharedHolds
    from gateway.adapters.placement import Placement
    from gateway.adapters.stage import AdapterStage
    from gateway.budget.stage import BudgetStage
    from gateway.cache.stage import CacheStage
    from gateway.config import BackendConfig
    from gateway.cost.meter import CostMeter
    from gateway.identity.stage import AuthStage
    from gateway.observability.hooks import RequestObserver
    from gateway.observability.tracing import Tracing
    from gateway.pipeline import RequestContext
    from gateway.policy.engine import CompiledPolicy
    from gateway.policy.opa import OPAPolicy
    from gateway.policy.stage import PolicyStage
    from gateway.rollouts.stage import RolloutStage
    from gateway.policy.model import RequestAttrs
    from gateway.routing.stage import PredictiveRouteStage
    from gateway.types import Decision, Principal


def wire(gw: Gateway, span_exporter: SpanExporter | None = None) -> Gateway:
    """Attach every subsystem to the gateway (called once, before the app starts) and return it, built: each
    subsystem attribute (`gw.identity`, `gw.router`, ...) holds its concrete service, typed on Gateway.
    `span_exporter`: tracing on with this exporter besides the configured OTLP one (tests pass an in-memory
    exporter)."""
    authenticate = _wire_identity(gw)
    adapters = _wire_adapters(gw)
    placement = _wire_placement(gw)
    decide = _wire_policy(gw)
    rollout = _wire_rollouts(gw)
    reserve = _wire_budgets(gw)
    cache = _wire_cache(gw)
    cache.charge = reserve.charge_answer  # a hit is charged at the cache price by the budget (docs/cache.md#price)
    served = _wire_telemetry(gw)
    route = _wire_routing(gw)
    route.setup = placement.setup_s  # an adapter's load where it is not resident counts in the predicted TTFT
    record = _wire_evidence(gw)
    meter = _wire_cost(gw)
    observer, tracing = _wire_observability(gw, span_exporter)
    stages: list[Any] = [
        ObserveStage(gw),  # first in: the request's log context; its finish records the request metrics
        authenticate,
        rollout,  # a weighted alias's arm, sticky per end user (gateway/rollouts, docs/rollouts.md)
        adapters,  # after the arm is chosen: an adapter exists only for its owner scope (gateway/adapters)
        placement,  # adapter_placement: its finish releases the request's hold on an adapter it placed (the dispatcher places)
        decide,
        cache,  # a hit answers here: no route, no GPU; charged at the cache price (budgets.prices, default 0)
        reserve,
        route,
        *([meter.stage] if meter is not None else []),  # spans open per dispatch attempt (docs/cost.md)
        *([UpstreamTraceStage(tracing)] if tracing is not None else []),  # opens the spans, sets traceparent
    ]
    # what runs after the response, in this order, once per request (gateway/completion.py); a stage's finish
    # runs only where its run started. docs/architecture.md renders this list (tests/test_architecture_doc.py)
    completion = Completion([
        finish_of("meter", "close the request's engine-time span and price it: a GPU-second budget settles the "
                           "apportioned time, so this comes before the budget"),
        finish_of("route", "learn: the TTFT learner's sample, the routing slot, the flow-control share and the "
                           "peers' flight released"),
        finish_of("reserve", "settle the budget hold with the engine's usage and file the spend-ledger row"),
        finish_of("cache", "store a cacheable answer, with what it was charged (after the budget settled)"),
        finish_of("adapter_placement", "release the request's hold on the adapter it placed; unload a deleted one"),
        finish_of("rollout", "the arm's outcome into the rollback watch; start the sampled shadow copies"),
        finish_of("batch_retention", "batch lane: a line of a zero-retention batch is zero-retention in every "
                                     "record below, even when refused before its input file's decision ran"),
        finish_of("observe", "request metrics: status, duration, TTFT, tokens, stage timings"),
        *([Step("cost", meter.finish, "price with the charge, file a ledger row where the budget filed none, "
                                      "cost metrics; before the audit record, which carries the unit cost")]
          if meter is not None else []),
        Step("telemetry", served, "the engine stored blocks (the KV-event stream's silence alarm)"),
        Step("evidence", record, "the audit record"),
        Step("access_log", observer, "per-request metrics beyond the standard ones, the recent ring, the "
                                     "access log"),
        *([Step("trace_end", tracing.finish, "complete the request's spans (last: they carry every fact above)")]
          if tracing is not None else []),
    ])
    gw.pipeline = Pipeline(stages, DispatchStage(gw.dispatcher), completion)
    _wire_batch(gw)
    _wire_discovery(gw)  # last: its first resolution reloads the config into services already started
    return gw


def batch_pipeline(base: Pipeline, restriction: Any, zero: bool) -> Pipeline:
    """The batch lane's pipeline for a line (gateway/batch): the realtime one at priority `batch`, never looser
    than its input file's decision nor than the batch's zero retention. Its stages' finishes are in the
    completion list above (`batch_retention`)."""
    from gateway.batch.scope import InputFileDecision, RetentionGuard
    from gateway.batch.service import BatchPriorityStage

    pipe = base.with_stage_after("decide", BatchPriorityStage())
    if restriction or zero:
        pipe = pipe.with_stage_after("decide", InputFileDecision(restriction, zero)).with_stage_after(
            "observe", RetentionGuard(restriction, zero))
    return pipe


def shadow_pipeline(base: Pipeline, caller: Decision) -> Pipeline:
    """A shadow copy's pipeline (gateway/rollouts/shadow.py): no authentication or arm choice of its own (it runs as
    the primary's caller, on the arm it copies), the caller's decision tightened after `decide`."""
    from gateway.rollouts.shadow import SKIPPED_STAGES, ShadowDecisionStage

    return base.without(SKIPPED_STAGES).with_stage_after("decide", ShadowDecisionStage(caller))


def _wire_cost(gw: Gateway) -> CostMeter | None:
    """Engine time apportioned to requests, priced per backend, on audit records, ledger rows and /metrics;
    the meter (its stage goes in the stage list), or None with `cost.enabled: false`."""
    from gateway.cost.wiring import wire_cost

    return wire_cost(gw)


def _wire_discovery(gw: Gateway) -> None:
    """Backends with `discovery: {dns}` become one backend per resolved address, refreshed (gateway/discovery.py).
    Always wired (idle without templates), so a reload that adds a discovery backend is served too."""
    from gateway.discovery import DiscoveryService

    gw.services.append(DiscoveryService(gw))


def _wire_identity(gw: Gateway) -> AuthStage:
    """API keys, JWT/OIDC, partners and the admin CRUD plane (SQLite by default, Postgres for replicas)."""
    from gateway.identity.admin import admin_routes
    from gateway.identity.service import IdentityService
    from gateway.identity.stage import AuthStage

    svc = IdentityService(gw.config)
    gw.services.append(svc)
    gw.identity = svc
    gw.auth = AuthStage(svc)

    gw.admin_auth = svc.authenticate_admin  # with the client address: the limiter counts per address
    gw.extra_routes.extend(admin_routes(svc, gateway_guard(gw)))
    return gw.auth


def _wire_adapters(gw: Gateway) -> AdapterStage:
    """Tenant-owned LoRA adapters: the registry in the identity store, its admin routes, the ownership stage."""
    from gateway.adapters.admin import adapter_routes
    from gateway.adapters.service import AdapterService
    from gateway.adapters.stage import AdapterStage

    assert gw.identity is not None, "the identity layer is wired first"
    svc = AdapterService(gw.identity)
    gw.services.append(svc)  # after the identity service, which opens the store it uses
    gw.adapters = svc
    gw.extra_routes.extend(adapter_routes(svc, gateway_guard(gw)))
    return AdapterStage(svc)


def _shared_holds(gw: Gateway) -> SharedHolds | None:
    """The adapter holds shared with other processes, when there are others: replicas on one PostgreSQL
    identity store, or the workers of `server.workers` on one SQLite file (gateway/adapters/holds.py)."""
    import os

    from gateway.adapters.holds import SharedHolds
    from gateway.identity.store import SqlIdentityStore
    from gateway.stores.identity_sqlite import SqliteIdentityStore

    store = gw.identity.store if gw.identity is not None else None
    if not isinstance(store, SqlIdentityStore):
        return None
    workers = max(int(os.environ.get("GATEWAY_WORKERS") or 1), gw.config.raw.server.workers)
    return SharedHolds(store) if workers > 1 or not isinstance(store, SqliteIdentityStore) else None


def _wire_placement(gw: Gateway) -> Placement:
    """Registered adapters loaded on dynamic engines (backends[].lora.dynamic) where routing sends them: the
    dispatcher asks it before each attempt; its stage's finish ends a request's hold (gateway/adapters/placement)."""
    from gateway.adapters.placement import Placement
    from gateway.proxy.dialects import dialect_for

    def auth(b: BackendConfig) -> dict[str, str]:
        return dialect_for(b.kind).auth_headers(gw.upstreams.auth(b.name))

    adapters = gw.adapters
    assert adapters is not None, "the adapter registry is wired first"
    pl = Placement(lambda: gw.config, auth, adapters.registry, registry=gw.metrics.registry)
    pl.engine_load = lambda name: gw.telemetry.load(name) if gw.telemetry is not None else None
    pl.shared = lambda: _shared_holds(gw)
    gw.services.append(pl)
    gw.dispatcher.placement = pl
    adapters.placement = pl  # DELETE unloads its copies once their requests finish
    return pl


def _wire_rollouts(gw: Gateway) -> RolloutStage:
    """Weighted alias arms: live state in the identity store, /admin/aliases, rollback on regression."""
    from gateway.rollouts.admin import alias_admin_routes
    from gateway.rollouts.service import RolloutService
    from gateway.rollouts.shadow import ShadowRunner
    from gateway.rollouts.stage import RolloutStage

    svc = RolloutService(gw.config, gw.identity, gw.metrics)
    gw.services.append(svc)  # after the identity service, which opens the store it uses
    gw.rollouts = svc
    gw.extra_routes.extend(alias_admin_routes(svc, gateway_guard(gw)))
    # a copy runs through the pipeline as it is when the copy starts (a reload may have replaced it)
    svc.shadow_runner = ShadowRunner(gw, lambda caller: shadow_pipeline(gw.pipeline, caller))
    return RolloutStage(svc, svc.shadow_runner)


class PolicyHolder:
    """The compiled policy of the current config snapshot; recompiled and swapped on reload."""

    def __init__(self, config: Config) -> None:
        self.current = self._compile(config)
        self._pending: CompiledPolicy | None = None  # the policy check_config compiled, taken by the swap that follows
        self.on_swap: list[Callable[[CompiledPolicy], None]] = []  # called with each newly compiled policy (identity's restriction labels)
        self.opa = None
        if config.raw.policy.opa is not None:
            from gateway.policy.opa import OPAPolicy

            self.opa = OPAPolicy(config.raw.policy.opa, local=lambda: self.current)

    @staticmethod
    def _compile(config: Config) -> CompiledPolicy:
        from gateway.policy.cli import load_for_config
        from gateway.policy.compiler import PolicyError

        try:
            return load_for_config(config)
        except PolicyError as e:
            raise ConfigError(f"policy: {e}") from None

    def provider(self) -> OPAPolicy | CompiledPolicy:
        return self.opa if self.opa is not None else self.current

    async def adecide(self, principal: Principal, request: RequestAttrs) -> Decision:
        """A decision outside the request path (the batch lane's uploads): OPA's where it is configured, else
        the compiled policy's."""
        if self.opa is not None:
            return await self.opa.adecide(principal, request)
        decision: Decision = self.current.decide(principal, request)
        return decision

    def check_config(self, config: Config) -> None:
        self._pending = self._compile(config)

    async def swap_config(self, config: Config) -> None:
        pending = self._pending
        self.current = pending if pending is not None else self._compile(config)
        self._pending = None
        for cb in self.on_swap:
            cb(self.current)
        want = config.raw.policy.opa
        have = self.opa.config if self.opa is not None else None
        if want != have:  # OPA added, removed or re-pointed by the reload: swap the client too
            from gateway.policy.opa import OPAPolicy

            old = self.opa
            new = OPAPolicy(want, local=lambda: self.current) if want is not None else None
            if new is not None:
                await new.start()
            self.opa = new
            if old is not None:
                await old.close()

    async def start(self) -> None:
        if self.opa is not None:
            await self.opa.start()

    async def close(self) -> None:
        if self.opa is not None:
            await self.opa.close()


def _wire_policy(gw: Gateway) -> PolicyStage:
    """YAML policies (optionally delegated to OPA) decide allow/deny, residency, retention, budgets, SLOs."""
    from gateway.policy.stage import PolicyStage

    holder = PolicyHolder(gw.config)
    gw.policy = holder
    if gw.identity is not None:  # labels the policy restricts on can only be tightened below the tenant
        gw.identity.set_policy(holder.current)
        holder.on_swap.append(gw.identity.set_policy)
    gw.services.append(holder)
    return PolicyStage(holder.provider)


def _wire_cache(gw: Gateway) -> CacheStage:
    """Response cache (exact and semantic, chosen per policy rule; docs/cache.md): a stage between decide and
    reserve, DELETE /admin/cache, and a purge on every reload (policy, model aliases or backends may change)."""
    from gateway.cache.service import CacheService

    svc = CacheService(gw)
    gw.services.append(svc)
    gw.cache = svc
    gw.extra_routes.append(gateway_guard(gw).route("/admin/cache", svc.admin_delete, ["DELETE"],
                                                   (PLATFORM_ADMIN, TENANT_ADMIN)))
    return svc.stage


def _wire_telemetry(gw: Gateway) -> Callable[[RequestContext], Awaitable[None]]:
    """KV-event subscribers and metric scrapers for engines that publish them (kind vllm/sim)."""
    from gateway.telemetry.service import TelemetryService

    svc = TelemetryService(gw.config)
    gw.services.append(svc)
    gw.telemetry = svc

    async def served(ctx: RequestContext) -> None:  # evidence that the engine stored blocks (KV-stream silence alarm)
        if ctx.backend and ctx.status in (0, 200) and ctx.usage is not None:
            svc.observe_served(ctx.backend, ctx.usage.prompt_tokens, ctx.usage.cached_tokens)

    async def fleet(request: Request, principal: Principal | None) -> Response:
        await svc.refresh_block_counts()
        return JSONResponse({"engines": svc.fleet_snapshot(), "health": gw.health.snapshot()})

    gw.extra_routes.append(gateway_guard(gw).route("/admin/fleet", fleet, ["GET"], (PLATFORM_ADMIN,)))
    return served  # its completion step


def _wire_evidence(gw: Gateway) -> Callable[[RequestContext], Awaitable[None]]:
    """One audit record per request (JSON lines; Postgres optional), readable at /admin/decisions/{id}."""
    from gateway.evidence.admin import make_decision_handler
    from gateway.evidence.recorder import EvidenceRecorder

    cfg = gw.config
    pc = cfg.raw.policy
    sink = None
    if pc.audit_postgres_dsn:
        import os

        from gateway.evidence.postgres import PostgresSink

        sink = PostgresSink(os.path.expandvars(pc.audit_postgres_dsn))
    rec = EvidenceRecorder(pc.audit_path if pc.audit_path == "-" else cfg.resolve_path(pc.audit_path),
                           max_bytes=pc.audit_max_bytes, backups=pc.audit_backups,
                           capture_content=cfg.raw.observability.capture_content,
                           backend_lookup=lambda name: _backend_or_none(gw, name), sink=sink,
                           sink_backlog=pc.audit_postgres_backlog)
    gw.services.append(rec)
    gw.evidence = rec

    async def record(ctx: RequestContext) -> None:
        rec.record(ctx)

    # platform admins read every record; a tenant admin its own tenant's (others' ids are 404)
    gw.extra_routes.append(gateway_guard(gw).route("/admin/decisions/{request_id}", make_decision_handler(rec),
                                                   ["GET"], (PLATFORM_ADMIN, TENANT_ADMIN)))
    return record  # its completion step


def _wire_observability(gw: Gateway, span_exporter: SpanExporter | None
                        ) -> tuple[RequestObserver, Tracing | None]:
    """State metrics, per-request metrics/access log, /admin/ui dashboard, OTel tracing when configured (or an
    exporter given): the request observer and the tracing (None when off), for the stage and completion lists."""
    from gateway.observability.wiring import wire_observability

    return wire_observability(gw, span_exporter)


def _backend_or_none(gw: Gateway, name: str) -> BackendConfig | None:
    try:
        return gw.config.backend(name)
    except KeyError:
        return None


def _wire_budgets(gw: Gateway) -> BudgetStage:
    """Budget reserve after the policy decision (before routing); settle runs in its finish."""
    from gateway.budget.service import BudgetService
    from gateway.budget.stage import BudgetStage

    svc = BudgetService(gw.config)
    gw.services.append(svc)
    gw.budgets = svc
    return BudgetStage(svc)


def _wire_routing(gw: Gateway) -> PredictiveRouteStage:
    """The predictive router (candidates, prediction, plugins, admission) as the route stage."""
    from gateway.routing.admin import routing_admin_route
    from gateway.routing.stage import PredictiveRouteStage

    stage = PredictiveRouteStage(lambda: gw.config, gw.health, lambda: gw.telemetry)
    gw.router = stage
    gw.extra_routes.append(routing_admin_route(gw, stage))
    _wire_peers(gw, stage)
    return stage


def _wire_peers(gw: Gateway, stage: PredictiveRouteStage) -> None:
    """The peer bus (gateway/routing/peers.py) when `routing.peers` resolves to a transport: Redis (the store
    the budgets already use, or routing.peers.redis_url) or the workers' Unix-datagram directory; else nothing."""
    from gateway.routing.peers import PeerBus, PeerState, replica_id, resolve_transport

    transport = resolve_transport(gw.config)
    if transport is None:
        return
    pc = gw.config.raw.routing.peers
    state = PeerState(stage.inflight, stage.clock, peer_timeout_s=pc.peer_timeout_s, flight_ttl_s=pc.flight_ttl_s,
                      predictor=stage.predictor if pc.share_learning else None,
                      affinity=stage.affinity if pc.share_affinity else None)
    bus = PeerBus(transport, state, replica_id(), flush_ms=pc.flush_ms, heartbeat_s=pc.heartbeat_s,
                  share_learning=pc.share_learning, share_affinity=pc.share_affinity,
                  first_token_poll_ms=pc.first_token_poll_ms)
    stage.peers = bus
    gw.services.append(bus)


def _wire_batch(gw: Gateway) -> None:
    """OpenAI Files and Batch API (/v1/files, /v1/batches) and the batch lane that runs their lines through this
    pipeline at priority `batch` in spare capacity (gateway/batch, docs/batch.md)."""
    if not gw.config.raw.batch.enabled or gw.identity is None:
        return
    from gateway.batch.api import batch_routes
    from gateway.batch.service import BatchService

    svc = BatchService(gw, pipeline_for=lambda restriction, zero: batch_pipeline(gw.pipeline, restriction, zero))
    gw.services.append(svc)
    gw.batch = svc
    gw.extra_routes.extend(batch_routes(svc))

    async def batch_admin(request: Request, principal: Principal | None) -> Response:
        return JSONResponse(svc.snapshot())

    gw.extra_routes.append(gateway_guard(gw).route("/admin/batch", batch_admin, ["GET"], (PLATFORM_ADMIN,)))
    from gateway.batch.admin import batch_admin_routes

    gw.extra_routes.extend(batch_admin_routes(svc, gateway_guard(gw)))  # every tenant's batches: list, cancel


def check_config(cfg: Config) -> None:
    """Deeper checks than parsing (policy files compile, ...); raises ConfigError."""
    PolicyHolder._compile(cfg)
