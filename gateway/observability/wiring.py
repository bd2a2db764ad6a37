"""Attach observability to a Gateway: state metrics collector, the request observer (extra metrics, recent ring,
access log), the dashboard routes and, when configured, tracing. Called last by gateway.wiring.wire."""
from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter

from gateway.observability.collect import GatewayStateCollector
from gateway.observability.dashboard import dashboard_routes
from gateway.observability.hooks import RequestObserver
from gateway.observability.tracing import Tracing, UpstreamTraceStage, build_provider


def wire_observability(gw: Any) -> None:
    """Everything but tracing is always on (cheap); tracing only with `observability.otlp_endpoint`."""
    from gateway.admin_guard import gateway_guard

    gw.metrics.register_state(GatewayStateCollector(gw))
    observer = RequestObserver(gw.metrics, lambda: gw.config.server.access_log)
    gw.observer = observer
    gw.finish_hooks.append(observer)
    gw.extra_routes.extend(dashboard_routes(gw, gateway_guard(gw), lambda: list(observer.recent)))
    gw.tracing = None
    if gw.config.raw.observability.otlp_endpoint:
        enable_tracing(gw)


def enable_tracing(gw: Any, exporter: SpanExporter | None = None) -> Tracing:
    """Install tracing: OTLP/HTTP from the config and/or `exporter` (tests inject an InMemorySpanExporter).

    Adds the `trace` stage at the end of the pipeline (it opens the spans and sets the upstream traceparent)
    and a finish hook that completes them. Call after every other stage is wired."""
    obs = gw.config.raw.observability
    provider = build_provider(obs.service_name, obs.otlp_endpoint, exporter)

    def backend(name: str) -> Any:
        try:
            return gw.config.backend(name)
        except KeyError:
            return None

    tracing = Tracing(provider, lambda: [getattr(st, "name", "") for st in gw.pipeline.stages], backend,
                      lambda: gw.config.raw.observability.capture_content)
    gw.tracing = tracing
    gw.services.append(tracing)
    gw.pipeline.stages.append(UpstreamTraceStage(tracing))  # the last stage before dispatch
    gw.finish_hooks.append(tracing.finish)
    return tracing
