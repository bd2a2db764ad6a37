"""IdentityService: turns request credentials into a Principal (the authenticator); the records it reads are
managed by its `directory` (gateway/identity/directory.py: tenants, teams, projects, partners and keys for the
admin plane and the CLI).

Hot path (per request): extract the credential, check the failure limiter, then one of
  static key  -> dict lookup by sha256(value) (config keys),
  gw_<id>_<s> -> in-memory cache by key id (TTL `cache_ttl_s`, dropped on store change events), then a
                 constant-time hash comparison and expiry/revocation checks against wall time,
  JWT         -> cache of verified tokens until `exp`, else JWKS verification (see jwt_verify.py).
Nothing here logs or echoes a presented credential; errors carry only fixed messages and key ids.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import time
from typing import Any, Mapping

from gateway.config import Config
from gateway.errors import GatewayError
from gateway.identity import keys as keyfmt
from gateway.identity.clock import Clock
from gateway.identity.directory import Directory, merge_labels
from gateway.identity.jwt_verify import JWTVerifier, token_error
from gateway.identity.model import ApiKey
from gateway.identity.ratelimit import FailureLimiter
from gateway.identity.restrictions import DEFAULT as DEFAULT_RESTRICTIONS
from gateway.identity.restrictions import Restrictions
from gateway.identity.store import IdentityStore
from gateway.observability.logs import register_secret
from gateway.types import Principal, PrincipalKind

log = logging.getLogger("gateway.identity")

_END_USER_MAX = 256
ADMIN_PRINCIPAL = Principal(id="admin:config", kind="static_key", tenant="*", roles=("admin",))


def _bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_request")


def invalid_key() -> GatewayError:
    return GatewayError(401, "Invalid API key.", code="invalid_api_key")


def missing_key() -> GatewayError:
    return GatewayError(401, "No API key provided. Send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                        code="missing_api_key")


def extract_credential(headers: Mapping[str, str]) -> str:
    """The presented credential from `authorization: Bearer ...` or `x-api-key`; 401 if absent/malformed."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        value = value.strip()
        if scheme.lower() != "bearer" or not value or " " in value:
            raise GatewayError(401, "Malformed Authorization header; expected 'Bearer <key>'.",
                               code="invalid_api_key")
        return value
    xk = headers.get("x-api-key")
    if xk and xk.strip():
        return xk.strip()
    raise missing_key()


def clean_end_user(value: str) -> str:
    """The partner's end-user id as recorded: bounded length, printable ASCII only (it goes to evidence)."""
    v = value.strip()
    if not v or len(v) > _END_USER_MAX or not v.isprintable() or not v.isascii():
        raise _bad("The end-user id header must be 1-256 printable ASCII characters.", param="end_user")
    return v


@dataclasses.dataclass(slots=True)
class _KeyEntry:
    key: ApiKey | None
    principal: Principal | None
    fresh_until: float  # monotonic


@dataclasses.dataclass(slots=True)
class _JwtEntry:
    principal: Principal
    valid_until: float  # wall clock (exp + leeway, capped)


def make_store(config: Config) -> IdentityStore:
    """The configured store: SQLite file (default) or PostgreSQL."""
    ic = config.raw.identity
    if ic.store == "postgres":
        dsn = ic.postgres_dsn or (os.environ.get(ic.postgres_dsn_env) if ic.postgres_dsn_env else None)
        if not dsn:
            raise GatewayError(500, "identity.store is postgres but no postgres_dsn/postgres_dsn_env is set",
                               code="config_error")
        from gateway.stores.identity_postgres import PostgresIdentityStore

        return PostgresIdentityStore(dsn, schema=ic.postgres_schema, channel=ic.notify_channel)
    from gateway.stores.identity_sqlite import SqliteIdentityStore

    return SqliteIdentityStore(config.resolve_path(ic.sqlite_path))


