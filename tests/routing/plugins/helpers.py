"""Scored items for plugin tests: a candidate on a named backend with the view fields a plugin reads."""
from __future__ import annotations

from gateway.config import BackendConfig
from gateway.routing.plan import Candidate
from gateway.routing.plugin import EngineView, Scored


def item(name: str = "e0", *, pred: float | None = None, upper: float | None = None, inflight: int = 0,
         waiting: float = 0.0, running: float = 0.0, approx: float = 0.0, affinity: bool = False,
         target: float | None = None, context_window: int | None = None, model: str = "m") -> Scored:
    b = BackendConfig(name=name, url=f"http://{name}/v1", models=[model], context_window=context_window)
    c = Candidate(b, model, predicted_ttft_ms=pred, predicted_ttft_upper_ms=upper)
    return Scored(c, EngineView(inflight=inflight, waiting=waiting, running=running, approx_match=approx,
                                affinity=affinity, ttft_target_ms=target))


def names(items: list[Scored]) -> list[str]:
    return [s.cand.backend.name for s in items]
