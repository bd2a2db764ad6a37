"""One pooled httpx client per backend (keep-alive, HTTP/1.1, pool limits from config) and its credential."""
from __future__ import annotations

import asyncio
import logging

import httpx

from gateway.config import BackendConfig, Config, read_secret

log = logging.getLogger("gateway.upstream")


class Upstreams:
    """Clients keyed by backend name; a reload that changes a backend's URL or limits gets a fresh client
    while in-flight requests finish on the old one (closed after a grace period)."""

    def __init__(self, config: Config) -> None:
        self._clients: dict[str, tuple[tuple, httpx.AsyncClient]] = {}
        self._auth: dict[str, str | None] = {}
        self._retired: list[httpx.AsyncClient] = []
        self.swap_config(config)

    @staticmethod
    def _identity(b: BackendConfig) -> tuple:
        return (b.url, b.limits, b.timeouts.connect_s)

    def swap_config(self, config: Config) -> None:
        new: dict[str, tuple[tuple, httpx.AsyncClient]] = {}
        for b in config.backends:
            ident = self._identity(b)
            old = self._clients.get(b.name)
            if old is not None and old[0] == ident:
                new[b.name] = old
            else:
                new[b.name] = (ident, self._make_client(b))
                if old is not None:
                    self._retired.append(old[1])
            key = read_secret(b.api_key_env, b.api_key_file, config.base_dir)
            self._auth[b.name] = f"Bearer {key}" if key else None
        for name, (_, c) in self._clients.items():
            if name not in new:
                self._retired.append(c)
        self._clients = new
        if self._retired:
            retired, self._retired = self._retired, []
            try:
                asyncio.get_running_loop().call_later(config.server.graceful_shutdown_s + 5, self._close_later, retired)
            except RuntimeError:
                pass

    @staticmethod
    def _close_later(clients: list[httpx.AsyncClient]) -> None:
        for c in clients:
            asyncio.ensure_future(c.aclose())

    @staticmethod
    def _make_client(b: BackendConfig) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=b.limits.max_connections,
                              max_keepalive_connections=b.limits.max_keepalive,
                              keepalive_expiry=b.limits.keepalive_expiry_s)
        timeout = httpx.Timeout(connect=b.timeouts.connect_s, read=None, write=b.timeouts.idle_s,
                                pool=b.timeouts.connect_s)
        # HTTP/1.1 only; the gateway manages first-token/idle/total deadlines itself.
        return httpx.AsyncClient(base_url=b.url.rstrip("/") + "/", limits=limits, timeout=timeout,
                                 http1=True, http2=False, follow_redirects=False, trust_env=False)

    def client(self, name: str) -> httpx.AsyncClient:
        return self._clients[name][1]

    def auth(self, name: str) -> str | None:
        return self._auth.get(name)

    async def aclose(self) -> None:
        for _, c in self._clients.values():
            await c.aclose()
        self._clients.clear()
