"""JWT/OIDC bearer verification against per-issuer JWKS (RS256 and ES256 only).

The JWKS is fetched with httpx and cached for `jwks_cache_s`; a token whose `kid` is unknown triggers one
refetch (at most once per `jwks_min_refresh_s` per issuer, single-flight), so signing-key rotation works
without a restart and unknown kids cannot be used to hammer the IdP. A failed refetch keeps the last good
set. `alg: none`, HS* and any algorithm not configured for the issuer are refused before any key lookup.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import jwt
from jwt import PyJWK

from gateway.errors import GatewayError
from gateway.identity.clock import Clock
from gateway.identity.config import JWTIssuerConfig

log = logging.getLogger("gateway.identity.jwt")
SUPPORTED_ALGS = frozenset({"RS256", "ES256"})


def token_error(message: str, code: str = "invalid_token") -> GatewayError:
    return GatewayError(401, message, code=code, headers={"www-authenticate": 'Bearer error="invalid_token"'})


@dataclass
class _Jwks:
    keys: dict[str, PyJWK] = field(default_factory=dict)
    fetched_at: float = -1e18
    last_attempt: float = -1e18
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class JwksCache:
    """Signing keys of one issuer, by kid."""

    def __init__(self, cfg: JWTIssuerConfig, client: httpx.AsyncClient, clock: Clock = time) -> None:
        self.cfg = cfg
        self.client = client
        self.clock = clock
        self.state = _Jwks()
        self.fetches = 0

    async def _fetch(self) -> None:
        st = self.state
        st.last_attempt = self.clock.monotonic()
        self.fetches += 1
        try:
            r = await self.client.get(self.cfg.jwks_url)
            r.raise_for_status()
            data = r.json()
        except (httpx.HTTPError, ValueError) as e:
            log.warning("JWKS fetch for issuer %s failed: %s", self.cfg.issuer, type(e).__name__)
            return
        keys: dict[str, PyJWK] = {}
        for i, jwk in enumerate(data.get("keys", []) if isinstance(data, dict) else []):
            if not isinstance(jwk, dict) or jwk.get("use", "sig") != "sig":
                continue
            try:
                k = PyJWK(jwk)
            except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError):
                continue
            if k.algorithm_name not in SUPPORTED_ALGS:
                continue
            keys[str(jwk.get("kid", f"#{i}"))] = k
        st.keys = keys
        st.fetched_at = self.clock.monotonic()

    async def get(self, kid: str | None) -> PyJWK | None:
        st = self.state
        now = self.clock.monotonic()
        if now - st.fetched_at > self.cfg.jwks_cache_s:
            async with st.lock:
                if self.clock.monotonic() - st.fetched_at > self.cfg.jwks_cache_s and \
                        self.clock.monotonic() - st.last_attempt >= min(self.cfg.jwks_min_refresh_s, self.cfg.jwks_cache_s):
                    await self._fetch()
        k = self._pick(kid)
        if k is None and self.clock.monotonic() - st.last_attempt >= self.cfg.jwks_min_refresh_s:
            async with st.lock:  # single flight: waiters see the fresh set
                if self.clock.monotonic() - st.last_attempt >= self.cfg.jwks_min_refresh_s:
                    await self._fetch()
            k = self._pick(kid)
        return k

    def _pick(self, kid: str | None) -> PyJWK | None:
        keys = self.state.keys
        if kid is not None:
            return keys.get(kid)
        return next(iter(keys.values())) if len(keys) == 1 else None


@dataclass(frozen=True, slots=True)
class VerifiedToken:
    issuer: JWTIssuerConfig
    claims: dict[str, Any]


class JWTVerifier:
    """Verifies bearer JWTs for the configured issuers."""

    def __init__(self, issuers: list[JWTIssuerConfig], client: httpx.AsyncClient | None = None,
                 clock: Clock = time) -> None:
        self.client = client or httpx.AsyncClient(timeout=5.0)
        self.clock = clock
        self.issuers: dict[str, JwksCache] = {i.issuer: JwksCache(i, self.client, clock) for i in issuers}

    def replace_issuers(self, issuers: list[JWTIssuerConfig]) -> None:
        """Hot reload: keep caches of unchanged issuers, drop removed ones."""
        new: dict[str, JwksCache] = {}
        for i in issuers:
            old = self.issuers.get(i.issuer)
            new[i.issuer] = old if old is not None and old.cfg == i else JwksCache(i, self.client, self.clock)
        self.issuers = new

    async def aclose(self) -> None:
        await self.client.aclose()

    async def verify(self, token: str) -> VerifiedToken:
        try:
            header = jwt.get_unverified_header(token)
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError:
            raise token_error("Malformed bearer token.") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in SUPPORTED_ALGS:
            raise token_error("Token algorithm is not accepted (RS256 or ES256 required).")
        iss = unverified.get("iss")
        cache = self.issuers.get(iss) if isinstance(iss, str) else None
        if cache is None:
            raise token_error("Token issuer is not trusted.")
        cfg = cache.cfg
        if alg not in cfg.algorithms:
            raise token_error("Token algorithm is not accepted for this issuer.")
        kid = header.get("kid")
        key = await cache.get(kid if isinstance(kid, str) else None)
        if key is None:
            raise token_error("Token signing key is unknown.")
        if key.algorithm_name != alg:
            raise token_error("Token algorithm does not match its signing key.")
        try:
            claims = jwt.decode(
                token, key=key.key, algorithms=[alg], audience=cfg.audience, issuer=cfg.issuer,
                leeway=cfg.leeway_s,
                options={"require": ["exp", "iss"] + (["aud"] if cfg.audience else []),
                         "verify_aud": cfg.audience is not None},
            )
        except jwt.ExpiredSignatureError:
            raise token_error("Token has expired.", code="expired_token") from None
        except jwt.InvalidAudienceError:
            raise token_error("Token audience is not accepted.") from None
        except jwt.InvalidIssuerError:
            raise token_error("Token issuer is not trusted.") from None
        except jwt.ImmatureSignatureError:
            raise token_error("Token is not yet valid.") from None
        except jwt.MissingRequiredClaimError as e:
            raise token_error(f"Token lacks the required claim {e.claim!r}.") from None
        except jwt.InvalidSignatureError:
            raise token_error("Token signature is invalid.") from None
        except jwt.PyJWTError:
            raise token_error("Token is invalid.") from None
        return VerifiedToken(cfg, claims)
