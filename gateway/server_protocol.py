"""The HTTP/1.1 server protocol the gateway runs under uvicorn: httptools plus the limits uvicorn lacks.

uvicorn's httptools protocol answers unparseable requests (smuggling attempts such as Content-Length with
Transfer-Encoding, duplicate Content-Length, bare CR/LF in headers) with a plain-text 400, enforces no header
size or count limit (its h11 limit does not apply to httptools) and waits forever for a client that sends its
headers byte by byte (slow-loris). This subclass keeps every refusal OpenAI-shaped and adds:
431 past `max_header_bytes` or `max_headers`, and 408 when the request line and headers are not complete
within `header_timeout_s` of the connection opening or the request starting; 501 for a Transfer-Encoding other
than `chunked` alone (llhttp reads `gzip, chunked` as plain chunked); and a lingering close after a response
sent before the body was read (413, 408), so the client gets the answer instead of a connection reset.

It also puts itself in every request's scope (`scope["gateway.conn"]`) so a data-plane handler can register
`on_lost`, called once when the client's connection drops before the response is complete: the handler
learns of a vanished client from the connection itself instead of keeping a task blocked on `receive()` for
every request (a task per request, a visible share of the CPU at saturation).
"""
from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from gateway.errors import GatewayError

_STATUS_TEXT = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
                501: b"Not Implemented"}

# Lingering close (nginx's lingering_close): when a response ends before the request body was read (a 413, a
# 408), the connection is half-closed (FIN after the response) and up to LINGER_BYTES more of the body are read
# and dropped, for at most LINGER_S, before it is closed. Closing at once with unread bytes in the kernel buffer
# sends a TCP reset, and a client still uploading saw "connection reset" instead of the 413.
LINGER_BYTES = 16 * 1024 * 1024
LINGER_S = 5.0


def transfer_coding_refusal(values: list[bytes]) -> tuple[int, str, str] | None:
    """RFC 9112 6.1/6.3 for a request's Transfer-Encoding field(s): the gateway implements only `chunked`, which
    must come last and once. Another coding (gzip, deflate, ...) is a 501; `chunked` repeated or not last is a
    400 (the body length cannot be determined). None when the field is absent or exactly `chunked`."""
    if not values:
        return None
    codings = [c.strip().lower() for v in values for c in v.split(b",")]
    unknown = sorted({c.decode("latin-1") for c in codings if c != b"chunked"})
    if unknown:
        return (501, f"Transfer-Encoding {', '.join(unknown)} is not implemented; send the body with chunked "
                     "alone (or Content-Length).", "unsupported_transfer_encoding")
    if len(codings) != 1:
        return (400, "Transfer-Encoding must name chunked once, as the last coding.", "invalid_http_request")
    return None


class _LingerOnClose:
    """The transport as the request's response cycle sees it: `close()` after the response lingers (see
    LINGER_BYTES) while the request body is unread, instead of resetting the connection. What the cycle calls
    on every response (`write`, `is_closing`) is the transport's own bound method, not a `__getattr__` hop."""

    __slots__ = ("_transport", "_protocol", "write", "is_closing")

    def __init__(self, transport: asyncio.Transport, protocol: "GatewayHttpProtocol") -> None:
        self._transport = transport
        self._protocol = protocol
        self.write = transport.write
        self.is_closing = transport.is_closing

    def close(self) -> None:
        self._protocol._close_lingering()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def write_response(send: Any, status: int, content_type: bytes, headers: dict[str, str], body: bytes) -> bool:
    """Write a whole response (status line, headers, body) with one transport write, when `send` is the send of
    a uvicorn httptools response cycle that has not started a response. What uvicorn's own `send` would do for
    the two ASGI messages `http.response.start` and a final `http.response.body`, with the same header checks
    (one regex pass over all names and one over all values instead of two per header), the same keep-alive
    and `connection: close` rules and the same completion callbacks, minus one syscall and the per-message
    dispatch. False (nothing written) when the response must take the ASGI path: another server, a response
    already started, a disconnected client, paused writing, uvicorn's access log on, or a HEAD request."""
    cycle = getattr(send, "__self__", None)
    if type(cycle) is not RequestResponseCycle or cycle.response_started or cycle.disconnected \
            or cycle.flow.write_paused or cycle.access_log or cycle.scope["method"] == "HEAD":
        return False
    names = "".join(headers).encode("latin-1")
    values = "\t".join(headers.values()).encode("latin-1")  # a tab is a valid value byte: it joins, never hides
    if HEADER_RE.search(names) or HEADER_VALUE_RE.search(values):
        return False  # uvicorn's send raises on it: let it
    parts = [STATUS_LINE[status]]
    for dname, dvalue in cycle.default_headers:
        parts += (dname, b": ", dvalue, b"\r\n")
    parts += (b"content-type: ", content_type, b"\r\ncontent-length: ", b"%d" % len(body), b"\r\n")
    close = False
    for k, v in headers.items():
        name = k.lower()
        if name == "connection" and "close" in [t.strip() for t in v.lower().split(",")]:
            close = True
            cycle.keep_alive = False
        parts += (name.encode("latin-1"), b": ", v.encode("latin-1"), b"\r\n")
    if not cycle.keep_alive and not close:
        parts.append(b"connection: close\r\n")
    parts += (b"\r\n", body)
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    cycle.transport.write(b"".join(parts))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()
    return True


