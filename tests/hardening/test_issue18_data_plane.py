"""Issue 18, data plane: one end-to-end check per defect against the real gateway process (in front of a simulated
engine), over HTTP and raw sockets. Each failed on the code before its fix (docs/hardening.md, "Issue 18")."""
from __future__ import annotations

import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from backends.sim.fleet import FleetProcess
from tests.hardening.test_raw_http import assert_openai_error, exchange, parse
from tests.resilience.stack import ADMIN_KEY, sim_backends, write_config
from tests.support.procs import start_gateway

pytestmark = pytest.mark.e2e

KEY = "issue18-plain-key-0123456789"
ZR_KEY = "issue18-zr-key-0123456789"  # residency eea -> zero retention; may use sim-model only
QWEN_KEY = "issue18-qwen-key-0123456789"  # may use qwen* only
TIGHT_KEY = "issue18-tight-key-0123456789"  # a key budget of 41 tokens a day
TIGHT_TOKENS = 41  # "hi" reserves a prompt bound of 38 tokens (6 chars + 16 per message + 16): 3 remain
BLOCKED_KEY = "issue18-blocked-key-0123456789"  # team blocked: denied by the policy stage
POLICY = {"version": 1, "rules": [
    {"id": "eea-stays-in-eea", "match": {"labels": {"residency": "eea"}},
     "require": {"jurisdiction": "EEA", "retention": "zero"}},
    {"id": "tight-key-budget", "match": {"team": "tight"},
     "budgets": [{"window": "day", "scope": "key", "tokens": TIGHT_TOKENS}]},
    {"id": "blocked-team", "match": {"team": "blocked"}, "deny": True}]}


