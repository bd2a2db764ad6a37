"""The composition root: the Gateway object (config snapshot, services, pipeline) and the Starlette app.

The data plane (`/v1/...`, one route per entry of the endpoint table) is served by raw ASGI endpoints
(gateway/api/ingress.py: all HTTP handling) so a client disconnect can cancel the upstream request at once and
the hot path stays short; the admin plane and probes are ordinary Starlette routes. The subsystems and the
pipeline's stage list are assembled by gateway/wiring.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Protocol

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin_guard import PLATFORM_ADMIN, gateway_guard
from gateway.api.endpoints import ENDPOINTS
from gateway.api.ingress import GatewayApp, InferenceEndpoint
from gateway.api.reply import error_headers, request_id
from gateway.config import BackendConfig, Config, ConfigError, load_config
from gateway.errors import GatewayError, retry_headers
from gateway.metrics import Metrics
from gateway.observability.logs import current_request
from gateway.observability.semconv import operation_name, provider_name
from gateway.pipeline import Pipeline, RequestContext, Stage
from gateway.proxy.forward import Dispatcher, DispatchStage
from gateway.proxy.health import Health, probe_loop
from gateway.proxy.upstream import Upstreams
from gateway.routing.plan import Candidate
from gateway.routing.stage import RouteStage, residency_reason
from gateway.types import Principal

if TYPE_CHECKING:  # the subsystems' classes, for the types only: each of them imports the Gateway's modules
    from gateway.adapters.service import AdapterService
    from gateway.admin_guard import AdminGuard
    from gateway.batch.service import BatchService
    from gateway.budget.service import BudgetService
    from gateway.cache.service import CacheService
    from gateway.cost.meter import CostMeter
    from gateway.evidence.recorder import EvidenceRecorder
    from gateway.identity.service import IdentityService
    from gateway.observability.hooks import RequestObserver
    from gateway.observability.tracing import Tracing
    from gateway.rollouts.service import RolloutService
    from gateway.routing.stage import PredictiveRouteStage
    from gateway.telemetry.service import TelemetryService
    from gateway.wiring import PolicyHolder

log = logging.getLogger("gateway")

STREAM_CUT_MARGIN_S = 1.0  # streams are cut this long before uvicorn's graceful-shutdown timeout cancels them


class NoIdentity:
    """The authenticate slot until gateway.wiring attaches the identity layer (gateway/identity): refuses every
    request, so a Gateway that was never wired fails closed instead of serving anonymous traffic."""

    name = "authenticate"

    async def run(self, ctx: RequestContext) -> None:
        raise GatewayError(503, "No identity layer is configured.", code="identity_unavailable")


class ObserveStage:
    """First stage in: sets the request's log context; its finish (a completion step after every stage's own)
    records the request metrics, so refusals are observed as well as successes."""

    name = "observe"

    def __init__(self, gw: "Gateway") -> None:
        self.gw = gw
        # the request's series, looked up once per request instead of building label tuples for each metric
        # (each Metrics.child call hashes its labels again): (endpoint, model, backend, backend_model, status,
        # tenant class, error type) -> [requests child, duration child, genai labels, tokens in, tokens out].
        # Its labels depend on the config (known models, backend kinds): cleared when the config is swapped.
        self._series: dict[tuple[Any, ...], list[Any]] = {}
        self._series_config: Config | None = None
        self._stage_series: dict[str, Any] = {}  # stage name -> its stage_seconds child

    async def run(self, ctx: RequestContext) -> None:
        current_request.set(ctx)  # log records of this task carry the request id (gateway.observability.logs)

    def _series_of(self, ctx: RequestContext, tclass: str, err: str) -> list[Any]:
        gw = self.gw
        m = gw.metrics
        backend = ctx.backend or "none"
        model = ctx.model if ctx.model in gw.config.models or ctx.model in gw.config.aliases else "unknown"
        genai = (operation_name(ctx.endpoint), self._provider(ctx.backend), model, ctx.backend_model or "")
        return [m.child(m.requests, ctx.endpoint, model, backend, str(ctx.status or 200), tclass),
                m.child(m.duration, *genai, backend, err), genai, None, None]

    async def finish(self, ctx: RequestContext) -> None:
        gw = self.gw
        m = gw.metrics
        ctx.total_s = time.perf_counter() - ctx.received_at
        tclass = (ctx.principal.labels.get("tier", "default") if ctx.principal else "anonymous")
        err = error_type(ctx)
        if gw.config is not self._series_config:  # a reload: models and backend kinds may have changed
            self._series.clear()
            self._series_config = gw.config
        key = (ctx.endpoint, ctx.model, ctx.backend, ctx.backend_model, ctx.status, tclass, err)
        s = self._series.get(key)
        if s is None:
            if len(self._series) > 10_000:  # bounded: the client names the model (unknown ones share a label)
                self._series.clear()
            s = self._series[key] = self._series_of(ctx, tclass, err)
        s[0].inc()
        s[1].observe(ctx.total_s)
        genai = s[2]
        c = m.child
        if ctx.ttft_s is not None and ctx.backend:
            c(m.ttft, *genai, ctx.backend).observe(ctx.ttft_s)
        u = ctx.usage
        if u is not None and ctx.backend_model:
            if s[3] is None:  # created on first use: a series only exists once it has been observed
                s[3], s[4] = c(m.tokens, *genai, "input"), c(m.tokens, *genai, "output")
            s[3].observe(u.prompt_tokens)
            s[4].observe(u.completion_tokens)
            if ctx.stream and ctx.ttft_s is not None and u.completion_tokens > 1 and ctx.total_s > ctx.ttft_s:
                # decode time spread over the tokens after the first (what vLLM calls inter-token latency)
                c(m.tpot, *genai, ctx.backend or "none").observe((ctx.total_s - ctx.ttft_s) / (u.completion_tokens - 1))
        stages = self._stage_series
        for st, us in ctx.stage_timings_us.items():
            h = stages.get(st)
            if h is None:
                h = stages[st] = c(m.stage_seconds, st)  # stage names: the pipeline's, bounded
            h.observe(us / 1e6)


    def _provider(self, backend: str | None) -> str:
        if not backend:
            return ""
        try:
            return provider_name(self.gw.config.backend(backend).kind)
        except KeyError:  # a backend removed by a reload while the request ran
            return ""


_ERROR_TYPE = re.compile(r"^[a-z0-9_.]{1,64}$")


def error_type(ctx: RequestContext) -> str:
    """The semconv `error.type` of a finished request: "" on success, else the gateway's error code (bounded:
    a code-shaped string, else `_OTHER`), or the HTTP status when the upstream's error carried no code."""
    status = ctx.status or 200
    if status < 400 and not ctx.error:
        return ""
    if ctx.error:
        return ctx.error if _ERROR_TYPE.match(ctx.error) else "_OTHER"
    return str(status)


