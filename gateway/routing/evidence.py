"""The route's evidence in the audit record: candidates with their predictions, the `route` summary
(strategy, pick, target, admission action, token source, timing) and the stale KV views predictions used."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from gateway.pipeline import RequestContext
from gateway.routing.plan import Candidate

if TYPE_CHECKING:
    from gateway.telemetry.service import TelemetryService


def kv_view_evidence(stale: list[str], kv_view: Callable[[str], dict | None] | None) -> dict[str, dict]:
    """{engine: {stale, reason}} for the stale candidates' KV views (route.kv_views in the audit record).
    `kv_view` is TelemetryService.kv_view; an engine it has no state for (or a service without it) is
    recorded stale with reason None, since is_stale said so."""
    out: dict[str, dict] = {}
    for name in stale:
        v = kv_view(name) if kv_view is not None else None
        out[name] = {"stale": True, "reason": v.get("reason") if v else None}
    return out


def route_evidence(ctx: RequestContext, cands: list[Candidate], target: float | None, action: str, source: str,
                   t_start: float, salt: str | None, strategy: str, tel: TelemetryService | None,
                   has_telemetry: Callable[[Candidate], bool]) -> None:
    ctx.evidence["candidates"] = [c.to_evidence() for c in cands]
    if cands:
        ctx.evidence["predicted_ttft_ms"] = cands[0].predicted_ttft_ms
        ctx.evidence["predicted_cached_tokens"] = cands[0].cached_tokens
    ctx.evidence["route"] = {"strategy": strategy, "pick": cands[0].backend.name if cands else None,
                             "ttft_slo_ms": target, "admission": action,
                             "token_source": source, "cache_isolation": salt is not None,
                             "decided_us": round((time.perf_counter() - t_start) * 1e6, 1),
                             "since_arrival_ms": round((time.perf_counter() - ctx.received_at) * 1000, 3)}
    if tel is not None:  # predictions made on a stale KV view say so, with why (silent, wrong topic, gap)
        stale = [c.backend.name for c in cands if has_telemetry(c) and tel.is_stale(c.backend.name)]
        if stale:
            ctx.evidence["route"]["stale_kv_views"] = stale
            ctx.evidence["route"]["kv_views"] = kv_view_evidence(stale, tel.kv_view)