class OtlpReceiver:
    """An OTLP/HTTP trace receiver: every export request the gateway sends, decoded to protobuf text."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        got = self.got = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["content-length"]))
                got.append(str(ExportTraceServiceRequest.FromString(body)))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *a) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_port}"

    def text(self) -> str:
        return "\n".join(self.got)

    def stop(self) -> None:
        self.srv.shutdown()


class Gw:
    def __init__(self, tmp: Path, port: int, proc, otlp: OtlpReceiver) -> None:
        self.tmp, self.port, self.proc, self.otlp = tmp, port, proc, otlp
        self.base = f"http://127.0.0.1:{port}"

    def chat(self, key: str | None, content="hi", model="sim-model", rid: str | None = None, **kw) -> httpx.Response:
        h = {"content-type": "application/json"}
        if key:
            h["authorization"] = f"Bearer {key}"
        if rid:
            h["x-request-id"] = rid
        body = {"model": model, "messages": [{"role": "user", "content": content}], **kw}
        return httpx.post(self.base + "/v1/chat/completions", content=orjson.dumps(body), headers=h, timeout=20)

    def audit(self) -> dict[str, dict]:
        out = {}
        p = self.tmp / "audit.jsonl"
        for line in (p.read_bytes().splitlines() if p.exists() else []):
            rec = orjson.loads(line)
            out[rec.get("client_request_id") or rec["request_id"]] = rec
        return out

    def wait_audit(self, rid: str) -> dict:
        for _ in range(200):  # the recorder writes in the background (a few ms)
            rec = self.audit().get(rid)
            if rec is not None:
                return rec
            time.sleep(0.05)
        raise AssertionError(f"no audit record for {rid}")

    def metrics(self) -> str:
        return httpx.get(self.base + "/metrics", timeout=10).text


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("issue18")
    (tmp / "policy.yaml").write_text(yaml.safe_dump(POLICY))
    otlp = OtlpReceiver()
    fp = FleetProcess(["--engines", "1", "--profile", "tiny", "--base-port", "0", "--locations", "DE"],
                      tmp / "manifest.json")
    manifest = fp.start()
    proc = None
    try:
        models = ["sim-model", "qwen3-a", "qwen3-b", "llama-x"]
        backends = sim_backends(manifest, capabilities=["chat", "completions", "embeddings"], models=models,
                                model_map={m: "sim-model" for m in models[1:]})
        cfg = write_config(
            tmp, backends, server={"max_body_bytes": 1_000_000, "access_log": True},
            aliases=[{"name": "fast", "targets": ["qwen3-a", "qwen3-b"]}],
            keys=[{"key": KEY, "tenant": "acme", "name": "plain"},
                  {"key": ZR_KEY, "tenant": "eu-corp", "name": "zr", "labels": {"residency": "eea"},
                   "models": ["sim-model"]},
                  {"key": QWEN_KEY, "tenant": "acme", "name": "qwen", "models": ["qwen*"]},
                  {"key": TIGHT_KEY, "tenant": "acme", "team": "tight", "name": "tight"},
                  {"key": BLOCKED_KEY, "tenant": "acme", "team": "blocked", "name": "blocked"}],
            identity={"auth_fail_limit_per_minute": 100000},
            observability={"log_level": "info", "capture_content": True, "otlp_endpoint": otlp.url})
        proc, port = start_gateway(cfg, env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
        g = Gw(tmp, port, proc, otlp)
        for _ in range(100):
            if httpx.get(g.base + "/readyz", timeout=2).status_code == 200:
                break
            time.sleep(0.1)
        yield g
    finally:
        if proc is not None:
            proc.stop()
        fp.stop()
        otlp.stop()
    log = proc.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]


def admin(gw: Gw, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, gw.base + path, json=body, headers={"authorization": f"Bearer {ADMIN_KEY}"},
                         timeout=10)


def error_code(r: httpx.Response) -> str:
    return r.json()["error"]["code"]


# ---- 4: zero-retention prompts on refusals


def test_refused_zero_retention_prompts_reach_no_audit_span_log_or_spool(gw):
    """A known zero-retention principal refused before the policy decision (403 model_not_allowed), and its
    revoked key (401), left the prompt in the audit log and the exported spans with capture_content on."""
    r = admin(gw, "POST", "/admin/tenants", {"id": "eu-rev", "labels": {"residency": "eea"}})
    assert r.status_code == 201, r.text
    r = admin(gw, "POST", "/admin/keys", {"tenant": "eu-rev"})
    assert r.status_code == 201, r.text
    kid, revoked = r.json()["id"], r.json()["key"]
    assert admin(gw, "DELETE", f"/admin/keys/{kid}").status_code in (200, 204)

    refused_canary, revoked_canary, plain_canary = "CANARY-zr-403-9f1c", "CANARY-zr-401-77ab", "CANARY-plain-5e2d"
    r = gw.chat(ZR_KEY, f"secret {refused_canary}", model="llama-x", rid="zr-403", stop=[f"{refused_canary}!"])
    assert r.status_code == 403 and error_code(r) == "model_not_allowed", r.text
    r = gw.chat(revoked, f"secret {revoked_canary}", rid="zr-401")
    assert r.status_code == 401 and error_code(r) == "revoked_api_key", r.text
    r = gw.chat(KEY, f"ordinary {plain_canary}", rid="plain-200", max_tokens=2)  # the control: captured
    assert r.status_code == 200, r.text
    recs = {rid: gw.wait_audit(rid) for rid in ("zr-403", "zr-401", "plain-200")}
    ids = [rec["request_id"] for rec in recs.values()]
    for _ in range(200):  # spans are exported in batches every 50 ms (OTEL_BSP_SCHEDULE_DELAY)
        if all(i in gw.otlp.text() for i in ids):
            break
        time.sleep(0.05)
    spans = gw.otlp.text()
    assert all(i in spans for i in ids), "spans of the three requests were exported"
    assert plain_canary in spans and plain_canary in (gw.tmp / "audit.jsonl").read_text()  # capture is on
    sinks = {"audit": (gw.tmp / "audit.jsonl").read_text(), "spans": spans, "log": gw.proc.log(),
             "spool": "".join(p.read_text() for p in gw.tmp.glob("spool.jsonl*"))}
    for where, text in sinks.items():
        for canary in (refused_canary, revoked_canary):
            assert canary not in text, f"{canary} leaked into {where}"
    assert "content" not in recs["zr-403"] and "content" not in recs["zr-401"]


# ---- 5: budgets enforced on JSON responses


def test_json_request_without_max_tokens_gets_the_remaining_budget_as_max_tokens(gw):
    """With 3 tokens of budget left after the prompt bound, a JSON request without max_tokens generated the
    simulator's natural length (16 or more): only streams were cut at the allowance."""
    r = gw.chat(TIGHT_KEY, "hi", rid="tight-json")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] <= 3, body["usage"]
    assert body["choices"][0]["finish_reason"] == "length"
    rec = gw.wait_audit("tight-json")
    assert rec["evidence"]["budget_max_tokens"]["set_max_tokens"] == 3, rec["evidence"]


