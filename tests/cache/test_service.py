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


async def test_tenant_admin_purges_only_its_own_tenant():
    stage, store, _ = make_stage()
    for t in ("a", "b"):
        await serve(stage, make_ctx(user("q"), tenant=t, mode="exact"), t)
    svc = _svc(store)
    b_admin = SimpleNamespace(roles=("tenant_admin",), tenant="b")
    with pytest.raises(GatewayError) as ei:
        await svc.admin_delete(_req(tenant="a"), b_admin)
    assert ei.value.status == 403 and len(store) == 2
    r = await svc.admin_delete(_req(), b_admin)
    assert b'"deleted":1' in r.body and [e.tenant for e in store.entries()] == ["a"]
    r = await svc.admin_delete(_req(tenant="a"), SimpleNamespace(roles=("admin",), tenant=None))
    assert b'"deleted":1' in r.body and len(store) == 0


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
