"""`gateway report`: unit economics from the spend ledger (budgets.sqlite_path, or budgets.ledger_dsn on
Postgres: table budget_ledger, plus cost_unbilled for cache hits and early refusals), grouped by tenant, team, project, partner, model, backend, adapter and/or arm over a time range, as CSV or JSON.

Per group: requests (and per cost category), tokens, the price charged, the engine time apportioned to the
requests (GPU-seconds) and what it cost, the margin, cost and charge per million tokens, the GPU-seconds
saved (prefix cache, response cache) and wasted (aborted, cut, failed), and the tokens and money response-cache
hits saved (`saved_tokens`, `saved_cost`: their normal price less what they were charged, in the currency of
`charged`). Sums are the ledger's own sums: a
`--group-by` over nothing (the default: one `all` row) equals `select sum(...)` over the same range.

`adapter` is the tenant-owned LoRA adapter a request used, `arm` the weighted alias's arm it was routed to
(`<alias>:<arm model>`, a shadow copy's `<alias>:<model> (shadow)`): ledger columns the cost meter fills from the
request's evidence (gateway/cost/dims.py). A request that used none has no value there, like a missing team or
partner: its group is the empty one (empty in CSV, null in JSON), so every group-by's rows add up to the total.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sqlite3
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from gateway.cost.model import CATEGORIES

GROUPS = ("tenant", "team", "project", "partner", "model", "backend", "adapter", "arm")
_READ = ("ts", "tenant", "team", "project", "partner", "model", "backend", "engine", "prompt_tokens",
         "completion_tokens", "cached_tokens", "total_tokens", "cost", "currency", "gpu_seconds_apportioned",
         "engine_cost", "cost_category", "saved_gpu_seconds", "wasted_gpu_seconds", "retries", "saved_tokens",
         "saved_cost", "adapter", "arm")
FIELDS = ("requests", *(f"requests_{c}" for c in CATEGORIES), "retries", "prompt_tokens", "cached_tokens",
          "completion_tokens", "total_tokens", "charged", "currency", "gpu_seconds", "engine_cost", "margin",
          "engine_cost_per_1m_tokens", "charged_per_1m_tokens", "saved_gpu_seconds", "wasted_gpu_seconds",
          "saved_tokens", "saved_cost")


def parse_time(s: str | None) -> float | None:
    """Epoch seconds, or an ISO 8601 date/time (UTC unless it names a zone)."""
    if s is None or s == "":
        return None
    try:
        return float(s)
    except ValueError:
        pass
    d = datetime.fromisoformat(s.replace("Z", "+00:00"))
    if d.tzinfo is None:
        d = d.replace(tzinfo=UTC)
    return d.timestamp()


# the spend ledger, and the requests it does not record (cache hits, early refusals: gateway/cost/wiring.py)
TABLES = ("budget_ledger", "cost_unbilled")


def read_sqlite(path: str, since: float | None, until: float | None,
                tables: Sequence[str] = TABLES) -> list[dict[str, Any]]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        out: list[dict[str, Any]] = []
        for table in tables:
            have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
            if not have:
                continue  # not created yet (no unbilled request so far)
            cols = [c if c in have else f"NULL AS {c}" for c in _READ]
            q = f"SELECT {', '.join(cols)} FROM {table} WHERE (? IS NULL OR ts >= ?) AND (? IS NULL OR ts < ?)"
            out.extend(dict(zip(_READ, r)) for r in db.execute(q, (since, since, until, until)).fetchall())
        return out
    finally:
        db.close()


async def read_postgres(dsn: str, since: float | None, until: float | None,
                        tables: Sequence[str] = TABLES) -> list[dict[str, Any]]:
    import asyncpg

    c = await asyncpg.connect(dsn, timeout=10)
    try:
        out: list[dict[str, Any]] = []
        for table in tables:
            have = {r[0] for r in await c.fetch("SELECT column_name FROM information_schema.columns "
                                                "WHERE table_name = $1 AND table_schema = current_schema()", table)}
            if not have:
                continue  # not created yet
            cols = [col if col in have else f"NULL AS {col}" for col in _READ]  # older tables: columns added on open
            rows = await c.fetch(f"SELECT {', '.join(cols)} FROM {table} WHERE ($1::float8 IS NULL OR ts >= $1) "
                                 "AND ($2::float8 IS NULL OR ts < $2)", since, until)
            out.extend(dict(r) for r in rows)
        return out
    finally:
        await c.close()


def summarize(rows: Iterable[dict[str, Any]], group_by: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One dict per group (ordered by the group key); every numeric field is a plain sum or a ratio of sums."""
    for g in group_by:
        if g not in GROUPS:
            raise ValueError(f"unknown group {g!r}; one of {', '.join(GROUPS)}")
    acc: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        key = tuple(r.get(g) for g in group_by) if group_by else ("all",)
        a = acc.get(key)
        if a is None:
            a = acc[key] = {**({g: v for g, v in zip(group_by, key)} if group_by else {"group": "all"}),
                            **{f: 0 for f in FIELDS if f != "currency"}, "currency": None,
                            "charged": 0.0, "gpu_seconds": 0.0, "engine_cost": 0.0,
                            "saved_gpu_seconds": 0.0, "wasted_gpu_seconds": 0.0, "saved_cost": 0.0}
        a["requests"] += 1
        cat = r.get("cost_category") or ("served" if r.get("backend") else "rejected")
        if f"requests_{cat}" in a:
            a[f"requests_{cat}"] += 1
        for f in ("prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens", "retries", "saved_tokens"):
            a[f] += int(r.get(f) or 0)
        a["charged"] += float(r.get("cost") or 0.0)
        ccy = r.get("currency")
        if ccy:
            a["currency"] = ccy if a["currency"] in (None, ccy) else "mixed"
        a["gpu_seconds"] += float(r.get("gpu_seconds_apportioned") or 0.0)
        a["engine_cost"] += float(r.get("engine_cost") or 0.0)
        a["saved_gpu_seconds"] += float(r.get("saved_gpu_seconds") or 0.0)
        a["wasted_gpu_seconds"] += float(r.get("wasted_gpu_seconds") or 0.0)
        a["saved_cost"] += float(r.get("saved_cost") or 0.0)
    out = []
    for key in sorted(acc, key=lambda k: tuple("" if v is None else str(v) for v in k)):
        a = acc[key]
        t = a["total_tokens"]
        a["margin"] = a["charged"] - a["engine_cost"]
        a["engine_cost_per_1m_tokens"] = a["engine_cost"] / t * 1e6 if t else None
        a["charged_per_1m_tokens"] = a["charged"] / t * 1e6 if t else None
        out.append(a)
    return out


