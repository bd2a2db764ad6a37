"""A wired in-process gateway in front of an in-process simulated fleet (shared by the cost tests)."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import yaml

KEY = "cost-test-key-0123456789"


def gateway_config(engines: list[dict[str, Any]], tmp: Path, cost: dict[str, Any] | None = None,
                   prices: dict[str, Any] | None = None) -> dict[str, Any]:
    (tmp / "policy.yaml").write_text(yaml.safe_dump({"version": 1, "defaults": {"allow": True}, "rules": [
        {"id": "money", "match": {"tenant": "acme"}, "budgets": [{"window": "day", "money": 1000.0}]}]}))
    return {"server": {"host": "127.0.0.1", "port": 0},
            "backends": [{"name": e["name"], "url": e["url"], "kind": "vllm", "models": ["sim-model"],
                          "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                          "location": {"country": "DE"}, "retention": "none"} for e in engines],
            "keys": [{"name": "k", "key": KEY, "tenant": "acme", "team": "search", "project": "p1"}],
            "policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / "audit.jsonl")},
            "identity": {"sqlite_path": str(tmp / "id.db")},
            "budgets": {"sqlite_path": str(tmp / "budgets.db"), "spool_path": str(tmp / "spool.jsonl"),
                        "ledger_flush_s": 0.05,
                        "prices": prices or {"sim-model": {"input": 0.5, "output": 1.5, "gpu_second": 0.001}}},
            "cost": cost or {"default": {"gpu_hour": 2.5}},
            "routing": {"admission": False},
            "data_dir": str(tmp)}


@contextlib.asynccontextmanager
async def wired_gateway(cfg: dict[str, Any], tmp: Path) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    from gateway.app import Gateway, build_app
    from gateway.config import parse_config
    from gateway.wiring import wire

    gw = Gateway(parse_config(yaml.safe_dump(cfg), base_dir=tmp))
    wire(gw)
    app = build_app(gw)
    await gw.start()
    try:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                     limits=limits, timeout=60) as cl:
            yield gw, cl
    finally:
        await gw.close()
