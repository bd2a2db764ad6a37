"""IdentityService against both stores (SQLite and real PostgreSQL): key lifecycle, principals, errors."""
from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from gateway.errors import GatewayError
from gateway.identity.service import IdentityService
from gateway.identity.stage import AuthStage
from gateway.identity.store import SCHEMA_VERSION
from gateway.pipeline import RequestContext

from tests.support.wait import ManualClock

from .conftest import ADMIN_KEY, STATIC_KEY


def bearer(k: str) -> dict[str, str]:
    return {"authorization": f"Bearer {k}"}


async def err(coro: Any) -> GatewayError:
    with pytest.raises(GatewayError) as ei:
        await coro
    return ei.value


async def seed(svc: IdentityService) -> None:
    await svc.directory.create_tenant("acme", labels={"residency": "eea", "tier": "standard"})
    await svc.directory.create_team("acme", "search", labels={"tier": "realtime"})
    await svc.directory.create_project("acme", "search", "ranker", labels={"retention": "zero"})


async def test_migrations_versioned_and_idempotent(service: IdentityService) -> None:
    assert service.store is not None
    assert await service.store.migrate() == SCHEMA_VERSION
    assert await service.store.migrate() == SCHEMA_VERSION


async def test_key_principal_labels_merge_and_headers(service: IdentityService) -> None:
    await seed(service)
    k, secret = await service.directory.create_key("acme", team="search", project="ranker", labels={"owner": "bob"},
                                         scopes=["intern"], models=["qwen*"])
    assert secret.startswith(f"gw_{k.id}_") and k.secret_hash not in secret
    stored = await service.directory.get_key(k.id)
    assert stored is not None and secret.split("_")[2] not in stored.secret_hash
    p = await service.authenticate(bearer(secret), "10.0.0.1")
    assert (p.kind, p.tenant, p.team, p.project, p.key_id) == ("api_key", "acme", "search", "ranker", k.id)
    assert dict(p.labels) == {"residency": "eea", "tier": "realtime", "retention": "zero", "owner": "bob"}
    assert p.scopes == ("intern",) and p.allowed_models == ("qwen*",)
    p2 = await service.authenticate({"x-api-key": secret, "x-end-user-id": "u-9"}, "10.0.0.1")
    assert p2.end_user == "u-9" and p2.id == p.id


async def test_wrong_secret_unknown_id_and_malformed(service: IdentityService) -> None:
    await seed(service)
    k, secret = await service.directory.create_key("acme")
    wrong = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    for tok in [wrong, "gw_" + "0" * 12 + "_" + "a" * 40, "gw_short", "nonsense"]:
        e = await err(service.authenticate(bearer(tok), "10.0.0.2"))
        assert (e.status, e.code) == (401, "invalid_api_key")
        assert tok not in e.message and tok not in str(e.body())
    e = await err(service.authenticate({}, "10.0.0.2"))
    assert (e.status, e.code) == (401, "missing_api_key")


async def test_revoke_expire_and_rotate(config_factory: Any) -> None:
    clock = ManualClock()
    service = IdentityService(config_factory(), clock=clock)
    await service.start()
    try:
        await _revoke_expire_and_rotate(service, clock)
    finally:
        await service.close()


async def _revoke_expire_and_rotate(service: IdentityService, clock: ManualClock) -> None:
    await seed(service)
    k, secret = await service.directory.create_key("acme", team="search")
    await service.authenticate(bearer(secret), "a")
    await service.directory.revoke_key(k.id)
    e = await err(service.authenticate(bearer(secret), "a"))
    assert (e.status, e.code) == (401, "revoked_api_key") and secret not in e.message

    k2, s2 = await service.directory.create_key("acme", expires_at=clock.time() + 0.3)
    await service.authenticate(bearer(s2), "a")
    clock.advance(0.35)
    e = await err(service.authenticate(bearer(s2), "a"))
    assert (e.status, e.code) == (401, "expired_api_key")

    k3, s3 = await service.directory.create_key("acme", team="search", models=["m*"])
    res = await service.directory.rotate_key(k3.id, overlap_s=0.4)
    assert res is not None
    k4, s4 = res
    assert k4.id != k3.id and k4.rotated_from == k3.id and k4.models == ["m*"] and k4.team == "search"
    assert (await service.authenticate(bearer(s3), "a")).key_id == k3.id  # overlap: both work
    assert (await service.authenticate(bearer(s4), "a")).key_id == k4.id
    assert await service.directory.rotate_key(k3.id) is None  # already rotated
    clock.advance(0.45)
    e = await err(service.authenticate(bearer(s3), "a"))
    assert e.code == "expired_api_key"
    assert (await service.authenticate(bearer(s4), "a")).key_id == k4.id
    old = await service.directory.get_key(k3.id)
    assert old is not None and old.rotated_to == k4.id


