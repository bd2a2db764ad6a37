"""/admin/ui: a live dashboard served by the gateway itself (one static HTML page, inline JS, no build step).

GET /admin/ui       the page shell: no data, no secrets. It takes the admin key from the URL fragment
                    (`/admin/ui#key=...`: fragments never reach the server or its logs) or a prompt, keeps it
                    in sessionStorage and sends it as a Bearer header.
GET /admin/ui/data  platform-admin JSON the page polls: engines (queue, KV usage, cached blocks by tier,
                    learned prefill rate, predicted TTFT, circuit), budgets by tenant, recent decisions with
                    their evidence, the predicted-vs-actual TTFT series, and unit economics (gateway/cost:
                    cost and charge per 1M tokens per model and engine, utilisation, margin, savings, waste),
                    and each weighted alias's arms side by side with the rollback alarms (gateway/rollouts),
                    and the adapters resident on each dynamic engine (gateway/adapters placement).
                    Every source degrades to empty.
"""
from __future__ import annotations

import time
from importlib import resources
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

if TYPE_CHECKING:
    from gateway.adapters.service import AdapterService
    from gateway.admin_guard import AdminGuard
    from gateway.config import Config
    from gateway.cost.meter import CostMeter
    from gateway.proxy.health import Health
    from gateway.rollouts.service import RolloutService

PAGE = resources.files("gateway.observability") / "dashboard.html"  # package data (pyproject package-data)
_DROP = ("content",)  # records never show captured content on the dashboard


class FleetSource(Protocol):
    """The engines as telemetry sees them (gateway/telemetry/service.py TelemetryService)."""

    async def refresh_block_counts(self) -> None: ...

    def fleet_snapshot(self) -> Mapping[str, Any]: ...


class RoutingSource(Protocol):
    """The router's /admin/routing snapshot (gateway/routing/stage.py PredictiveRouteStage)."""

    def snapshot(self) -> dict[str, Any]: ...


class RecordSource(Protocol):
    """Audit records by request id (gateway/evidence/recorder.py EvidenceRecorder)."""

    async def get(self, request_id: str) -> dict[str, Any] | None: ...


class SnapshotSource(Protocol):
    """What the page reads (gateway/app.py Gateway): the config and the subsystems' public snapshots; a
    subsystem that is not wired (None) gives an empty part."""

    @property
    def config(self) -> Config: ...

    @property
    def health(self) -> Health: ...

    @property
    def telemetry(self) -> FleetSource | None: ...

    @property
    def router(self) -> RoutingSource | None: ...

    @property
    def evidence(self) -> RecordSource | None: ...

    @property
    def cost(self) -> CostMeter | None: ...

    @property
    def rollouts(self) -> RolloutService | None: ...

    @property
    def adapters(self) -> AdapterService | None: ...


def _obj(rec: dict[str, Any], key: str) -> dict[str, Any]:
    v = rec.get(key)
    return v if isinstance(v, dict) else {}


def _decision(rec: dict[str, Any]) -> dict[str, Any]:
    """A recent evidence record trimmed for the table (the full record stays at /admin/decisions/{id})."""
    p, route, cost = _obj(rec, "principal"), _obj(rec, "route"), _obj(rec, "cost")
    ttft, cached = _obj(rec, "ttft_ms"), _obj(rec, "cached_tokens")
    c = rec.get("candidates")
    cands: list[Any] = c if isinstance(c, list) else []
    return {
        "request_id": rec.get("request_id"), "ts": rec.get("ts"), "tenant": p.get("tenant"),
        "model": rec.get("model"), "backend": rec.get("backend"), "status": rec.get("status"),
        "error": rec.get("error"), "matched_rules": rec.get("matched_rules") or [],
        "zero_retention": rec.get("zero_retention"), "admission": route.get("admission"),
        "ttft_slo_ms": route.get("ttft_slo_ms"),
        "predicted_ttft_ms": ttft.get("predicted"), "actual_ttft_ms": ttft.get("actual"),
        "predicted_cached_tokens": cached.get("predicted"), "actual_cached_tokens": cached.get("actual"),
        "cost": cost.get("amount"), "currency": cost.get("currency"),
        "candidates": [{k: c.get(k) for k in ("backend", "predicted_ttft_ms", "predicted_ttft_upper_ms",
                                              "predicted_cached_tokens") if k in c} for c in cands if isinstance(c, dict)],
        "evidence": {k: v for k, v in rec.items() if k not in _DROP},
    }


