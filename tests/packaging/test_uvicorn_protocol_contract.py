"""gateway/server_protocol.py against uvicorn's real HttpToolsProtocol, in process, on a fake transport.

tests/packaging/test_uvicorn_pin.py checks the pin and the signatures of the methods the subclass overrides;
this checks the rest of the private contract the subclass relies on, which a signature check cannot see: the
per-connection and per-request attributes it reads from the base (`loop`, `transport`, `flow`, `headers`,
`scope`, `cycle` with `response_complete` and a writable `transport`), that an exception raised from a parser
callback reaches `send_400_response` (how 431 and 501 are answered), that the base calls
`on_response_complete` when a response ends, and that `connection_lost` sees the unfinished cycle. A uvicorn
release that renames or reorders any of these fails here, not on a client's connection. (The same behaviours
end to end over real sockets: tests/hardening/test_raw_http.py.)"""
from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
import uvicorn
from uvicorn.server import ServerState

from gateway.server_protocol import GatewayHttpProtocol, _LingerOnClose, protocol_class, response_started, write_response


class FakeTransport(asyncio.Transport):
    """Records what the protocol writes (and in how many writes) and how it ends the connection."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.writes = 0
        self.closed = False
        self.eof_written = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "write after close"
        self.out += data
        self.writes += 1

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8080)}.get(name, default)

    def status(self) -> int:
        return int(bytes(self.out).split(b" ", 2)[1])

    def body(self) -> bytes:
        return bytes(self.out).split(b"\r\n\r\n", 1)[1]


class App:
    """An ASGI app that keeps each scope it got, reads the body only when asked, and answers 200 or 413."""

    def __init__(self, read_body: bool = True, status: int = 200, hold: asyncio.Event | None = None) -> None:
        self.scopes: list[dict[str, Any]] = []
        self.read_body, self.status, self.hold = read_body, status, hold

    async def __call__(self, scope, receive, send) -> None:
        self.scopes.append(scope)
        if self.read_body:
            more = True
            while more:
                msg = await receive()
                more = msg.get("more_body", False)
        if self.hold is not None:
            await self.hold.wait()
        body = b'{"ok":true}'
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def connect(app: App, **limits: Any) -> tuple[GatewayHttpProtocol, FakeTransport]:
    """What uvicorn's server does per accepted connection, with the configured protocol class cli.py builds."""
    cls = protocol_class(limits.get("max_header_bytes", 32 * 1024), limits.get("max_headers", 256),
                         limits.get("header_timeout_s", 10.0))
    config = uvicorn.Config(app, http=cls, lifespan="off", log_config=None, access_log=False)
    config.load()
    assert config.http_protocol_class is cls  # uvicorn still takes a protocol class through http=
    proto = cls(config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop())
    t = FakeTransport()
    proto.connection_made(t)
    return proto, t


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


POST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n")


async def test_a_request_gets_the_gateway_scope_keys_and_a_lingering_transport():
    app = App()
    proto, t = connect(app)
    body = b'{"model":"m"}'
    proto.data_received(POST % len(body) + body)
    await settle()
    [scope] = app.scopes
    assert scope["gateway.conn"] is proto  # on_headers_complete: self.scope is the scope the app gets
    assert scope["gateway.body_complete"] is True  # on_message_complete runs after the base buffered the body
    assert scope["path"] == "/v1/chat/completions" and scope["method"] == "POST"
    assert isinstance(proto.cycle.transport, _LingerOnClose)  # the base's cycle writes through a settable transport
    assert t.status() == 200 and orjson.loads(t.body()) == {"ok": True}
    assert proto.cycle.response_complete and not t.closed  # on_response_complete: kept alive
    assert proto._header_timer is None  # armed on self.loop at connection_made/on_message_begin, cancelled once
    # the headers were in; a second request on the kept-alive connection goes through the same hooks
    proto.data_received(POST % len(body) + body)
    await settle()
    assert len(app.scopes) == 2 and app.scopes[1]["gateway.conn"] is proto
    assert bytes(t.out).count(b"HTTP/1.1 200") == 2


@pytest.mark.parametrize("head, status, code", [
    (b"x-h: " + b"a" * 40_000 + b"\r\n", 431, "headers_too_large"),
    (b"".join(b"x-h%d: v\r\n" % i for i in range(300)), 431, "too_many_headers"),
    (b"transfer-encoding: gzip, chunked\r\n", 501, "unsupported_transfer_encoding"),
])
async def test_a_refusal_raised_in_a_parser_callback_is_answered_by_send_400_response(head, status, code):
    app = App()
    proto, t = connect(app)
    proto.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n" + head + b"\r\n")
    await settle()
    assert t.status() == status and t.closed, bytes(t.out)[:200]
    assert orjson.loads(t.body())["error"]["code"] == code
    assert app.scopes == []  # the app never ran


