"""A lean HTTP/1.1 upstream client: asyncio protocols, httptools' C response parser, one keep-alive pool per
backend (`server.upstream_client: native`).

Why: at saturation aiohttp's client request path (request/response objects, multidicts, payload registry,
timers, its stream reader) was the largest single block of the gateway's CPU after the server itself
(docs/benchmarks.md, "Upstream client"). The gateway needs little of it: one POST with a ready body to a fixed set of upstreams
and a Content-Length or chunked answer. This client does only that, with the C parser that uvicorn already
uses for requests (httptools, llhttp).

Scope, on purpose: HTTP/1.1 keep-alive with a connection limit and idle expiry, TLS (system trust store, SNI),
a connect timeout (also for waiting on a free connection), Content-Length / chunked / until-close bodies,
streaming with back-pressure (reading pauses while 1 MiB is buffered and unread). No redirects, proxies,
cookies or decompression (Accept-Encoding is never sent). Response-level timeouts (first token, idle, total)
stay with the caller (gateway/proxy/forward.py), as for the other transports.

A response that is not read to its end is closed with its connection, so an abandoned request stops the
engine's work on it; a fully read keep-alive response hands its connection back to the pool.
"""
from __future__ import annotations

import asyncio
import collections
import ssl
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable
from urllib.parse import urlsplit

import httptools

from gateway.proxy.transport import UpstreamBroken, UpstreamConnectError

if TYPE_CHECKING:  # annotations only: the config loader sits above the transports
    from gateway.config import BackendConfig

_HIGH_WATER = 1 << 20  # unread response bytes past which reading from the upstream pauses
_JOIN_UP_TO = 1 << 16  # buffered pieces handed over as one, up to this many bytes


