"""One pooled upstream client per backend (keep-alive, HTTP/1.1, pool limits from config) and its credential."""
from __future__ import annotations

import asyncio
import logging

import httpx

from gateway.config import BackendConfig, Config, read_secret
from gateway.proxy.scrub import Scrubber
from gateway.proxy.h1client import H1Transport
from gateway.proxy.transport import AiohttpTransport, HttpxTransport, Transport

log = logging.getLogger("gateway.upstream")


def uses_proxy(b: BackendConfig) -> bool:
    """A backend that opted into an egress proxy (trust_env or proxy): served by httpx, which speaks to HTTP
    proxies (CONNECT for https, absolute-form for http) and reads HTTPS_PROXY/NO_PROXY; the native and aiohttp
    clients stay proxy-free for engines on the cluster network."""
    return b.trust_env or b.proxy is not None


def make_transport(kind: str, b: BackendConfig) -> Transport:
    """The client for one backend: `kind` is server.upstream_client (native: gateway/proxy/h1client.py; aiohttp;
    httpx), except that a backend behind an egress proxy always gets httpx."""
    if uses_proxy(b):
        return HttpxTransport(b)
    if kind == "native":
        return H1Transport(b)
    return HttpxTransport(b) if kind == "httpx" else AiohttpTransport(b)


class Upstreams:
    """Clients keyed by backend name; a reload that changes a backend's URL or limits gets a fresh client
    while in-flight requests finish on the old one (closed after a grace period)."""

    def __init__(self, config: Config) -> None:
        self._clients: dict[str, tuple[tuple, Transport]] = {}
        self._auth: dict[str, str | None] = {}
        self._retired: list[Transport] = []
        self._probe_clients: dict[tuple, httpx.AsyncClient] = {}
        self.scrubber = Scrubber()  # what of an upstream's error text a client may see (gateway/proxy/scrub.py)
        self.swap_config(config)

    @staticmethod
    def _identity(b: BackendConfig, kind: str) -> tuple:
        return (b.url, b.limits, b.timeouts.connect_s, kind, b.trust_env, b.proxy)

    def swap_config(self, config: Config) -> None:
        new: dict[str, tuple[tuple, Transport]] = {}
        kind = config.server.upstream_client
        secrets: list[str | None] = []
        for b in config.backends:
            ident = self._identity(b, kind)
            old = self._clients.get(b.name)
            if old is not None and old[0] == ident:
                new[b.name] = old
            else:
                new[b.name] = (ident, make_transport(kind, b))
                if old is not None:
                    self._retired.append(old[1])
            key = read_secret(b.api_key_env, b.api_key_file, config.base_dir)
            self._auth[b.name] = f"Bearer {key}" if key else None
            secrets.append(key)
        # every backend's credential and hosts, as this config sends them: masked in any upstream error text
        self.scrubber = Scrubber.for_backends(config.backends, secrets)
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
    def _close_later(clients: list[Transport]) -> None:
        for c in clients:
            asyncio.ensure_future(c.aclose())

    def probe_client(self, b: BackendConfig) -> "httpx.AsyncClient | None":
        """The client health probes of a proxied backend use (same trust_env/proxy as its requests, so a
        partner reachable only through the egress proxy is not probed directly and marked down); None for the
        others (the gateway's shared probe client)."""
        if not uses_proxy(b):
            return None
        key = (b.trust_env, b.proxy)
        c = self._probe_clients.get(key)
        if c is None:
            c = self._probe_clients[key] = httpx.AsyncClient(trust_env=b.trust_env, proxy=b.proxy)
        return c

    def client(self, name: str) -> Transport:
        return self._clients[name][1]

    def auth(self, name: str) -> str | None:
        return self._auth.get(name)

    async def aclose(self) -> None:
        for _, c in self._clients.values():
            await c.aclose()
        self._clients.clear()
        for pc in self._probe_clients.values():
            await pc.aclose()
        self._probe_clients.clear()
