"""An identity service with the adapter registry on both stores (SQLite file, a fresh Postgres schema), and an
ASGI client for the admin routes."""
from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, AsyncIterator

import asyncpg
import httpx
import pytest
import yaml
from starlette.applications import Starlette

from gateway.adapters.admin import adapter_routes
from gateway.adapters.service import AdapterService
from gateway.admin_guard import AdminGuard
from gateway.config import Config, parse_config
from gateway.identity.admin import admin_routes
from gateway.identity.service import IdentityService
from tests.identity.conftest import ADMIN_KEY, PG_DSN, require_pg

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def adapter_config(tmp_path: Path, store: str, schema: str | None) -> Config:
    ident: dict[str, Any] = {"store": store, "sqlite_path": str(tmp_path / "identity.db"), "cache_ttl_s": 5.0}
    if store == "postgres":
        ident.update(postgres_dsn=PG_DSN, postgres_schema=schema)
    data = {
        "identity": ident,
        "admin": {"key": ADMIN_KEY},
        "backends": [{"name": "e1", "kind": "openai", "url": "http://127.0.0.1:9/v1",
                      "models": ["base", "static-lora"], "lora_adapters": ["static-lora"]}],
        "aliases": [{"name": "support", "targets": ["base"]}],
    }
    return parse_config(yaml.safe_dump(data), source="test.yaml", base_dir=tmp_path)


@pytest.fixture(params=["sqlite", "postgres"])
async def adapters(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AdapterService]:
    schema = None
    if request.param == "postgres":
        require_pg()
        schema = "t_" + secrets.token_hex(6)
    ident = IdentityService(adapter_config(tmp_path, request.param, schema))
    await ident.start()
    svc = AdapterService(ident)
    await svc.start()
    yield svc
    await ident.close()
    if schema:
        c = await asyncpg.connect(PG_DSN)
        try:
            await c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await c.close()


@pytest.fixture
async def client(adapters: AdapterService) -> AsyncIterator[httpx.AsyncClient]:
    ident = adapters.identity
    guard = AdminGuard(ident.authenticate_admin, lambda: ident.config.server.max_body_bytes)
    app = Starlette(routes=admin_routes(ident, guard) + adapter_routes(adapters, guard))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        yield c
