"""A gateway wired like `gateway serve`, in process, in front of an in-process simulated engine, for the batch
tests that need the API, the admin plane and the lane together: `async with lane(tmp_path) as s: ...`."""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import yaml

from backends.sim.fleet import start_fleet
from gateway.app import Gateway, build_app
from gateway.config import load_config
from gateway.wiring import wire

ADMIN_KEY = "batch-inproc-admin-0123456789"
KEYS = {"alpha": "batch-inproc-alpha-0123456789", "beta": "batch-inproc-beta-0123456789",
        "gamma": "batch-inproc-gamma-0123456789", "delta": "batch-inproc-delta-0123456789"}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def line(i: int, body: dict[str, Any] | None = None, url: str = "/v1/chat/completions") -> bytes:
    b = body if body is not None else {"model": "sim-model", "max_tokens": 2,
                                       "messages": [{"role": "user", "content": f"question {i}"}]}
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": b}).encode()


def jsonl(n: int) -> bytes:
    return b"\n".join(line(i) for i in range(n)) + b"\n"


@dataclass
class Lane:
    gw: Gateway
    client: httpx.AsyncClient
    tmp: Path
    config: Path

    @property
    def svc(self) -> Any:
        return self.gw.batch

    async def upload(self, tenant: str, data: bytes, filename: str = "in.jsonl") -> httpx.Response:
        return await self.client.post("/v1/files", headers=auth(KEYS[tenant]), data={"purpose": "batch"},
                                      files={"file": (filename, data, "application/jsonl")})

    async def create(self, tenant: str, file_id: str) -> httpx.Response:
        return await self.client.post("/v1/batches", headers=auth(KEYS[tenant]), json={
            "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"})

    async def batch(self, tenant: str, n: int = 2) -> dict[str, Any]:
        f = await self.upload(tenant, jsonl(n))
        assert f.status_code == 200, f.text
        b = await self.create(tenant, f.json()["id"])
        assert b.status_code == 200, b.text
        return b.json()

    async def get(self, tenant: str, bid: str) -> dict[str, Any]:
        r = await self.client.get(f"/v1/batches/{bid}", headers=auth(KEYS[tenant]))
        assert r.status_code == 200, r.text
        return r.json()

    async def wait(self, tenant: str, bid: str, done: tuple[str, ...] = ("completed", "failed", "expired",
                                                                          "cancelled"), polls: int = 600) -> dict:
        """Poll until the batch is in one of `done` (a bound on polls, not a timing claim)."""
        for _ in range(polls):
            b = await self.get(tenant, bid)
            if b["status"] in done:
                return b
            await asyncio.sleep(0.05)
        raise AssertionError(f"batch {bid} still {b['status']}")


def config(tmp: Path, engine: dict[str, Any] | None, batch: dict[str, Any] | None = None,
           keys: list[dict[str, Any]] | None = None) -> Path:
    backends = [{"name": "sim0", "url": engine["url"] if engine else "http://127.0.0.1:9/v1", "kind": "vllm",
                 "models": ["sim-model"], "location": {"country": "DE"}, "retention": "zero"}]
    cfg = {"server": {"host": "127.0.0.1", "port": 0}, "backends": backends,
           "keys": [{"name": t, "key": k, "tenant": t} for t, k in KEYS.items()] + (keys or []),
           "admin": {"key": ADMIN_KEY},
           "identity": {"sqlite_path": str(tmp / "gw.db"), "auth_fail_limit_per_minute": 100000},
           "policy": {"audit_path": str(tmp / "audit.jsonl")},
           "budgets": {"sqlite_path": str(tmp / "budgets.db")},
           "observability": {"log_level": "warning"},
           "batch": {"lease_s": 2.0, "tick_s": 0.02, **(batch or {})},
           "data_dir": str(tmp)}
    path = tmp / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@contextlib.asynccontextmanager
async def gateway(path: Path, tmp: Path) -> AsyncIterator[Lane]:
    gw = Gateway(load_config(path))
    wire(gw)
    app = build_app(gw)
    await gw.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                     timeout=60) as c:
            yield Lane(gw, c, tmp, path)
    finally:
        await gw.close()


@contextlib.asynccontextmanager
async def lane(tmp: Path, batch: dict[str, Any] | None = None, engine: bool = True) -> AsyncIterator[Lane]:
    """The gateway (SQLite stores under `tmp`) in front of one in-process sim engine (none: `engine=False`)."""
    if not engine:
        async with gateway(config(tmp, None, batch), tmp) as s:
            yield s
        return
    async with start_fleet(1, profiles=["tiny"]) as fleet:
        async with gateway(config(tmp, fleet.manifest()["engines"][0], batch), tmp) as s:
            yield s
