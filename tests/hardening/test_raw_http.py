"""Hostile HTTP on raw sockets against the real gateway process (in front of a simulated engine): malformed and
deeply nested JSON, invalid UTF-8, huge bodies, header floods, slow-loris headers and bodies, request
smuggling and header injection. Every refusal is an OpenAI-shaped 4xx, never a 5xx or a hang, and the
gateway keeps serving other clients throughout."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import orjson
import pytest

from tests.hardening.stack import GW_KEY, start_stack, wait_ready

pytestmark = pytest.mark.e2e
OK_BODY = b'{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    st = start_stack(tmp_path_factory.mktemp("raw"), engines=1, locations="DE",
                     server={"max_body_bytes": 1_000_000, "header_timeout_s": 1.0, "body_timeout_s": 1.5})
    wait_ready(st.base)
    yield st
    st.stop()
    assert "Traceback" not in st.gw.log_path.read_text(errors="replace"), st.gw.log_path.read_text()[-3000:]


def head(extra: str = "", path: str = "/v1/chat/completions") -> str:
    return (f"POST {path} HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {GW_KEY}\r\n"
            f"content-type: application/json\r\nconnection: close\r\n{extra}")


def with_body(body: bytes, extra: str = "") -> bytes:
    return (head(extra) + f"content-length: {len(body)}\r\n\r\n").encode() + body


def exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send `data` (from a thread, so a server that answers early cannot deadlock us) and read to EOF."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(timeout)

    def writer() -> None:
        try:
            s.sendall(data)
        except OSError:
            pass  # the server answered and closed before taking everything: fine

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except ConnectionResetError:
        pass
    except socket.timeout:
        raise AssertionError(f"no complete answer within {timeout}s (got {out[:200]!r})") from None
    finally:
        s.close()
    t.join(5)
    return out


def parse(resp: bytes) -> tuple[int, dict[str, str], bytes]:
    assert resp.startswith(b"HTTP/1.1 "), resp[:200]
    hdr, _, body = resp.partition(b"\r\n\r\n")
    lines = hdr.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, body


def assert_openai_error(resp: bytes, status: int, code: str | None = None) -> dict:
    st, headers, body = parse(resp)
    assert st == status, resp[:400]
    assert headers.get("content-type", "").startswith("application/json"), headers
    err = orjson.loads(body[: int(headers["content-length"])])["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"], err
    if code:
        assert err["code"] == code, err
    return err


def still_serving(gw) -> None:
    r = httpx.post(gw.base + "/v1/chat/completions", content=OK_BODY, timeout=10,
                   headers={"authorization": f"Bearer {GW_KEY}", "content-type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body", [b"{", b'{"model": "sim-model",}', b"[1, 2]", b"null", b"\"str\"", b"{}}",
                                  b"{'model': 'x'}", b"\x00\x01\x02", b"NaN", b'{"model": 1e999999}'])
def test_malformed_json_is_a_400(gw, body):
    assert_openai_error(exchange(gw.port, with_body(body)), 400)


def test_nesting_100k_deep_is_a_400_not_a_500(gw):
    for body in (b"[" * 100_000 + b"]" * 100_000,
                 b'{"model":"sim-model","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
        assert_openai_error(exchange(gw.port, with_body(body)), 400, "invalid_json")


@pytest.mark.parametrize("depth", [100, 300, 1000])
def test_deep_but_parseable_extra_field_is_a_400_not_a_500(gw, depth):
    """orjson reads 1024 levels but writes only 255: a deep unvalidated field used to crash the forwarder (500)."""
    body = OK_BODY[:-1] + b',"extra":' + b"[" * depth + b"]" * depth + b"}"
    assert_openai_error(exchange(gw.port, with_body(body)), 400, "invalid_json")
    still_serving(gw)


@pytest.mark.parametrize("body", [
    b'{"model":"sim-model","messages":[{"role":"user","content":"\xff\xfe"}]}',
    b'{"model":"\xc3\x28","messages":[{"role":"user","content":"hi"}]}',
    b'{"model":"sim-model","messages":[{"role":"user","content":"\xed\xa0\x80"}]}',  # encoded surrogate
    b'{"model":"sim-model","messages":[{"role":"user","content":"\\ud800"}]}',  # escaped lone surrogate
])
def test_invalid_utf8_is_a_400(gw, body):
    assert_openai_error(exchange(gw.port, with_body(body)), 400)


def test_10mb_body_is_a_413_with_or_without_content_length(gw):
    big = b'{"model":"sim-model","messages":[{"role":"user","content":"' + b"a" * 10_000_000 + b'"}]}'
    assert_openai_error(exchange(gw.port, with_body(big)), 413, "request_too_large")
    chunked = (head("transfer-encoding: chunked\r\n") + "\r\n").encode()
    step = 1 << 20
    for i in range(0, len(big), step):
        part = big[i:i + step]
        chunked += b"%x\r\n" % len(part) + part + b"\r\n"
    chunked += b"0\r\n\r\n"
    assert_openai_error(exchange(gw.port, chunked), 413, "request_too_large")
    still_serving(gw)


def test_header_flood_and_huge_header_are_431(gw):
    flood = "".join(f"x-h{i}: v\r\n" for i in range(1000))
    assert_openai_error(exchange(gw.port, with_body(OK_BODY, flood)), 431, "too_many_headers")
    assert_openai_error(exchange(gw.port, with_body(OK_BODY, "x-big: " + "a" * 100_000 + "\r\n")), 431,
                        "headers_too_large")
    assert_openai_error(exchange(gw.port, ("GET /healthz?" + "q" * 100_000 + " HTTP/1.1\r\nhost: gw\r\n\r\n").encode()),
                        431, "headers_too_large")
    still_serving(gw)


def test_slow_loris_headers_time_out_while_others_are_served(gw):
    """A client dribbling its headers byte by byte gets a 408 at header_timeout_s; others are served meanwhile."""
    s = socket.create_connection(("127.0.0.1", gw.port))
    s.settimeout(10)
    data = with_body(OK_BODY)
    t0 = time.monotonic()
    served = 0
    got = b""
    try:
        for i in range(len(data)):
            try:
                s.sendall(data[i:i + 1])
            except OSError:
                break
            if i % 10 == 0:
                still_serving(gw)
                served += 1
            time.sleep(0.05)
            if time.monotonic() - t0 > 5:
                break
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except ConnectionResetError:
        pass
    finally:
        s.close()
    assert served >= 2
    assert_openai_error(got, 408, "request_timeout")
    assert time.monotonic() - t0 < 5


def test_idle_connection_that_sends_nothing_is_closed(gw):
    s = socket.create_connection(("127.0.0.1", gw.port))
    s.settimeout(5)
    t0 = time.monotonic()
    got = s.recv(65536)
    s.close()
    assert time.monotonic() - t0 < 4
    assert_openai_error(got, 408, "request_timeout")


def test_a_kept_alive_connection_serves_after_idling_then_closes_after_uvicorns_keep_alive_timeout(gw):
    """The real server with uvicorn's default keep-alive (5 s): the gateway keeps one keep-alive timer per
    connection (server_protocol.py), so a connection that idled 1.5 s between requests is still served, and one
    idle for the whole timeout after its last response is closed by the server, as uvicorn's own timer does."""
    req = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {GW_KEY}\r\n"
           f"content-type: application/json\r\ncontent-length: {len(OK_BODY)}\r\n\r\n").encode() + OK_BODY
    s = socket.create_connection(("127.0.0.1", gw.port))
    s.settimeout(15)

    def answer() -> bytes:
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += s.recv(65536)
        st, headers, body = parse(buf)
        while len(body) < int(headers["content-length"]):
            body += s.recv(65536)
        assert st == 200 and "connection" not in headers, buf[:300]  # kept alive
        return body

    try:
        s.sendall(req)
        answer()
        time.sleep(1.5)
        s.sendall(req)
        answer()
        t0 = time.monotonic()
        assert s.recv(65536) == b""  # the server closed it, idle since the second response
        idle = time.monotonic() - t0
    finally:
        s.close()
    assert 4.0 < idle < 8.0, idle


