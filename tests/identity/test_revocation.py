"""Revocation reaches other replicas: two IdentityService instances sharing one store.

Postgres: LISTEN/NOTIFY delivers the change in milliseconds even with a long cache TTL; with notifications
lost (change written behind the service's back, or the listener connection killed) the TTL bounds staleness.
SQLite (single replica + CLI on the same file): the TTL bounds it.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from gateway.errors import GatewayError
from gateway.identity.service import IdentityService

from tests.support.wait import ManualClock

from .conftest import PG_DSN, make_config


async def until_rejected(svc: IdentityService, secret: str, limit_s: float) -> float:
    """Seconds until `svc` rejects the key (polling every 10 ms); fails after limit_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            await svc.authenticate({"authorization": f"Bearer {secret}"}, "r")
        except GatewayError as e:
            assert e.code == "revoked_api_key"
            return time.monotonic() - t0
        await asyncio.sleep(0.01)
    raise AssertionError(f"still accepted after {limit_s}s")


async def two(tmp_path: Path, store: str, schema: str | None, ttl: float) -> tuple[IdentityService, IdentityService]:
    a = IdentityService(make_config(tmp_path, store, schema, cache_ttl_s=ttl))
    b = IdentityService(make_config(tmp_path, store, schema, cache_ttl_s=ttl))
    await a.start()
    await b.start()
    return a, b


async def test_postgres_notify_propagates_revocation_fast(tmp_path: Path, pg_schema: str) -> None:
    a, b = await two(tmp_path, "postgres", pg_schema, ttl=60.0)  # TTL far above the bound: NOTIFY must do it
    try:
        await a.directory.create_tenant("acme")
        k, secret = await a.directory.create_key("acme")
        assert (await b.authenticate({"authorization": f"Bearer {secret}"}, "r")).key_id == k.id  # cached in b
        await a.directory.revoke_key(k.id)
        took = await until_rejected(b, secret, limit_s=2.0)
        assert took < 2.0
        # rotation with zero overlap also propagates (the old key expires right away everywhere)
        k2, s2 = await a.directory.create_key("acme")
        await b.authenticate({"authorization": f"Bearer {s2}"}, "r")
        await a.directory.rotate_key(k2.id, overlap_s=0)
        t0 = time.monotonic()
        while True:
            try:
                await b.authenticate({"authorization": f"Bearer {s2}"}, "r")
            except GatewayError as e:
                assert e.code == "expired_api_key"
                break
            assert time.monotonic() - t0 < 2.0
            await asyncio.sleep(0.01)
        # label edits propagate too
        await a.directory.update_tenant_labels("acme", {"residency": "eea"})
        _, s3 = await a.directory.create_key("acme")
        t0 = time.monotonic()
        while (await b.authenticate({"authorization": f"Bearer {s3}"}, "r")).labels.get("residency") != "eea":
            assert time.monotonic() - t0 < 2.0
            await asyncio.sleep(0.01)
    finally:
        await a.close()
        await b.close()


async def until(check: Any, limit_s: float) -> float:
    """Seconds until the async predicate holds (polling every 10 ms); fails after limit_s."""
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < limit_s, f"not seen within {limit_s}s"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def test_postgres_notify_propagates_edits_and_deletes(tmp_path: Path, pg_schema: str) -> None:
    """Admin PATCH/DELETE (team, project, partner, key) reach a replica holding cached principals in well under
    the 60 s TTL: only the NOTIFY published by the change can do that."""
    a, b = await two(tmp_path, "postgres", pg_schema, ttl=60.0)
    try:
        await a.directory.create_tenant("acme", labels={"residency": "eea"})
        await a.directory.create_team("acme", "search", labels={"tier": "batch"})
        await a.directory.create_project("acme", "search", "ranker", labels={"retention": "30d"})
        await a.directory.create_partner("opper", "acme")
        k, secret = await a.directory.create_key("acme", team="search", project="ranker")
        pk, psecret = await a.directory.create_key("acme", partner="opper")
        h, ph = {"authorization": f"Bearer {secret}"}, {"authorization": f"Bearer {psecret}"}
        assert (await b.authenticate(h, "r")).labels["tier"] == "batch"  # cached in b
        assert (await b.authenticate(ph, "r")).labels == {"residency": "eea"}

        await a.directory.update_team("acme", "search", {"labels": {"tier": "realtime"}})
        assert await until(lambda: _labels_has(b, h, "tier", "realtime"), 2.0) < 2.0
        await a.directory.update_project("acme", "search", "ranker", {"labels": {"retention": "zero"}})
        assert await until(lambda: _labels_has(b, h, "retention", "zero"), 2.0) < 2.0
        await a.directory.update_partner("opper", {"labels": {"residency": "de"}})  # narrower than the tenant's eea
        assert await until(lambda: _labels_has(b, ph, "residency", "de"), 2.0) < 2.0

        async def models_restricted() -> bool:
            return (await b.authenticate(h, "r")).allowed_models == ("qwen*",)

        await a.directory.update_key(k.id, {"models": ["qwen*"]})
        assert await until(models_restricted, 2.0) < 2.0

        # DELETE of a key is revocation; then its project can go, and b forgets the project's labels (what a
        # JWT naming that project would be given)
        await a.directory.revoke_key(k.id)
        assert await until_rejected(b, secret, limit_s=2.0) < 2.0
        assert (await b._hierarchy_labels("acme", "search", "ranker", None))["retention"] == "zero"
        assert await a.directory.delete_project("acme", "search", "ranker")

        async def project_gone() -> bool:
            return "retention" not in await b._hierarchy_labels("acme", "search", "ranker", None)

        assert await until(project_gone, 2.0) < 2.0
    finally:
        await a.close()
        await b.close()


