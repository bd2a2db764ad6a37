"""Cache salts: the `cache_salt` an engine receives, so tenants never share (or guess) a prefix cache."""
from __future__ import annotations

import os

import xxhash

from gateway.pipeline import RequestContext

_SALT_DEFAULT_SECRET = "policy-gateway-cache-salt-v1"


def tenant_cache_salt(tenant: str, secret: str) -> str:
    """A per-tenant cache_salt vLLM accepts (<= 128 chars, no '@', '/', '\\' or NUL): a keyed hash, so the
    salt names no tenant and cannot be guessed by another tenant."""
    return "t" + xxhash.xxh3_128_hexdigest(secret.encode() + b"\x00" + tenant.encode())


def engine_cache_salt(ctx: RequestContext, secret_env: str | None) -> str | None:
    """The cache_salt the engine receives, or None (no salt: the shared prefix cache).

    Under the policy's cache isolation, the tenant's own salt (tenant_cache_salt). A client's own `cache_salt`
    is never forwarded as sent: it is namespaced by the caller's tenant (and, under isolation, combined with
    the tenant's salt), so no caller can present another tenant's salt - which is computable when
    `routing.cache_salt_secret_env` is unset - or share a prefix cache with another tenant by choosing the
    same string. Requests of one tenant with the same client salt still share their cache."""
    d = ctx.decision
    client = ctx.body.get("cache_salt")
    client = client if isinstance(client, str) else None
    isolate = d is not None and d.cache_isolation
    if not isolate and client is None:
        return None
    secret = (os.environ.get(secret_env, "") if secret_env else "") or _SALT_DEFAULT_SECRET
    tenant = ctx.principal.tenant if ctx.principal is not None else ""
    if client is None:
        return tenant_cache_salt(tenant, secret)
    return tenant_cache_salt(f"{tenant}\x00{'isolated' if isolate else 'shared'}\x00client:{client}", secret)