def test_slow_loris_body_times_out(gw):
    s = socket.create_connection(("127.0.0.1", gw.port))
    s.settimeout(10)
    s.sendall((head() + "content-length: 1000\r\n\r\n").encode())
    t0 = time.monotonic()
    got = b""
    try:
        for _ in range(100):
            s.sendall(b" ")
            time.sleep(0.1)
            s.setblocking(False)
            try:
                got += s.recv(65536)
            except BlockingIOError:
                pass
            s.setblocking(True)
            if got:
                break
        s.settimeout(5)
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        s.close()
    assert time.monotonic() - t0 < 5
    assert_openai_error(got, 408, "request_timeout")


@pytest.mark.parametrize("framing", [
    "content-length: 5\r\ntransfer-encoding: chunked\r\n",
    "transfer-encoding: chunked\r\ncontent-length: 5\r\n",
    "content-length: 5\r\ncontent-length: 60\r\n",
    "transfer-encoding: chunked, identity\r\n",
    "content-length: -1\r\n",
    "content-length: 0x10\r\n",
    "transfer-encoding : chunked\r\n",
])
def test_request_smuggling_is_refused_and_the_smuggled_request_never_runs(gw, framing):
    smuggled = "0\r\n\r\nGET /admin/fleet HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer x\r\n\r\n"
    resp = exchange(gw.port, (head(framing) + "\r\n" + smuggled).encode())
    assert resp.count(b"HTTP/1.1 ") == 1, resp
    status, _, _ = parse(resp)
    assert 400 <= status < 500
    assert_openai_error(resp, status)


@pytest.mark.parametrize("rid", ["abc\rset-cookie: x=1", "abc\nset-cookie: x=1", "abc%0d%0aset-cookie:%20x=1",
                                 "abc\x00def", "a" * 200, "ab c"])
def test_header_injection_in_request_id_is_never_echoed(gw, rid):
    resp = exchange(gw.port, with_body(OK_BODY, f"x-request-id: {rid}\r\n"))
    status, headers, _ = parse(resp)
    assert "set-cookie" not in headers
    if status == 200:
        assert headers["x-request-id"].startswith("req_")  # replaced, not echoed
    else:
        assert_openai_error(resp, 400)


def test_openapi_is_served_and_describes_the_data_plane(gw):
    spec = httpx.get(gw.base + "/openapi.json", timeout=5).json()
    assert spec["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/healthz",
            "/readyz"} <= set(spec["paths"])
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert not any(p.startswith("/admin") for p in spec["paths"])


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"model":"sim-model","prompt":[-192,-37263]}'),
    ("/v1/completions", b'{"model":"sim-model","prompt":[[1,2],[-1]]}'),
    ("/v1/completions", b'{"model":"sim-model","prompt":[4294967296]}'),
    ("/v1/embeddings", b'{"model":"sim-model","input":[-1]}'),
])
def test_negative_or_huge_token_ids_are_a_400_not_a_stalled_engine(gw, path, body):
    """Found by bench/fuzz_api.py: negative token ids stalled the engine for 30 s, its circuit opened and every
    client got 503 no_backend_available. They are refused at the edge now."""
    data = (head(path=path) + f"content-length: {len(body)}\r\n\r\n").encode() + body
    assert_openai_error(exchange(gw.port, data), 400, "invalid_type")
    still_serving(gw)