class IdentityService:
    def __init__(self, config: Config, store: IdentityStore | None = None, clock: Clock = time) -> None:
        self._clock = clock
        self._store_override = store
        self.store: IdentityStore | None = None
        self._keys: dict[str, _KeyEntry] = {}
        self._labels: dict[tuple[Any, ...], tuple[dict[str, str], float]] = {}
        self._jwt_cache: dict[str, _JwtEntry] = {}
        self._gen = 0  # bumped by every change event; a load that raced an event is not cached
        self.restrictions: Restrictions = DEFAULT_RESTRICTIONS
        self._jwt = JWTVerifier(list(config.raw.identity.jwt), clock=clock)
        self.swap_config(config)
        # the records' CRUD (admin API, CLI); its changes drop what this authenticator cached
        self.directory = Directory(lambda: self.store, clock, lambda: self.restrictions, self._on_event,
                                   lambda: self.config.raw.identity.rotation_overlap_s)

    # ------------------------------------------------------------------ lifecycle
    def check_config(self, config: Config) -> None:
        """A reload (gateway.app.Reloadable): nothing beyond what load_config validated (store settings it keeps
        need a restart, and the swap says nothing of them)."""

    def swap_config(self, config: Config) -> None:
        """Hot reload: static keys, admin key, JWT issuers, limits. Store settings need a restart."""
        ic = config.raw.identity
        self.config = config
        self.cache_ttl_s = ic.cache_ttl_s
        self.end_user_header = ic.end_user_header.lower()
        self.limiter = FailureLimiter(ic.auth_fail_limit_per_minute)
        static: dict[bytes, Principal] = {}
        for i, sk in enumerate(config.raw.keys):
            value = os.environ.get(sk.key_env) if sk.key_env else sk.key
            if not value:
                continue
            register_secret(value)
            ident = f"static:{sk.name or i}"
            static[hashlib.sha256(value.encode()).digest()] = Principal(
                id=ident, kind="static_key", tenant=sk.tenant, team=sk.team, project=sk.project, key_id=ident,
                partner=sk.partner, labels=dict(sk.labels), scopes=tuple(sk.scopes), allowed_models=tuple(sk.models))
        self._static = static
        adm = config.raw.admin
        admin_value = os.environ.get(adm.key_env) if adm.key_env else adm.key
        register_secret(admin_value)
        self._admin_digest = hashlib.sha256(admin_value.encode()).digest() if admin_value else None
        self._jwt.replace_issuers(list(ic.jwt))
        self._jwt_cache.clear()

    async def start(self) -> None:
        """Open the store (creating SQLite on first run), migrate, and subscribe to change events."""
        self.store = self._store_override or make_store(self.config)
        await self.store.open()
        version = await self.store.migrate()
        await self.store.listen(self._on_event)
        log.info("identity store ready (%s, schema v%d)", type(self.store).__name__, version)

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()
        await self._jwt.aclose()

    def set_policy(self, policy: Any) -> None:
        """Take the restriction labels of a (re)loaded policy; principals merged under the old set are dropped."""
        self.restrictions = Restrictions(policy)
        self._on_event("*")

    def _on_event(self, event: str) -> None:
        """A change somewhere (this or another replica): drop what it may have made stale."""
        self._gen += 1
        kind, _, ident = event.partition(":")
        if kind == "key":
            self._keys.pop(ident, None)
        else:  # hierarchy labels, partners, or "*": rare admin changes, flush derived state
            self._keys.clear()
            self._labels.clear()
            self._jwt_cache.clear()

    # ------------------------------------------------------------------ data plane
    async def authenticate(self, headers: Mapping[str, str], client_addr: str) -> Principal:
        """Principal for a data-plane request, or GatewayError 401/403/429 (never echoing the credential)."""
        self.limiter.check(client_addr, self._clock.monotonic())
        try:
            token = extract_credential(headers)
            p = await self._resolve(token, "data")
        except GatewayError as e:
            if e.status == 401:
                self.limiter.failure(client_addr, self._clock.monotonic())
            raise
        eu = headers.get(self.end_user_header)
        if eu is not None:
            p = dataclasses.replace(p, end_user=clean_end_user(eu))
        return p

    def token_valid_until(self, token: str) -> float | None:
        """When a JWT this service verified and still caches stops being valid (its `exp`, bounded by the cache);
        None when it is not cached (the batch lane then re-checks its owner sooner)."""
        hit = self._jwt_cache.get(token)
        return hit.valid_until if hit is not None else None

    async def recheck(self, p: Principal, valid_until: float | None = None) -> Principal:
        """The current Principal of a principal authenticated earlier (a batch job's owner), re-checked now
        without its credential: a stored key must still exist, be unrevoked, unexpired and a data key (its
        labels are re-read); a static key must still be in the config; a JWT principal holds until its
        token's expiry (`valid_until`). Raises the same 401/403 a request with that credential would get."""
        now = self._clock.time()
        if p.kind == "static_key":
            for sp in self._static.values():
                if sp.id == p.id:
                    return sp
            raise GatewayError(401, "The static key that created this batch is no longer configured.",
                               code="invalid_api_key")
        if p.kind in ("api_key", "partner") and p.key_id and not p.id.startswith("jwt:"):
            entry = self._keys.get(p.key_id)
            if entry is None or self._clock.monotonic() >= entry.fresh_until:
                entry = await self._load_key(p.key_id)
            k = entry.key
            if k is None or entry.principal is None:
                raise invalid_key()
            if k.revoked_at is not None and k.revoked_at <= now:
                raise GatewayError(401, f"API key {k.id} has been revoked.", code="revoked_api_key")
            if k.expires_at is not None and k.expires_at <= now:
                raise GatewayError(401, f"API key {k.id} has expired.", code="expired_api_key")
            if k.purpose != "data":
                raise GatewayError(403, "Admin keys cannot call the model API.", code="wrong_plane")
            return dataclasses.replace(entry.principal, end_user=p.end_user) if p.end_user else entry.principal
        if valid_until is not None and now >= valid_until:
            raise GatewayError(401, "The token that created this batch has expired.", code="expired_api_key")
        return p

    async def authenticate_admin(self, headers: Mapping[str, str], client_addr: str = "") -> Principal:
        """Principal for the admin plane: role "admin" (config admin key) or "tenant_admin" (stored admin key)."""
        self.limiter.check(client_addr, self._clock.monotonic())
        try:
            token = extract_credential(headers)
            if self._admin_digest is not None and hmac.compare_digest(
                    hashlib.sha256(token.encode()).digest(), self._admin_digest):
                return ADMIN_PRINCIPAL
            p = await self._resolve(token, "admin")
        except GatewayError as e:
            if e.status == 401:
                self.limiter.failure(client_addr, self._clock.monotonic())
            raise
        if "tenant_admin" not in p.roles:
            raise GatewayError(403, "This credential may not use the admin API.", code="admin_required")
        return p

    async def _resolve(self, token: str, plane: str) -> Principal:
        digest = hashlib.sha256(token.encode()).digest()
        sp = self._static.get(digest)
        if sp is not None:
            if plane == "admin":
                raise GatewayError(403, "This credential may not use the admin API.", code="admin_required")
            return sp
        if keyfmt.looks_like_gateway_key(token):
            return await self._resolve_key(token, plane)
        if token.count(".") == 2:
            return await self._resolve_jwt(token)
        if plane == "data" and self._admin_digest is not None and hmac.compare_digest(digest, self._admin_digest):
            raise GatewayError(403, "The admin key cannot call the model API.", code="wrong_plane")
        raise invalid_key()

    async def _resolve_key(self, token: str, plane: str) -> Principal:
        parsed = keyfmt.parse_key(token)
        if parsed is None:
            raise invalid_key()
        kid, secret = parsed
        entry = self._keys.get(kid)
        if entry is None or self._clock.monotonic() >= entry.fresh_until:
            entry = await self._load_key(kid)
        k = entry.key
        if k is None or entry.principal is None or not keyfmt.secret_matches(secret, k.secret_hash):
            raise invalid_key()
        now = self._clock.time()
        if k.revoked_at is not None and k.revoked_at <= now:
            raise GatewayError(401, f"API key {kid} has been revoked.", code="revoked_api_key")
        if k.expires_at is not None and k.expires_at <= now:
            raise GatewayError(401, f"API key {kid} has expired.", code="expired_api_key")
        if k.purpose != plane:
            if plane == "data":
                raise GatewayError(403, "Admin keys cannot call the model API.", code="wrong_plane")
            raise GatewayError(403, "This credential may not use the admin API.", code="admin_required")
        return entry.principal

    async def _load_key(self, kid: str) -> _KeyEntry:
        assert self.store is not None, "IdentityService.start() was not awaited"
        gen = self._gen
        k = await self.store.get_key(kid)
        p = await self._key_principal(k) if k is not None else None
        entry = _KeyEntry(k, p, self._clock.monotonic() + self.cache_ttl_s)
        if gen == self._gen:  # no change event arrived while loading: safe to cache
            if len(self._keys) > 200_000:
                self._keys.clear()
            self._keys[kid] = entry
        return entry

    async def _hierarchy_labels(self, tenant: str, team: str | None, project: str | None,
                                partner: str | None) -> dict[str, str]:
        ck = (tenant, team, project, partner)
        hit = self._labels.get(ck)
        if hit is not None and self._clock.monotonic() < hit[1]:
            return hit[0]
        assert self.store is not None
        gen = self._gen
        t = await self.store.get_tenant(tenant)
        pa = await self.store.get_partner(partner) if partner else None
        tm = await self.store.get_team(tenant, team) if team else None
        pr = await self.store.get_project(tenant, team, project) if team and project else None
        labels = merge_labels(t.labels if t else None, pa.labels if pa else None, tm.labels if tm else None,
                              pr.labels if pr else None, restrictions=self.restrictions)
        if gen == self._gen:
            if len(self._labels) > 100_000:
                self._labels.clear()
            self._labels[ck] = (labels, self._clock.monotonic() + self.cache_ttl_s)
        return labels

    async def _key_principal(self, k: ApiKey) -> Principal:
        base = await self._hierarchy_labels(k.tenant, k.team, k.project, k.partner)
        return Principal(
            id=f"key:{k.id}", kind="partner" if k.partner else "api_key", tenant=k.tenant, team=k.team,
            project=k.project, key_id=k.id, partner=k.partner,
            labels=merge_labels(base, k.labels, restrictions=self.restrictions),
            scopes=tuple(k.scopes), allowed_models=tuple(k.models),
            roles=("tenant_admin",) if k.purpose == "admin" else ())

    async def _resolve_jwt(self, token: str) -> Principal:
        hit = self._jwt_cache.get(token)
        if hit is not None:
            if self._clock.time() < hit.valid_until:
                return hit.principal
            del self._jwt_cache[token]
        if not self._jwt.issuers:
            raise invalid_key()
        gen = self._gen
        vt = await self._jwt.verify(token)
        cfg, claims = vt.issuer, vt.claims

        def claim_str(name: str | None) -> str | None:
            v = claims.get(name) if name else None
            return v if isinstance(v, str) and v else None

        tenant = claim_str(cfg.tenant_claim) or cfg.default_tenant
        if not tenant:
            raise token_error("Token carries no tenant claim.")
        team = claim_str(cfg.team_claim)
        project = claim_str(cfg.project_claim) if team else None
        partner = cfg.partner or claim_str(cfg.partner_claim)
        kind: PrincipalKind = "partner" if (cfg.kind == "partner" or partner) else "jwt"
        if kind == "partner" and not partner:
            raise token_error("Token carries no partner claim.")
        raw_labels = claims.get(cfg.labels_claim) if cfg.labels_claim else None
        claim_labels = {k: v for k, v in raw_labels.items() if isinstance(k, str) and isinstance(v, str)} \
            if isinstance(raw_labels, dict) else {}
        base = await self._hierarchy_labels(tenant, team, project, partner)
        scope = claims.get("scope")
        sub = claims.get("sub") if isinstance(claims.get("sub"), str) else "?"
        p = Principal(id=f"jwt:{cfg.issuer}|{sub}", kind=kind, tenant=tenant, team=team, project=project,
                      partner=partner, labels=merge_labels(base, claim_labels, restrictions=self.restrictions),
                      scopes=tuple(scope.split()) if isinstance(scope, str) else ())
        exp = claims["exp"]  # required and checked numeric by the verifier (jwt_verify: options.require)
        valid_until = min(float(exp) + cfg.leeway_s, self._clock.time() + cfg.jwks_cache_s)
        if gen == self._gen:
            if len(self._jwt_cache) >= self.config.raw.identity.jwt_cache_max:
                self._jwt_cache.pop(next(iter(self._jwt_cache)))
            self._jwt_cache[token] = _JwtEntry(p, valid_until)
        return p
