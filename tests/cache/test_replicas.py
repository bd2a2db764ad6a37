"""Two `python -m gateway serve` replicas sharing one Redis store: an answer replica 1 stored is a hit on
replica 2 (exact and semantic), never for another tenant; DELETE /admin/cache on one replica purges for both.
Redis at 127.0.0.1:6379 under a fresh key prefix (removed after); missing: skip locally, FAIL under CI=true."""
from __future__ import annotations

import asyncio

import httpx
import pytest
import yaml

from tests.cache.conftest import REDIS_URL, redis_clean
from tests.support.procs import free_port, start_gateway, start_upstream

pytestmark = pytest.mark.e2e
KEY_A = "cache-rep-acme-0123456789"
KEY_B = "cache-rep-beta-0123456789"
ADMIN_KEY = "cache-rep-admin-0123456789"


@pytest.fixture
def replicas(tmp_path, redis_url, redis_prefix):
    up, up_port = start_upstream(tmp_path)
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump({"version": 1, "rules": [
        {"id": "cache-all", "match": {"tenant": ["acme", "beta"]},
         "set": {"cache": {"mode": "semantic", "ttl_s": 600, "similarity": 0.9}}}]}))
    procs, bases = [], []
    try:
        for i in (1, 2):
            port = free_port()
            d = tmp_path / f"r{i}"
            d.mkdir()
            cfg = {"server": {"host": "127.0.0.1", "port": port},
                   "backends": [{"name": "up", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1",
                                 "models": ["m"], "location": {"country": "DE"}}],
                   "keys": [{"key": KEY_A, "tenant": "acme", "name": "a"},
                            {"key": KEY_B, "tenant": "beta", "name": "b"}],
                   "admin": {"key": ADMIN_KEY},
                   "cache": {"store": "redis", "redis_url": redis_url, "redis_key_prefix": redis_prefix,
                             "location": {"country": "DE"}},
                   "policy": {"files": [str(tmp_path / "policy.yaml")], "audit_path": str(d / "audit.jsonl")},
                   "identity": {"sqlite_path": str(d / "id.db")},
                   "budgets": {"sqlite_path": str(d / "budgets.db")},
                   "data_dir": str(d)}
            (d / "gw.yaml").write_text(yaml.safe_dump(cfg))
            g, _ = start_gateway(d / "gw.yaml")
            procs.append(g)
            bases.append(f"http://127.0.0.1:{port}")
        yield bases, up_port
    finally:
        for g in procs:
            g.stop()
        up.stop()
        asyncio.run(redis_clean(redis_prefix))


def chat(base: str, key: str, content: str) -> httpx.Response:
    r = httpx.post(f"{base}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=30,
                   json={"model": "m", "max_tokens": 6, "temperature": 0,
                         "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r


def upstream_requests(port: int) -> int:
    return httpx.get(f"http://127.0.0.1:{port}/stats").json()["requests"]


def test_a_hit_on_replica_2_for_what_replica_1_stored_never_across_tenants(replicas):
    (r1, r2), up = replicas
    q = "How do I rotate the API key of the Orion project?"
    before = upstream_requests(up)
    first = chat(r1, KEY_A, q)
    assert first.headers["x-gateway-cache"] == "miss"
    hit = chat(r2, KEY_A, q)
    assert hit.headers["x-gateway-cache"] == "hit"
    assert hit.json()["choices"] == first.json()["choices"] and hit.json()["usage"] == first.json()["usage"]
    para = chat(r2, KEY_A, "please, how do I rotate the API key of the Orion project")
    assert para.headers["x-gateway-cache"] == "hit" and float(para.headers["x-gateway-cache-similarity"]) >= 0.9
    assert upstream_requests(up) == before + 1  # both hits were answered by replica 2 from the shared store
    assert chat(r2, KEY_B, q).headers["x-gateway-cache"] == "miss"  # another tenant is never served acme's entry
    assert chat(r1, KEY_B, q).headers["x-gateway-cache"] == "hit"  # beta's own entry, stored by replica 2
    assert upstream_requests(up) == before + 2
    # a purge on replica 2 is a purge for replica 1
    d = httpx.delete(f"{r2}/admin/cache", params={"tenant": "acme"},
                     headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert d.status_code == 200 and d.json()["deleted"] == 1
    assert chat(r1, KEY_A, q).headers["x-gateway-cache"] == "miss"
    assert chat(r1, KEY_B, q).headers["x-gateway-cache"] == "hit"


def test_replicas_share_one_namespace(replicas, redis_prefix):
    """Same backends, aliases, policy and cache location on both replicas (other ports, paths, audit files):
    their entries live under one namespace of the prefix."""
    (r1, r2), _ = replicas
    chat(r1, KEY_A, "namespace probe one")
    chat(r2, KEY_A, "namespace probe two")
    import redis

    c = redis.Redis.from_url(REDIS_URL)
    try:
        names = [k.decode() for k in c.scan_iter(match=f"{redis_prefix}:*:e:*")]
    finally:
        c.close()
    assert len(names) == 2 and len({n.split(":")[2] for n in names}) == 1
