"""Run by tests/budget/test_new_dimension.py in a process of its own: the gateway's budget path with one row added
to the budget dimensions' table (gateway/budget/dimensions.py) and no other change, an output-token limit (as
Anthropic's OTPM): reserve holds 1 per completion token, settle charges the completion tokens, its own header, a
ledger column of its own. Exercises the policy compiler (schema from the table), the service on the memory, SQLite
and Redis stores (the Lua script after the prelude generated from the table), the stage's ledger row, the Postgres
ledger sink, and prints a JSON summary.

Usage: python -m tests.budget._new_dimension SPEC_JSON   (dir, redis_url, prefix, pg_dsn, pg_table)"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import gateway.budget

ROOT = Path(__file__).resolve().parents[2]
ROW = '''    Dimension("output_tokens", Kind.AMOUNT, {"output_tokens": _POSITIVE_INT}, "Completion tokens per window.",
              code="o", reserve=lambda f: (0, 1), settle=lambda f: f.usage.completion_tokens, quota="calendar",
              header="output-tokens", ledger="output_tokens"),
'''


def _patched_table() -> None:
    """gateway.budget.dimensions with ROW appended to DIMENSIONS, before anything else imports it."""
    path = ROOT / "gateway" / "budget" / "dimensions.py"
    src = path.read_text(encoding="utf-8")
    head, sep, tail = src.partition("DIMENSIONS: tuple[Dimension, ...] = (\n")
    body, close, rest = tail.partition("\n)\n")
    assert sep and close, "the table's layout changed: update this test"
    src = head + sep + body + "\n" + ROW + close.lstrip("\n") + rest
    spec = importlib.util.spec_from_loader("gateway.budget.dimensions", loader=None)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    mod.__file__ = str(path)
    sys.modules["gateway.budget.dimensions"] = mod
    exec(compile(src, str(path), "exec"), mod.__dict__)
    gateway.budget.dimensions = mod  # type: ignore[attr-defined]


async def run(spec: dict) -> dict:
    import yaml

    from gateway.budget.dimensions import NAMES
    from gateway.budget.service import BudgetService
    from gateway.budget.stage import BudgetStage
    from gateway.config import parse_config
    from gateway.errors import GatewayError
    from gateway.pipeline import RequestContext
    from gateway.policy.compiler import parse_documents
    from gateway.types import Decision, Principal, Usage

    assert NAMES[-1] == "output_tokens"
    rules, _, _ = parse_documents([("p.yaml", "rules:\n  - id: otpm\n    budgets: [{window: day, output_tokens: 100}]\n")])
    budgets = rules[0].budgets
    out: dict = {"limit": budgets[0].limit("output_tokens")}
    base = Path(spec["dir"])
    p = Principal(id="key:k", kind="api_key", tenant="acme", key_id="k")
    for store in ("memory", "sqlite", "redis"):
        d = base / store
        d.mkdir(exist_ok=True)
        cfg = parse_config(yaml.safe_dump({"budgets": {
            "store": store, "redis_url": spec["redis_url"], "key_prefix": f"{spec['prefix']}:{store}",
            "sqlite_path": str(d / "budgets.db"), "spool_path": str(d / "spool.jsonl")}}), "t.yaml", base_dir=d)
        svc = BudgetService(cfg)
        await svc.start()
        stage = BudgetStage(svc)
        seen: dict = {}
        try:
            ctx = RequestContext(request_id=f"{store}-1", endpoint="chat", headers={}, body={}, model="m",
                                 model_chain=("m",), prompt_tokens_est=10, principal=p,
                                 decision=Decision(budgets=budgets))
            await stage.run(ctx)  # uncapped: the completion allowance is what the output budget leaves
            seen["allowance"] = ctx.completion_token_allowance
            seen["headers"] = {k: v for k, v in ctx.extra_headers.items() if "output" in k}
            seen["reserved"] = ctx.evidence["budget"]["reserved"]["output_tokens"]
            ctx.usage, ctx.backend = Usage(10, 60), "b"
            await stage.finish(ctx)
            seen["settled"] = ctx.evidence["budget"]["settled"]["output_tokens"]
            out2 = await svc.reserve(f"{store}-2", p, budgets, ("m",), 10, None)
            seen["allowance_after"] = out2.allowance
            seen["limit_evidence"] = out2.evidence["limits"][0]["before"]["output_tokens"]
            try:
                await svc.reserve(f"{store}-3", p, budgets, ("m",), 10, 50)
            except GatewayError as e:
                seen["refusal"] = [e.status, e.code, e.message, (e.extra or {}).get("budget")]
            await svc.ledger.flush()
        finally:
            await svc.close()
        if store == "memory":
            import sqlite3

            db = sqlite3.connect(d / "budgets.db")
            seen["ledger"] = db.execute("SELECT request_id, total_tokens, output_tokens FROM budget_ledger").fetchall()
            db.close()
        out[store] = seen
    out["postgres"] = await _postgres_ledger(spec["pg_dsn"], spec["pg_table"])
    return out


async def _postgres_ledger(dsn: str, table: str) -> list:
    """The Postgres ledger sink on a table this version created: it gains the dimension's column on open."""
    import asyncpg

    from gateway.budget.ledger import PostgresSink

    sink = PostgresSink(dsn, table)
    await sink.open()
    await sink.write([{"request_id": "pg-1", "total_tokens": 70, "output_tokens": 60}])
    await sink.close()
    db = await asyncpg.connect(dsn)
    try:
        return list(await db.fetchrow(f"SELECT request_id, total_tokens, output_tokens FROM {table}"))
    finally:
        await db.close()


if __name__ == "__main__":
    _patched_table()
    print(json.dumps(asyncio.run(run(json.loads(sys.argv[1])))))
