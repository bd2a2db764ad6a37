"""OpenTelemetry traces following the GenAI semantic conventions, built from the RequestContext.

Off by default: with no `observability.otlp_endpoint` (and no exporter injected by a test) nothing here is
installed and the request path does not change. When on, two things touch a request:

- `UpstreamTraceStage`, the last pipeline stage (after routing, before dispatch), opens the SERVER span
  `{gen_ai.operation.name} {gen_ai.request.model}` as a child of the client's `traceparent` and the CLIENT span
  `upstream` under it, and puts the upstream span's `traceparent` into `ctx.upstream_headers`, so the engine
  sees the gateway's span as its parent (the Dispatcher sends it instead of the client's header).
- `Tracing.finish`, a finish hook, closes those spans (or builds them whole for refused requests) with explicit
  timestamps from ctx (received_wall, stage_timings_us, ttft_s, total_s) and adds one child span per pipeline
  stage (auth, policy, budget, route). Building at finish time keeps the hot path to one dict insert.

Content (`gen_ai.input.messages`) is recorded only when `capture_content` is on AND a policy decision for a
known principal says retention is not zero; zero-retention requests, and requests refused before the decision
(unknown retention counts as zero), also drop `gen_ai.request.stop_sequences`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable
from urllib.parse import urlsplit

import orjson
from opentelemetry import trace
from opentelemetry.propagators.textmap import DefaultGetter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.observability.semconv import operation_name, provider_name  # shared with gateway.metrics
from gateway.pipeline import RequestContext

if TYPE_CHECKING:
    from gateway.config import BackendConfig, Config

log = logging.getLogger("gateway.tracing")

# pipeline stage name -> span name (the vocabulary)
STAGE_SPANS = {"authenticate": "auth", "decide": "policy", "reserve": "budget", "route": "route"}
_PROPAGATOR = TraceContextTextMapPropagator()
_GETTER = DefaultGetter()
_MAX_CONTENT = 64 * 1024
_MAX_LIVE = 100_000


def _ns(wall_s: float) -> int:
    return int(wall_s * 1e9)


def server_address(url: str) -> tuple[str | None, int | None]:
    """Host and port of a backend URL (default port by scheme)."""
    u = urlsplit(url)
    port = u.port or (443 if u.scheme == "https" else 80 if u.scheme == "http" else None)
    return u.hostname, port


def request_attributes(ctx: RequestContext) -> dict[str, Any]:
    """gen_ai.request.* and gateway.* attributes known before dispatch. Pure; never reads message content."""
    body = ctx.body or {}
    a: dict[str, Any] = {
        "gen_ai.operation.name": operation_name(ctx.endpoint),
        "gen_ai.request.model": ctx.model or "unknown",
        "gateway.request_id": ctx.request_id,
        "gateway.endpoint": ctx.endpoint,
        "gateway.stream": bool(ctx.stream),
    }
    mt = ctx.max_tokens if ctx.max_tokens is not None else body.get("max_completion_tokens")
    if isinstance(mt, int):
        a["gen_ai.request.max_tokens"] = mt
    for key, attr in (("temperature", "gen_ai.request.temperature"), ("top_p", "gen_ai.request.top_p"),
                      ("top_k", "gen_ai.request.top_k"), ("seed", "gen_ai.request.seed"),
                      ("frequency_penalty", "gen_ai.request.frequency_penalty"),
                      ("presence_penalty", "gen_ai.request.presence_penalty")):
        v = body.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            a[attr] = v
    n = body.get("n")
    if isinstance(n, int) and n != 1:
        a["gen_ai.request.choice.count"] = n
    if ctx.ep is not None and not ctx.ep.generates and isinstance(body.get("encoding_format"), str):
        a["gen_ai.request.encoding_formats"] = [body["encoding_format"]]
    stop = body.get("stop")
    if ctx.content_retainable and stop:
        stops = [stop] if isinstance(stop, str) else [s for s in stop if isinstance(s, str)] if isinstance(stop, list) else []
        if stops:
            a["gen_ai.request.stop_sequences"] = stops
    p = ctx.principal
    if p is not None:
        a["gateway.tenant"] = p.tenant
        a["gateway.principal.kind"] = p.kind
        if p.team:
            a["gateway.team"] = p.team
    d = ctx.decision
    if d is not None:
        a["gateway.decision.retention"] = d.retention or "any"
        if d.matched_rules:
            a["gateway.decision.matched_rules"] = list(d.matched_rules)
        if d.priority:
            a["gateway.decision.priority"] = str(d.priority)
    return a


def response_attributes(ctx: RequestContext, backend: BackendConfig | None) -> dict[str, Any]:
    """gen_ai.response.*, gen_ai.usage.*, server.* and outcome attributes, from the finished ctx. Pure."""
    a: dict[str, Any] = {}
    status = ctx.status or 200
    a["http.response.status_code"] = status
    if backend is not None:
        a["gen_ai.provider.name"] = provider_name(backend.kind)
        host, port = server_address(backend.url)
        if host:
            a["server.address"] = host
        if port:
            a["server.port"] = port
        a["gateway.backend"] = backend.name
        if ctx.backend_model:
            a["gen_ai.response.model"] = backend.upstream_model(ctx.backend_model)
    if ctx.response_id:
        a["gen_ai.response.id"] = ctx.response_id
    if ctx.finish_reasons:
        a["gen_ai.response.finish_reasons"] = list(ctx.finish_reasons)
        loc = backend.location if backend is not None else None
        if loc is not None:
            a["gateway.backend.country"] = loc.country
    u = ctx.usage
    if u is not None:
        a["gen_ai.usage.input_tokens"] = u.prompt_tokens
        if ctx.ep is None or ctx.ep.generates:
            a["gen_ai.usage.output_tokens"] = u.completion_tokens
        if u.cached_tokens is not None:
            a["gen_ai.usage.cache_read.input_tokens"] = u.cached_tokens
    if ctx.ttft_s is not None:
        a["gateway.ttft_ms"] = round(ctx.ttft_s * 1000, 3)
    ev = ctx.evidence
    pred = ev.get("predicted_ttft_ms")
    if isinstance(pred, (int, float)):
        a["gateway.predicted_ttft_ms"] = float(pred)
    route = ev.get("route")
    if isinstance(route, dict) and route.get("admission"):
        a["gateway.route.admission"] = str(route["admission"])
    if status >= 400 or ctx.error:
        a["error.type"] = ctx.error or str(status)
    if ctx.cut_by_budget:
        a["gateway.cut_by_budget"] = True
    return a


def content_attributes(ctx: RequestContext, capture: bool) -> dict[str, Any]:
    """Opt-in message content; empty unless capture is on and a decision for a known principal says retention
    is not zero (unknown retention, a request refused before the decision, counts as zero)."""
    if not capture or not ctx.content_retainable:
        return {}
    body = ctx.body or {}
    out: dict[str, Any] = {}
    for key in ("messages", "prompt", "input"):
        if key in body:
            out["gen_ai.input.messages"] = orjson.dumps(body[key]).decode()[:_MAX_CONTENT]
            break
    for key in ("completion", "completion_text"):
        v = ctx.evidence.get(key)
        if isinstance(v, str):
            out["gen_ai.output.messages"] = orjson.dumps([{"role": "assistant", "parts": [
                {"type": "text", "content": v}]}]).decode()[:_MAX_CONTENT]
    return out


class _Live:
    __slots__ = ("server", "upstream", "dispatch_at")

    def __init__(self, server: Any, upstream: Any, dispatch_at: float) -> None:
        self.server = server
        self.upstream = upstream
        self.dispatch_at = dispatch_at  # perf_counter when the pipeline handed over to dispatch


def build_provider(service_name: str, otlp_endpoint: str | None = None,
                   exporter: SpanExporter | None = None) -> TracerProvider:
    """A TracerProvider of our own (never the global one): OTLP/HTTP batched, or the given exporter, sync."""
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        ep = otlp_endpoint.rstrip("/")
        if not urlsplit(ep).path:
            ep += "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=ep)))
    return provider


class Tracing:
    """Builds the spans of a request; a gateway service (shutdown flushes the exporter)."""

    def __init__(self, provider: TracerProvider, stage_names: Callable[[], Iterable[str]],
                 backend_lookup: Callable[[str], BackendConfig | None], capture_content: Callable[[], bool]) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("gateway", schema_url="https://opentelemetry.io/schemas/1.37.0")
        self._stage_names = stage_names
        self._backend = backend_lookup
        self._capture = capture_content
        self._live: dict[int, _Live] = {}

    def check_config(self, config: Config) -> None:
        """A reload (gateway.app.Reloadable): nothing to check."""

    def swap_config(self, config: Config) -> None:
        """Nothing to swap: the exporter is chosen at startup; capture_content is read per request."""

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        """Flush and stop the exporters (off the event loop: an unreachable collector retries for seconds)."""
        await asyncio.to_thread(self.provider.shutdown)

    # ---- request path (only when tracing is on)
    def open(self, ctx: RequestContext) -> None:
        """Open the request span and the upstream span; point the upstream traceparent at the latter."""
        now = time.perf_counter()
        parent = _PROPAGATOR.extract(ctx.headers, getter=_GETTER) if ctx.headers is not None else None
        attrs = request_attributes(ctx)
        server = self.tracer.start_span(f"{attrs['gen_ai.operation.name']} {attrs['gen_ai.request.model']}",
                                        context=parent, kind=SpanKind.SERVER, attributes=attrs,
                                        start_time=_ns(ctx.received_wall))
        up = self.tracer.start_span("upstream", context=trace.set_span_in_context(server), kind=SpanKind.CLIENT,
                                    start_time=_ns(ctx.received_wall + (now - ctx.received_at)))
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(up))
        ctx.upstream_headers.update(carrier)
        if len(self._live) >= _MAX_LIVE:  # never grow without bound, whatever happens to finishers
            self._live.pop(next(iter(self._live)))
        self._live[id(ctx)] = _Live(server, up, now)

    async def finish(self, ctx: RequestContext) -> None:
        """Finish hook: complete (or build) the request's spans with explicit timestamps."""
        try:
            self._finish(ctx)
        except Exception:
            log.exception("building spans for %s failed", ctx.request_id)

    def _wall(self, ctx: RequestContext, perf: float) -> int:
        return _ns(ctx.received_wall + (perf - ctx.received_at))

    def _finish(self, ctx: RequestContext) -> None:
        live = self._live.pop(id(ctx), None)
        total = ctx.total_s if ctx.total_s is not None else time.perf_counter() - ctx.received_at
        end_perf = ctx.received_at + total
        backend = self._backend(ctx.backend) if ctx.backend else None
        attrs = response_attributes(ctx, backend)
        attrs.update(content_attributes(ctx, self._capture()))
        if live is None:
            req = request_attributes(ctx)
            parent = _PROPAGATOR.extract(ctx.headers, getter=_GETTER) if ctx.headers is not None else None
            server = self.tracer.start_span(f"{req['gen_ai.operation.name']} {req['gen_ai.request.model']}",
                                            context=parent, kind=SpanKind.SERVER, attributes=req,
                                            start_time=_ns(ctx.received_wall))
            t0 = ctx.received_at
        else:
            server = live.server
            # decisions made in the pipeline after the span opened (route, admission) are known now
            server.set_attributes(request_attributes(ctx))
            t0 = live.dispatch_at - sum(us for st, us in ctx.stage_timings_us.items() if st != "trace") / 1e6
        self._stage_spans(ctx, server, t0, end_perf)
        if live is not None:
            self._end_upstream(ctx, live.upstream, attrs, end_perf)
        server.set_attributes(attrs)
        status = ctx.status or 200
        if status >= 500:
            server.set_status(Status(StatusCode.ERROR, ctx.error or str(status)))
        server.end(end_time=self._wall(ctx, end_perf))

    def _stage_spans(self, ctx: RequestContext, server: Any, t0: float, end_perf: float) -> None:
        parent = trace.set_span_in_context(server)
        timings = ctx.stage_timings_us
        t = t0
        for name in self._stage_names():
            us = timings.get(name)
            span_name = STAGE_SPANS.get(name)
            if us is None:  # the stage that was running when the request stopped (a refusal or a disconnect)
                if span_name is not None:
                    err = ctx.error or str(ctx.status or 499)
                    sp = self.tracer.start_span(span_name, context=parent, kind=SpanKind.INTERNAL,
                                                start_time=self._wall(ctx, t),
                                                attributes={"gateway.stage": name, "error.type": err})
                    sp.set_status(Status(StatusCode.ERROR, err))
                    sp.end(end_time=self._wall(ctx, max(t, end_perf)))
                break
            if span_name is not None:
                sp = self.tracer.start_span(span_name, context=parent, kind=SpanKind.INTERNAL,
                                            start_time=self._wall(ctx, t), attributes={"gateway.stage": name})
                sp.end(end_time=self._wall(ctx, t + us / 1e6))
            t += us / 1e6

    def _end_upstream(self, ctx: RequestContext, up: Any, attrs: dict[str, Any], end_perf: float) -> None:
        up_attrs = {k: v for k, v in attrs.items() if k.startswith(("server.", "gen_ai.provider", "gen_ai.usage",
                                                                     "gen_ai.response", "error.type", "http."))}
        up_attrs["gen_ai.operation.name"] = operation_name(ctx.endpoint)
        if ctx.backend_model:
            up_attrs["gen_ai.request.model"] = ctx.backend_model
        up_attrs["http.request.method"] = "POST"
        up_attrs["gateway.attempts"] = len(ctx.attempts)
        up.set_attributes(up_attrs)
        for a in ctx.attempts:
            up.add_event("attempt", {k: v for k, v in a.items() if isinstance(v, (str, int, float, bool))})
        if ctx.ttft_s is not None:
            up.add_event("gen_ai.first_token", timestamp=self._wall(ctx, ctx.received_at + ctx.ttft_s))
        status = ctx.status or 200
        if status >= 500 or (ctx.backend is None and status >= 400):
            up.set_status(Status(StatusCode.ERROR, ctx.error or str(status)))
        up.end(end_time=self._wall(ctx, end_perf))


class UpstreamTraceStage:
    """Last stage before dispatch (installed only when tracing is on): opens the spans, sets traceparent."""

    name = "trace"

    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    async def run(self, ctx: RequestContext) -> None:
        self.tracing.open(ctx)
