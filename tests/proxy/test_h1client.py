"""The native HTTP/1.1 upstream client (gateway/proxy/h1client.py) against a real TCP server in this process:
framing (Content-Length, chunked, until-close, interim 1xx), the keep-alive pool (reuse, limit, waiting,
idle expiry, stale connections), failures (refused, closed mid-body, garbage, cancellation), back-pressure,
header-injection refusal and TLS with SNI."""
from __future__ import annotations

import asyncio
import datetime
import ssl

import msgspec
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gateway.config import BackendConfig
from gateway.proxy.h1client import H1Transport
from gateway.proxy.transport import UpstreamBroken, UpstreamConnectError
from gateway.proxy.upstream import make_transport
from tests.support.procs import free_port


def _ok(body: bytes = b'{"ok":true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n" % (len(body), extra) + body


class Server:
    """Reads one request at a time per connection (head + Content-Length body) and answers with `reply(req)`:
    bytes to write, or a coroutine function (writer, request) for scripted behaviour."""

    def __init__(self, reply) -> None:
        self.reply = reply
        self.connections = 0
        self.open = 0
        self.max_open = 0
        self.requests: list[bytes] = []
        self.closed_by_client = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed_by_client += 1
                    return
                n = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        n = int(line.split(b":", 1)[1])
                req = head + (await reader.readexactly(n) if n else b"")
                self.requests.append(req)
                r = self.reply(req)
                if isinstance(r, bytes):
                    writer.write(r)
                    await writer.drain()
                else:
                    if await r(writer, req) == "close":
                        writer.close()
                        return
        finally:
            self.open -= 1

    async def __aenter__(self) -> "Server":
        self.port = free_port()
        self.srv = await asyncio.start_server(self._handle, "127.0.0.1", self.port, ssl=getattr(self, "ssl", None))
        return self

    async def __aexit__(self, *exc) -> None:
        self.srv.close()


def backend(port: int, scheme: str = "http", host: str = "127.0.0.1", **limits) -> BackendConfig:
    return msgspec.convert({"name": "b", "url": f"{scheme}://{host}:{port}/v1", "models": ["m"],
                            "timeouts": {"connect_s": limits.pop("connect_s", 2.0)}, "limits": limits}, BackendConfig)


async def test_content_length_body_and_keep_alive_reuse_one_connection() -> None:
    async with Server(lambda req: _ok()) as s:
        t = make_transport("native", backend(s.port))
        assert isinstance(t, H1Transport)
        for _ in range(3):
            r = await t.post("chat/completions", b'{"x":1}', {"content-type": "application/json", "x-request-id": "r1"})
            assert r.status == 200 and r.headers["content-type"] == "application/json"
            assert await r.aread() == b'{"ok":true}'
            await r.aclose()
        assert s.connections == 1  # the connection went back to the pool each time
        req = s.requests[0]
        assert req.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        assert f"host: 127.0.0.1:{s.port}\r\n".encode() in req and b"content-length: 7\r\n" in req
        assert b"x-request-id: r1\r\n" in req and req.endswith(b'\r\n\r\n{"x":1}')
        await t.aclose()


async def test_chunked_body_streams_in_pieces_and_reuses_the_connection() -> None:
    async def chunked(w: asyncio.StreamWriter, req: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(3):
            ev = b"data: %d\n\n" % i
            w.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            await w.drain()
            await asyncio.sleep(0.01)
        w.write(b"0\r\n\r\n")

    async with Server(lambda req: chunked) as s:
        t = H1Transport(backend(s.port))
        for _ in range(2):
            r = await t.post("completions", b"{}", {})
            parts = [c async for c in r.aiter_raw()]
            await r.aclose()
            assert b"".join(parts) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n" and len(parts) >= 3
        assert s.connections == 1
        await t.aclose()


async def test_body_delimited_by_close_and_interim_100_response() -> None:
    async def until_close(w: asyncio.StreamWriter, req: bytes) -> str:
        w.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await w.drain()
        return "close"

    async with Server(lambda req: until_close) as s:
        t = H1Transport(backend(s.port))
        r = await t.post("x", b"{}", {})
        assert r.status == 200 and await r.aread() == b"all of it"
        await r.aclose()
        r = await t.post("x", b"{}", {})  # the closed connection was not reused
        assert await r.aread() == b"all of it"
        await r.aclose()
        assert s.connections == 2
        await t.aclose()


async def test_refused_connection_is_a_connect_error() -> None:
    t = H1Transport(backend(free_port()))
    with pytest.raises(UpstreamConnectError):
        await t.post("x", b"{}", {})
    assert t._count == 0
    await t.aclose()


async def test_pool_limit_holds_and_waiters_get_freed_connections() -> None:
    async def slow(w: asyncio.StreamWriter, req: bytes) -> None:
        await asyncio.sleep(0.05)
        w.write(_ok())

    async with Server(lambda req: slow) as s:
        t = H1Transport(backend(s.port, max_connections=2))

        async def one() -> bytes:
            r = await t.post("x", b"{}", {})
            try:
                return await r.aread()
            finally:
                await r.aclose()

        out = await asyncio.gather(*(one() for _ in range(7)))
        assert out == [b'{"ok":true}'] * 7
        assert s.max_open == 2 and s.connections == 2
        await t.aclose()


async def test_waiting_for_a_free_connection_times_out_as_a_connect_error() -> None:
    release = asyncio.Event()

    async def held(w: asyncio.StreamWriter, req: bytes) -> None:
        await release.wait()
        w.write(_ok())

    async with Server(lambda req: held) as s:
        t = H1Transport(backend(s.port, max_connections=1, connect_s=0.2))
        first = asyncio.ensure_future(t.post("x", b"{}", {}))
        await asyncio.sleep(0.05)
        with pytest.raises(UpstreamConnectError):
            await t.post("x", b"{}", {})
        release.set()
        r = await first
        await r.aread()
        await r.aclose()
        r = await t.post("x", b"{}", {})  # the pool still works: the timed-out waiter left no trace
        await r.aread()
        await r.aclose()
        assert s.connections == 1
        await t.aclose()


async def test_upstream_dying_mid_body_raises_broken_and_frees_the_slot() -> None:
    calls = 0

    def reply(req: bytes):
        nonlocal calls
        calls += 1
        if calls == 1:
            async def die(w: asyncio.StreamWriter, req: bytes) -> str:
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
                await w.drain()
                return "close"
            return die
        return _ok()

    async with Server(reply) as s:
        t = H1Transport(backend(s.port, max_connections=1))
        r = await t.post("x", b"{}", {})
        with pytest.raises(UpstreamBroken):
            await r.aread()
        await r.aclose()
        r = await t.post("x", b"{}", {})  # the only slot was freed: a new connection serves this one
        assert await r.aread() == b'{"ok":true}'
        await r.aclose()
        assert s.connections == 2
        await t.aclose()


async def test_garbage_response_is_broken_not_a_crash() -> None:
    async with Server(lambda req: b"SMTP ready\r\n\r\n") as s:
        t = H1Transport(backend(s.port))
        with pytest.raises(UpstreamBroken):
            await t.post("x", b"{}", {})
        await t.aclose()


async def test_abandoned_response_closes_its_connection() -> None:
    async def endless(w: asyncio.StreamWriter, req: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(200):
            w.write(b"5\r\nhello\r\n")
            await w.drain()
            await asyncio.sleep(0.01)

    async with Server(lambda req: endless) as s:
        t = H1Transport(backend(s.port))
        r = await t.post("x", b"{}", {})
        it = r.aiter_raw()
        assert (await it.__anext__()).startswith(b"hello")
        await r.aclose()  # not read to its end: the engine must stop working on it
        for _ in range(100):
            if s.open == 0:
                break
            await asyncio.sleep(0.02)
        assert s.open == 0 and t._count == 0 and not t._idle
        await t.aclose()


async def test_cancelled_request_closes_the_connection_and_frees_the_slot() -> None:
    async def never(w: asyncio.StreamWriter, req: bytes) -> None:
        await asyncio.sleep(30)

    async with Server(lambda req: never) as s:
        t = H1Transport(backend(s.port, max_connections=1))
        task = asyncio.ensure_future(t.post("x", b"{}", {}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if t._count == 0:
                break
            await asyncio.sleep(0.01)
        assert t._count == 0  # the slot is free again
        await t.aclose()


async def test_idle_connections_expire_and_server_closed_ones_are_not_reused() -> None:
    async def then_close(w: asyncio.StreamWriter, req: bytes) -> str:
        w.write(_ok())
        await w.drain()
        await asyncio.sleep(0.05)
        return "close"  # the server ends the idle keep-alive connection (as uvicorn does after 5 s)

    async with Server(lambda req: then_close) as s:
        t = H1Transport(backend(s.port))
        r = await t.post("x", b"{}", {})
        await r.aread()
        await r.aclose()
        await asyncio.sleep(0.2)
        assert not t._idle and t._count == 0  # the closed connection left the pool at once
        r = await t.post("x", b"{}", {})
        assert await r.aread() == b'{"ok":true}'
        await r.aclose()
        await t.aclose()

    async with Server(lambda req: _ok()) as s:
        t = H1Transport(backend(s.port, keepalive_expiry_s=0.1))
        r = await t.post("x", b"{}", {})
        await r.aread()
        await r.aclose()
        assert len(t._idle) == 1
        for _ in range(100):
            if s.open == 0:
                break
            await asyncio.sleep(0.02)
        assert s.open == 0 and not t._idle and t._count == 0  # closed by the client after keepalive_expiry_s
        await t.aclose()


async def test_back_pressure_pauses_reading_and_loses_nothing() -> None:
    big = bytes(range(256)) * (4 * 4096)  # 4 MiB

    async with Server(lambda req: _ok(big)) as s:
        t = H1Transport(backend(s.port))
        r = await t.post("x", b"{}", {})
        got = []
        paused = False
        async for c in r.aiter_raw():
            got.append(c)
            paused = paused or r._conn.paused
            await asyncio.sleep(0.002)  # a slow client
        assert b"".join(got) == big and paused
        await r.aclose()
        await t.aclose()


async def test_header_values_cannot_split_the_request() -> None:
    async with Server(lambda req: _ok()) as s:
        t = H1Transport(backend(s.port))
        with pytest.raises(ValueError):
            await t.post("x", b"{}", {"traceparent": "00-abc\r\nx-injected: 1"})
        assert s.requests == []
        await t.aclose()


def _self_signed(tmp_path) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    cp, kp = tmp_path / "cert.pem", tmp_path / "key.pem"
    cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    kp.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    return str(cp), str(kp)


async def test_tls_with_sni_and_certificate_verification(tmp_path) -> None:
    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    s = Server(lambda req: _ok())
    s.ssl = server_ctx
    async with s:
        t = H1Transport(backend(s.port, scheme="https", host="localhost"))
        with pytest.raises((UpstreamConnectError, UpstreamBroken, ssl.SSLError)):  # not in the system trust store
            await t.post("x", b"{}", {})
        t._ssl = ssl.create_default_context(cafile=cert)  # trust the test's own CA
        r = await t.post("x", b"{}", {})
        assert r.status == 200 and await r.aread() == b'{"ok":true}'
        await r.aclose()
        assert f"host: localhost:{s.port}\r\n".encode() in s.requests[-1]
        await t.aclose()


async def test_tls_handshake_that_never_completes_times_out_and_frees_the_slot() -> None:
    async with Server(lambda req: _ok()) as s:  # plain TCP: the client's TLS hello gets no answer
        t = H1Transport(backend(s.port, scheme="https", host="localhost", connect_s=0.2, max_connections=1))
        with pytest.raises(UpstreamConnectError):
            await t.post("x", b"{}", {})
        await asyncio.sleep(0.05)
        assert t._count == 0
        await t.aclose()


async def test_a_connection_closed_while_pooled_is_never_written_to() -> None:
    async with Server(lambda req: _ok()) as s:
        t = H1Transport(backend(s.port, max_connections=1))
        r = await t.post("x", b"{}", {})
        await r.aread()
        await r.aclose()
        conn = t._idle[-1]
        conn.transport.close()  # closed, and its connection_lost not delivered yet: the slot is still taken
        r = await t.post("x", b"{}", {})  # waits for the slot, then opens a new connection
        assert await r.aread() == b'{"ok":true}'
        await r.aclose()
        assert s.connections == 2 and t._count == 1
        with pytest.raises(UpstreamBroken):  # a closed connection refuses at once instead of waiting forever
            await asyncio.wait_for(conn.request(b"GET / HTTP/1.1\r\n\r\n"), 1.0)
        await t.aclose()


async def test_a_second_response_in_the_same_read_is_ignored_and_the_connection_dropped() -> None:
    async with Server(lambda req: _ok(b"first") + _ok(b"second")) as s:
        t = H1Transport(backend(s.port))
        r = await t.post("x", b"{}", {})
        assert r.status == 200 and await r.aread() == b"first"
        await r.aclose()
        assert not t._idle  # out of sync: not kept for the next request
        r = await t.post("x", b"{}", {})
        assert await r.aread() == b"first"
        await r.aclose()
        assert s.connections == 2
        await t.aclose()


async def test_a_reused_connection_closed_before_any_answer_is_retried_once_on_a_new_one() -> None:
    per_conn: dict[int, int] = {}

    def reply(req: bytes):
        async def answer(w: asyncio.StreamWriter, req: bytes) -> str | None:
            k = id(w)
            per_conn[k] = per_conn.get(k, 0) + 1
            if per_conn[k] == 2:  # the upstream's keep-alive timeout met our second request on the wire
                return "close"
            w.write(_ok())
            return None
        return answer

    async with Server(reply) as s:
        t = H1Transport(backend(s.port))
        for _ in range(2):
            r = await t.post("x", b"{}", {})
            assert await r.aread() == b'{"ok":true}'
            await r.aclose()
        assert s.connections == 2 and len(s.requests) == 3  # sent twice, answered once
        await t.aclose()


async def test_a_fresh_connection_closed_before_any_answer_is_not_retried() -> None:
    async def close(w: asyncio.StreamWriter, req: bytes) -> str:
        return "close"

    async with Server(lambda req: close) as s:
        t = H1Transport(backend(s.port))
        with pytest.raises(UpstreamBroken):
            await t.post("x", b"{}", {})
        assert len(s.requests) == 1
        await t.aclose()


async def test_get_returns_the_status_and_times_out_as_broken() -> None:
    async def slow(w: asyncio.StreamWriter, req: bytes) -> None:
        await asyncio.sleep(1.0)
        w.write(_ok())

    async with Server(lambda req: _ok() if req.startswith(b"GET /health ") else slow) as s:
        t = H1Transport(backend(s.port))
        assert await t.get(f"http://127.0.0.1:{s.port}/health", 1.0) == 200
        assert s.requests[0].startswith(b"GET /health HTTP/1.1\r\n") and b"content-length" not in s.requests[0]
        with pytest.raises(UpstreamBroken):
            await t.get(f"http://127.0.0.1:{s.port}/slow", 0.1)
        await t.aclose()