async def test_static_partner_and_planes(service: IdentityService) -> None:
    p = await service.authenticate(bearer(STATIC_KEY), "b")
    assert (p.kind, p.tenant, p.team, p.labels["tier"]) == ("static_key", "static-co", "ops", "batch")
    await service.directory.create_tenant("opper-t", labels={"residency": "eea"})
    await service.directory.create_partner("opper", "opper-t", labels={"retention": "zero"})
    _, ps = await service.directory.create_key("opper-t", partner="opper")
    pp = await service.authenticate({"authorization": f"Bearer {ps}", "x-end-user-id": "opper-user-1"}, "b")
    assert (pp.kind, pp.partner, pp.end_user) == ("partner", "opper", "opper-user-1")
    assert dict(pp.labels) == {"residency": "eea", "retention": "zero"}
    assert ("partner", "opper") in pp.budget_scopes()
    # admin plane vs data plane
    e = await err(service.authenticate(bearer(ADMIN_KEY), "b"))
    assert (e.status, e.code) == (403, "wrong_plane")
    _, adm = await service.directory.create_key("opper-t", purpose="admin")
    e = await err(service.authenticate(bearer(adm), "b"))
    assert e.status == 403
    ap = await service.authenticate_admin(bearer(adm))
    assert ap.roles == ("tenant_admin",) and ap.tenant == "opper-t"
    assert (await service.authenticate_admin(bearer(ADMIN_KEY))).roles == ("admin",)
    e = await err(service.authenticate_admin(bearer(ps)))
    assert (e.status, e.code) == (403, "admin_required")
    e = await err(service.authenticate_admin(bearer(STATIC_KEY)))
    assert e.status == 403
    e = await err(service.authenticate_admin({}))
    assert e.status == 401
    e = await err(service.authenticate_admin(bearer("wrong-admin")))
    assert e.status == 401


async def test_failed_auth_rate_limited_per_client(config_factory: Any) -> None:
    clock = ManualClock()
    svc = IdentityService(config_factory(auth_fail_limit_per_minute=3), clock=clock)
    await svc.start()
    try:
        await svc.directory.create_tenant("acme")
        _, good = await svc.directory.create_key("acme")
        for _ in range(3):
            assert (await err(svc.authenticate(bearer("bad"), "6.6.6.6"))).status == 401
        e = await err(svc.authenticate(bearer(good), "6.6.6.6"))
        assert (e.status, e.code) == (429, "auth_rate_limited")
        assert int(e.headers["retry-after"]) >= 1 and "retry-after-ms" in e.headers
        assert (await svc.authenticate(bearer(good), "7.7.7.7")).tenant == "acme"
        clock.advance(59.0)  # the admin plane shares the limiter, and the window still holds
        assert (await err(svc.authenticate_admin(bearer(ADMIN_KEY), "6.6.6.6"))).code == "auth_rate_limited"
        clock.advance(1.0)  # the one-minute window is over: the address may try again
        assert (await svc.authenticate(bearer(good), "6.6.6.6")).tenant == "acme"
    finally:
        await svc.close()


