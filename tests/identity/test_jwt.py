"""JWT bearer tokens signed with keys generated here and served from a local JWKS endpoint."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from gateway.errors import GatewayError
from gateway.identity.service import IdentityService

from tests.support.wait import ManualClock

from .conftest import JwksServer, make_config

ISS = "https://idp.test"
AUD = "gateway"


def rsa_key() -> Any:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def ec_key() -> Any:
    return ec.generate_private_key(ec.SECP256R1())


def jwk_of(priv: Any, kid: str) -> dict[str, Any]:
    if isinstance(priv, rsa.RSAPrivateKey):
        d = json.loads(RSAAlgorithm.to_jwk(priv.public_key()))
        d["alg"] = "RS256"
    else:
        d = json.loads(ECAlgorithm.to_jwk(priv.public_key()))
        d["alg"] = "ES256"
    d.update(kid=kid, use="sig")
    return d


def claims(**over: Any) -> dict[str, Any]:
    now = int(time.time())
    c = {"iss": ISS, "aud": AUD, "sub": "user-1", "exp": now + 300, "iat": now, "tenant": "acme",
         "team": "search", "labels": {"residency": "eea"}, "scope": "chat embed"}
    c.update(over)
    return {k: v for k, v in c.items() if v is not None}


def sign(priv: Any, kid: str | None, **over: Any) -> str:
    alg = "RS256" if isinstance(priv, rsa.RSAPrivateKey) else "ES256"
    headers = {"kid": kid} if kid else {}
    return jwt.encode(claims(**over), priv, algorithm=alg, headers=headers)


def b64(d: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()


@pytest.fixture
def jwt_clock() -> ManualClock:
    """The service's clock: tests move it past `jwks_min_refresh_s` instead of sleeping."""
    return ManualClock()


@pytest.fixture
async def jwt_service(tmp_path: Path, jwks_server: JwksServer, jwt_clock: ManualClock) -> Any:
    cfg = make_config(tmp_path, jwt=[{"issuer": ISS, "jwks_url": jwks_server.url, "audience": AUD,
                                      "leeway_s": 5, "jwks_min_refresh_s": 0.2, "project_claim": "project"}])
    svc = IdentityService(cfg, clock=jwt_clock)
    await svc.start()
    yield svc
    await svc.close()


async def fail(svc: IdentityService, token: str) -> GatewayError:
    with pytest.raises(GatewayError) as ei:
        await svc.authenticate({"authorization": f"Bearer {token}"}, "1.1.1.1")
    e = ei.value
    assert token not in e.message and token not in json.dumps(e.body())
    return e


async def ok(svc: IdentityService, token: str, **headers: str) -> Any:
    return await svc.authenticate({"authorization": f"Bearer {token}", **headers}, "1.1.1.1")


async def test_rs256_and_es256_claims_mapping(jwt_service: IdentityService, jwks_server: JwksServer) -> None:
    r, e = rsa_key(), ec_key()
    jwks_server.jwks = {"keys": [jwk_of(r, "r1"), jwk_of(e, "e1")]}
    await jwt_service.directory.create_tenant("acme", labels={"tier": "standard", "residency": "none"})
    p = await ok(jwt_service, sign(r, "r1"), **{"x-end-user-id": "eu-1"})
    assert (p.kind, p.tenant, p.team, p.id, p.end_user) == ("jwt", "acme", "search", f"jwt:{ISS}|user-1", "eu-1")
    assert dict(p.labels) == {"tier": "standard", "residency": "eea"}  # claim labels override stored tenant labels
    assert p.scopes == ("chat", "embed")
    p2 = await ok(jwt_service, sign(e, "e1", sub="user-2", project="x"))
    assert p2.id.endswith("user-2") and p2.project == "x"


async def test_verified_token_is_cached(jwt_service: IdentityService, jwks_server: JwksServer) -> None:
    r = rsa_key()
    jwks_server.jwks = {"keys": [jwk_of(r, "r1")]}
    tok = sign(r, "r1")
    await ok(jwt_service, tok)
    hits = jwks_server.hits
    jwks_server.jwks = {"keys": []}  # even if the IdP went away, the verified token stays valid until exp
    for _ in range(5):
        await ok(jwt_service, tok)
    assert jwks_server.hits == hits