class Service(Protocol):
    """What the Gateway starts with itself and closes in reverse order (`Gateway.services`)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class Reloadable(Protocol):
    """What a reload asks of every service: `check_config` may refuse the new config (raising ConfigError) before
    anything is swapped; `swap_config` then takes it (sync or async). A service with nothing to check or swap
    implements them as no-ops."""

    def check_config(self, config: Config) -> None: ...

    def swap_config(self, config: Config) -> Awaitable[None] | None: ...


class ManagedService(Service, Reloadable, Protocol):
    """An entry of `Gateway.services`: started, reloaded and closed with the gateway."""


class Gateway:
    """Holds the current config snapshot and the services built from it. `reload` swaps the snapshot."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.started_at = time.time()
        self.metrics = Metrics()
        self.health = Health(config)
        self.upstreams = Upstreams(config)
        self.dispatcher = Dispatcher(lambda: self.upstreams, self.health, self._residency_check)
        self.services: list[ManagedService] = []  # started in order, reloaded, closed in reverse
        self.auth: Stage = NoIdentity()  # the authenticate stage (gateway.identity.stage.AuthStage when wired)
        # (headers, client address) -> the admin principal (gateway.admin_guard.Authenticate); identity wiring sets it
        self.admin_auth: Callable[[Mapping[str, str], str], Awaitable[Principal]] = self._no_admin_auth
        self._tasks: list[asyncio.Task] = []
        self._reload_lock = asyncio.Lock()
        self.streams: dict[asyncio.Task, RequestContext] = {}  # streams being sent, cut at the drain deadline
        self.draining = False
        self.extra_routes: list[Route] = []
        # subsystems attached by gateway.wiring.wire (None when not wired, e.g. in unit tests); the attribute
        # always exists, so a consumer tests `is None`, never probes with getattr/hasattr
        self.identity: IdentityService | None = None
        self.policy: PolicyHolder | None = None
        self.budgets: BudgetService | None = None
        self.cache: CacheService | None = None
        self.telemetry: TelemetryService | None = None
        self.router: PredictiveRouteStage | None = None
        self.evidence: EvidenceRecorder | None = None
        self.cost: CostMeter | None = None  # None when cost.enabled was false at startup
        self.observer: RequestObserver | None = None
        self.tracing: Tracing | None = None  # only with tracing on
        self.batch: BatchService | None = None  # only with batch.enabled
        self.rollouts: RolloutService | None = None
        self.adapters: AdapterService | None = None  # tenant-owned LoRA adapters
        self.admin_guard: AdminGuard | None = None  # built on first use (gateway_guard)
        # unwired: fails closed (NoIdentity refuses every request); gateway.wiring.wire sets the real list
        self.pipeline = Pipeline([ObserveStage(self), self.auth, RouteStage(lambda: self.config, self.health)],
                                 DispatchStage(self.dispatcher))

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The pipeline's stages before dispatch, in order (gateway/pipeline.py)."""
        return self.pipeline.stages

    def _residency_check(self, ctx: RequestContext, cand: Candidate) -> str | None:
        return residency_reason(ctx.decision, cand.backend)

    async def start(self) -> None:
        for s in self.services:
            await s.start()
        import httpx

        self._probe_client = httpx.AsyncClient(trust_env=False)
        self._tasks.append(asyncio.create_task(probe_loop(lambda: self.config, self.health, self._probe_client,
                                                          self.upstreams.probe_client)))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for s in reversed(self.services):
            try:
                await s.close()
            except Exception:
                log.exception("closing %r failed", s)
        await self.upstreams.aclose()
        await self._probe_client.aclose()

    async def reload(self) -> Config:
        """Load the config file again and swap it in whole; a broken file leaves the old snapshot serving."""
        async with self._reload_lock:
            if self.config.path is None:
                raise ConfigError("no config file to reload from")
            try:
                new = await asyncio.to_thread(load_config, self.config.path)
                new = Config(raw=new.raw, path=new.path, base_dir=new.base_dir, models=new.models,
                             aliases=new.aliases, generation=self.config.generation + 1)
                for s in self.services:
                    s.check_config(new)  # may raise ConfigError (e.g. a broken policy file)
            except ConfigError:
                self.metrics.reloads.labels("refused").inc()
                raise
            self.upstreams.swap_config(new)
            self.health.swap_config(new)
            for s in self.services:
                res = s.swap_config(new)
                if res is not None:
                    await res
            self.config = new
            self.metrics.reloads.labels("ok").inc()
            log.info("config reloaded (generation %d)", new.generation)
            return new

    def begin_drain(self) -> None:
        """Shutdown began (SIGTERM): uvicorn stops accepting and waits `server.graceful_shutdown_s` for open
        requests, then cancels them. Streams still running shortly before that are ended by us instead, with an
        error event (`server_shutting_down`) and [DONE], so the client learns why and what was settled."""
        if self.draining:
            return
        self.draining = True
        grace = self.config.server.graceful_shutdown_s
        asyncio.get_running_loop().call_later(max(0.0, min(grace - STREAM_CUT_MARGIN_S, grace * 0.8)),
                                              self.cut_streams)

    def cut_streams(self) -> int:
        """End every stream still being sent with an error event (see begin_drain); returns how many."""
        n = 0
        for task, ctx in list(self.streams.items()):
            if not task.done():
                ctx.cut_by_shutdown = True
                ctx.status, ctx.error = 503, "server_shutting_down"  # before the cancel: the stream's own
                task.cancel()  # cleanup may settle and record it before the handler sees the CancelledError
                n += 1
        if n:
            log.warning("drain deadline: cut %d stream(s) still running", n)
        return n

    async def _no_admin_auth(self, headers: Mapping[str, str], client_addr: str) -> Principal:
        raise GatewayError(503, "No identity layer is configured.", code="identity_unavailable")