def _round(v: Any) -> Any:
    return round(v, 9) if isinstance(v, float) else v


def to_json(groups: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    return json.dumps({**meta, "groups": [{k: _round(v) for k, v in g.items()} for g in groups]}, indent=2)


def to_csv(groups: list[dict[str, Any]], group_by: Sequence[str]) -> str:
    buf = io.StringIO()
    cols = [*(group_by or ("group",)), *FIELDS]
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for g in groups:
        w.writerow({k: ("" if g.get(k) is None else _round(g.get(k))) for k in cols})
    return buf.getvalue()


def load(config: Any, since: float | None, until: float | None) -> list[dict[str, Any]]:
    b = config.raw.budgets
    if b.ledger == "postgres":
        import asyncio

        if not b.ledger_dsn:
            raise ValueError("budgets.ledger is postgres but budgets.ledger_dsn is not set")
        return asyncio.run(read_postgres(os.path.expandvars(b.ledger_dsn), since, until))
    path = config.resolve_path(b.sqlite_path)
    if not path.exists():
        raise FileNotFoundError(f"no ledger at {path} (budgets.sqlite_path)")
    return read_sqlite(str(path), since, until)


def cmd_report(args: argparse.Namespace) -> int:
    from gateway.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
        since, until = parse_time(args.since), parse_time(args.until)
        group_by = [g for g in (args.group_by or "").split(",") if g]
        groups = summarize(load(cfg, since, until), group_by)
    except (ConfigError, ValueError, FileNotFoundError, sqlite3.Error) as e:
        print(f"gateway report: {e}", file=sys.stderr)
        return 2
    if args.format == "json":
        text = to_json(groups, {"since": since, "until": until, "group_by": group_by,
                                "cost_currency": cfg.raw.cost.currency})
    else:
        text = to_csv(groups, group_by)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def add_report_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Hook that gateway/cli.py calls to register `gateway report`."""
    p = sub.add_parser("report", help="unit economics from the spend ledger: cost, charge, margin, savings, waste")
    p.add_argument("--config", "-c", required=True)
    p.add_argument("--since", help="from this time (epoch seconds or ISO 8601, UTC by default), inclusive")
    p.add_argument("--until", help="to this time, exclusive")
    p.add_argument("--group-by", default="", metavar="G[,G...]",
                   help=f"comma-separated, any of {', '.join(GROUPS)} (default: one row for everything)")
    p.add_argument("--format", choices=("csv", "json"), default="csv")
    p.add_argument("--out", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_report)
