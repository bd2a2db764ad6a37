"""GPU-seconds per adapter and per rollout arm (gateway/cost/dims.py, docs/cost.md#per-adapter-and-per-arm).

Pins: the ledger values a request's evidence gives (`adapter` = the registered adapter's name; `arm` =
`<alias>:<arm>` of the arm that answered, else of the arm chosen, a shadow copy's `<alias>:<arm> (shadow)`, a
primary that was copied stays a primary, an arm dropped for the caller is none); the meter files them on the spend ledger's row (parked before the budget
settles, or read from the request being finished when its meter stage never ran, as for a priced cache hit) and
on its own unbilled rows; its totals and /metrics counters per adapter and arm; and `summarize` groups by them
with the requests that used neither in the empty group, every group-by adding up to the total."""
from __future__ import annotations

import asyncio
import contextvars
import sqlite3

import pytest
import yaml
from prometheus_client import generate_latest

from gateway.budget.ledger import Ledger, SqliteSink
from gateway.config import parse_config
from gateway.cost.dims import DimCounters, ledger_dims
from gateway.cost.meter import CostMeter
from gateway.cost.report import read_sqlite, summarize
from gateway.metrics import Metrics
from gateway.observability.logs import current_request
from gateway.pipeline import AdapterUse, ArmChoice, Charge, RequestContext, RequestHeaders
from gateway.types import Principal, Usage

ADAPTER = {"adapter": {"name": "acme-lora", "base_model": "base", "engine": "e1", "loaded": True}}
ARM_V2 = {"rollout": {"alias": "support", "arm": "v2"}}
COPIED = {"rollout": {"alias": "support", "arm": "v1", "shadow": ["v3"]}}  # a primary naming its copies
SHADOW = {"rollout": {"alias": "support", "arm": "v3", "shadow": True, "of": "req-1"}}
DROPPED = {"rollout": {"alias": "support", "arm": None}}  # hide_dropped_arm left the caller no arm


def ctx_with(rid: str, evidence: dict, gpu: float = 0.0) -> RequestContext:
    """A finished request with the adapter and arm its stages would have set (as in their evidence)."""
    ctx = RequestContext(request_id=rid, endpoint="chat", headers=RequestHeaders(), body={})
    ctx.principal = Principal(id="key:k", kind="key", tenant="acme")
    ctx.model = ctx.backend_model = "m"
    ctx.evidence.update(evidence)
    if "adapter" in evidence:
        ctx.adapter = AdapterUse(evidence["adapter"]["name"], evidence["adapter"]["base_model"])
    if "rollout" in evidence:
        ro = evidence["rollout"]
        ctx.rollout = ArmChoice(ro["alias"], ro["arm"], shadow=ro.get("shadow") is True)
    if gpu:
        ctx.backend, ctx.status, ctx.usage = "e1", 200, Usage(10, 5)
        ctx.outcome.unit_cost = {"engine": "e1", "method": "apportioned", "gpu_seconds": gpu,
                                 "prefill_gpu_seconds": 0.0, "shared_gpu_seconds": gpu, "gpus": 1}
    return ctx


def test_ledger_values_from_the_evidence():
    assert ledger_dims(ctx_with("a", ADAPTER)) == {"adapter": "acme-lora", "arm": None}
    assert ledger_dims(ctx_with("b", ARM_V2)) == {"adapter": None, "arm": "support:v2"}
    assert ledger_dims(ctx_with("c", COPIED)) == {"adapter": None, "arm": "support:v1"}
    assert ledger_dims(ctx_with("d", SHADOW)) == {"adapter": None, "arm": "support:v3 (shadow)"}
    assert ledger_dims(ctx_with("e", DROPPED)) == {"adapter": None, "arm": None}
    assert ledger_dims(ctx_with("f", {**ADAPTER, "rollout": {"alias": "support", "arm": "acme-lora"}})) == \
        {"adapter": "acme-lora", "arm": "support:acme-lora"}  # an arm that is an adapter: both
    assert ledger_dims(ctx_with("g", {})) == {"adapter": None, "arm": None}
    fell_back = ctx_with("h", ARM_V2)  # the chosen arm failed, the next arm of the chain answered
    fell_back.model_chain, fell_back.backend_model = ("v2", "v1"), "v1"
    assert ledger_dims(fell_back) == {"adapter": None, "arm": "support:v1"}