async def test_a_parse_error_is_openai_shaped_not_uvicorns_plain_text():
    proto, t = connect(App())
    proto.data_received(b"POST / HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab")  # smuggling
    await settle()
    assert t.status() == 400 and b"application/json" in bytes(t.out) and t.closed
    assert orjson.loads(t.body())["error"]["code"] == "invalid_http_request"


async def test_the_header_timer_runs_on_the_bases_loop_and_answers_408():
    proto, t = connect(App(), header_timeout_s=0.05)
    proto.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n")  # and nothing more
    await asyncio.sleep(0.2)
    assert t.status() == 408 and t.closed
    assert orjson.loads(t.body())["error"]["code"] == "request_timeout"


async def test_a_response_before_the_body_lingers_instead_of_resetting():
    proto, t = connect(App(read_body=False, status=413))
    proto.data_received(POST % 100_000 + b"x" * 1000)  # most of the body still to come
    await settle()
    assert t.status() == 413
    assert t.eof_written and not t.closed  # half-closed: the client reads the 413, then may finish its upload
    proto.data_received(b"x" * 99_000)  # dropped while lingering, never parsed as a next request
    assert t.status() == 413 and bytes(t.out).count(b"HTTP/1.1") == 1
    proto.connection_lost(None)
    assert proto._linger_timer is None


async def test_on_lost_fires_when_the_client_leaves_mid_request_only():
    hold = asyncio.Event()
    proto, t = connect(App(hold=hold))
    proto.data_received(POST % 2 + b"{}")
    await settle()
    lost: list[bool] = []
    proto.on_lost = lambda: lost.append(True)
    proto.connection_lost(ConnectionResetError())  # response not complete: the handler learns of it
    assert lost == [True] and proto.cycle.disconnected
    hold.set()
    await settle()

    hold2 = asyncio.Event()
    hold2.set()
    proto, t = connect(App(hold=hold2))
    proto.data_received(POST % 2 + b"{}")
    await settle()
    proto.on_lost = lambda: lost.append(False)
    proto.connection_lost(None)  # the response was complete: nothing to tell
    assert lost == [True]