# ------------------------------------------------------------------------------------------- routes


def readiness(gw: Gateway) -> dict[str, Any]:
    """Readiness for the load balancer (server.readiness); not ready when `reasons` is not empty. `process`
    (default): this process can serve, so one dead partner or loading engine does not take every pod out of the
    Service; per-model health is reported in the body either way and fails readiness only under any_model /
    all_models."""
    cfg = gw.config
    mode = cfg.server.readiness
    models = {m: sorted(n for n in names if gw.health.available(n)) for m, names in cfg.models.items()}
    missing = sorted(m for m, healthy in models.items() if not healthy)
    budget_ok = gw.budgets is None or bool(gw.budgets.available)
    reasons = []
    if gw.draining:
        reasons.append("draining")
    if not budget_ok and cfg.raw.budgets.on_store_error == "closed":
        reasons.append("budget_store_unavailable")  # every budgeted request would get a 503 here
    if mode == "all_models" and missing:
        reasons.append("model_without_healthy_backend")
    if mode == "any_model" and models and len(missing) == len(models):
        reasons.append("no_model_has_a_healthy_backend")
    return {"status": "not ready" if reasons else "ready", "readiness": mode, "reasons": reasons,
            "config_generation": cfg.generation, "models_without_healthy_backend": missing,
            "models": {m: {"healthy_backends": healthy, "backends": len(cfg.models[m])}
                       for m, healthy in sorted(models.items())},
            "stores": {"budgets": "ok" if budget_ok else f"unavailable (on_store_error: "
                                                         f"{cfg.raw.budgets.on_store_error})"}}


