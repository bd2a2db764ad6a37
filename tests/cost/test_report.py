"""`gateway report`: the report's sums equal the ledger's, per group and in total, for CSV and JSON, with
--since/--until and --group-by over tenant/team/project/partner/model/backend/adapter/arm (a request that used no
adapter or went through no alias arm is in the empty group of that dimension, as a missing team is)."""
from __future__ import annotations

import asyncio
import csv
import io
import json
import random
import sqlite3

import pytest
import yaml

from gateway.budget.ledger import SqliteSink
from gateway.cli import main
from gateway.cost.report import GROUPS, parse_time

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


@pytest.fixture
def ledger(tmp_path):
    rng = random.Random(3)
    rows = []
    for i in range(300):
        cat = rng.choice(["served", "served", "batch", "cache_hit", "aborted", "rejected"])
        served = cat not in ("cache_hit", "rejected")
        prompt, comp = rng.randrange(10, 2000), rng.randrange(0, 500)
        gpu = rng.uniform(0.01, 3.0) if served else 0.0
        rows.append({"request_id": f"r{i}", "ts": T0 + i * 60, "tenant": rng.choice(["acme", "globex"]),
                     "team": rng.choice(["search", "ads", None]), "project": rng.choice(["p1", "p2"]),
                     "partner": rng.choice([None, "opper"]), "model": rng.choice(["m-small", "m-large"]),
                     "backend": rng.choice(["gpu-0", "gpu-1"]) if served else None,
                     "engine": None, "prompt_tokens": prompt, "completion_tokens": comp,
                     "cached_tokens": rng.randrange(0, prompt), "total_tokens": prompt + comp,
                     "cost": rng.uniform(0, 0.01) if served else 0.0, "currency": "EUR", "gpu_seconds": None,
                     "status": 200, "cut_by_budget": False, "gpu_seconds_apportioned": gpu,
                     "engine_cost": gpu * 2.5 / 3600, "cost_category": cat,
                     "saved_gpu_seconds": rng.uniform(0, 0.5), "wasted_gpu_seconds": gpu if cat == "aborted" else 0.0,
                     "retries": rng.choice([0, 0, 1]),
                     # response-cache hits: the tokens answered without the GPU, the money saved
                     "saved_tokens": prompt + comp if cat == "cache_hit" else 0,
                     "saved_cost": rng.uniform(0, 0.01) if cat == "cache_hit" else 0.0,
                     # the adapter used and the alias arm routed to (gateway/cost/dims.py), or none
                     "adapter": rng.choice([None, None, "acme-lora", "globex-lora"]),
                     "arm": rng.choice([None, "support:v1", "support:v2", "support:v3 (shadow)"])})
    # spend rows in the budget ledger, cache hits and early refusals in the meter's own table (as wired)
    unbilled = [r for r in rows if r["cost_category"] in ("cache_hit", "rejected")]
    spent = [r for r in rows if r["cost_category"] not in ("cache_hit", "rejected")]

    async def write() -> None:
        for table, part in (("budget_ledger", spent), ("cost_unbilled", unbilled)):
            sink = SqliteSink(tmp_path / "budgets.db", table=table)
            await sink.open()
            await sink.write(part)
            await sink.close()

    asyncio.run(write())
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({"budgets": {"sqlite_path": str(tmp_path / "budgets.db")}}))
    return cfg, tmp_path / "budgets.db"


def run(capsys, *argv: str) -> str:
    assert main(["report", *argv]) == 0
    return capsys.readouterr().out


SUMS = ("count(*)", "sum(total_tokens)", "sum(cost)", "sum(gpu_seconds_apportioned)", "sum(engine_cost)",
        "sum(saved_gpu_seconds)", "sum(wasted_gpu_seconds)", "sum(saved_tokens)", "sum(saved_cost)")


def sql(db, where: str = "1=1", group: str | None = None) -> list[tuple]:
    c = sqlite3.connect(db)
    try:
        g = f" group by {group} order by {group}" if group else ""
        sel = (f"{group}, " if group else "") + ", ".join(SUMS)
        both = "(select * from budget_ledger union all select * from cost_unbilled)"
        return c.execute(f"select {sel} from {both} where {where}{g}").fetchall()
    finally:
        c.close()


def test_totals_equal_the_ledger_sums_json(ledger, capsys):
    cfg, db = ledger
    out = json.loads(run(capsys, "--config", str(cfg), "--format", "json"))
    (g,) = out["groups"]
    n, tokens, charged, gpu, cost, saved, wasted, saved_tokens, saved_cost = sql(db)[0]
    assert g["requests"] == n and g["total_tokens"] == tokens
    assert g["charged"] == pytest.approx(charged) and g["gpu_seconds"] == pytest.approx(gpu)
    assert g["engine_cost"] == pytest.approx(cost) and g["margin"] == pytest.approx(charged - cost)
    assert g["saved_gpu_seconds"] == pytest.approx(saved) and g["wasted_gpu_seconds"] == pytest.approx(wasted)
    assert g["engine_cost_per_1m_tokens"] == pytest.approx(cost / tokens * 1e6)
    assert g["saved_tokens"] == saved_tokens > 0 and g["saved_cost"] == pytest.approx(saved_cost) and saved_cost > 0
    assert sum(g[f"requests_{c}"] for c in ("served", "batch", "cache_hit", "aborted", "cut", "error",
                                            "rejected")) == n


