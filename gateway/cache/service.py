"""The cache as a gateway service: builds the store, embedder and stage from `cache:`, purges on reload and
serves `DELETE /admin/cache?tenant=&model=&prefix=` (platform admin: any; tenant admin: its own tenant only)."""
from __future__ import annotations

import glob
import hashlib
import logging
from pathlib import Path
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.cache.embed import BackendEmbedder, EmbedderUnavailable, LexicalEmbedder, WordLlamaEmbedder
from gateway.cache.stage import CacheMetrics, CacheStage
from gateway.cache.store import CacheStore, MemoryStore
from gateway.errors import GatewayError

STORES = ("memory", "sqlite", "redis")
log = logging.getLogger("gateway.cache")


def _config_error(msg: str) -> Exception:
    from gateway.config import ConfigError

    return ConfigError(msg)


def build_embedder(gw: Any, cc: Any) -> Any:
    """The configured embedder; raises ConfigError for a bad `cache:` section (checked at start and reload)."""
    check_store(cc)
    if cc.location is not None:
        from gateway.policy.eea import country_error

        why = country_error(cc.location.country)
        if why is not None:
            raise _config_error(f"cache.location.country: {why}")
    if cc.embedder == "backend":
        if not cc.embeddings_model:
            raise _config_error("cache.embedder: backend needs cache.embeddings_model")
        return BackendEmbedder(cc.embeddings_model, lambda: gw.config, lambda: gw.upstreams, cc.embeddings_timeout_s)
    if cc.embedder == "wordllama":
        try:
            return WordLlamaEmbedder()
        except EmbedderUnavailable as e:
            raise _config_error(f"cache.embedder: wordllama: {e}") from e
    if cc.embedder != "lexical":
        raise _config_error(f"cache.embedder: {cc.embedder!r} is not one of wordllama, lexical, backend")
    return LexicalEmbedder()


def check_store(cc: Any) -> None:
    if cc.store not in STORES:
        raise _config_error(f"cache.store: {cc.store!r} is not one of {', '.join(STORES)}")
    if cc.max_entries < 1 or cc.max_partition_entries < 1:
        raise _config_error("cache.max_entries and cache.max_partition_entries must be at least 1")
    if cc.store == "redis":
        if not cc.redis_url:
            raise _config_error("cache.store: redis needs cache.redis_url")
        if not cc.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise _config_error("cache.redis_url: must be a redis://, rediss:// or unix:// URL")
        if not cc.redis_key_prefix or ":" in cc.redis_key_prefix[-1:]:
            raise _config_error("cache.redis_key_prefix: must be non-empty and not end with ':'")
    if cc.redis_timeout_s <= 0:
        raise _config_error("cache.redis_timeout_s must be positive")


def store_settings(cc: Any) -> tuple:
    """What selects the store itself (a reload changing any of it opens a new one)."""
    return (cc.store, cc.sqlite_path, cc.redis_url, cc.redis_key_prefix, cc.redis_timeout_s)


def namespace(config: Any) -> str:
    """A fingerprint of everything that decides who may share an answer and where it comes from: backends,
    aliases, the policy (its settings and its files' contents), the store's location and the embedder. Persistent
    stores key their entries by it, so a restart or a replica on another config never serves an entry made under
    this one; replicas on the same config (other ports, paths, audit files) share one namespace."""
    raw, cc = config.raw, config.raw.cache
    pol = raw.policy
    h = hashlib.sha256(msgspec.json.encode([raw.backends, raw.aliases, pol.default_allow, pol.opa, cc.location,
                                            cc.embedder, cc.embeddings_model]))
    contents = []
    for pattern in pol.files or []:
        p = pattern if Path(pattern).is_absolute() else str(Path(config.base_dir) / pattern)
        for f in sorted(glob.glob(p)) or [p]:
            try:
                contents.append(Path(f).read_bytes())
            except OSError:
                contents.append(b"missing:" + pattern.encode())
    for c in sorted(contents):
        h.update(hashlib.sha256(c).digest())
    return h.hexdigest()[:16]


def build_store(config: Any) -> CacheStore:
    cc = config.raw.cache
    check_store(cc)
    if cc.store == "sqlite":
        from gateway.cache.sqlite_store import SqliteStore

        path = Path(cc.sqlite_path) if cc.sqlite_path else Path(config.raw.data_dir) / "cache.db"
        if not path.is_absolute():
            path = Path(config.base_dir) / path
        return SqliteStore(path, cc.max_entries, cc.location, cc.max_partition_entries, namespace(config))
    if cc.store == "redis":
        from gateway.cache.redis_store import RedisStore

        return RedisStore(cc.redis_url, cc.redis_key_prefix, cc.max_entries, cc.location, cc.max_partition_entries,
                          cc.redis_timeout_s, namespace(config))
    return MemoryStore(cc.max_entries, cc.location)


class CacheService:
    def __init__(self, gw: Any) -> None:
        self.gw = gw
        cc = gw.config.raw.cache
        embedder = build_embedder(gw, cc)
        self.store = build_store(gw.config)
        self.stage = CacheStage(lambda: gw.config, self.store, embedder, CacheMetrics(gw.metrics.registry))

    async def start(self) -> None:
        await self.store.start()

    async def close(self) -> None:
        await self.store.close()  # the in-process store is emptied; sqlite and redis keep their entries

    def check_config(self, config: Any) -> None:
        build_embedder(self.gw, config.raw.cache)  # a bad `cache:` section refuses the reload

    async def swap_config(self, config: Any) -> None:
        """A reload may change the policy (who may share what), aliases or backends (what an answer comes
        from): every entry is dropped rather than served across that change (in a shared store: for every
        replica; replicas still on the old config keep a namespace of their own, docs/cache.md#stores)."""
        cc = config.raw.cache
        old = self.gw.config.raw.cache
        try:
            await self.store.invalidate()
        except Exception as e:  # the namespace below still keeps entries of another config from being served
            log.warning("cache purge on reload failed (%s store): %s", self.store.name, e)
        if store_settings(cc) != store_settings(old):
            new = build_store(config)
            await new.start()
            await new.invalidate()
            prev, self.store = self.store, new
            self.stage.store = new
            await prev.close()
        else:
            self.store.retune(cc, namespace(config))
        if cc != old:
            self.stage.embedder = build_embedder(self.gw, cc)

    async def admin_delete(self, request: Request, principal: Any) -> Response:
        q = request.query_params
        tenant, model, prefix = q.get("tenant"), q.get("model"), q.get("prefix")
        if principal is not None and "admin" not in (principal.roles or ()):
            if tenant is not None and tenant != principal.tenant:
                raise GatewayError(403, "A tenant admin may only purge its own tenant's entries.",
                                   code="tenant_forbidden")
            tenant = principal.tenant
        try:
            n = await self.store.invalidate(tenant=tenant, model=model, prefix=prefix)
        except Exception as e:
            raise GatewayError(503, f"The cache store ({self.store.name}) could not be purged: {e}",
                               code="cache_store_unavailable") from e
        return JSONResponse({"deleted": n, "tenant": tenant, "model": model, "prefix": prefix})