def test_meter_files_counts_and_exports_per_adapter_and_arm(tmp_path):
    cfg = parse_config(yaml.safe_dump({"backends": [{"name": "e1", "url": "http://127.0.0.1:1/v1",
                                                     "models": ["m"]}],
                                       "cost": {"default": {"gpu_hour": 3.6}}}))
    metrics = Metrics()
    db = tmp_path / "budgets.db"
    unbilled = Ledger(SqliteSink(db, table="cost_unbilled"), tmp_path / "cost-spool.jsonl")
    meter = CostMeter(lambda: cfg, ledger=lambda: unbilled, metrics=metrics)
    meter.dims = DimCounters(metrics.registry)
    spend = Ledger(SqliteSink(db), tmp_path / "spool.jsonl")  # the budget stage's, the meter's enricher on it
    spend.enrichers.append(meter.enrich)
    reqs = [ctx_with("r1", ADAPTER, 1.0), ctx_with("r2", ADAPTER, 0.5), ctx_with("r3", ARM_V2, 2.0),
            ctx_with("r4", COPIED, 0.25), ctx_with("r5", SHADOW, 0.75), ctx_with("r6", {}, 4.0)]

    async def serve() -> None:
        for ctx in reqs:  # the meter stage's finish, the budget stage's row, the meter's finish hook
            meter.before_settle(ctx)
            spend.enqueue({"request_id": ctx.request_id})
            ctx.outcome.charge = Charge(0.0, "EUR")
            await meter.finish(ctx)
        # a priced cache hit: answered before the meter stage, its row filed while the request is finished
        hit = ctx_with("r7", ADAPTER)
        hit.answer, hit.status, hit.usage = object(), 200, Usage(10, 5)

        def budget_finish() -> None:
            current_request.set(hit)
            spend.enqueue({"request_id": "r7", "cost_category": "cache_hit"})

        contextvars.copy_context().run(budget_finish)
        hit.outcome.charge = Charge(0.0, "EUR")
        await meter.finish(hit)
        # an early refusal through an alias: the meter files its row on the unbilled table
        await meter.finish(ctx_with("r8", ARM_V2))
        for led in (spend, unbilled):
            await led.sink.open()
            assert await led.flush()
            await led.sink.close()

    asyncio.run(serve())
    with sqlite3.connect(db) as con:
        rows = con.execute("select request_id, adapter, arm from budget_ledger union all "
                           "select request_id, adapter, arm from cost_unbilled").fetchall()
        unbilled_ids = [r[0] for r in con.execute("select request_id from cost_unbilled")]
    dims = {rid: (a, arm) for rid, a, arm in rows}
    assert dims == {"r1": ("acme-lora", None), "r2": ("acme-lora", None), "r3": (None, "support:v2"),
                    "r4": (None, "support:v1"), "r5": (None, "support:v3 (shadow)"), "r6": (None, None),
                    "r7": ("acme-lora", None), "r8": (None, "support:v2")}
    assert unbilled_ids == ["r8"]
    report = {g["adapter"]: (g["requests"], g["gpu_seconds"])
              for g in summarize(read_sqlite(str(db), None, None), ["adapter"])}
    assert report == {"acme-lora": (3, 1.5), None: (5, 7.0)}  # the report reads what the meter filed
    assert meter._dims == {}  # nothing parked is left behind
    got = {(a["adapter"], a["requests"], a["gpu_seconds"]) for a in meter.dim_snapshot("adapter")}
    assert got == {("acme-lora", 3, 1.5)}
    got = {(a["arm"], a["requests"], a["gpu_seconds"]) for a in meter.dim_snapshot("arm")}
    assert got == {("support:v2", 2, 2.0), ("support:v1", 1, 0.25), ("support:v3 (shadow)", 1, 0.75)}
    text = generate_latest(metrics.registry).decode()
    assert 'gateway_cost_adapter_gpu_seconds_total{adapter="acme-lora"} 1.5' in text
    assert 'gateway_cost_arm_gpu_seconds_total{alias="support",arm="v2",shadow="false"} 2.0' in text
    assert 'gateway_cost_arm_gpu_seconds_total{alias="support",arm="v1",shadow="false"} 0.25' in text
    assert 'gateway_cost_arm_gpu_seconds_total{alias="support",arm="v3",shadow="true"} 0.75' in text


def _row(i: int, adapter: str | None, arm: str | None, gpu: float) -> dict:
    return {"ts": float(i), "tenant": "acme", "model": "m", "backend": "e1", "prompt_tokens": 10,
            "completion_tokens": 5, "total_tokens": 15, "cost": 0.01, "currency": "EUR",
            "gpu_seconds_apportioned": gpu, "engine_cost": gpu / 1000, "cost_category": "served",
            "adapter": adapter, "arm": arm}


@pytest.mark.parametrize("dim", ["adapter", "arm"])
def test_summarize_groups_by_adapter_and_arm(dim):
    rows = [_row(0, "acme-lora", None, 1.0), _row(1, "acme-lora", "support:acme-lora", 0.5),
            _row(2, None, "support:v2", 2.0), _row(3, None, "support:v3 (shadow)", 0.75), _row(4, None, None, 4.0)]
    groups = {g[dim]: g for g in summarize(rows, [dim])}
    want = {"adapter": {"acme-lora": (2, 1.5), None: (3, 6.75)},
            "arm": {"support:acme-lora": (1, 0.5), "support:v2": (1, 2.0), "support:v3 (shadow)": (1, 0.75),
                    None: (2, 5.0)}}[dim]
    assert {k: (g["requests"], g["gpu_seconds"]) for k, g in groups.items()} == want
    assert all(g["total_tokens"] == 15 * g["requests"] for g in groups.values())
    (total,) = summarize(rows)
    assert sum(g["gpu_seconds"] for g in groups.values()) == pytest.approx(total["gpu_seconds"])
    assert sum(g["engine_cost"] for g in groups.values()) == pytest.approx(total["engine_cost"])
    assert sum(g["requests"] for g in groups.values()) == total["requests"] == 5