async def _labels_has(svc: IdentityService, headers: dict[str, str], k: str, v: str) -> bool:
    return (await svc.authenticate(headers, "r")).labels.get(k) == v


async def test_postgres_ttl_bounds_staleness_without_notify(tmp_path: Path, pg_schema: str) -> None:
    clock = ManualClock()  # b's clock: its cache ages only when the test moves it
    a = IdentityService(make_config(tmp_path, "postgres", pg_schema, cache_ttl_s=0.5))
    b = IdentityService(make_config(tmp_path, "postgres", pg_schema, cache_ttl_s=0.5), clock=clock)
    await a.start()
    await b.start()
    try:
        await a.directory.create_tenant("acme")
        k, secret = await a.directory.create_key("acme")
        await b.authenticate({"authorization": f"Bearer {secret}"}, "r")  # cached in b until clock + ttl
        conn = await asyncpg.connect(PG_DSN, server_settings={"search_path": pg_schema})
        try:  # revoke behind the services' backs (no NOTIFY is sent), as of b's now
            await conn.execute("UPDATE api_keys SET revoked_at = $1 WHERE id = $2", clock.time(), k.id)
        finally:
            await conn.close()
        clock.advance(0.49)  # inside the TTL: b still answers from its cache, it cannot know
        assert (await b.authenticate({"authorization": f"Bearer {secret}"}, "r")).key_id == k.id
        # Once the TTL has passed, the very next request must be rejected: only the bound itself (the entry
        # cannot outlive its load + ttl).
        clock.advance(0.01)
        with pytest.raises(GatewayError) as e:
            await b.authenticate({"authorization": f"Bearer {secret}"}, "r")
        assert e.value.code == "revoked_api_key"
    finally:
        await a.close()
        await b.close()


async def test_postgres_listener_reconnects_and_flushes(tmp_path: Path, pg_schema: str) -> None:
    a, b = await two(tmp_path, "postgres", pg_schema, ttl=60.0)
    try:
        await a.directory.create_tenant("acme")
        k, secret = await a.directory.create_key("acme")
        await b.authenticate({"authorization": f"Bearer {secret}"}, "r")
        store_b: Any = b.store
        pid = store_b._listen_conn.get_server_pid()
        admin = await asyncpg.connect(PG_DSN)
        try:
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
            # pg_terminate_backend only signals the backend: wait until it is gone, so the NOTIFY below is
            # really lost (under load the old listener could still receive it and make the test vacuous)
            for _ in range(100):
                if not await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"listener backend {pid} still alive 5 s after pg_terminate_backend")
        finally:
            await admin.close()
        await a.directory.revoke_key(k.id)  # this NOTIFY is lost for b (its listener is gone)
        took = await until_rejected(b, secret, limit_s=4.0)  # reconnect (1 s poll) flushes b's cache
        assert took < 4.0
        assert store_b._listen_conn.get_server_pid() != pid
    finally:
        await a.close()
        await b.close()


async def test_sqlite_second_instance_bounded_by_ttl(tmp_path: Path) -> None:
    a, b = await two(tmp_path, "sqlite", None, ttl=0.3)
    try:
        await a.directory.create_tenant("acme")
        k, secret = await a.directory.create_key("acme")
        await b.authenticate({"authorization": f"Bearer {secret}"}, "r")
        await a.directory.revoke_key(k.id)
        took = await until_rejected(b, secret, limit_s=1.0)
        assert took <= 0.3 + 0.15
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("n", [1])
async def test_concurrent_migration_is_safe(tmp_path: Path, pg_schema: str, n: int) -> None:
    svcs = [IdentityService(make_config(tmp_path, "postgres", pg_schema)) for _ in range(3)]
    await asyncio.gather(*(s.start() for s in svcs))
    for s in svcs:
        await s.close()
