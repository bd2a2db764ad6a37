"""Fixtures for the identity tests: configs for both stores, a fresh Postgres schema per test, a local JWKS server."""
from __future__ import annotations

import json
import os
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import asyncpg
import pytest
import yaml

from gateway.config import Config, parse_config
from gateway.identity.service import IdentityService
from tests.conftest import require_service

PG_DSN = os.environ.get("GATEWAY_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
ADMIN_KEY = "admin-" + "x" * 32
STATIC_KEY = "sk-static-" + "y" * 24


def _pg_available() -> bool:
    """TCP probe (works inside a running event loop); a refused/closed port means no server."""
    import socket

    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=2):
            return True
    except OSError:
        return False


_PG: bool | None = None


def require_pg() -> None:
    """Skip without Postgres locally; fail under CI=true (the suite must run against the real server)."""
    global _PG
    if _PG is None:
        _PG = _pg_available()
    require_service(_PG, f"PostgreSQL at {PG_DSN}")


def make_config(tmp_path: Path, store: str = "sqlite", schema: str | None = None, **identity: Any) -> Config:
    ident: dict[str, Any] = {"store": store, "sqlite_path": str(tmp_path / "identity.db"), "cache_ttl_s": 5.0}
    if store == "postgres":
        ident.update(postgres_dsn=PG_DSN, postgres_schema=schema)
    ident.update(identity)
    data = {
        "identity": ident,
        "admin": {"key": ADMIN_KEY},
        "keys": [{"key": STATIC_KEY, "tenant": "static-co", "team": "ops", "name": "ops",
                  "labels": {"tier": "batch"}, "models": ["qwen*"]}],
    }
    return parse_config(yaml.safe_dump(data), source="test.yaml", base_dir=tmp_path)


@pytest.fixture
async def pg_schema() -> AsyncIterator[str]:
    require_pg()
    schema = "t_" + secrets.token_hex(6)
    yield schema
    c = await asyncpg.connect(PG_DSN)
    try:
        await c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await c.close()


@pytest.fixture(params=["sqlite", "postgres"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def config_factory(store_kind: str, tmp_path: Path) -> AsyncIterator[Any]:
    """Builds configs that share one store (same SQLite file or same Postgres schema)."""
    schema = None
    if store_kind == "postgres":
        require_pg()
        schema = "t_" + secrets.token_hex(6)

    def factory(**identity: Any) -> Config:
        return make_config(tmp_path, store_kind, schema, **identity)

    yield factory
    if schema:
        c = await asyncpg.connect(PG_DSN)
        try:
            await c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await c.close()


@pytest.fixture
async def service(config_factory: Any) -> AsyncIterator[IdentityService]:
    svc = IdentityService(config_factory())
    await svc.start()
    yield svc
    await svc.close()


class JwksServer:
    """A real local HTTP server serving a JWKS document the test can change (key rotation)."""

    def __init__(self) -> None:
        self.jwks: dict[str, Any] = {"keys": []}
        self.hits = 0
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                outer.hits += 1
                body = json.dumps(outer.jwks).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/.well-known/jwks.json"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def jwks_server() -> Iterator[JwksServer]:
    s = JwksServer()
    yield s
    s.close()