# ---- 6: content parts whose text is not a string


@pytest.mark.parametrize("text", [5, None, ["a", "b"], {"t": 1}])
def test_text_part_that_is_not_a_string_is_a_400_naming_the_field(gw, text):
    r = gw.chat(KEY, [{"type": "text", "text": "ok"}, {"type": "text", "text": text}], max_tokens=2)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1].text" and err["code"] == "invalid_type", err


def test_image_url_part_is_not_a_500(gw):
    r = gw.chat(KEY, [{"type": "image_url", "image_url": 7}], max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].image_url", r.text
    r = gw.chat(KEY, [{"type": "text", "text": "look"},
                      {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}], max_tokens=2)
    assert r.status_code == 200, r.text


# ---- 8: trailing slash, dropped streams, transfer codings, auth before validation, 413


def raw(path: str = "/v1/chat/completions", key: str | None = KEY, extra: str = "", host: str = "gw") -> str:
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nhost: {host}\r\n{auth}content-type: application/json\r\n"
            f"connection: close\r\n{extra}")


def test_trailing_slash_is_a_404_not_a_redirect_to_the_clients_host(gw):
    body = b'{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
    for path in ("/v1/chat/completions/", "/v1/models/", "/healthz/"):
        req = (raw(path, host="evil.example") + f"content-length: {len(body)}\r\n\r\n").encode() + body
        resp = exchange(gw.port, req)
        status, headers, _ = parse(resp)
        assert "location" not in headers, resp[:300]
        assert_openai_error(resp, 404, "not_found")


def test_client_that_drops_a_stream_is_recorded_as_499_with_what_was_delivered(gw):
    body = orjson.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "count"}],
                         "max_tokens": 900, "stream": True})
    s = socket.create_connection(("127.0.0.1", gw.port))
    s.settimeout(20)
    s.sendall((raw(extra="x-request-id: dropped-1\r\n") + f"content-length: {len(body)}\r\n\r\n").encode() + body)
    got = b""
    while got.count(b'"content"') < 3:  # a few tokens arrived, then the client goes away
        chunk = s.recv(65536)
        assert chunk, got
        got += chunk
    s.close()
    rec = gw.wait_audit("dropped-1")
    assert rec["status"] == 499 and rec["error"] == "client_disconnected", rec
    assert rec["delivered_completion_tokens"] >= 1 and rec["usage"]["completion_tokens"] >= 1, rec
    assert re.search(r'gateway_requests_total\{[^}]*status="499"[^}]*\} [1-9]', gw.metrics())


@pytest.mark.parametrize("te,status", [("gzip, chunked", 501), ("deflate,chunked", 501), ("chunked, chunked", 400)])
def test_transfer_coding_other_than_chunked_alone_is_refused(gw, te, status):
    """llhttp read `gzip, chunked` as chunked and the gateway decoded a gzip body as plain bytes (RFC 9112:
    an unknown coding is a 501; chunked must be last and once)."""
    smuggled = "GET /admin/fleet HTTP/1.1\r\nhost: gw\r\n\r\n"
    body = b'{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
    req = (raw(extra=f"transfer-encoding: {te}\r\n") + "\r\n").encode() + b"%x\r\n" % len(body) + body + \
        b"\r\n0\r\n\r\n" + smuggled.encode()
    resp = exchange(gw.port, req)
    assert resp.count(b"HTTP/1.1 ") == 1, resp
    assert_openai_error(resp, status, "unsupported_transfer_encoding" if status == 501 else "invalid_http_request")


