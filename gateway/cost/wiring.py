"""Assembly of cost engineering into a Gateway (called from gateway.wiring.wire, which puts the meter's stage
last in its stage list, before dispatch): the dispatcher reports attempts to the meter, its finish hook is first
(before the audit recorder's),
the spend ledger gets the apportioned fields (and unbilled requests a table of their own), /metrics the
per-engine busy series, /admin/cost the snapshot."""
from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admin_guard import PLATFORM_ADMIN, gateway_guard
from gateway.budget.ledger import Ledger, PostgresSink, SqliteSink
from gateway.config import Config, ConfigError
from gateway.cost.dims import DimCounters
from gateway.cost.meter import CostMeter

if TYPE_CHECKING:
    from gateway.app import Gateway


class EngineCostCollector:
    """Per-engine series at scrape time: busy time seen, GPU-seconds apportioned, prefill share, in flight."""

    def __init__(self, meter: CostMeter) -> None:
        self.meter = meter

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        snap = self.meter.engines_snapshot()
        busy = CounterMetricFamily("gateway_engine_busy_seconds", "Engine busy time seen by this gateway "
                                   "(a request of this gateway on it)", labels=["backend"])
        charged = CounterMetricFamily("gateway_engine_apportioned_seconds", "Engine-seconds apportioned to "
                                      "requests (conservation: close to the busy time)", labels=["backend"])
        share = GaugeMetricFamily("gateway_engine_prefill_share", "Decayed share of busy time spent on prefill "
                                  "(learned cost per token x uncached tokens)", labels=["backend"])
        for name, s in snap.items():
            busy.add_metric([name], s["busy_s"])
            charged.add_metric([name], s["charged_s"])
            share.add_metric([name], s["prefill_share"])
        yield busy
        yield charged
        yield share


UNBILLED_TABLE = "cost_unbilled"


def unbilled_ledger(config: Any) -> Ledger:
    """Rows of requests the budget stage does not record (response-cache hits, early refusals): the spend
    ledger's outbox and columns, its own table next to `budget_ledger` (same SQLite file or Postgres), its own
    spool (`cost-<budgets.spool_path name>`, outside the spend ledger's replay glob). The spend ledger stays
    one row per request that spent; `gateway report` reads both."""
    b = config.raw.budgets
    if b.ledger == "postgres" and b.ledger_dsn:
        sink: Any = PostgresSink(os.path.expandvars(b.ledger_dsn), table=UNBILLED_TABLE)
    else:
        sink = SqliteSink(config.resolve_path(b.sqlite_path), table=UNBILLED_TABLE)
    spool = config.resolve_path(b.spool_path)
    return Ledger(sink, spool.with_name("cost-" + spool.name), b.ledger_flush_s)


class MeterOff:
    """Wired instead of the meter when `cost.enabled: false` at startup: the meter's stage, clocks and ledger
    are assembled only then, so a reload cannot switch it on (it would be a meter that never saw a request
    begin, and GPU-second budgets could not reserve); such a reload is refused and says to restart."""

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def check_config(self, new: Config) -> None:
        if new.raw.cost.enabled:
            raise ConfigError("cost.enabled: true needs a restart: the cost meter was off at startup, and it is "
                              "assembled (its stage, engine clocks, ledger) only when the gateway starts")

    def swap_config(self, new: Config) -> None:
        """Nothing to swap: the meter stays off until a restart (check_config refused turning it on)."""


def wire_cost(gw: Gateway) -> CostMeter | None:
    if not gw.config.raw.cost.enabled:
        gw.services.append(MeterOff())
        return None
    budgets = gw.budgets
    unbilled = unbilled_ledger(gw.config)
    gw.services.append(unbilled)  # its config is read once: the ledger's sink and spool
    meter = CostMeter(lambda: gw.config,
                      predictor=lambda: gw.router.predictor if gw.router is not None else None,
                      ledger=lambda: unbilled, metrics=gw.metrics)
    gw.cost = meter
    meter.dims = DimCounters(gw.metrics.registry)  # GPU-seconds per adapter and per arm
    gw.dispatcher.attempts = meter  # engine time per attempt: a failed attempt's is retry waste
    if budgets is not None:
        budgets.ledger.enrichers.append(meter.enrich)
        budgets.set_gpu_estimator(meter.gpu_worst_case)  # GPU-second budgets reserve the learned worst case
    gw.metrics.register_state(EngineCostCollector(meter))  # type: ignore[arg-type]

    async def admin_cost(request: Request, principal: Any) -> Response:
        return JSONResponse(meter.snapshot())

    gw.extra_routes.append(gateway_guard(gw).route("/admin/cost", admin_cost, ["GET"], (PLATFORM_ADMIN,)))
    return meter
