"""The cache wired like `gateway serve`, in front of a simulated engine: a hit is answered without dispatch
(no backend, no budget reservation) with the original usage; a streamed hit is a replayed SSE stream; the audit
record names the entry and the request that created it; DELETE /admin/cache and a reload purge."""
from __future__ import annotations

from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import orjson
import pytest
import yaml

from backends.sim.fleet import start_fleet
from gateway.app import Gateway, build_app
from gateway.config import load_config
from gateway.wiring import wire
from tests.cache.conftest import REDIS_URL, redis_clean, redis_up
from tests.conftest import require_service

KEY = "cache-test-key-0123456789"
ZR_KEY = "cache-zr-key-0123456789"
ADMIN_KEY = "cache-admin-key-0123456789"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
POLICY = """
version: 1
defaults: {allow: true}
rules:
  - id: acme-cache
    match: {tenant: acme}
    set: {cache: {mode: semantic, ttl_s: 600, similarity: 0.9}}
  - id: zr-tenant
    match: {tenant: zr}
    require: {retention: zero}
    set: {cache: {mode: exact}}
"""


def store_config(kind: str, tmp_path: Path, redis_prefix: str) -> dict:
    if kind == "sqlite":
        return {"store": "sqlite", "sqlite_path": str(tmp_path / "cache.db")}
    if kind == "redis":
        require_service(redis_up(), "Redis at 127.0.0.1:6379")
        return {"store": "redis", "redis_url": REDIS_URL, "redis_key_prefix": redis_prefix}
    return {}


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def stack(request, tmp_path: Path, redis_prefix: str) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient, Path]]:
    extra = store_config(request.param, tmp_path, redis_prefix)
    async with start_fleet(1, profiles=["tiny"]) as fleet:
        (tmp_path / "policy.yaml").write_text(POLICY)
        e = fleet.manifest()["engines"][0]
        cfg = {"server": {"host": "127.0.0.1", "port": 0},
               "backends": [{"name": "sim0", "url": e["url"], "kind": "vllm", "models": ["sim-model"],
                             "location": {"country": "DE"}, "retention": "zero"}],
               "keys": [{"name": "a", "key": KEY, "tenant": "acme"}, {"name": "z", "key": ZR_KEY, "tenant": "zr"}],
               "admin": {"key": ADMIN_KEY},
               "cache": {"location": {"country": "DE"}, "max_temperature": 1.0, **extra},
               "policy": {"files": [str(tmp_path / "policy.yaml")], "audit_path": str(tmp_path / "audit.jsonl")},
               "identity": {"sqlite_path": str(tmp_path / "gw.db")},
               "budgets": {"sqlite_path": str(tmp_path / "budgets.db")},
               "data_dir": str(tmp_path)}
        path = tmp_path / "gw.yaml"
        path.write_text(yaml.safe_dump(cfg))
        gw = Gateway(load_config(path))
        wire(gw)
        app = build_app(gw)
        await gw.start()
        assert gw.cache.store.name == request.param
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
                yield gw, c, tmp_path
        finally:
            await gw.close()
            if request.param == "redis":
                await redis_clean(redis_prefix)


async def chat(c: httpx.AsyncClient, content: str, key: str = KEY, **body: Any) -> httpx.Response:
    return await c.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                        json={"model": "sim-model", "max_tokens": 8,
                              "messages": [{"role": "user", "content": content}], **body})


async def record(c: httpx.AsyncClient, r: httpx.Response) -> dict:
    rid = r.headers.get("x-gateway-request-id") or r.headers["x-request-id"]
    return (await c.get(f"/admin/decisions/{rid}", headers=ADMIN)).json()


