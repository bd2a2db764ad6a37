"""Postgres going away and coming back (through a TCP forwarder we kill and restart, which drops every
connection like a server restart): requests keep being served, and no ledger or audit row is lost."""
from __future__ import annotations

import asyncio
import sys
import time
import uuid

import asyncpg
import httpx
import pytest

from tests.conftest import require_service
from tests.support.procs import Proc, free_port, start_gateway, start_upstream

PG = "postgresql://postgres@127.0.0.1:5432/test"
KEY = "pg-outage-key-0123456789"
pytestmark = pytest.mark.e2e


async def _pg_ok() -> bool:
    try:
        c = await asyncpg.connect(PG, timeout=3)
        await c.close()
        return True
    except (OSError, asyncpg.PostgresError):
        return False


def _proxy(tmp, port: int) -> Proc:
    p = Proc([sys.executable, "-m", "tests.support.tcpproxy", str(port), "127.0.0.1", "5432"], tmp / f"proxy-{time.time()}.log")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            import socket

            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return p
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("tcp proxy did not start")


async def _rows(table: str, prefix: str) -> set[str]:
    c = await asyncpg.connect(PG)
    try:
        # the client's x-request-id is recorded in its own column (the gateway keys rows by its own id)
        return {r["client_request_id"] for r in await c.fetch(
            f"SELECT client_request_id FROM {table} WHERE client_request_id LIKE $1", prefix + "%")}
    finally:
        await c.close()


async def test_postgres_outage_loses_no_ledger_or_audit_rows(tmp_path):
    require_service(await _pg_ok(), "PostgreSQL on 127.0.0.1:5432")
    up, up_port = start_upstream(tmp_path)
    pport, gport = free_port(), free_port()
    proxy = _proxy(tmp_path, pport)
    dsn = f"postgresql://postgres@127.0.0.1:{pport}/test"
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"""
server: {{host: 127.0.0.1, port: {gport}}}
backends:
  - {{name: up, url: "http://127.0.0.1:{up_port}/v1", models: [m], location: {{country: DE}}, retention: zero}}
keys: [{{key: {KEY}, tenant: t}}]
identity: {{sqlite_path: {tmp_path}/id.db}}
budgets: {{ledger: postgres, ledger_dsn: "{dsn}", spool_path: {tmp_path}/spool.jsonl, ledger_flush_s: 0.1}}
policy: {{audit_path: {tmp_path}/audit.jsonl, audit_postgres_dsn: "{dsn}"}}
""")
    gw, _ = start_gateway(cfg)
    prefix = f"pgout-{uuid.uuid4().hex[:8]}-"
    sent: list[str] = []
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gport}", timeout=10,
                                     headers={"authorization": f"Bearer {KEY}"}) as c:
            async def burst(tag: str) -> None:
                for i in range(10):
                    rid = f"{prefix}{tag}-{i}"
                    r = await c.post("/v1/chat/completions", headers={"x-request-id": rid},
                                     json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                           "max_tokens": 2})
                    assert r.status_code == 200, r.text  # Postgres is never on the request path
                    sent.append(rid)

            await burst("before")
            await asyncio.sleep(0.5)
            proxy.kill()  # Postgres "restarts": every pooled connection drops, new ones are refused
            await burst("during")
            await asyncio.sleep(1.0)
            await burst("during2")
            proxy = _proxy(tmp_path, pport)  # and comes back
            deadline = time.monotonic() + 20
            ledger = audit = set()
            while time.monotonic() < deadline:
                ledger = await _rows("budget_ledger", prefix)
                audit = await _rows("audit_decisions", prefix)
                if ledger >= set(sent) and audit >= set(sent):
                    break
                await asyncio.sleep(0.5)
            assert set(sent) - ledger == set(), "ledger rows lost"
            assert set(sent) - audit == set(), "audit rows lost"
            assert len(sent) == 30
    finally:
        gw.stop()
        proxy.kill()
        up.stop()
        c = await asyncpg.connect(PG)
        try:
            for t in ("budget_ledger", "audit_decisions"):
                await c.execute(f"DELETE FROM {t} WHERE client_request_id LIKE $1", prefix + "%")
        finally:
            await c.close()