def _budgets(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Latest known use vs limit per (scope, id, window), from the budget evidence of recent requests."""
    latest: dict[tuple[str, str, str], dict[str, Any]] = {}
    for rec in records:  # oldest first: later records overwrite
        b = rec.get("budget")
        if not isinstance(b, dict):
            continue
        tenant = (rec.get("principal") or {}).get("tenant")
        for lim in b.get("limits") or []:
            if not isinstance(lim, dict):
                continue
            key = (str(lim.get("scope")), str(lim.get("id")), str(lim.get("window")))
            latest[key] = {"tenant": tenant, "scope": key[0], "id": key[1], "window": key[2],
                           "limit": lim.get("limit"), "used": lim.get("after"), "currency": b.get("currency"),
                           "as_of": rec.get("ts"), "refused": bool(b.get("refused"))}
        ref = b.get("refused")
        if isinstance(ref, dict) and not b.get("limits"):  # a refusal names scope and window, not the scope id
            hits = [v for v in latest.values() if v["tenant"] == tenant and v["scope"] == str(ref.get("scope"))
                    and v["window"] == str(ref.get("window"))]
            for v in hits:
                v["refused"], v["as_of"] = True, rec.get("ts")
            if not hits:
                key = (str(ref.get("scope")), "?", str(ref.get("window")))
                latest[key] = {"tenant": tenant, "scope": key[0], "id": key[1], "window": key[2], "limit": None,
                               "used": None, "currency": None, "as_of": rec.get("ts"), "refused": True}
    return sorted(latest.values(), key=lambda x: (str(x["tenant"]), x["scope"], x["id"], x["window"]))


async def dashboard_data(gw: SnapshotSource, recent_ids: Callable[[], list[str]],
                         limit: int = 100) -> dict[str, Any]:
    """Everything the page shows, from the subsystems' public snapshots; missing subsystems give empty parts."""
    cfg = gw.config
    health = gw.health.snapshot()
    tel = gw.telemetry
    fleet: Mapping[str, Any] = {}
    if tel is not None:
        await tel.refresh_block_counts()  # the KV index counts, off the event loop
        fleet = tel.fleet_snapshot()
    routing = gw.router.snapshot() if gw.router is not None else {}
    learned = routing.get("engines", {}) if isinstance(routing, dict) else {}
    rec_src = gw.evidence
    records: list[dict[str, Any]] = []
    if rec_src is not None:
        seen: set[str] = set()
        for rid in reversed(recent_ids()):
            if rid in seen:
                continue
            seen.add(rid)
            rec = await rec_src.get(rid)
            if rec is not None:
                records.append(rec)
            if len(records) >= limit:
                break
        records.reverse()  # oldest first
    last_pred: dict[str, float] = {}
    for rec in records:
        for c in rec.get("candidates") or []:
            if isinstance(c, dict) and isinstance(c.get("predicted_ttft_ms"), (int, float)) and c.get("backend"):
                last_pred[c["backend"]] = c["predicted_ttft_ms"]
    engines = []
    modes = routing.get("modes", {}) if isinstance(routing, dict) else {}
    holding = set((routing.get("flow") or {}).get("holding_with_room", ())) if isinstance(routing, dict) else set()
    fe = fleet.get("engines", {}) if isinstance(fleet, dict) else {}
    for b in cfg.backends:
        e = fe.get(b.name, {})
        load = e.get("load") or {}
        lr = learned.get(b.name, {})
        engines.append({
            "name": b.name, "kind": b.kind, "country": b.location.country if b.location else None,
            "retention": b.retention, "circuit": (health.get(b.name) or {}).get("state", "closed"),
            "running": load.get("running"), "waiting": load.get("waiting"), "kv_usage": load.get("kv_usage"),
            "cached_blocks": e.get("cached_blocks") or {}, "stale": bool(e.get("stale")),
            "stale_reason": e.get("stale_reason"), "stale_detail": e.get("stale_detail"),
            "inflight": (e.get("inflight") or {}).get("requests"),
            "kv_agreement": (e.get("agreement") or {}).get("token_agreement") if (e.get("agreement") or {}).get(
                "requests") else None,
            "prefill_tokens_per_s": lr.get("prefill_tokens_per_s"), "overhead_ms": lr.get("overhead_ms"),
            "mape": lr.get("mape"), "samples": lr.get("samples"),
            "mdare": lr.get("mdare"), "calibration": lr.get("calibration"),
            "calibration_target": lr.get("calibration_target"),
            "chunk_budget": (lr.get("facts") or {}).get("chunk_budget"),
            "chunk_budget_source": (lr.get("facts") or {}).get("chunk_budget_source"),
            "guard_resets": (lr.get("guard") or {}).get("resets"),
            "predicted_ttft_ms": last_pred.get(b.name),
            # what the gateway models of it (gateway/routing/mode.py) and whether the harmful-hold check fired
            "mode": (modes.get(b.name) or {}).get("mode"), "mode_reason": (modes.get(b.name) or {}).get("reason"),
            "holding_with_room": b.name in holding,
        })
    decisions = [_decision(r) for r in records]
    series = [{"request_id": d["request_id"], "backend": d["backend"], "ts": d["ts"],
               "predicted_ms": d["predicted_ttft_ms"], "actual_ms": d["actual_ttft_ms"]}
              for d in decisions if d["predicted_ttft_ms"] is not None and d["actual_ttft_ms"] is not None]
    meter = gw.cost
    # utilisation is busy_s / (generated_at - started_at), computed by the page: the data stays stable when idle
    cost = ({"currency": meter.cfg.currency, "started_at": meter.started_at, "engines": meter.engines_snapshot(),
             "by_model": meter.by_model()}
            if meter is not None else {"currency": None, "started_at": None, "engines": {}, "by_model": []})
    return {"generated_at": time.time(), "config_generation": cfg.generation, "engines": engines, "cost": cost,
            "admission": routing.get("admission", {}) if isinstance(routing, dict) else {},
            "flow": routing.get("flow", {}) if isinstance(routing, dict) else {},
            "budgets": _budgets(records), "decisions": list(reversed(decisions)), "ttft_series": series,
            "rollouts": _rollouts(gw), "adapters": await _adapters(gw)}


async def _adapters(gw: SnapshotSource) -> list[dict[str, Any]]:
    """Per dynamic engine, the adapters this process has resident (in flight, idle time, owner) and the learned
    load time: GET /admin/adapters/placement as the platform admin sees it (gateway/adapters)."""
    svc = gw.adapters
    if svc is None or svc.store is None:
        return []
    view: list[dict[str, Any]] = await svc.placement_view(None)
    return view


def _rollouts(gw: SnapshotSource) -> dict[str, Any]:
    """Each weighted alias's arms side by side (gateway/rollouts) and the latest rollback alarms."""
    ro = gw.rollouts
    if ro is None:
        return {"aliases": [], "alarms": []}
    views = [ro.view(a) for a in sorted(ro.rollouts)]
    # the alarms every replica shares: the rolled-back arms of the live state (the store), not this process's own
    alarms = [{"alias": v["alias"], "arm": x["model"], "reason": x["rolled_back"]}
              for v in views for x in v["arms"] if x["rolled_back"]]
    return {"aliases": views, "alarms": alarms}


def dashboard_routes(gw: SnapshotSource, guard: AdminGuard, recent_ids: Callable[[], list[str]]) -> list[Route]:
    """The page (public shell, no data) and its data (platform admins only: every tenant's decisions and
    spend), both declared through the gateway's admin guard (gateway/admin_guard.py)."""
    from gateway.admin_guard import PLATFORM_ADMIN, PUBLIC

    html = PAGE.read_bytes()

    async def page(request: Request, principal: Any) -> Response:
        return HTMLResponse(html, headers={"cache-control": "no-store", "referrer-policy": "no-referrer",
                                           "content-security-policy": "default-src 'self'; script-src 'unsafe-inline'; "
                                           "style-src 'unsafe-inline'; img-src 'self' data:"})

    async def data(request: Request, principal: Any) -> Response:
        return JSONResponse(await dashboard_data(gw, recent_ids), headers={"cache-control": "no-store"})

    return [guard.route("/admin/ui", page, ["GET"], (PUBLIC,)),
            guard.route("/admin/ui/data", data, ["GET"], (PLATFORM_ADMIN,))]
