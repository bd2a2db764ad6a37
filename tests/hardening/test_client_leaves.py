"""Issue 35, finding 4: a client that leaves ends its upstream request at once, whichever way it leaves.

The real gateway process (each upstream client: native, aiohttp, httpx) in front of a hostile upstream
(tests/support/hostile.py: a raw asyncio server in this process) that answers part of a request and then
holds the connection open, sending nothing. The client leaves before the response headers, before the first
token, mid-stream, or during a JSON body; the upstream must see the gateway's side of that connection closed.
The backend's own timeouts are minutes long, so only the client's leaving can close it; the test waits for
the close (the bound below is only there to fail instead of hanging, far under those timeouts).

Before the fix the dispatcher closed the upstream response on a timeout or a broken connection, never on a
cancellation: a client that left after the headers left the upstream connection open (and its engine
generating) until the upstream gave up.
"""
from __future__ import annotations

import socket
import time
import uuid

import orjson
import pytest

from tests.resilience.stack import GW_KEY, write_config
from tests.support.hostile import HostileUpstream, Seen
from tests.support.procs import start_gateway

pytestmark = pytest.mark.e2e
GUARD_S = 30.0  # fail instead of hanging; the backend's timeouts are 300 s and more
SETTLE_S = 0.5  # lets the gateway read the headers just sent, so the old code is past them (not an assertion)

SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            b"cache-control: no-cache\r\n\r\n")
ROLE = b'data: {"id":"c1","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
TOKEN = b'data: {"id":"c1","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"tokenA1"},"finish_reason":null}]}\n\n'


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@pytest.fixture(scope="module", params=["native", "aiohttp", "httpx"])
def stack(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"leaves-{request.param}")
    up = HostileUpstream()
    backends = [{"name": "hostile", "kind": "openai", "url": f"http://127.0.0.1:{up.port}/v1", "models": ["m"],
                 "api_key_env": "UP_KEY", "location": {"country": "DE"}, "retention": "zero",
                 "capabilities": ["chat", "completions"], "health": {"enabled": False},
                 "timeouts": {"connect_s": 5, "first_token_s": 300, "idle_s": 300, "total_s": 600}}]
    cfg = write_config(tmp, backends, server={"upstream_client": request.param})
    gw, port = start_gateway(cfg, env={"UP_KEY": "upstream-secret-leaves"})
    yield {"up": up, "port": port, "gw": gw}
    gw.stop()
    up.stop()


def send(port: int, tag: str, stream: bool) -> socket.socket:
    body = orjson.dumps({"model": "m", "stream": stream, "max_tokens": 64,
                         "messages": [{"role": "user", "content": f"hello {tag}"}]})
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer " + GW_KEY.encode()
              + b"\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    return s


def leave_and_check(stack, tag: str, seen: Seen, s: socket.socket) -> None:
    assert seen.received.wait(GUARD_S), f"the upstream never got {tag}"
    s.close()  # the client leaves
    assert seen.closed.wait(GUARD_S), f"{tag}: the gateway kept the upstream connection open after the client left"
    assert "Traceback" not in stack["gw"].log()


def test_client_leaves_before_the_response_headers(stack):
    tag = f"probe-headers-{uuid.uuid4().hex[:8]}"
    seen = stack["up"].script(tag, b"", close=False)  # the upstream sends nothing at all
    leave_and_check(stack, tag, seen, send(stack["port"], tag, stream=True))


def test_client_leaves_before_the_first_token(stack):
    tag = f"probe-first-{uuid.uuid4().hex[:8]}"
    seen = stack["up"].script(tag, SSE_HEAD + chunked(ROLE), close=False)  # headers, a role chunk, no token
    s = send(stack["port"], tag, stream=True)
    assert seen.received.wait(GUARD_S)
    time.sleep(SETTLE_S)
    leave_and_check(stack, tag, seen, s)


def test_client_leaves_mid_stream(stack):
    tag = f"probe-mid-{uuid.uuid4().hex[:8]}"
    seen = stack["up"].script(tag, SSE_HEAD + chunked(ROLE) + chunked(TOKEN), close=False)
    s = send(stack["port"], tag, stream=True)
    got = b""
    while b"tokenA1" not in got:  # the first token reached the client
        data = s.recv(65536)
        assert data, got
        got += data
    leave_and_check(stack, tag, seen, s)


def test_client_leaves_during_a_json_body(stack):
    tag = f"probe-json-{uuid.uuid4().hex[:8]}"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5000\r\n\r\n"
    seen = stack["up"].script(tag, head + b'{"id": "c1", "object": "chat.completion", "choices": [', close=False)
    s = send(stack["port"], tag, stream=False)
    assert seen.received.wait(GUARD_S)
    time.sleep(SETTLE_S)
    leave_and_check(stack, tag, seen, s)
