"""Issue 35, finding 4: a client that leaves ends its upstream request at once, whichever way it leaves.

The real gateway process (each upstream client: native, aiohttp, httpx) in front of a hostile upstream
(tests/support/hostile.py: a raw asyncio server in this process) that answers part of a request and then
holds the connection open, sending nothing. The client leaves before the response headers, before the first
token, mid-stream, or during a JSON body; the upstream must see the gateway's side of that connection closed.
The backend's own timeouts are minutes long, so only the client's leaving can close it; the test waits for
the close (the bound below is only there to fail instead of hanging, far under those timeouts). And an
engine (the simulator, which like vLLM aborts a request whose connection closes) slowed so that its first
token is minutes away: the client leaves after the engine's headers and the engine must count the abort.

Before the fix the dispatcher closed the upstream response on a timeout or a broken connection, never on a
cancellation: a client that left after the headers left the upstream connection open (and its engine
generating) until the upstream gave up.
"""
from __future__ import annotations

import socket
import time
import uuid

import httpx
import orjson
import pytest

from backends.sim.fleet import manifest_backends
from tests.resilience.stack import GW_KEY, set_faults, start_fleet_proc, write_config
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
    fleet, manifest = start_fleet_proc(tmp, 1, "DE")
    common = {"location": {"country": "DE"}, "retention": "zero", "capabilities": ["chat", "completions"],
              "health": {"enabled": False},
              "timeouts": {"connect_s": 5, "first_token_s": 300, "idle_s": 300, "total_s": 600}}
    backends = [{"name": "hostile", "kind": "openai", "url": f"http://127.0.0.1:{up.port}/v1", "models": ["m"],
                 "api_key_env": "UP_KEY", **common},
                *({**b, **common} for b in manifest_backends(manifest, kind="sim"))]
    cfg = write_config(tmp, backends, server={"upstream_client": request.param})
    try:
        gw, port = start_gateway(cfg, env={"UP_KEY": "upstream-secret-leaves"})
    except BaseException:
        fleet.stop()
        up.stop()
        raise
    yield {"up": up, "port": port, "gw": gw, "manifest": manifest}
    gw.stop()
    fleet.stop()
    up.stop()


def send(port: int, tag: str, stream: bool, model: str = "m") -> socket.socket:
    body = orjson.dumps({"model": model, "stream": stream, "max_tokens": 64,
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


def engine_metric(manifest: dict, name: str) -> float:
    text = httpx.get(manifest["engines"][0]["metrics"], timeout=5).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))


def test_the_engine_aborts_the_request_of_a_client_that_left(stack):
    m = stack["manifest"]
    aborted = 'vllm:request_success_total{engine="0",finished_reason="abort"'
    before = engine_metric(m, aborted)
    set_faults(m, 0, slow_factor=100000.0)  # a 2 ms step takes minutes: the first token never comes in time
    try:
        s = send(stack["port"], f"probe-engine-{uuid.uuid4().hex[:8]}", stream=True, model="sim-model")
        deadline = time.monotonic() + GUARD_S
        while engine_metric(m, "vllm:num_requests_running") + engine_metric(m, "vllm:num_requests_waiting") < 1:
            assert time.monotonic() < deadline, "the engine never got the request"
            time.sleep(0.05)
        time.sleep(SETTLE_S)  # the engine's response headers reach the gateway
        s.close()  # the client leaves before the first token
        while engine_metric(m, aborted) <= before:  # the engine saw the connection close and aborted
            assert time.monotonic() < deadline + GUARD_S, "the engine is still generating for a client that left"
            time.sleep(0.05)
    finally:
        set_faults(m, 0, slow_factor=1.0)