async def test_auth_stage_sets_principal_evidence_and_model_limits(service: IdentityService) -> None:
    await seed(service)
    _, secret = await service.directory.create_key("acme", models=["qwen*"])
    stage = AuthStage(service)
    assert stage.name == "authenticate"
    ctx = RequestContext(request_id="r1", endpoint="chat", headers=bearer(secret), body={}, client_addr="c",
                         model="qwen3-8b")
    await stage.run(ctx)
    assert ctx.principal is not None and ctx.evidence["principal"]["tenant"] == "acme"
    assert secret not in repr(ctx.evidence)
    ctx2 = RequestContext(request_id="r2", endpoint="chat", headers=bearer(secret), body={}, client_addr="c",
                          model="kimi-k3")
    e = await err(stage.run(ctx2))
    assert (e.status, e.code) == (403, "model_not_allowed")


async def test_secrets_never_logged(service: IdentityService, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    await seed(service)
    k, secret = await service.directory.create_key("acme")
    await service.authenticate(bearer(secret), "x")
    await service.directory.rotate_key(k.id)
    await service.directory.revoke_key(k.id)
    await err(service.authenticate(bearer(secret), "x"))
    assert k.id in caplog.text
    assert secret not in caplog.text and secret.split("_")[2] not in caplog.text


async def test_cache_revocation_same_process_immediate(service: IdentityService) -> None:
    await seed(service)
    k, secret = await service.directory.create_key("acme")
    await service.authenticate(bearer(secret), "x")  # now cached
    await service.directory.revoke_key(k.id)
    assert (await err(service.authenticate(bearer(secret), "x"))).code == "revoked_api_key"


async def test_validation_and_conflicts(service: IdentityService) -> None:
    await seed(service)
    e = await err(service.directory.create_tenant("acme"))
    assert e.status == 409
    e = await err(service.directory.create_tenant("Bad Id!"))
    assert e.status == 400
    e = await err(service.directory.create_team("nope", "x"))
    assert e.status == 404
    e = await err(service.directory.create_key("acme", team="nope"))
    assert e.status == 404
    e = await err(service.directory.create_key("acme", expires_at=time.time() - 5))
    assert e.status == 400
    e = await err(service.directory.create_key("acme", labels={"a": 1}))  # type: ignore[dict-item]
    assert e.status == 400


async def test_migration_3_keeps_keys_and_lets_parents_go(config_factory: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A store created at schema v2 (api_keys with foreign keys) migrates to v3 with every key intact; after
    it, a tenant/partner whose keys are all revoked can be deleted while the key rows stay as the audit trail."""
    import gateway.identity.store as store_mod

    monkeypatch.setattr(store_mod, "MIGRATIONS", store_mod.MIGRATIONS[:2])
    old = IdentityService(config_factory())
    await old.start()
    try:
        assert old.store is not None and await old.store.migrate() == 2
        await old.directory.create_tenant("acme", labels={"residency": "eea"})
        await old.directory.create_partner("opper", "acme")
        dead, _ = await old.directory.create_key("acme", partner="opper", labels={"owner": "x"}, models=["qwen*"])
        await old.directory.revoke_key(dead.id)
        e = await err(old.directory.delete_partner("opper"))  # v2: the foreign key refuses; answered as 409, not 500
        assert (e.status, e.code) == (409, "resource_in_use")
        live, secret = await old.directory.create_key("acme", expires_at=time.time() + 3600)
        before = await old.directory.list_keys()
    finally:
        await old.close()
    monkeypatch.undo()

    new = IdentityService(config_factory())
    await new.start()
    try:
        assert new.store is not None and await new.store.migrate() == SCHEMA_VERSION >= 3
        assert await new.directory.list_keys() == before
        assert (await new.authenticate(bearer(secret), "c")).key_id == live.id
        assert await new.directory.delete_partner("opper")  # its only key is revoked: a v2 foreign key would refuse this
        assert await new.directory.get_partner("opper") is None
        assert (await err(new.directory.delete_tenant("acme"))).status == 409  # the live key
        await new.directory.revoke_key(live.id)
        assert await new.directory.delete_tenant("acme")
        assert await new.directory.get_tenant("acme") is None
        after = await new.directory.list_keys()
        assert [k.id for k in after] == [k.id for k in before] and all(k.revoked_at for k in after)
        assert (await err(new.authenticate(bearer(secret), "c"))).code == "revoked_api_key"
        assert (await err(new.directory.create_key("acme"))).status == 404
    finally:
        await new.close()