class _Endpoint:
    """Where a URL's requests go: (host, port, TLS) and the Host header / path prefix to send."""

    __slots__ = ("host", "port", "tls", "host_header", "prefix", "root")

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port or (443 if self.tls else 80)
        default = (self.tls and self.port == 443) or (not self.tls and self.port == 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if default else f"{host}:{self.port}"
        self.prefix = u.path.rstrip("/") + "/"
        base = u.path.rstrip("/")  # the server root (without a trailing /v1): where a path with a leading '/' goes
        self.root = base[:-3] if base.endswith("/v1") else base


def _head(method: str, target: str, host: str, headers: dict[str, str], length: int | None) -> bytes:
    lines = [f"{method} {target} HTTP/1.1\r\nhost: {host}\r\n"]
    if length is not None:
        lines.append(f"content-length: {length}\r\n")
    for k, v in headers.items():
        if "\r" in v or "\n" in v or "\r" in k or "\n" in k or ":" in k:
            raise ValueError(f"invalid upstream header {k!r}")  # never let a value split the request
        lines.append(f"{k}: {v}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


class _Response:
    """One response being received on a connection; the body is handed over as the parser produces it."""

    __slots__ = ("status", "headers", "_conn", "_chunks", "_buffered", "_done", "_error", "_wake", "_closed",
                 "_wait_limit", "_timer", "_push", "_push_error", "_last_push")

    def __init__(self, conn: "_Conn") -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._conn = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False  # the whole body arrived
        self._error: str | None = None  # the connection broke before the body's end
        self._wake: asyncio.Future[None] | None = None
        self._closed = False
        self._wait_limit: float | None = None  # loop time by which the current read_within wait must get bytes
        self._timer: asyncio.TimerHandle | None = None  # the one lazily re-armed timer behind read_within
        # push mode (`push_within`): the body bytes of each upstream read go to this handler inside the read's
        # callback, with no task switch; it returns False to hand control back to the waiting caller
        self._push: Callable[[bytes], bool] | None = None
        self._push_error: BaseException | None = None
        self._last_push = 0.0  # loop time of the last push (the idle timeout counts from it)

    # -- called by the connection
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER:
            self._conn.pause()
        if self._push is None:  # in push mode the connection hands the read over once it is parsed
            self._notify()

    def _finish(self, error: str | None = None) -> None:
        if not self._done and self._error is None:
            if error is None:
                self._done = True
            else:
                self._error = error
            self._notify()

    def _notify(self) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        """Until the connection's next notice: bytes, the body's end, a break, or a timer's TimeoutError."""
        self._wake = self._conn.loop.create_future()
        try:
            await self._wake
        finally:
            self._wake = None

    async def _next(self) -> bytes | None:
        """The next body bytes, or None at the end; raises UpstreamBroken if the connection broke first."""
        while not self._chunks:
            if self._done:
                return None
            if self._error is not None:
                raise UpstreamBroken(self._error)
            await self._wait()
        return self._take()

    def _take(self) -> bytes:
        """The buffered body bytes (at least one piece is buffered)."""
        chunks = self._chunks
        data = chunks.popleft()
        if chunks and len(data) < _JOIN_UP_TO:
            # several reads (or HTTP chunks: one per event from an engine) arrived since the last call: they go
            # on as one piece, so the caller parses, times and writes them downstream once
            parts = [data]
            n = len(data)
            while chunks and n < _JOIN_UP_TO:
                d = chunks.popleft()
                parts.append(d)
                n += len(d)
            data = b"".join(parts)
        self._buffered -= len(data)
        if self._conn.paused and self._buffered <= _HIGH_WATER // 2:
            self._conn.resume()
        return data

    async def read_within(self, idle_s: float, deadline: float) -> bytes | None:
        """`_next` that raises TimeoutError when no byte arrives within `idle_s` of the call or by `deadline`
        (loop time): the stream's idle and total timeouts without a timer per read. One timer per response,
        armed at the first wait; when it fires during a later wait whose limit is further away it re-arms
        itself there, and when it fires between waits it lapses (the next wait arms it again)."""
        if self._chunks:
            return self._take()  # bytes are here: no wait, no timer
        if self._done:
            return None
        loop = self._conn.loop
        limit = min(loop.time() + idle_s, deadline)
        self._wait_limit = limit
        t = self._timer
        if t is None or t.when() > limit:
            if t is not None:
                t.cancel()
            self._timer = loop.call_at(limit, self._check_wait)
        try:  # _next's wait, inline: one coroutine less to resume per event
            while not self._chunks:
                if self._done:
                    return None
                if self._error is not None:
                    raise UpstreamBroken(self._error)
                self._wake = loop.create_future()
                try:
                    await self._wake
                finally:
                    self._wake = None
        finally:
            self._wait_limit = None
        return self._take()

    def _pushed(self) -> None:
        """Called by the connection after each read it parsed, with body bytes buffered: hand them all to the
        push handler (joined, as `_take` does: one downstream write per upstream read of up to _JOIN_UP_TO). A
        handler that returns False or raises ends push mode and wakes the caller of `push_within`; what is still
        buffered then waits for the next call."""
        handler = self._push
        if handler is None:
            return
        self._last_push = self._conn.loop.time()
        keep = True
        try:
            while keep and self._chunks:  # `_take` joins up to _JOIN_UP_TO: a large read is several pieces
                keep = handler(self._take())
        except BaseException as e:  # noqa: BLE001 - raised to the caller of push_within, in its own task
            self._push_error = e
            keep = False
        if not keep:
            self._push = None
            self._notify()

    async def push_within(self, handler: Callable[[bytes], bool], idle_s: float, deadline: float) -> bool:
        """Push mode: body bytes go to `handler` as each upstream read brings them, inside the connection's
        callback, until the body ends (returns False: same as `read_within` returning None) or the handler
        returns False (returns True: the caller decides what next, e.g. wait for the client to drain). Raises
        TimeoutError when no byte arrives within `idle_s` of the last one or by `deadline` (loop time),
        UpstreamBroken when the connection breaks, and whatever the handler raised. Bytes already buffered are
        pushed first."""
        loop = self._conn.loop
        self._last_push = loop.time()
        if self._chunks:
            self._push = handler
            self._pushed()
            if self._push is None:
                return self._after_push()
        if self._done:
            self._push = None
            return False
        self._push = handler
        self._wait_limit = min(self._last_push + idle_s, deadline)
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(self._wait_limit, self._check_push, idle_s, deadline)
        try:
            while self._push is not None:
                if self._done:
                    return False
                if self._error is not None:
                    raise UpstreamBroken(self._error)
                await self._wait()
            return self._after_push()
        finally:
            self._push = None
            self._wait_limit = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _after_push(self) -> bool:
        err, self._push_error = self._push_error, None
        if err is not None:
            raise err
        return True

    def _check_push(self, idle_s: float, deadline: float) -> None:
        """The push-mode timer: fires at the earliest moment the wait could time out; re-armed from the last
        push when bytes came meanwhile (one timer per stream, not one per event)."""
        self._timer = None
        if self._push is None:
            return
        loop = self._conn.loop
        limit = min(self._last_push + idle_s, deadline)
        if loop.time() >= limit - 0.001:  # call_at may run a little early (the loop's clock resolution)
            w = self._wake
            if w is not None and not w.done():
                w.set_exception(TimeoutError())
        else:
            self._timer = loop.call_at(limit, self._check_push, idle_s, deadline)

    def _check_wait(self) -> None:
        self._timer = None
        limit = self._wait_limit
        if limit is None:  # fired between waits
            return
        loop = self._conn.loop
        if loop.time() >= limit - 0.001:  # call_at may run a little early (the loop's clock resolution)
            w = self._wake
            if w is not None and not w.done():
                w.set_exception(TimeoutError())
        else:
            self._timer = loop.call_at(limit, self._check_wait)

    # -- the transport interface (gateway/proxy/transport.py UpstreamResponse)
    async def aread(self) -> bytes:
        parts = []
        while (data := await self._next()) is not None:
            parts.append(data)
        return b"".join(parts)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while (data := await self._next()) is not None:
            yield data

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._conn.done_with(self, reusable=self._done and not self._chunks)

    def abort(self) -> None:
        """Close the connection whatever was read (gateway/proxy/transport.py `abort`); no-op once closed."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._conn.done_with(self, reusable=False)


class _Conn(asyncio.Protocol):
    """One upstream connection: sends a request, parses the response into its _Response."""

    def __init__(self, pool: "H1Transport", loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: _Response | None = None
        self.headers_ready: asyncio.Future[None] | None = None
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.lost = False
        self.paused = False
        self.idle_since = 0.0
        self.until_close = False  # a body delimited by the connection's end (no length, not chunked)
        self.counted = False  # holds one of the pool's slots (set once the connection is established)
        self.sent = 0  # requests written on this connection
        self.got_bytes = False  # any byte of the current request's response arrived

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.resp is None or self.resp._done:  # bytes after the response's end: out of sync, drop it
            self.keep_alive = False
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._broken(f"invalid HTTP response from upstream ({type(e).__name__})")
            self.close()
            return
        resp = self.resp
        if resp is not None and resp._push is not None and resp._chunks:
            resp._pushed()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.resp is not None and self.until_close and exc is None and self.headers_ready is None:
            self.resp._finish()  # the body ran to the connection's end, as its framing said
        else:
            self._broken("upstream closed the connection" if exc is None else f"{type(exc).__name__}")
        self.pool._lost(self)

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp is None or self.headers_ready is None:  # a second response to one request: never reuse
            self.keep_alive = False
            self.raw_headers = []
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim response (we never send Expect): wait for the final one
            self.raw_headers = []
            return
        resp.status = status
        h: dict[str, str] = {}
        for k, v in self.raw_headers:
            name = k.decode("latin-1").lower()
            if name not in h:
                h[name] = v.decode("latin-1")
        resp.headers = h
        self.raw_headers = []
        self.keep_alive = self.parser.should_keep_alive()
        self.until_close = "content-length" not in h and "chunked" not in h.get("transfer-encoding", "").lower()
        fut, self.headers_ready = self.headers_ready, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        if resp is not None and self.headers_ready is None and not resp._done:
            resp._feed(body)

    def on_message_complete(self) -> None:
        if self.resp is not None and self.headers_ready is None:
            self.until_close = False
            self.resp._finish()

    # -- helpers
    def _broken(self, why: str) -> None:
        fut, self.headers_ready = self.headers_ready, None
        if fut is not None and not fut.done():
            fut.set_exception(UpstreamBroken(why))
        if self.resp is not None:
            self.resp._finish(why)

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.lost:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.close()

    def usable(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    async def request(self, data: bytes) -> _Response:
        self.sent += 1
        self.got_bytes = False
        if not self.usable():  # closed by the upstream since it was handed out: nothing was sent
            raise UpstreamBroken("upstream closed the connection")
        resp = _Response(self)
        self.resp = resp
        self.until_close = False
        self.headers_ready = self.loop.create_future()
        self.transport.write(data)  # type: ignore[union-attr]
        await self.headers_ready
        return resp

    def done_with(self, resp: _Response, reusable: bool) -> None:
        """The caller is finished with `resp`: keep the connection for the next request or close it."""
        if self.resp is not resp:
            return
        self.resp = None
        if reusable and self.keep_alive and self.usable():
            self.resume()
            self.pool._release(self)
        else:
            self.close()


class H1Transport:
    """The pool for one backend (see the module docstring). Implements gateway.proxy.transport.Transport."""

    def __init__(self, b: BackendConfig) -> None:
        self._ep = _Endpoint(b.url)
        self._max = max(1, b.limits.max_connections)
        self._expiry = b.limits.keepalive_expiry_s
        self._connect_s = b.timeouts.connect_s
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self._ep.tls else None
        self._idle: list[_Conn] = []  # LIFO: the most recently used connection is the least likely to be stale
        self._count = 0  # open + opening connections
        self._waiters: collections.deque[asyncio.Future[_Conn | None]] = collections.deque()
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    # -- pool
    async def _acquire(self) -> _Conn:
        while True:
            now = time.monotonic()
            while self._idle:
                c = self._idle.pop()
                if c.usable() and now - c.idle_since < self._expiry:
                    return c
                c.close()
            if self._count < self._max:
                self._count += 1
                return await self._connect()
            fut: asyncio.Future[_Conn | None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                async with asyncio.timeout(self._connect_s):
                    got = await fut
            except BaseException:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self._give_back(fut.result())  # handed a connection (or a slot) we will not use
                else:
                    fut.cancel()
                raise
            if got is None:  # a connection closed and its slot was handed to us (already counted)
                return await self._connect()
            if got.usable():
                return got
            # handed a connection that the upstream closed before we could use it: try again

    async def _connect(self) -> _Conn:
        """Open a connection in an already counted slot; on failure the slot is freed."""
        loop = asyncio.get_running_loop()
        ep = self._ep
        try:
            async with asyncio.timeout(self._connect_s):
                _, conn = await loop.create_connection(lambda: _Conn(self, loop), ep.host, ep.port, ssl=self._ssl,
                                                       server_hostname=ep.host if self._ssl else None)
        except BaseException:
            self._count -= 1
            self._wake_waiter()
            raise
        conn.counted = True
        return conn

    def _give_back(self, got: _Conn | None) -> None:
        if got is None:  # an unused slot
            self._count -= 1
            self._wake_waiter()
        else:
            self._release(got)

    def _release(self, c: _Conn) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(c)
                return
        if self._closed:
            c.close()
            return
        c.idle_since = time.monotonic()
        self._idle.append(c)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self._expiry, self._expire)

    def _wake_waiter(self) -> None:
        while self._waiters and self._count < self._max:
            w = self._waiters.popleft()
            if not w.done():
                self._count += 1
                w.set_result(None)

    def _expire(self) -> None:
        self._sweep = None
        cutoff = time.monotonic() - self._expiry
        keep = []
        for c in self._idle:
            if c.idle_since > cutoff and c.usable():
                keep.append(c)
            else:
                c.close()
        self._idle = keep
        if keep:
            self._sweep = asyncio.get_running_loop().call_later(self._expiry, self._expire)

    def _lost(self, c: _Conn) -> None:
        if not c.counted:  # never handed out (its connect failed or was cancelled): _connect freed the slot
            return
        c.counted = False
        self._count -= 1
        if c in self._idle:
            self._idle.remove(c)
        self._wake_waiter()

    # -- requests
    async def _send(self, method: str, target: str, headers: dict[str, str], body: bytes | None) -> _Response:
        data = _head(method, target, self._ep.host_header, headers, None if body is None else len(body))
        if body:
            data += body
        for attempt in (1, 2):
            try:
                conn = await self._acquire()
            except (TimeoutError, OSError) as e:
                raise UpstreamConnectError(type(e).__name__) from None
            try:
                return await conn.request(data)
            except UpstreamBroken:
                conn.resp = None
                conn.close()
                # A kept-alive connection the upstream closed just as it was reused (its idle timeout, e.g.
                # uvicorn's 5 s, met our request on the wire): no byte of an answer came, so the request is
                # sent once more on another connection, as the dispatcher would send it to another backend.
                if attempt == 1 and conn.sent > 1 and not conn.got_bytes:
                    continue
                raise
            except BaseException:
                conn.resp = None
                conn.close()  # cancelled or broken mid-request: the connection's state is unknown
                raise
        raise AssertionError("unreachable")

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> _Response:
        ep = self._ep
        return await self._send("POST", (ep.root if path[:1] == "/" else ep.prefix) + path, headers, body)

    async def get(self, url: str, timeout: float) -> int:
        u = urlsplit(url)
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        try:
            async with asyncio.timeout(timeout):
                resp = await self._send("GET", target, {}, None)
                try:
                    await resp.aread()
                finally:
                    await resp.aclose()
        except TimeoutError as e:
            raise UpstreamBroken(type(e).__name__) from None
        return resp.status

    async def aclose(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        idle, self._idle = self._idle, []
        for c in idle:
            c.close()
        for w in self._waiters:
            if not w.done():
                w.set_exception(UpstreamConnectError("upstream client closed"))
        self._waiters.clear()