async def _not_found(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    err = GatewayError(status, f"No route for {request.method} {request.url.path}.",
                       code="not_found" if status == 404 else "method_not_allowed")
    return JSONResponse(err.body(), status_code=status, headers={"x-request-id": request_id(request.headers)})


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    err = GatewayError(500, "Internal gateway error.", code="internal_error")
    return JSONResponse(err.body(), status_code=500, headers={"x-request-id": request_id(request.headers)})


def build_app(gw: Gateway) -> GatewayApp:
    worker = os.environ.get("GATEWAY_WORKER_ID")  # one of `gateway serve --workers N` (gateway/workers.py)
    health_body = {"status": "ok"} if worker is None else {"status": "ok", "worker": int(worker), "pid": os.getpid()}

    async def healthz(request: Request) -> Response:
        return JSONResponse(health_body)

    async def openapi(request: Request) -> Response:
        from gateway.api.openapi import openapi_spec

        return JSONResponse(openapi_spec())

    async def readyz(request: Request) -> Response:
        body = readiness(gw)
        if body["reasons"]:
            return JSONResponse(body, status_code=503, headers=retry_headers(1.0))
        return JSONResponse(body)

    async def metrics(request: Request) -> Response:
        for name, st in gw.health.snapshot().items():
            gw.metrics.backend_up.labels(name).set(1.0 if st["state"] == "closed" else 0.0)
        gw.metrics.event_loop_tasks.set(len(asyncio.all_tasks()))
        if gw.telemetry is not None:
            await gw.telemetry.refresh_block_counts()  # the KV index counts, off the event loop
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(request: Request) -> Response:
        rid = request_id(request.headers)
        try:
            ctx = RequestContext(request_id=rid, endpoint="models", headers=request.headers, body={})
            await gw.auth.run(ctx)
        except GatewayError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=error_headers(e, rid))
        data = model_catalog(gw.config)
        if gw.adapters is not None and ctx.principal is not None:  # adapters only their owners may use
            from gateway.adapters.catalog import visible_catalog

            data = visible_catalog(ctx.principal, data, await gw.adapters.registry(), gw.config)
        return JSONResponse({"object": "list", "data": data}, headers={"x-request-id": rid})

    async def admin_reload(request: Request, principal: Principal | None) -> Response:
        # authenticated and authorized (platform admins only) by the admin guard, whose refusals (429
        # included) carry x-request-id and Retry-After
        try:
            new = await gw.reload()
        except ConfigError as e:
            raise GatewayError(400, f"Config refused, the previous one keeps serving: {e}",
                               code="invalid_config") from None
        return JSONResponse({"status": "reloaded", "generation": new.generation})

    from gateway.api.unserved import routes as unserved_routes

    data_plane = {ep.path: InferenceEndpoint(gw, ep) for ep in ENDPOINTS}
    routes = [
        *(Route(path, ep, methods=None) for path, ep in data_plane.items()),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        gateway_guard(gw).route("/admin/reload", admin_reload, ["POST"], (PLATFORM_ADMIN,)),
        *unserved_routes(gw),  # OpenAI's routes for stored state the gateway does not keep: 404 saying so
        *gw.extra_routes,
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await gw.start()
        try:
            yield
        finally:
            await gw.close()

    app = GatewayApp(data_plane, routes=routes, lifespan=lifespan,
                     exception_handlers={404: _not_found, 405: _not_found, 500: _server_error,
                                         Exception: _server_error})
    app.state.gateway = gw
    return app


def _jurisdiction(countries: set[str | None]) -> str | None:
    """"EEA" when every inference and storage country is in the EEA (else None: no jurisdiction claim)."""
    from gateway.policy.eea import EEA_COUNTRIES

    return "EEA" if countries and all(c in EEA_COUNTRIES for c in countries) else None


def _price(cfg: Config, model: str, backends: list[BackendConfig]) -> dict[str, Any] | None:
    """The model's price (budgets.prices[model]; a per-backend `<backend>:<model>` price when all agree)."""
    prices = cfg.raw.budgets.prices
    p = prices.get(model)
    if p is None:
        per = {prices.get(f"{b.name}:{model}") for b in backends}
        p = per.pop() if len(per) == 1 else None
    if p is None:
        return None
    out: dict[str, Any] = {"currency": p.currency, "input_per_mtok": p.input, "output_per_mtok": p.output}
    if p.cached_input is not None:
        out["cached_input_per_mtok"] = p.cached_input
    if p.gpu_second is not None:
        out["gpu_second"] = p.gpu_second
    return out


def model_catalog(cfg: Config) -> list[dict[str, Any]]:
    """/v1/models entries, each with where it runs and what it keeps (what a partner aggregator lists):
    per-backend locations, jurisdiction ("EEA" only when every inference and storage country is in the EEA),
    retention (the weakest guarantee over the serving backends), context window (also as `context_length`, the
    field OpenRouter-style aggregators read: the smallest `context_window` of the serving backends), capabilities,
    prices."""
    out = []
    created = int(cfg.path.stat().st_mtime) if cfg.path and Path(cfg.path).exists() else 0
    entries: dict[str, dict[str, Any]] = {}
    for model, names in sorted(cfg.models.items()):
        bks = [cfg.backend(n) for n in names]
        countries = {b.location.country if b.location else None for b in bks}
        storage = {b.location.storage if b.location else None for b in bks}
        days = [b.retention_days for b in bks]
        retention = ("zero" if all(d == 0 for d in days) else
                     "none" if any(d is None for d in days) else f"{max(d for d in days if d is not None)}d")
        windows = [b.context_window for b in bks if b.context_window]
        caps = sorted(set().union(*(b.capabilities for b in bks)))
        entry = {
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "gateway",
            "locations": [{"backend": b.name, "country": b.location.country if b.location else None,
                           "storage_country": b.location.storage if b.location else None,
                           "region": b.location.region if b.location else None,
                           "operator": b.operator, "retention": b.retention} for b in bks],
            "inference_locations": sorted(c for c in countries if c),
            "storage_locations": sorted(c for c in storage if c),
            "jurisdiction": _jurisdiction(countries | storage),
            "retention": retention,
            "retention_by_backend": sorted({b.retention for b in bks}),
            "zero_data_retention": retention == "zero",
            "context_window": min(windows) if windows else None,
            "context_length": min(windows) if windows else None,  # OpenRouter's name for the same number
            "capabilities": caps,
            "pricing": _price(cfg, model, bks),
        }
        entries[model] = entry
        out.append(entry)
    for alias, targets in sorted(cfg.aliases.items()):
        tgt = [entries[t] for t in targets if t in entries]
        out.append({"id": alias, "object": "model", "created": created, "owned_by": "gateway",
                    "alias_of": list(targets),
                    "jurisdiction": "EEA" if tgt and all(t["jurisdiction"] == "EEA" for t in tgt) else None,
                    "retention": "zero" if tgt and all(t["retention"] == "zero" for t in tgt) else "none",
                    "context_window": min((t["context_window"] for t in tgt if t["context_window"]), default=None),
                    "context_length": min((t["context_window"] for t in tgt if t["context_window"]), default=None),
                    "capabilities": sorted(set.intersection(*(set(t["capabilities"]) for t in tgt))) if tgt else []})
    return out
