"""Pacing the batch lane: how many lines may run now (from the router's realtime TTFT prediction) and in
which order jobs get them (round-robin across tenants, earliest deadline first within a tenant).

The router is read, never driven: for every own, healthy engine the pacer asks the routing stage's
predictor for the upper-bound TTFT a typical realtime request would get there now (the same engine view
and features the route stage uses, gateway/routing/stage.py), without dispatching anything. While the best
engine's bound stays under `headroom` x the realtime target the concurrency rises by one line per tick in
which all slots are busy; when it does not (or routing shed a line) the concurrency halves, at most once
per cooldown. Concurrency is per replica.
"""
from __future__ import annotations

import time
from typing import Any

HALVE_COOLDOWN_S = 0.5


def realtime_prediction(gw: Any) -> float | None:
    """The lowest upper-bound TTFT (ms) over own healthy engines for a typical realtime request, or None
    when there is no predictive router (then only max_concurrency bounds the lane)."""
    router = getattr(gw, "router", None)
    if router is None or not hasattr(router, "predictor") or not hasattr(router, "_view"):
        return None
    from gateway.routing.predictor import Features

    cfg = gw.config
    now = router.clock()
    tel = router.telemetry
    best: float | None = None
    seen: set[str] = set()
    for names in cfg.models.values():
        for name in names:
            if name in seen:
                continue
            seen.add(name)
            b = cfg.backend(name)
            if b.operator == "partner" or not gw.health.available(name):
                continue
            v = router._view(name, now, tel is not None and b.kind in ("vllm", "sim"))
            f = Features(ahead_tokens=v.ahead_tokens, uncached_tokens=router.avg_uncached.get(name, 512.0),
                         running=v.running)
            _, upper = router.predictor.predict(name, f)
            ms = upper * 1000.0
            best = ms if best is None else min(best, ms)
    return best


class Pacer:
    """Additive-increase / multiplicative-decrease concurrency of batch lines on this replica."""

    def __init__(self, bc: Any) -> None:
        self.conc = float(max(1, bc.min_concurrency))
        self._halved_at = 0.0
        self.last_prediction_ms: float | None = None
        self.last_target_ms: float | None = None
        self.room = True
        self._bc = bc

    def target_ms(self, gw: Any) -> float:
        bc = gw.config.raw.batch
        t = bc.realtime_ttft_target_ms or gw.config.raw.routing.default_ttft_slo_ms or 1000.0
        return float(t)

    def _halve(self, bc: Any) -> None:
        now = time.monotonic()
        if now - self._halved_at >= HALVE_COOLDOWN_S:
            self._halved_at = now
            self.conc = max(float(bc.min_concurrency), self.conc / 2)

    def pressure(self) -> None:
        """Routing refused a line for lack of room: back off."""
        self._halve(self._bc)

    def allowance(self, gw: Any, jobs: list[dict[str, Any]], inflight: int) -> int:
        bc = self._bc = gw.config.raw.batch
        target = self.target_ms(gw)
        pred = realtime_prediction(gw)
        self.last_prediction_ms, self.last_target_ms = pred, target
        self.room = pred is None or pred <= bc.headroom * target
        if not self.room:
            self._halve(bc)
            return 0
        if inflight >= int(self.conc):
            self.conc = min(float(bc.max_concurrency), self.conc + 1)
        self.conc = min(max(self.conc, float(bc.min_concurrency)), float(bc.max_concurrency))
        return int(self.conc) - inflight

    def snapshot(self) -> dict[str, Any]:
        return {"concurrency": int(self.conc), "room": self.room, "predicted_realtime_ttft_ms": self.last_prediction_ms,
                "realtime_target_ms": self.last_target_ms}


def pick_jobs(jobs: list[dict[str, Any]], rr: int) -> tuple[list[dict[str, Any]], int]:
    """Jobs in the order they get lines this tick: tenants take turns (the starting tenant rotates every
    tick), and each tenant's jobs go earliest deadline (expires_at) first."""
    by_tenant: dict[str, list[dict[str, Any]]] = {}
    for j in jobs:
        by_tenant.setdefault(j["tenant"], []).append(j)
    tenants = sorted(by_tenant)
    if not tenants:
        return [], rr
    start = rr % len(tenants)
    tenants = tenants[start:] + tenants[:start]
    for t in tenants:
        by_tenant[t].sort(key=lambda j: (j["expires_at"], j["created_at"], j["id"]))
    order: list[dict[str, Any]] = []
    depth = max(len(v) for v in by_tenant.values())
    for i in range(depth):
        for t in tenants:
            if i < len(by_tenant[t]):
                order.append(by_tenant[t][i])
    return order, rr + 1
