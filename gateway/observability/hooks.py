"""Per-request observability after the response: extra metrics, the recent-request ring the dashboard reads,
and one structured log line per request. All run as one gateway finish hook (after the evidence recorder)."""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable

from gateway.metrics import Metrics
from gateway.pipeline import RequestContext

ADMISSION_CODES = frozenset({"ttft_slo_unattainable", "request_shed", "flow_queue_timeout", "flow_queue_full"})
access_log = logging.getLogger("gateway.access")


def request_fields(ctx: RequestContext) -> dict[str, Any]:
    """The access-log fields of a finished request: ids, outcome, timings, token counts. Never content or keys."""
    u = ctx.usage
    p = ctx.principal
    route = ctx.evidence.get("route")
    return {
        "request_id": ctx.request_id, "endpoint": ctx.endpoint, "model": ctx.model, "backend": ctx.backend,
        "backend_model": ctx.backend_model, "status": ctx.status or 200, "error": ctx.error,
        "stream": ctx.stream, "tenant": p.tenant if p else None, "key_id": p.key_id if p else None,
        "zero_retention": ctx.zero_retention,
        "admission": route.get("admission") if isinstance(route, dict) else None,
        "predicted_ttft_ms": ctx.evidence.get("predicted_ttft_ms"),
        "ttft_ms": round(ctx.ttft_s * 1000, 3) if ctx.ttft_s is not None else None,
        "total_ms": round(ctx.total_s * 1000, 3) if ctx.total_s is not None else None,
        "prompt_tokens": u.prompt_tokens if u else None, "completion_tokens": u.completion_tokens if u else None,
        "cached_tokens": u.cached_tokens if u else None, "attempts": len(ctx.attempts),
    }


class RequestObserver:
    """Finish hook: budget/admission/prediction metrics, the recent-request ring, the access log line."""

    def __init__(self, metrics: Metrics, access_log_on: Callable[[], bool], recent: int = 500) -> None:
        self.m = metrics
        self._access_on = access_log_on
        self.recent: deque[str] = deque(maxlen=recent)  # request ids, newest last

    def _child(self, metric: Any, *labels: str) -> Any:
        return self.m.child(metric, *labels)

    async def __call__(self, ctx: RequestContext) -> None:
        self.observe(ctx)

    def observe(self, ctx: RequestContext) -> None:
        m = self.m
        ev = ctx.evidence
        status = ctx.status or 200
        self.recent.append(ctx.request_id)
        err = ctx.error
        if err in ADMISSION_CODES:
            m.admission_rejections.labels(err).inc()
        if status == 429:
            b = ev.get("budget")
            ref = b.get("refused") if isinstance(b, dict) else None
            if isinstance(ref, dict):
                m.budget_rejections.labels(err or "budget", str(ref.get("scope")), str(ref.get("window"))).inc()
        if status == 200 and ctx.backend:
            if ctx.ttft_s:  # (a JSON response has no TTFT: its prediction is not looked up)
                pred = ev.get("predicted_ttft_ms")
                route = ev.get("route")
                picked = route.get("pick") if isinstance(route, dict) else None
                if isinstance(pred, (int, float)) and picked == ctx.backend:
                    self._child(m.ttft_prediction_error, ctx.backend).observe(abs(pred / 1000 - ctx.ttft_s)
                                                                               / ctx.ttft_s)
                    self._child(m.ttft_prediction_delta, ctx.backend).observe(ctx.ttft_s - pred / 1000)
            u = ctx.usage
            if u is not None and u.cached_tokens:
                self._child(m.cached_tokens, ctx.backend_model or "unknown", ctx.backend).inc(u.cached_tokens)
        if status >= 500:
            access_log.warning("request failed", extra={"fields": request_fields(ctx)})
        elif self._access_on() and access_log.isEnabledFor(logging.INFO):
            access_log.info("request", extra={"fields": request_fields(ctx)})
