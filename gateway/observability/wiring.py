"""Attach observability to a Gateway: state metrics collector, the request observer (extra metrics, recent ring,
access log), the dashboard routes and, when configured, tracing. Called by gateway.wiring.wire, which places the
trace stage and the observer's and the tracing's completion steps."""
from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry.sdk.trace.export import SpanExporter

from gateway.observability.collect import GatewayStateCollector
from gateway.observability.dashboard import dashboard_routes
from gateway.observability.hooks import RequestObserver
from gateway.observability.tracing import Tracing, build_provider

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.config import BackendConfig


def wire_observability(gw: Gateway, exporter: SpanExporter | None = None) -> tuple[RequestObserver, Tracing | None]:
    """Everything but tracing is always on (cheap); tracing only with `observability.otlp_endpoint` or an
    `exporter` (tests inject an InMemorySpanExporter). Returns the request observer and the tracing (None: off):
    gateway/wiring.py puts the trace stage and both completion steps in their lists."""
    from gateway.admin_guard import gateway_guard

    gw.metrics.register_state(GatewayStateCollector(gw))
    observer = RequestObserver(gw.metrics, lambda: gw.config.server.access_log)
    gw.observer = observer
    gw.extra_routes.extend(dashboard_routes(gw, gateway_guard(gw), lambda: list(observer.recent)))
    gw.tracing = None
    if gw.config.raw.observability.otlp_endpoint or exporter is not None:
        gw.tracing = _tracing(gw, exporter)
    return observer, gw.tracing


def _tracing(gw: Gateway, exporter: SpanExporter | None) -> Tracing:
    """OTLP/HTTP from the config and/or `exporter`; its service is started and closed with the gateway."""
    obs = gw.config.raw.observability
    provider = build_provider(obs.service_name, obs.otlp_endpoint, exporter)

    def backend(name: str) -> BackendConfig | None:
        try:
            return gw.config.backend(name)
        except KeyError:
            return None

    tracing = Tracing(provider, lambda: [st.name for st in gw.pipeline.stages], backend,
                      lambda: gw.config.raw.observability.capture_content)
    gw.services.append(tracing)
    return tracing
