"""Pacing the batch lane: how many lines may run now (from the router's realtime TTFT prediction) and in
which order jobs get them (round-robin across tenants, earliest deadline first within a tenant).

The router is read, never driven: for every own, healthy engine the pacer asks the routing stage's
predictor for the upper-bound TTFT a typical realtime request would get there now (the same engine view
and features the route stage uses, gateway/routing/stage.py), without dispatching anything. While the best
engine's bound stays under `headroom` x the realtime target the concurrency rises by one line per tick in
which all slots are busy; when it does not (or routing shed a line) the concurrency halves, at most once
per cooldown. Concurrency is per replica.

On top of that, lines start only where an engine has prefill room (`engine_room`): what costs realtime its
TTFT is batch *prefill* in the engine step a realtime request arrives during or is scheduled in (the engine
never stops a step; priority scheduling only orders the waiting queue), not batch decodes
(bench/batch_lane.py attributes it from the audit records). So an engine gets a new line only while no
realtime request of this replica is before its first token there, it has fewer than
`max_prefilling_per_engine` batch lines before theirs, and (under `prefill_duty` < 1) the last line started
there is `predicted prefill / prefill_duty` old; and only while `clear_engines` other engines have no prefill
in flight at all (`fleet_room`), so the router, which sends realtime to the engine predicted fastest, has an
engine without batch prefill for the realtime request that arrives next.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.batch.config import BatchConfig
    from gateway.config import BackendConfig

HALVE_COOLDOWN_S = 0.5


class FlightView(Protocol):
    """What the pacer reads of a request in flight (gateway/routing/inflight.py Flight)."""

    @property
    def started(self) -> float: ...

    @property
    def predicted_s(self) -> float: ...

    @property
    def is_batch(self) -> bool: ...

    def prefilling(self, now: float) -> bool: ...


class RouterView(Protocol):
    """What the pacer reads of the router (gateway/routing/stage.py PredictiveRouteStage), never driving it:
    its clock, its flights per engine and the TTFT bound a typical realtime request would get on an engine."""

    def clock(self) -> float: ...

    @property
    def flights(self) -> Mapping[str, Mapping[str, FlightView]]: ...

    def typical_ttft_upper_s(self, backend: BackendConfig, now: float) -> float: ...


def realtime_prediction(gw: Gateway) -> float | None:
    """The lowest upper-bound TTFT (ms) over own healthy engines for a typical realtime request, or None
    when there is no predictive router (then only max_concurrency bounds the lane)."""
    router: RouterView | None = gw.router
    if router is None:
        return None
    now = router.clock()
    best: float | None = None
    for _name, b in own_engines(gw):
        ms = router.typical_ttft_upper_s(b, now) * 1000.0
        best = ms if best is None else min(best, ms)
    return best


def own_engines(gw: Gateway) -> Iterator[tuple[str, BackendConfig]]:
    """(name, backend) of every healthy own (non-partner) backend of the config, each once: where batch lines
    may run and whose realtime load they must leave room for."""
    cfg = gw.config
    seen: set[str] = set()
    for names in cfg.models.values():
        for name in names:
            if name in seen:
                continue
            seen.add(name)
            b = cfg.backend(name)
            if b.operator != "partner" and gw.health.available(name):
                yield name, b


def engine_room(rt_prefilling: int, batch_prefilling: int, since_last_start_s: float | None,
                last_prefill_s: float, max_prefilling: int, duty: float) -> bool:
    """May a new batch line start on this engine now? `rt_prefilling`/`batch_prefilling`: this replica's
    realtime requests / batch lines there before their first token; `since_last_start_s`: age of the last
    batch line started there (None: none yet) and `last_prefill_s` its predicted prefill time."""
    if rt_prefilling > 0 or batch_prefilling >= max_prefilling:
        return False
    if duty < 1.0 and since_last_start_s is not None and since_last_start_s < last_prefill_s / duty:
        return False
    return True


def fleet_room(rooms: int, clear: int, engines: int, keep_clear: int, unplaced: int) -> int:
    """Lines that may start now: engines with room (engine_room), while `keep_clear` engines (at most all
    but one of the `engines`) stay with no prefill in flight; `clear` counts those now. `unplaced`: lines
    started that routing has not placed yet (each will take a room and a clear engine)."""
    keep = max(0, min(keep_clear, engines - 1))
    return max(0, min(rooms - unplaced, clear - unplaced - keep))


def engine_loads(router: RouterView, now: float) -> dict[str, tuple[int, int, float | None, float]]:
    """Per engine with flights of this replica: (realtime before first token, batch lines before first
    token, start time of the newest batch line, its predicted prefill s). A non-streamed line counts as
    prefilling until its predicted TTFT has passed (the router's own rule, Flight.prefilling)."""
    out: dict[str, tuple[int, int, float | None, float]] = {}
    for name, fls in router.flights.items():
        rt = bt = 0
        last: float | None = None
        last_s = 0.0
        for f in list(fls.values()):
            is_batch = f.is_batch
            if f.prefilling(now):
                if is_batch:
                    bt += 1
                else:
                    rt += 1
            if is_batch and (last is None or f.started > last):
                last, last_s = f.started, f.predicted_s
        out[name] = (rt, bt, last, last_s)
    return out


class Pacer:
    """Additive-increase / multiplicative-decrease concurrency of batch lines on this replica."""

    def __init__(self, bc: BatchConfig) -> None:
        self.conc = float(max(1, bc.min_concurrency))
        self._halved_at = 0.0
        self.last_prediction_ms: float | None = None
        self.last_target_ms: float | None = None
        self.room = True
        self._bc = bc
        self._last: dict[str, tuple[float, float]] = {}  # engine -> (newest batch start, its predicted prefill s)
        self.engines_with_room: int | None = None

    def target_ms(self, gw: Gateway) -> float:
        bc = gw.config.raw.batch
        t = bc.realtime_ttft_target_ms or gw.config.raw.routing.default_ttft_slo_ms or 1000.0
        return float(t)

    def _halve(self, bc: BatchConfig) -> None:
        now = time.monotonic()
        if now - self._halved_at >= HALVE_COOLDOWN_S:
            self._halved_at = now
            self.conc = max(float(bc.min_concurrency), self.conc / 2)

    def pressure(self) -> None:
        """Routing refused a line for lack of room: back off."""
        self._halve(self._bc)

    def allowance(self, gw: Gateway, jobs: list[dict[str, Any]], inflight: int) -> int:
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
        free = int(self.conc) - inflight
        rooms = self.rooms(gw, inflight)
        self.engines_with_room = rooms
        return free if rooms is None else min(free, rooms)

    def rooms(self, gw: Gateway, inflight: int = 0) -> int | None:
        """How many lines may start for prefill room now: own healthy engines with room (engine_room), less
        the lines already started that routing has not placed yet (they will take a room); None without a
        router that tracks flights (then concurrency alone bounds the lane)."""
        router: RouterView | None = gw.router
        if router is None:
            return None
        bc = self._bc
        now = router.clock()
        loads = engine_loads(router, now)
        placed = sum(1 for fls in router.flights.values() for f in list(fls.values()) if f.is_batch)
        n = clear = engines = 0
        for name, _b in own_engines(gw):
            rt, bt, last, last_s = loads.get(name, (0, 0, None, 0.0))
            engines += 1
            clear += rt == 0 and bt == 0
            prev = self._last.get(name)
            if last is not None and (prev is None or last > prev[0]):
                self._last[name] = prev = (last, last_s)
            since = None if prev is None else now - prev[0]
            if engine_room(rt, bt, since, prev[1] if prev else 0.0, bc.max_prefilling_per_engine,
                           bc.prefill_duty):
                n += 1
        return fleet_room(n, clear, engines, bc.clear_engines, max(0, inflight - placed))

    def snapshot(self) -> dict[str, Any]:
        return {"concurrency": int(self.conc), "room": self.room, "predicted_realtime_ttft_ms": self.last_prediction_ms,
                "realtime_target_ms": self.last_target_ms, "engines_with_room": self.engines_with_room}


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