async def test_json_hit_is_answered_without_dispatch(stack) -> None:
    gw, c, _ = stack
    q = "How do I rotate the API key of the Orion project?"
    first = await chat(c, q)
    assert first.status_code == 200 and first.headers["x-gateway-cache"] == "miss"
    hit = await chat(c, q)
    assert hit.status_code == 200 and hit.headers["x-gateway-cache"] == "hit"
    assert hit.json()["choices"] == first.json()["choices"]
    assert hit.json()["usage"] == first.json()["usage"]
    rec = await record(c, hit)
    ev = rec["evidence"]["cache"]
    assert ev["result"] == "hit" and ev["created_by"] == (await record(c, first))["request_id"]
    assert rec["backend"] is None and rec["budget"] is None  # no engine, no reservation
    assert rec["usage"]["completion_tokens"] == first.json()["usage"]["completion_tokens"]
    para = await chat(c, "please, how do I rotate the API key of the Orion project")
    assert para.headers["x-gateway-cache"] == "hit" and "x-gateway-cache-similarity" in para.headers
    near = await chat(c, "How do I rotate the API key of the Atlas project?")
    assert near.headers["x-gateway-cache"] == "miss"
    metrics = (await c.get("/metrics")).text
    assert 'gateway_cache_lookups_total{result="hit",tier="exact"}' in metrics


async def test_stream_hit_is_a_replayed_sse_stream(stack) -> None:
    gw, c, _ = stack
    q = "Stream the Orion onboarding steps"
    first = await chat(c, q, stream=True, stream_options={"include_usage": True})
    assert first.headers["x-gateway-cache"] == "miss"
    hit = await chat(c, q, stream=True, stream_options={"include_usage": True})
    assert hit.headers["x-gateway-cache"] == "hit"
    assert hit.headers["content-type"].startswith("text/event-stream")

    def text(r: httpx.Response) -> tuple[str, dict | None]:
        out, usage = "", None
        for line in r.text.split("\n"):
            if line.startswith("data: {"):
                ev = orjson.loads(line[6:])
                usage = ev.get("usage") or usage
                for ch in ev["choices"]:
                    out += ch["delta"].get("content") or ""
        return out, usage

    assert text(hit) == text(first) and hit.text.rstrip().endswith("data: [DONE]")
    as_json = await chat(c, q)  # the same question without streaming is served the same answer as JSON
    assert as_json.headers["x-gateway-cache"] == "hit"
    assert as_json.json()["choices"][0]["message"]["content"] == text(first)[0]


async def test_zero_retention_tenant_is_bypassed_and_leaves_nothing(stack) -> None:
    gw, c, tmp_path = stack
    canary = "ZR-CANARY-9f3a"
    for _ in range(2):
        r = await chat(c, canary, key=ZR_KEY)
        assert r.status_code == 200 and r.headers["x-gateway-cache"] == "bypass"
    assert canary.encode() not in await gw.cache.store.dump()
    assert all(e.tenant != "zr" for e in await gw.cache.store.all_entries())
    db = tmp_path / "cache.db"
    for p in (db, Path(str(db) + "-wal")):  # the SQLite store's files themselves
        assert not p.exists() or canary.encode() not in p.read_bytes()


async def test_admin_delete_and_reload_purge(stack) -> None:
    gw, c, _ = stack
    await chat(c, "purge me")
    assert (await chat(c, "purge me")).headers["x-gateway-cache"] == "hit"
    r = await c.delete("/admin/cache", params={"tenant": "acme"}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["deleted"] >= 1
    assert (await chat(c, "purge me")).headers["x-gateway-cache"] == "miss"
    assert (await chat(c, "purge me")).headers["x-gateway-cache"] == "hit"
    r = await c.delete("/admin/cache", headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code in (401, 403) and "error" in r.json()
    await gw.reload()
    assert await gw.cache.store.count() == 0
    assert (await chat(c, "purge me")).headers["x-gateway-cache"] == "miss"


@pytest.mark.parametrize("stack", ["memory"], indirect=True)  # one switch is enough: memory -> sqlite
async def test_reload_that_changes_the_store_opens_the_new_one(stack) -> None:
    gw, c, tmp_path = stack
    await chat(c, "switch me")
    path = tmp_path / "gw.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["cache"].update({"store": "sqlite", "sqlite_path": str(tmp_path / "switched.db")})
    path.write_text(yaml.safe_dump(cfg))
    await gw.reload()
    assert gw.cache.store.name == "sqlite" and gw.cache.stage.store is gw.cache.store
    assert (await chat(c, "switch me")).headers["x-gateway-cache"] == "miss"
    assert (await chat(c, "switch me")).headers["x-gateway-cache"] == "hit"
    assert (tmp_path / "switched.db").exists()
    cfg["cache"]["store"] = "nonsense"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(Exception, match="cache.store"):
        await gw.reload()
    assert gw.cache.store.name == "sqlite"
