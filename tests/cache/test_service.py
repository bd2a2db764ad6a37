"""The cache service's edges: the admin purge is scoped to a tenant admin's own tenant; the backend embedder
only ever asks a backend the request's residency allows, and its failure is a miss."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.cache.embed import BackendEmbedder
from gateway.errors import GatewayError
from gateway.types import Decision
from tests.cache.helpers import make_ctx, make_stage, serve, user

pytestmark = pytest.mark.asyncio


def _svc(store):
    from gateway.cache.service import CacheService

    svc = CacheService.__new__(CacheService)
    svc.store = store
    return svc


def _req(**q):
    return SimpleNamespace(query_params=q)


async def test_tenant_admin_purges_only_its_own_tenant(stores):
    stage, store, _ = make_stage(stores=stores)
    for t in ("a", "b"):
        await serve(stage, make_ctx(user("q"), tenant=t, mode="exact"), t)
    svc = _svc(store)
    b_admin = SimpleNamespace(roles=("tenant_admin",), tenant="b")
    with pytest.raises(GatewayError) as ei:
        await svc.admin_delete(_req(tenant="a"), b_admin)
    assert ei.value.status == 403 and await store.count() == 2
    r = await svc.admin_delete(_req(), b_admin)
    assert b'"deleted":1' in r.body and [e.tenant for e in await store.all_entries()] == ["a"]
    r = await svc.admin_delete(_req(tenant="a"), SimpleNamespace(roles=("admin",), tenant=None))
    assert b'"deleted":1' in r.body and await store.count() == 0


def _backend(name, country):
    return SimpleNamespace(name=name, models=["emb"], url="http://127.0.0.1:9/v1", location=SimpleNamespace(
        country=country, storage=country, region=None), retention="none", operator=None)


async def test_backend_embedder_respects_residency_and_fails_as_a_miss():
    cfg = SimpleNamespace(raw=SimpleNamespace(backends=[_backend("us", "US"), _backend("de", "DE")]))
    emb = BackendEmbedder("emb", lambda: cfg, lambda: SimpleNamespace(auth=lambda n: None), 0.5)
    ctx = make_ctx(user("q"))
    ctx.decision = Decision(allowed_countries=frozenset({"DE", "FR"}))
    assert emb._backend(ctx).name == "de"
    ctx.decision = Decision(allowed_countries=frozenset({"JP"}))
    assert emb._backend(ctx) is None and await emb.embed(ctx, "x") is None
    ctx.decision = Decision(allowed_countries=frozenset({"DE"}))
    assert await emb.embed(ctx, "x") is None  # nothing listens on port 9: a miss, not an error


@pytest.mark.parametrize("cache, why", [
    ({"store": "postgres"}, "cache.store"),
    ({"store": "redis"}, "redis_url"),
    ({"store": "redis", "redis_url": "http://x"}, "redis_url"),
    ({"store": "sqlite", "max_entries": 0}, "max_entries"),
    ({"store": "redis", "redis_url": "redis://x", "redis_key_prefix": "p:"}, "redis_key_prefix"),
])
async def test_bad_store_settings_are_refused(cache, why):
    from gateway.cache.config import CacheConfig
    from gateway.cache.service import check_store
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match=why):
        check_store(CacheConfig(**cache))


async def test_store_is_built_from_config(tmp_path):
    import yaml

    from gateway.cache.service import build_store, namespace
    from gateway.config import parse_config

    def cfg(**cache):
        return parse_config(yaml.safe_dump({"cache": cache, "data_dir": "var"}), "t.yaml", base_dir=tmp_path)

    assert build_store(cfg()).name == "memory"
    s = build_store(cfg(store="sqlite"))
    assert s.name == "sqlite" and s.path == tmp_path / "var" / "cache.db"
    r = build_store(cfg(store="redis", redis_url="redis://127.0.0.1:6379/0", location={"country": "DE"}))
    assert r.name == "redis" and r.location.country == "DE"
    await r.close()
    assert namespace(cfg(store="sqlite")) == namespace(cfg(store="redis", redis_url="redis://h:1/0"))
    assert namespace(cfg()) != namespace(cfg(location={"country": "DE"}))