class OneWriteApp:
    """Answers with write_response (the data plane's JSON path) and records whether it took the one write, then
    falls back to the two ASGI messages as gateway/api/ingress.py send_bytes does."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers
        self.took: list[bool] = []
        self.started_before: list[bool | None] = []

    async def __call__(self, scope, receive, send) -> None:
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        body = b'{"ok":true}'
        self.started_before.append(response_started(send))
        took = write_response(send, 200, b"application/json", self.headers, body)
        self.took.append(took)
        if not took:
            raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
            await send({"type": "http.response.start", "status": 200, "headers": raw})
            await send({"type": "http.response.body", "body": body})


async def _answer(app: Any, request: bytes = POST % 2 + b"{}") -> FakeTransport:
    proto, t = connect(app)
    proto.server_state.default_headers = [(b"server", b"uvicorn")]  # what uvicorn sets when it starts (no date:
    # it changes every second and would make the two runs differ)
    proto.data_received(request)
    await settle()
    return t


@pytest.mark.parametrize("headers", [
    {"x-request-id": "req_1", "Server-Timing": "gw;dur=0.100, upstream;dur=1.000"},
    {"x-request-id": "req_2", "connection": "close"},
    {},
])
async def test_write_response_sends_what_uvicorns_two_messages_send_in_one_write(headers):
    fast = OneWriteApp(headers)
    t1 = await _answer(fast)
    assert fast.took == [True] and fast.started_before == [False]
    assert t1.writes == 1  # status line, headers and body in one syscall


    class Plain(OneWriteApp):  # uvicorn's own send for the same response: the bytes must be the same
        async def __call__(self, scope, receive, send) -> None:
            more = True
            while more:
                more = (await receive()).get("more_body", False)
            body = b'{"ok":true}'
            raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
            await send({"type": "http.response.start", "status": 200, "headers": raw})
            await send({"type": "http.response.body", "body": body})

    t2 = await _answer(Plain(headers))
    assert t2.writes == 2
    assert bytes(t1.out) == bytes(t2.out)
    assert t1.closed == t2.closed == ("connection" in headers)  # keep-alive unless the response says close


async def test_write_response_keeps_the_connection_serving_the_next_request():
    app = OneWriteApp({"x-request-id": "a"})
    proto, t = connect(app)
    proto.data_received(POST % 2 + b"{}")
    await settle()
    proto.data_received(POST % 2 + b"{}")
    await settle()
    assert app.took == [True, True] and bytes(t.out).count(b"HTTP/1.1 200") == 2 and not t.closed
    assert proto.cycle.response_complete


@pytest.mark.parametrize("headers", [{"x-evil": "a\r\nset-cookie: x=1"}, {"bad name": "v"}])
async def test_write_response_leaves_an_invalid_header_to_uvicorn_which_refuses_it(headers):
    app = OneWriteApp(headers)
    t = await _answer(app)
    assert app.took == [False]  # nothing written by the fast path
    assert b"set-cookie" not in bytes(t.out) and b"HTTP/1.1 200" not in bytes(t.out)  # uvicorn's send raised


async def test_write_response_is_not_taken_for_head_or_a_started_response_or_another_server():
    app = OneWriteApp({})
    await _answer(app, b"HEAD /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 0\r\n\r\n")
    assert app.took == [False]

    async def plain_send(msg: Any) -> None:  # not a uvicorn cycle (another ASGI server, a test transport)
        raise AssertionError("not called")

    assert write_response(plain_send, 200, b"application/json", {}, b"{}") is False
    assert response_started(plain_send) is None


async def test_headers_in_one_read_arm_no_header_timer_and_a_partial_head_arms_one():
    """The header timer (slow-loris) restarts at each request, but only a request whose headers did not all come
    in the read that began it needs one: a kept-alive client's ordinary request arms and cancels no timer."""
    hold = asyncio.Event()
    proto, t = connect(App(hold=hold))
    armed: list[bool] = []
    arm = proto._arm_header_timer
    proto._arm_header_timer = lambda: (armed.append(True), arm())[1]  # type: ignore[method-assign]
    proto.data_received(POST % 2 + b"{}")
    assert proto._header_timer is None  # headers complete in the read: the connection's timer was cancelled
    assert armed == []  # ... and none was armed for the request
    hold.set()
    await settle()
    assert t.status() == 200
    proto.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n")  # the next request, half a head
    assert proto._header_timer is not None and armed == [True]
    proto.data_received(b"content-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
    assert proto._header_timer is None
    await settle()
    assert bytes(t.out).count(b"HTTP/1.1 200") == 2


async def test_a_partial_head_after_a_response_still_times_out():
    proto, t = connect(App(), header_timeout_s=0.05)
    proto.data_received(POST % 2 + b"{}")
    await settle()
    proto.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n")  # and nothing more
    await asyncio.sleep(0.2)
    assert bytes(t.out).count(b"HTTP/1.1 408") == 1 and t.closed


def _keep_alive(proto: GatewayHttpProtocol, seconds: float) -> list[bool]:
    """Set the connection's keep-alive timeout and count the timers armed for it."""
    proto.timeout_keep_alive = seconds
    armed: list[bool] = []
    call_later = proto.loop.call_later

    class Loop:  # the protocol's loop, counting call_later for the keep-alive callback only
        def __getattr__(self, name: str) -> Any:
            return getattr(proto.__dict__["_real_loop"], name)

        def call_later(self, delay: float, cb: Any, *args: Any) -> Any:
            if getattr(cb, "__name__", "") == "_keep_alive_fired":
                armed.append(True)
            return call_later(delay, cb, *args)

    proto.__dict__["_real_loop"] = proto.loop
    proto.loop = Loop()  # type: ignore[assignment]
    return armed


async def test_an_idle_kept_alive_connection_closes_after_the_keep_alive_timeout():
    proto, t = connect(App())
    _keep_alive(proto, 0.05)
    proto.data_received(POST % 2 + b"{}")
    await settle()
    assert t.status() == 200 and not t.closed
    await asyncio.sleep(0.15)
    assert t.closed  # idle past the timeout: closed, as uvicorn's own timer would


async def test_a_busy_connection_arms_one_keep_alive_timer_not_one_per_response_and_stays_open():
    proto, t = connect(App())
    armed = _keep_alive(proto, 0.5)
    for _ in range(8):  # a request every 50 ms: never idle for 500 ms
        proto.data_received(POST % 2 + b"{}")
        await settle()
        await asyncio.sleep(0.05)
    assert bytes(t.out).count(b"HTTP/1.1 200") == 8 and not t.closed
    assert 1 <= len(armed) <= 3  # the first response armed it; it re-arms only when it fires (every ~500 ms)
    await asyncio.sleep(1.0)
    assert t.closed  # then idle: closed about 500 ms after the last response


async def test_a_lost_connection_cancels_its_keep_alive_timer():
    proto, t = connect(App())
    _keep_alive(proto, 30.0)
    proto.data_received(POST % 2 + b"{}")
    await settle()
    assert proto.timeout_keep_alive_task is not None
    proto.connection_lost(None)
    assert proto.timeout_keep_alive_task is None
