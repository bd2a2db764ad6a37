"""An in-process gateway (wired like `gateway serve`) in front of an in-process simulated vLLM fleet."""
from __future__ import annotations

from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
import yaml

from backends.sim.fleet import start_fleet
from gateway.app import Gateway, build_app
from gateway.config import parse_config
from gateway.wiring import wire

KEY = "obs-test-key-0123456789"
ZR_KEY = "obs-test-zr-key-0123456789"
TIGHT_KEY = "obs-test-tight-key-012345"
ADMIN_KEY = "obs-admin-key-0123456789"

POLICY = """
version: 1
defaults: {allow: true}
rules:
  - id: eea-zero-retention
    match: {principal.labels.residency: eea}
    require: {jurisdiction: EEA, retention: zero}
  - id: tight-budget
    match: {team: tight}
    budgets:
      - {window: minute, tokens: 60}
"""


def gateway_config(tmp: Path, engines: list[dict[str, Any]], server: dict[str, Any] | None = None,
                   **obs: Any) -> dict[str, Any]:
    backends = [{"name": e["name"], "url": e["url"], "kind": "vllm", "models": ["sim-model"],
                 "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                 "location": {"country": "DE"}, "retention": "zero",
                 "capabilities": ["chat", "completions", "embeddings"]} for e in engines]
    (tmp / "policy.yaml").write_text(POLICY)
    return {
        "server": {"host": "127.0.0.1", "port": 0, **(server or {})},
        "backends": backends,
        "keys": [{"name": "plain", "key": KEY, "tenant": "acme", "team": "search", "labels": {"tier": "gold"}},
                 {"name": "eea", "key": ZR_KEY, "tenant": "eu-corp", "labels": {"residency": "eea"}},
                 {"name": "tight", "key": TIGHT_KEY, "tenant": "smallco", "team": "tight"}],
        "admin": {"key": ADMIN_KEY},
        "policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / "audit.jsonl")},
        "identity": {"sqlite_path": str(tmp / "gw.db")},
        "budgets": {"sqlite_path": str(tmp / "budgets.db")},
        "telemetry": {"scrape_interval_s": 0.2},
        # the dashboard and metrics show the modelled mechanics (predictions, flow control) from the first
        # request: the prior counts as the engines' model (gateway/routing/mode.py)
        "routing": {"model_validity": {"min_observations": 0}},
        "observability": obs,
        "data_dir": str(tmp),
    }


class Stack:
    def __init__(self, gw: Gateway, client: httpx.AsyncClient, fleet: Any) -> None:
        self.gw, self.client, self.fleet = gw, client, fleet

    async def chat(self, content: str, key: str = KEY, headers: dict[str, str] | None = None,
                   **body: Any) -> httpx.Response:
        h = {"authorization": f"Bearer {key}", **(headers or {})}
        return await self.client.post("/v1/chat/completions", headers=h, json={
            "model": "sim-model", "max_tokens": body.pop("max_tokens", 4),
            "messages": [{"role": "user", "content": content}], **body})


async def open_stack(tmp: Path, fleet: Any, exporter: Any = None, server: dict[str, Any] | None = None,
                     **obs: Any) -> AsyncIterator[Stack]:
    cfg = parse_config(yaml.safe_dump(gateway_config(tmp, fleet.manifest()["engines"], server, **obs)), base_dir=tmp)
    gw = Gateway(cfg)
    wire(gw, span_exporter=exporter)
    app = build_app(gw)
    await gw.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            yield Stack(gw, c, fleet)
    finally:
        await gw.close()


@pytest.fixture
async def fleet() -> AsyncIterator[Any]:
    async with start_fleet(2, profiles=["tiny"]) as f:
        yield f
