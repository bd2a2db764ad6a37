"""The cache as a gateway service: builds the store, embedder and stage from `cache:`, purges on reload and
serves `DELETE /admin/cache?tenant=&model=&prefix=` (platform admin: any; tenant admin: its own tenant only)."""
from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.cache.embed import BackendEmbedder, LexicalEmbedder
from gateway.cache.stage import CacheMetrics, CacheStage
from gateway.cache.store import MemoryStore
from gateway.errors import GatewayError


def build_embedder(gw: Any, cc: Any) -> Any:
    """The configured embedder; raises ConfigError for a bad `cache:` section (checked at start and reload)."""
    if cc.location is not None:
        from gateway.config import ConfigError
        from gateway.policy.eea import country_error

        why = country_error(cc.location.country)
        if why is not None:
            raise ConfigError(f"cache.location.country: {why}")
    if cc.embedder == "backend":
        if not cc.embeddings_model:
            from gateway.config import ConfigError

            raise ConfigError("cache.embedder: backend needs cache.embeddings_model")
        return BackendEmbedder(cc.embeddings_model, lambda: gw.config, lambda: gw.upstreams, cc.embeddings_timeout_s)
    if cc.embedder != "lexical":
        from gateway.config import ConfigError

        raise ConfigError(f"cache.embedder: {cc.embedder!r} is not one of lexical, backend")
    return LexicalEmbedder()


class CacheService:
    def __init__(self, gw: Any) -> None:
        self.gw = gw
        cc = gw.config.raw.cache
        self.store = MemoryStore(cc.max_entries, cc.location)
        self.stage = CacheStage(lambda: gw.config, self.store, build_embedder(gw, cc), CacheMetrics(gw.metrics.registry))

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self.store.invalidate()

    def check_config(self, config: Any) -> None:
        build_embedder(self.gw, config.raw.cache)  # a bad `cache:` section refuses the reload

    def swap_config(self, config: Any) -> None:
        """A reload may change the policy (who may share what), aliases or backends (what an answer comes
        from): every entry is dropped rather than served across that change."""
        cc = config.raw.cache
        self.store.invalidate()
        self.store.max_entries = cc.max_entries
        self.store.location = cc.location
        if cc != self.gw.config.raw.cache:
            self.stage.embedder = build_embedder(self.gw, cc)

    async def admin_delete(self, request: Request, principal: Any) -> Response:
        q = request.query_params
        tenant, model, prefix = q.get("tenant"), q.get("model"), q.get("prefix")
        if principal is not None and "admin" not in (principal.roles or ()):
            if tenant is not None and tenant != principal.tenant:
                raise GatewayError(403, "A tenant admin may only purge its own tenant's entries.",
                                   code="tenant_forbidden")
            tenant = principal.tenant
        n = self.store.invalidate(tenant=tenant, model=model, prefix=prefix)
        return JSONResponse({"deleted": n, "tenant": tenant, "model": model, "prefix": prefix})