@pytest.mark.parametrize("group", GROUPS)
def test_group_by_each_dimension_csv_with_a_time_range(ledger, capsys, group):
    cfg, db = ledger
    since, until = "2026-01-01T02:00:00Z", str(T0 + 200 * 60)
    text = run(capsys, "--config", str(cfg), "--group-by", group, "--since", since, "--until", until)
    rows = list(csv.DictReader(io.StringIO(text)))
    want = sql(db, f"ts >= {parse_time(since)} and ts < {parse_time(until)}", group)
    assert len(rows) == len(want)
    by = {(r[group] or None): r for r in rows}
    for key, n, tokens, charged, gpu, cost, saved, wasted, saved_tokens, saved_cost in want:
        r = by[key]
        assert int(r["requests"]) == n and int(r["total_tokens"]) == tokens
        assert float(r["charged"]) == pytest.approx(charged, abs=1e-8)
        assert float(r["gpu_seconds"]) == pytest.approx(gpu, abs=1e-8)
        assert float(r["engine_cost"]) == pytest.approx(cost, abs=1e-8)
        assert float(r["wasted_gpu_seconds"]) == pytest.approx(wasted, abs=1e-8)
        assert int(r["saved_tokens"]) == saved_tokens
        assert float(r["saved_cost"]) == pytest.approx(saved_cost, abs=1e-8)


def test_two_groups_and_errors(ledger, capsys, tmp_path):
    cfg, db = ledger
    out = json.loads(run(capsys, "--config", str(cfg), "--group-by", "tenant,model", "--format", "json"))
    assert sorted((g["tenant"], g["model"]) for g in out["groups"]) == sorted(
        (t, m) for t, m, *_ in sql(db, group="tenant, model"))
    assert sum(g["requests"] for g in out["groups"]) == 300
    assert main(["report", "--config", str(cfg), "--group-by", "colour"]) == 2
    assert "unknown group" in capsys.readouterr().err
    missing = tmp_path / "none.yaml"
    missing.write_text(yaml.safe_dump({"budgets": {"sqlite_path": str(tmp_path / "nope.db")}}))
    assert main(["report", "--config", str(missing)]) == 2


PG = "postgresql://postgres@127.0.0.1:5432/test"


def test_postgres_ledger_both_tables(tmp_path, capsys):
    """budgets.ledger: postgres - the report reads budget_ledger and cost_unbilled there (rows of this test
    only: a time window of its own, far from any other test's rows)."""
    import uuid

    import asyncpg

    from gateway.budget.ledger import PostgresSink
    from tests.conftest import require_service

    async def ok() -> bool:
        try:
            c = await asyncpg.connect(PG, timeout=3)
            await c.close()
            return True
        except (OSError, asyncpg.PostgresError):
            return False

    require_service(asyncio.run(ok()), "PostgreSQL on 127.0.0.1:5432")
    tag = uuid.uuid4().hex[:8]
    base = 4_000_000_000.0 + random.Random(tag).randrange(10**6) * 100
    spent = [{"request_id": f"rep-{tag}-{i}", "ts": base + i, "tenant": "pg", "model": "m", "backend": "b",
              "total_tokens": 100, "cost": 0.5, "gpu_seconds_apportioned": 2.0, "engine_cost": 0.1,
              "cost_category": "served", "currency": "EUR", "adapter": "pg-lora" if i < 2 else None,
              "arm": "support:v2" if i % 2 else None} for i in range(5)]
    unbilled = [{"request_id": f"rep-{tag}-u{i}", "ts": base + 10 + i, "tenant": "pg", "model": "m",
                 "total_tokens": 0, "cost": 0.0, "cost_category": "rejected"} for i in range(3)]

    async def write() -> None:
        for table, part in (("budget_ledger", spent), ("cost_unbilled", unbilled)):
            s = PostgresSink(PG, table=table)
            await s.open()
            await s.write(part)
            await s.close()

    async def clean() -> None:
        c = await asyncpg.connect(PG)
        try:
            for t in ("budget_ledger", "cost_unbilled"):
                await c.execute(f"DELETE FROM {t} WHERE request_id LIKE $1", f"rep-{tag}-%")
        finally:
            await c.close()

    asyncio.run(write())
    try:
        cfg = tmp_path / "pg.yaml"
        cfg.write_text(yaml.safe_dump({"budgets": {"ledger": "postgres", "ledger_dsn": PG}}))
        out = json.loads(run(capsys, "--config", str(cfg), "--format", "json", "--since", str(base),
                             "--until", str(base + 100)))
        (g,) = out["groups"]
        assert g["requests"] == 8 and g["requests_served"] == 5 and g["requests_rejected"] == 3
        assert g["charged"] == pytest.approx(2.5) and g["gpu_seconds"] == pytest.approx(10.0)
        assert g["margin"] == pytest.approx(2.5 - 0.5)
        for dim, want in (("adapter", {"pg-lora": (2, 4.0), None: (6, 6.0)}),
                          ("arm", {"support:v2": (2, 4.0), None: (6, 6.0)})):
            out = json.loads(run(capsys, "--config", str(cfg), "--format", "json", "--group-by", dim,
                                 "--since", str(base), "--until", str(base + 100)))
            assert {g[dim]: (g["requests"], pytest.approx(g["gpu_seconds"])) for g in out["groups"]} == want
    finally:
        asyncio.run(clean())
