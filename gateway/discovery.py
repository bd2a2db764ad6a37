"""DNS discovery of engine replicas: a backend with `discovery: {dns, port, refresh_s}` stands for every address
its name resolves to (the A records of a Kubernetes headless Service, one per ready engine pod).

Why expand into one backend per address instead of one backend behind a Service: the gateway must see each
engine's own KV-event stream, load and circuit, so each replica is its own backend `<name>-<a-b-c-d>` with the
template's url / kv_events / replay / metrics pointed at that address (and `discovery.port` for the url, when
set), and the template's models, location and retention.

`parse_config` expands templates from the addresses last resolved in this process (`ADDRESSES`; nothing resolved
yet: no backends for the group, its models answer 503 until an engine appears). `DiscoveryService` resolves
each name every `refresh_s` and, when an address set changes, reloads the config file, so the change goes
through the same whole-snapshot swap as `POST /admin/reload` (new engines get telemetry, removed ones stop).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from gateway.errors import ConfigError

if TYPE_CHECKING:
    from gateway.config import BackendConfig, Config, DnsDiscovery

log = logging.getLogger("gateway.discovery")

ADDRESSES: dict[str, tuple[str, ...]] = {}  # dns name -> IPv4 addresses last resolved (sorted); process-wide
# config path (str, or None for text configs) -> the discovery templates parse_config saw in it
TEMPLATES: dict[str | None, tuple[BackendConfig, ...]] = {}

Resolver = Callable[[str], Awaitable[tuple[str, ...]]]


def watched(path: str | None) -> list[tuple[BackendConfig, DnsDiscovery]]:
    """The discovery templates of the config at `path`, each with its discovery settings (parse_config puts only
    backends that have them in TEMPLATES)."""
    return [(t, t.discovery) for t in TEMPLATES.get(path, ()) if t.discovery is not None]


def resolve_a(name: str) -> tuple[str, ...]:
    """The name's IPv4 addresses (A records, or /etc/hosts), sorted and unique; () when it does not resolve."""
    try:
        infos = socket.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return ()
    return tuple(sorted({str(i[4][0]) for i in infos}))


async def resolve_a_async(name: str) -> tuple[str, ...]:
    """resolve_a off the event loop (getaddrinfo blocks)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return ()
    return tuple(sorted({str(i[4][0]) for i in infos}))


def _with_host(url: str | None, address: str, port: int | None = None) -> str | None:
    if url is None:
        return None
    u = urlsplit(url)
    netloc = f"{address}:{port or u.port}" if (port or u.port) else address
    if u.username:  # credentials never belong in a discovered URL, but keep what was written
        netloc = f"{u.username}{':' + u.password if u.password else ''}@{netloc}"
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def backend_name(template: str, address: str) -> str:
    return f"{template}-{address.replace('.', '-')}"


def expand_one(template: BackendConfig, addresses: Iterable[str]) -> list[BackendConfig]:
    """One backend per address: the template with its endpoints pointed at the address, discovery cleared."""
    import msgspec

    d = template.discovery
    assert d is not None
    return [msgspec.structs.replace(
        template, name=backend_name(template.name, a), url=_with_host(template.url, a, d.port),
        kv_events=_with_host(template.kv_events, a), replay=_with_host(template.replay, a),
        metrics=_with_host(template.metrics, a), discovery=None) for a in addresses]


def expand(backends: list[BackendConfig], path: str | None) -> list[BackendConfig]:
    """The backend list with every discovery template replaced by its replicas (from ADDRESSES); records the
    templates under `path` for the DiscoveryService."""
    templates = tuple(b for b in backends if b.discovery is not None)
    TEMPLATES[path] = templates
    if not templates:
        return backends
    out: list[BackendConfig] = []
    for b in backends:
        out.extend(expand_one(b, ADDRESSES.get(b.discovery.dns, ())) if b.discovery is not None else [b])
    return out


class DiscoveryService:
    """Re-resolves every template's name on its `refresh_s` and reloads the config when an address set
    changed. A name that stops resolving keeps its last addresses (a DNS outage is not an engine outage: the
    circuits judge the engines); a name that resolves to a different set replaces them."""

    def __init__(self, gw: Any, resolver: Resolver = resolve_a_async, clock: Callable[[], float] = time.monotonic):
        self.gw = gw
        self.resolver = resolver
        self.clock = clock
        self._task: asyncio.Task | None = None
        self._due: dict[str, float] = {}
        self.refreshes = 0  # address-set changes applied (reloads triggered)

    def templates(self) -> tuple[BackendConfig, ...]:
        path = self.gw.config.path
        return TEMPLATES.get(str(path) if path is not None else None, ())

    def _watched(self) -> list[tuple[BackendConfig, DnsDiscovery]]:
        path = self.gw.config.path
        return watched(str(path) if path is not None else None)

    async def start(self) -> None:
        if self.templates():
            await self.refresh(force=True)
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    def check_config(self, config: Config) -> None:
        """A reload (gateway.app.Reloadable): nothing to check; the templates are read per refresh."""

    def swap_config(self, config: Config) -> None:
        """Nothing to swap: the next refresh reads `gw.config`'s templates."""

    async def refresh(self, force: bool = False) -> bool:
        """Resolve the names that are due; reload when any address set changed. Returns whether it did."""
        now = self.clock()
        changed = False
        for t, d in self._watched():
            if not force and self._due.get(d.dns, 0.0) > now:
                continue
            self._due[d.dns] = now + d.refresh_s
            addrs = await self.resolver(d.dns)
            if not addrs:
                if d.dns not in ADDRESSES:
                    log.warning("discovery: %s (backend %s) resolves to no address yet", d.dns, t.name)
                continue
            if ADDRESSES.get(d.dns) != addrs:
                log.info("discovery: %s -> %s (backend %s)", d.dns, ", ".join(addrs), t.name)
                ADDRESSES[d.dns] = addrs
                changed = True
        if changed:
            await self._apply()
        return changed

    async def _apply(self) -> None:
        if self.gw.config.path is None:
            log.warning("discovery: the config was not loaded from a file; new addresses apply on the next load")
            return
        try:
            await self.gw.reload()
            self.refreshes += 1
        except ConfigError as e:
            log.error("discovery: reload refused, previous backends keep serving: %s", e)

    async def _loop(self) -> None:
        while True:
            step = min((d.refresh_s for _, d in self._watched()), default=5.0)
            await asyncio.sleep(max(0.05, min(step, 5.0)))
            try:
                await self.refresh()
            except Exception:  # never let one bad lookup end discovery
                log.exception("discovery refresh failed")