@pytest.mark.parametrize("key", [None, "not-a-key-0123456789"])
@pytest.mark.parametrize("body", [b"{", b'{"model":"sim-model"}', b'{"model":"sim-model","messages":5}'])
def test_unauthenticated_request_with_a_bad_body_gets_401_not_400(gw, key, body):
    resp = exchange(gw.port, (raw(key=key) + f"content-length: {len(body)}\r\n\r\n").encode() + body)
    assert_openai_error(resp, 401)


def test_authenticated_request_with_a_bad_body_still_gets_400(gw):
    body = b'{"model":"sim-model","messages":5}'
    resp = exchange(gw.port, (raw() + f"content-length: {len(body)}\r\n\r\n").encode() + body)
    assert_openai_error(resp, 400, "invalid_type")


def test_413_reaches_a_client_that_sends_its_whole_body_first(gw):
    """Like most HTTP clients, send the whole 10 MB body, then read: the gateway answered 413 without reading
    the body and closed, and the client got a connection reset instead of the answer."""
    body = b'{"model":"sim-model","messages":[{"role":"user","content":"' + b"a" * 10_000_000 + b'"}]}'
    s = socket.create_connection(("127.0.0.1", gw.port))
    s.settimeout(20)
    try:
        s.sendall((raw() + f"content-length: {len(body)}\r\n\r\n").encode() + body)
        resp = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            resp += chunk
    finally:
        s.close()
    assert_openai_error(resp, 413, "request_too_large")


# ---- refusals counted under the stage that refused; a key's model list checked once


def _rejections(text: str, stage: str, code: str) -> float:
    m = re.search(r'gateway_rejections_total\{code="%s",stage="%s"\} ([0-9.e+]+)' % (code, stage), text)
    return float(m.group(1)) if m else 0.0


def test_refusals_are_counted_under_the_stage_that_refused(gw):
    before = gw.metrics()
    assert gw.chat("gw_nope_0123456789abcdef").status_code == 401
    assert gw.chat(ZR_KEY, model="llama-x").status_code == 403
    r = gw.chat(BLOCKED_KEY, max_tokens=2)
    assert r.status_code == 403 and error_code(r) == "policy_denied", r.text
    after = gw.metrics()
    for stage, code in (("authenticate", "invalid_api_key"), ("authenticate", "model_not_allowed"),
                        ("decide", "policy_denied")):
        assert _rejections(after, stage, code) == _rejections(before, stage, code) + 1, (stage, code)
        assert _rejections(after, "dispatch", code) == _rejections(before, "dispatch", code), code


def test_key_limited_to_qwen_may_call_an_alias_whose_every_target_matches(gw):
    r = gw.chat(QWEN_KEY, model="fast", max_tokens=2)
    assert r.status_code == 200, r.text
    r = gw.chat(QWEN_KEY, model="llama-x", max_tokens=2)
    assert r.status_code == 403 and error_code(r) == "model_not_allowed", r.text


def test_unread_body_after_an_early_answer_is_drained_only_up_to_the_bound(gw):
    """A 415 is answered before the body is read; on a kept-alive connection the server went on reading and
    dropping the rest of the body without bound (64 MiB here). It drops at most 16 MiB, then closes."""
    size = 64 * 1024 * 1024
    s = socket.create_connection(("127.0.0.1", gw.port))
    s.settimeout(20)
    s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {KEY}\r\n"
               f"content-type: text/plain\r\ncontent-length: {size}\r\n\r\n").encode())
    resp = b""
    while b"\r\n\r\n" not in resp or len(resp.partition(b"\r\n\r\n")[2]) < int(
            parse(resp)[1].get("content-length", "0")):
        chunk = s.recv(65536)
        assert chunk, resp
        resp += chunk
    assert_openai_error(resp, 415, "unsupported_media_type")
    sent, block = 0, b"x" * 65536
    try:
        while sent < size:
            sent += s.send(block)
    except OSError:  # reset or broken pipe: the server closed the connection
        pass
    finally:
        s.close()
    assert sent < size, "the server read the whole unbounded body"
