"""Upstream HTTP transports behind one small interface: native (default, gateway/proxy/h1client.py), aiohttp
or httpx (`server.upstream_client`; gateway/proxy/upstream.py::make_transport picks one per backend).

Why three: httpx/httpcore's pool and anyio stream layers were most of the gateway's CPU per request; aiohttp's
client (C parser, plain asyncio transports) does the same work for far less, and the native client (asyncio
protocols + httptools, only what the gateway needs) for less again (docs/benchmarks.md, "Upstream client"). All
three are kept, selectable, and run by the same end-to-end suite.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, Mapping, Protocol

import aiohttp
import httpx

if TYPE_CHECKING:  # annotations only: the config loader sits above the transports
    from gateway.config import BackendConfig


class UpstreamConnectError(Exception):
    """The upstream could not be reached (nothing was sent): always safe to retry elsewhere."""


class UpstreamBroken(Exception):
    """The upstream connection broke while sending or receiving."""


class UpstreamResponse(Protocol):
    status: int

    @property
    def headers(self) -> Mapping[str, str]: ...  # read-only: aiohttp's, httpx's and the native client's own type

    async def aread(self) -> bytes: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


async def abort(resp: UpstreamResponse) -> None:
    """End an upstream request now, however much of it was read (a client that left): its connection is
    closed, never handed back to the pool, so the upstream sees the close (vLLM then aborts the request).
    The native and aiohttp responses close synchronously (`abort()`: nothing to await while a cancellation
    unwinds); httpx closes a response that was not read to its end (httpcore drops that connection)."""
    hard = getattr(resp, "abort", None)
    if hard is not None:
        hard()
    else:
        await resp.aclose()


class Transport(Protocol):
    # `path` is relative to the backend's URL; one with a leading '/' is relative to its server root instead
    # (BackendConfig.server_root: the URL without a trailing /v1, where vLLM serves /tokenize)
    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse: ...

    async def get(self, path: str, timeout: float) -> int: ...

    async def aclose(self) -> None: ...


# ------------------------------------------------------------------------------------------------ aiohttp


class _AiohttpResponse:
    __slots__ = ("_r", "status", "headers", "_done")

    def __init__(self, r: aiohttp.ClientResponse) -> None:
        self._r = r
        self.status = r.status
        self.headers = r.headers
        self._done = False

    async def aread(self) -> bytes:
        try:
            body = await self._r.read()
        except (aiohttp.ClientError, OSError) as e:
            raise UpstreamBroken(type(e).__name__) from None
        self._done = True
        return body

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._r.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, OSError) as e:
            raise UpstreamBroken(type(e).__name__) from None
        self._done = True

    async def aclose(self) -> None:
        if self._done:
            self._r.release()  # fully read: the connection goes back to the pool
        else:
            self._r.close()  # abandoned mid-body: close the connection so the engine stops working on it

    def abort(self) -> None:
        self._r.close()


class AiohttpTransport:
    def __init__(self, b: BackendConfig) -> None:
        self._base = b.url.rstrip("/") + "/"
        self._root = b.server_root.rstrip("/")
        self._b = b
        self._session: aiohttp.ClientSession | None = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            b = self._b
            conn = aiohttp.TCPConnector(limit=b.limits.max_connections, limit_per_host=0,
                                        keepalive_timeout=b.limits.keepalive_expiry_s, ttl_dns_cache=60,
                                        enable_cleanup_closed=False)
            self._session = aiohttp.ClientSession(
                connector=conn, auto_decompress=False, raise_for_status=False, trust_env=False,
                timeout=aiohttp.ClientTimeout(total=None, connect=b.timeouts.connect_s,
                                              sock_connect=b.timeouts.connect_s),
                skip_auto_headers=("User-Agent", "Accept-Encoding"))
        return self._session

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        try:
            url = (self._root if path[:1] == "/" else self._base) + path
            r = await self._sess().post(url, data=body, headers=headers, allow_redirects=False)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            raise UpstreamConnectError(type(e).__name__) from None
        except (aiohttp.ClientError, OSError) as e:
            raise UpstreamBroken(type(e).__name__) from None
        return _AiohttpResponse(r)

    async def get(self, url: str, timeout: float) -> int:
        try:
            async with self._sess().get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                await r.read()
                return r.status
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            raise UpstreamConnectError(type(e).__name__) from None
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise UpstreamBroken(type(e).__name__) from None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


# ------------------------------------------------------------------------------------------------ httpx


class _HttpxResponse:
    __slots__ = ("_r", "status", "headers")

    def __init__(self, r: httpx.Response) -> None:
        self._r = r
        self.status = r.status_code
        self.headers = r.headers

    async def aread(self) -> bytes:
        try:
            return await self._r.aread()
        except (httpx.HTTPError, OSError) as e:
            raise UpstreamBroken(type(e).__name__) from None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._r.aiter_raw():
                yield chunk
        except (httpx.HTTPError, OSError) as e:
            raise UpstreamBroken(type(e).__name__) from None

    async def aclose(self) -> None:
        await self._r.aclose()


class HttpxTransport:
    def __init__(self, b: BackendConfig) -> None:
        limits = httpx.Limits(max_connections=b.limits.max_connections,
                              max_keepalive_connections=b.limits.max_keepalive,
                              keepalive_expiry=b.limits.keepalive_expiry_s)
        timeout = httpx.Timeout(connect=b.timeouts.connect_s, read=None, write=b.timeouts.idle_s,
                                pool=b.timeouts.connect_s)
        # trust_env / proxy: a partner route behind an egress proxy (per backend, opt-in; BackendConfig)
        self._c = httpx.AsyncClient(base_url=b.url.rstrip("/") + "/", limits=limits, timeout=timeout, http1=True,
                                    http2=False, follow_redirects=False, trust_env=b.trust_env, proxy=b.proxy)
        self._root = b.server_root.rstrip("/")

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        req = self._c.build_request("POST", self._root + path if path[:1] == "/" else path, content=body,
                                    headers=headers)
        try:
            return _HttpxResponse(await self._c.send(req, stream=True))
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:
            raise UpstreamConnectError(type(e).__name__) from None
        except (httpx.HTTPError, OSError) as e:
            raise UpstreamBroken(type(e).__name__) from None

    async def get(self, url: str, timeout: float) -> int:
        try:
            r = await self._c.get(url, timeout=timeout)
            return r.status_code
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise UpstreamConnectError(type(e).__name__) from None
        except (httpx.HTTPError, OSError) as e:
            raise UpstreamBroken(type(e).__name__) from None

    async def aclose(self) -> None:
        await self._c.aclose()