async def test_key_rotation_and_unknown_kid(jwt_service: IdentityService, jwks_server: JwksServer,
                                            jwt_clock: ManualClock) -> None:
    old, new = rsa_key(), rsa_key()
    jwks_server.jwks = {"keys": [jwk_of(old, "k-old")]}
    await ok(jwt_service, sign(old, "k-old"))
    # IdP rotates: publishes the new key; a token with the new kid triggers a refetch
    jwks_server.jwks = {"keys": [jwk_of(old, "k-old"), jwk_of(new, "k-new")]}
    jwt_clock.advance(0.25)  # past jwks_min_refresh_s
    await ok(jwt_service, sign(new, "k-new"))
    # a kid nobody publishes: one refetch, then 401; repeated tries inside the interval don't refetch
    jwt_clock.advance(0.25)  # past jwks_min_refresh_s
    hits = jwks_server.hits
    e = await fail(jwt_service, sign(new, "k-ghost"))
    assert (e.status, e.code) == (401, "invalid_token") and "unknown" in e.message
    assert jwks_server.hits == hits + 1
    for i in range(5):
        await fail(jwt_service, sign(new, "k-ghost", sub=f"s{i}"))
    assert jwks_server.hits == hits + 1
    # the old key is withdrawn; old-kid tokens still verify from cache of keys until the set is refetched
    jwks_server.jwks = {"keys": [jwk_of(new, "k-new")]}
    jwt_clock.advance(0.25)  # past jwks_min_refresh_s
    await fail(jwt_service, sign(new, "k-ghost2"))  # triggers refetch of the new set
    e = await fail(jwt_service, sign(old, "k-old", sub="fresh"))
    assert e.code == "invalid_token"


async def test_bad_signature(jwt_service: IdentityService, jwks_server: JwksServer) -> None:
    r, other = rsa_key(), rsa_key()
    jwks_server.jwks = {"keys": [jwk_of(r, "r1")]}
    e = await fail(jwt_service, sign(other, "r1"))  # signed by a key that is not r1
    assert (e.status, e.code) == (401, "invalid_token") and "signature" in e.message
    good = sign(r, "r1")
    h, p, s = good.split(".")
    tampered = f"{h}.{b64(claims(tenant='evil'))}.{s}"
    assert (await fail(jwt_service, tampered)).code == "invalid_token"


async def test_expired_with_leeway(jwt_service: IdentityService, jwks_server: JwksServer) -> None:
    r = rsa_key()
    jwks_server.jwks = {"keys": [jwk_of(r, "r1")]}
    now = int(time.time())
    await ok(jwt_service, sign(r, "r1", exp=now - 2))  # within 5 s leeway
    e = await fail(jwt_service, sign(r, "r1", exp=now - 60))
    assert (e.status, e.code) == (401, "expired_token")
    e = await fail(jwt_service, sign(r, "r1", exp=None))
    assert e.code == "invalid_token" and "exp" in e.message


async def test_wrong_issuer_and_audience(jwt_service: IdentityService, jwks_server: JwksServer) -> None:
    r = rsa_key()
    jwks_server.jwks = {"keys": [jwk_of(r, "r1")]}
    e = await fail(jwt_service, sign(r, "r1", iss="https://evil.test"))
    assert (e.status, e.code) == (401, "invalid_token") and "issuer" in e.message
    e = await fail(jwt_service, sign(r, "r1", aud="someone-else"))
    assert (e.status, e.code) == (401, "invalid_token") and "audience" in e.message
    e = await fail(jwt_service, sign(r, "r1", aud=None))
    assert e.status == 401


async def test_alg_none_and_hs256_confusion(jwt_service: IdentityService, jwks_server: JwksServer) -> None:
    r = rsa_key()
    jwks_server.jwks = {"keys": [jwk_of(r, "r1")]}
    none_tok = f"{b64({'alg': 'none', 'typ': 'JWT', 'kid': 'r1'})}.{b64(claims())}."
    e = await fail(jwt_service, none_tok)
    assert (e.status, e.code) == (401, "invalid_token") and "algorithm" in e.message
    # HS256 "signed" with the public key material: the classic algorithm-confusion attack
    from cryptography.hazmat.primitives import serialization

    pem = r.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    signing_input = f"{b64({'alg': 'HS256', 'typ': 'JWT', 'kid': 'r1'})}.{b64(claims())}"
    mac = hmac.new(pem, signing_input.encode(), hashlib.sha256).digest()
    hs = signing_input + "." + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
    e = await fail(jwt_service, hs)
    assert e.code == "invalid_token" and "algorithm" in e.message
    # ES256 header over an RSA kid
    ek = ec_key()
    es = jwt.encode(claims(), ek, algorithm="ES256", headers={"kid": "r1"})
    assert (await fail(jwt_service, es)).code == "invalid_token"


async def test_missing_tenant_and_garbage(jwt_service: IdentityService, jwks_server: JwksServer) -> None:
    r = rsa_key()
    jwks_server.jwks = {"keys": [jwk_of(r, "r1")]}
    e = await fail(jwt_service, sign(r, "r1", tenant=None))
    assert e.code == "invalid_token" and "tenant" in e.message
    assert (await fail(jwt_service, "a.b.c")).code == "invalid_token"
