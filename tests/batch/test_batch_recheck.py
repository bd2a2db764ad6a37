"""IdentityService.recheck: a batch job's owner re-checked per line without its credential, and the
authenticate stage using it only for in-process batch lines (a client's request cannot reach it)."""
from __future__ import annotations

import dataclasses
import time

import pytest
import yaml

from gateway.config import parse_config
from gateway.errors import GatewayError
from gateway.identity.service import IdentityService
from gateway.identity.stage import AuthStage
from gateway.pipeline import RequestContext, RequestHeaders
from gateway.types import Principal


def _cfg(tmp_path, static: bool = True):
    data = {"identity": {"sqlite_path": str(tmp_path / "id.db"), "cache_ttl_s": 60.0},
            "keys": [{"key": "static-key-0123456789", "tenant": "st", "name": "ops"}] if static else []}
    return parse_config(yaml.safe_dump(data), base_dir=tmp_path)


async def test_recheck_follows_revocation_expiry_and_config(tmp_path):
    svc = IdentityService(_cfg(tmp_path))
    await svc.start()
    try:
        await svc.directory.create_tenant("acme")
        k, secret = await svc.directory.create_key("acme", labels={"tier": "gold"})
        p = await svc.authenticate({"authorization": f"Bearer {secret}"}, "c")
        assert (await svc.recheck(p)).labels["tier"] == "gold"
        await svc.directory.update_key(k.id, {"labels": {"tier": "silver"}})
        assert (await svc.recheck(p)).labels["tier"] == "silver"  # labels re-read, not the snapshot
        await svc.directory.revoke_key(k.id)
        with pytest.raises(GatewayError) as e:
            await svc.recheck(p)
        assert e.value.status == 401 and e.value.code == "revoked_api_key"
        adm, _ = await svc.directory.create_key("acme", purpose="admin")
        with pytest.raises(GatewayError) as e:
            await svc.recheck(Principal(id=f"key:{adm.id}", kind="api_key", tenant="acme", key_id=adm.id))
        assert e.value.status == 403
        sp = await svc.authenticate({"authorization": "Bearer static-key-0123456789"}, "c")
        assert await svc.recheck(sp) == sp
        jwt_p = Principal(id="jwt:iss|sub", kind="jwt", tenant="acme")
        assert await svc.recheck(jwt_p, time.time() + 60) == jwt_p
        with pytest.raises(GatewayError) as e:
            await svc.recheck(jwt_p, time.time() - 1)
        assert e.value.code == "expired_api_key"
        svc.swap_config(_cfg(tmp_path, static=False))  # the static key left the config
        with pytest.raises(GatewayError) as e:
            await svc.recheck(sp)
        assert e.value.status == 401
    finally:
        await svc.close()


async def test_the_stage_trusts_a_preset_principal_only_for_batch_lines(tmp_path):
    svc = IdentityService(_cfg(tmp_path))
    await svc.start()
    try:
        stage = AuthStage(svc)
        forged = Principal(id="key:nope", kind="api_key", tenant="victim", key_id="nope")
        ctx = RequestContext(request_id="r1", endpoint="chat", headers=RequestHeaders(), body={})
        ctx.principal = forged  # without ctx.batch the credential is required as always
        with pytest.raises(GatewayError) as e:
            await stage.run(ctx)
        assert e.value.code == "missing_api_key"
        ctx = dataclasses.replace(ctx, batch={"batch_id": "b", "line": 1, "custom_id": "c"})
        with pytest.raises(GatewayError) as e:  # a batch line's owner must still exist
            await stage.run(ctx)
        assert e.value.status == 401
    finally:
        await svc.close()