class DirectBody:
    """A started chunked response's body written straight to the connection's transport: what uvicorn's `send`
    does for an `http.response.body` message with `more_body`, minus the ASGI message and the coroutine, so a
    stream relayed in push mode (gateway/proxy/forward.py) writes each upstream read from inside the upstream
    connection's callback. The caller honours `paused` (awaiting `drain`) between reads, as `send` would."""

    __slots__ = ("_cycle", "_write")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        self._write = cycle.transport.write

    def write(self, body: bytes) -> None:
        if body and not self._cycle.disconnected:
            self._write(b"%x\r\n%b\r\n" % (len(body), body))

    @property
    def paused(self) -> bool:
        return self._cycle.flow.write_paused and not self._cycle.disconnected

    @property
    def gone(self) -> bool:
        """The client's connection is lost (its task is being cancelled): relay and count nothing more."""
        return self._cycle.disconnected

    async def drain(self) -> None:
        await self._cycle.flow.drain()


def direct_body(send: Any) -> DirectBody | None:
    """A DirectBody for the response behind `send`, when it is a uvicorn httptools response cycle whose chunked
    response has started and not ended (None: the caller sends ASGI messages)."""
    cycle = getattr(send, "__self__", None)
    if type(cycle) is not RequestResponseCycle or not cycle.response_started or cycle.response_complete \
            or not cycle.chunked_encoding or cycle.scope["method"] == "HEAD":
        return None
    return DirectBody(cycle)


def response_started(send: Any) -> bool | None:
    """Whether the uvicorn httptools response cycle behind `send` has started its response (None: `send` is not
    one, the caller must track the messages itself)."""
    cycle = getattr(send, "__self__", None)
    return cycle.response_started if type(cycle) is RequestResponseCycle else None


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; `send_400_response` answers with `_refusal`."""


def error_bytes(status: int, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 response carrying an OpenAI-shaped error, closing the connection."""
    body = GatewayError(status, message, code=code).to_bytes()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, _STATUS_TEXT.get(status, b"Error"), len(body))) + body


class GatewayHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with header limits, a header timeout and OpenAI-shaped protocol errors."""

    max_header_bytes: int = 32 * 1024
    max_headers: int = 256
    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_bytes = 0
        self._header_count = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._headers_pending = False  # a request began in the bytes being parsed; its headers are not complete
        self._idle_since: float | None = None  # loop time the last response completed; None while busy
        self._refusal: tuple[int, str, str] | None = None
        self.on_lost: Any = None  # set by the request being served: called once if the client goes away mid-request
        self._body_done = True  # the current request's body was read to its end (or it has none)
        self._linger_left = 0  # > 0 while lingering: body bytes still to drop before closing
        self._linger_timer: asyncio.TimerHandle | None = None

    # ---- header timeout (slow-loris)
    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(error_bytes(408, f"Request headers not received within {self.header_timeout_s:g} s.",
                                             "request_timeout"))
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        cb, self.on_lost = self.on_lost, None
        pending = self.cycle is not None and not self.cycle.response_complete
        super().connection_lost(exc)
        if cb is not None and pending:
            cb()

    # ---- lingering close
    def _close_lingering(self) -> None:
        t = self.transport
        if self._linger_left > 0:  # already lingering
            return
        if self._body_done or t.is_closing():
            t.close()
            return
        self._linger_left = LINGER_BYTES
        self._cancel_header_timer()
        try:
            if t.can_write_eof():
                t.write_eof()  # the client sees the response end at once, then may finish its upload
        except (OSError, RuntimeError):
            t.close()
            return
        self._linger_timer = self.loop.call_later(LINGER_S, t.close)
        self.flow.resume_reading()

    def on_response_complete(self) -> None:
        if self._linger_left > 0:  # lingering before the close: no keep-alive, no next request
            return
        if not self._body_done and not self.transport.is_closing():
            # a response sent before its request body was read (on a kept-alive connection too): the rest of
            # the body is not read without bound, the connection lingers and closes
            self._close_lingering()
            return
        # uvicorn's on_response_complete, but with one keep-alive timer per connection instead of one armed per
        # response and cancelled by the next request's first read (a uvloop timer per request): the connection is
        # idle from now, and the timer, armed only if none is, closes it once it has been idle that long
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_fired)

    def _unset_keepalive_if_required(self) -> None:
        """uvicorn calls this on every read (the connection is busy) and when the connection is lost. Busy: the
        timer stays armed and lapses when it fires; lost or closing: it is cancelled."""
        self._idle_since = None
        t = self.timeout_keep_alive_task
        if t is not None and (self.transport is None or self.transport.is_closing()):
            t.cancel()
            self.timeout_keep_alive_task = None

    def _keep_alive_fired(self) -> None:
        self.timeout_keep_alive_task = None
        since = self._idle_since
        if since is None:  # a request is being served: the response's completion arms the timer again
            return
        left = since + self.timeout_keep_alive - self.loop.time()
        if left > 0:  # idle for less than the timeout (a request came and went since this was armed)
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_fired)
        else:
            self.timeout_keep_alive_handler()

    def data_received(self, data: bytes) -> None:
        if self._linger_left > 0:  # the response is sent: drop the rest of the body, close when the bound is hit
            self._linger_left -= len(data)
            if self._linger_left <= 0:
                self.transport.close()
            return
        super().data_received(data)
        if self._headers_pending:  # a request began in these bytes and its headers are not all in: time them
            self._headers_pending = False
            if not self.transport.is_closing():
                self._arm_header_timer()

    # ---- parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._header_count = 0
        self._body_done = False
        # the header timer restarts from here, armed once these bytes are parsed (data_received) and only if
        # the headers are still incomplete then: a request whose headers came in one read, the usual case, never
        # arms one (arming and cancelling a uvloop timer is work on every request)
        self._headers_pending = True

    def on_url(self, url: bytes) -> None:
        self._header_bytes += len(url)
        if self._header_bytes > self.max_header_bytes:
            self._refusal = (431, "Request line and headers are larger than the limit.", "headers_too_large")
            raise _Refused()
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value) + 4
        self._header_count += 1
        if self._header_bytes > self.max_header_bytes:
            self._refusal = (431, f"Request headers are larger than the limit of {self.max_header_bytes} bytes.",
                             "headers_too_large")
            raise _Refused()
        if self._header_count > self.max_headers:
            self._refusal = (431, f"More than {self.max_headers} request headers.", "too_many_headers")
            raise _Refused()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._headers_pending = False
        self._cancel_header_timer()
        refusal = transfer_coding_refusal([v for k, v in self.headers if k == b"transfer-encoding"])
        if refusal is not None:  # llhttp reads "gzip, chunked" as chunked: refuse what we cannot decode
            self._refusal = refusal
            raise _Refused()  # an exception from a callback ends parsing; send_400_response answers
        self.scope["gateway.conn"] = self  # type: ignore[typeddict-unknown-key]
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and not isinstance(cycle.transport, _LingerOnClose):
            cycle.transport = _LingerOnClose(self.transport, self)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        self._body_done = True
        super().on_message_complete()
        # the whole body is buffered: the handler reads it without arming its body timeout (a timer per request)
        self.scope["gateway.body_complete"] = True  # type: ignore[typeddict-unknown-key]

    # ---- refusals
    def send_400_response(self, msg: str) -> None:
        self._cancel_header_timer()
        status, message, code = self._refusal or (
            400, "Malformed HTTP request (conflicting or invalid framing headers are refused).", "invalid_http_request")
        self._refusal = None
        self.transport.write(error_bytes(status, message, code))
        self.transport.close()


def protocol_class(max_header_bytes: int, max_headers: int, header_timeout_s: float) -> type[GatewayHttpProtocol]:
    """A GatewayHttpProtocol subclass carrying the configured limits (uvicorn instantiates the class itself)."""
    return type("ConfiguredGatewayHttpProtocol", (GatewayHttpProtocol,),
                {"max_header_bytes": max_header_bytes, "max_headers": max_headers,
                 "header_timeout_s": header_timeout_s})
