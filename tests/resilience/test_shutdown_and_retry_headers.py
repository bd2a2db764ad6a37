"""Graceful shutdown (SIGTERM mid-stream: the client still gets the whole answer and [DONE]; the audit record
and the ledger row are flushed before the process exits) and the Retry-After contract: every 429 and 503 the
gateway answers, from every stage that refuses, carries both `retry-after` and `retry-after-ms`."""
from __future__ import annotations

import signal
import threading
import time

import httpx
import orjson
import pytest
import yaml

from tests.resilience.stack import GW_KEY, audit, ledger_rows, write_config
from tests.support.procs import free_port, start_gateway, start_upstream

pytestmark = pytest.mark.e2e
CHAT = {"model": "up-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _backends(up_port: int) -> list[dict]:
    return [{"name": "up", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1", "models": ["up-model"],
             "location": {"country": "DE"}, "retention": "zero"},
            {"name": "dead", "kind": "openai", "url": f"http://127.0.0.1:{free_port()}/v1", "models": ["dead-model"],
             "location": {"country": "DE"}, "health": {"enabled": False, "failures_to_open": 1000}}]


def _stream_in_thread(port: int, rid: str, max_tokens: int) -> tuple[list[str], threading.Thread]:
    """A slow streamed chat (one chunk per 0.25 s) read in a thread; returns once its first content arrived."""
    got: list[str] = []

    def client() -> None:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                          headers={"authorization": f"Bearer {GW_KEY}", "x-request-id": rid,
                                   "content-type": "application/json"},
                          content=orjson.dumps({**CHAT, "stream": True, "max_tokens": max_tokens,
                                                "x_test_fault": "slow_chunks:0.25"})) as r:
            for chunk in r.iter_text():
                got.append(chunk)

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 5
    while '"content"' not in "".join(got) and time.monotonic() < deadline:
        time.sleep(0.02)
    return got, t


def test_sigterm_mid_stream_finishes_the_stream_and_flushes_evidence_and_ledger(tmp_path):
    up, up_port = start_upstream(tmp_path)
    cfg = write_config(tmp_path, _backends(up_port))
    gw, port = start_gateway(cfg)
    try:
        rid = f"shutdown-{time.monotonic_ns()}"
        got, t = _stream_in_thread(port, rid, 8)
        gw.signal(signal.SIGTERM)  # mid-stream: ~1.5 s of the answer still to come
        time.sleep(0.3)
        with pytest.raises(httpx.HTTPError):  # it stopped accepting new connections at once
            httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT,
                       headers={"authorization": f"Bearer {GW_KEY}"}, timeout=2)
        t.join(20)
        gw.p.wait(20)
        body = "".join(got)
        assert body.count('"content"') >= 8 and body.rstrip().endswith("data: [DONE]"), body[-500:]
        assert '"error"' not in body
        # uvicorn re-raises the captured SIGTERM after its orderly shutdown, so -15 is the clean exit here
        assert gw.p.returncode in (0, -signal.SIGTERM), gw.log()[-2000:]
        recs = audit(tmp_path)
        assert rid in recs and recs[rid]["status"] == 200 and recs[rid]["usage"]["completion_tokens"] == 8
        rows = [r for r in ledger_rows(tmp_path) if r[0] == rid]
        assert len(rows) == 1 and rows[0][1] == 11 + 8
    finally:
        gw.stop()
        up.stop()


def _assert_retry_headers(r: httpx.Response, status: int, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    if code:
        assert r.json()["error"]["code"] == code, r.text
    ra, ms = r.headers.get("retry-after"), r.headers.get("retry-after-ms")
    assert ra and ra.isdigit() and int(ra) >= 1, dict(r.headers)
    assert ms and ms.isdigit() and int(ms) >= 1, dict(r.headers)


def test_every_429_and_503_carries_retry_after(tmp_path):
    up, up_port = start_upstream(tmp_path)
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump({"version": 1, "rules": [
        {"id": "one-a-minute", "match": {"tenant": "limited"}, "budgets": [{"window": "minute", "requests": 1}]},
        {"id": "tiny-quota", "match": {"tenant": "quota"}, "budgets": [{"window": "day", "tokens": 10}]},
        {"id": "impossible-slo", "match": {"tenant": "hurry"}, "set": {"ttft_slo_ms": 0.001}},
    ]}))
    cfg_path = write_config(tmp_path, _backends(up_port),
                            identity={"auth_fail_limit_per_minute": 3})
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["keys"] += [{"key": "limited-key-0123456789", "tenant": "limited"},
                    {"key": "quota-key-0123456789", "tenant": "quota"},
                    {"key": "hurry-key-0123456789", "tenant": "hurry"}]
    cfg_path.write_text(yaml.safe_dump(cfg))
    gw, port = start_gateway(cfg_path)
    base = f"http://127.0.0.1:{port}"

    def chat(key: str, body: dict = CHAT, addr_hdr: dict | None = None) -> httpx.Response:
        return httpx.post(base + "/v1/chat/completions", content=orjson.dumps(body), timeout=10,
                          headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    try:
        seen: dict[str, int] = {}
        # budgets: requests per minute (rate_limit_exceeded) and a token quota (insufficient_quota)
        assert chat("limited-key-0123456789").status_code == 200
        r = chat("limited-key-0123456789")
        _assert_retry_headers(r, 429, "rate_limit_exceeded")
        seen["budget rpm"] = r.status_code
        r = chat("quota-key-0123456789", {**CHAT, "max_tokens": 500})
        _assert_retry_headers(r, 429, "insufficient_quota")
        seen["budget quota"] = r.status_code
        # admission: no allowed engine can meet the TTFT target
        r = chat("hurry-key-0123456789")
        _assert_retry_headers(r, 429)
        seen["admission"] = r.status_code
        # no backend can take the request (connect error on the only backend)
        r = chat(GW_KEY, {**CHAT, "model": "dead-model"})
        _assert_retry_headers(r, 503)
        seen["no backend"] = r.status_code
        # an upstream 503 that exhausted the candidates is a 502 (upstream_error), never a bare 503
        r = chat(GW_KEY, {**CHAT, "x_test_fault": "error503"})
        assert r.status_code == 502
        assert len(seen) == 4, seen
    finally:
        gw.stop()
        up.stop()


def test_stream_still_running_at_the_drain_deadline_ends_with_an_error_event(tmp_path):
    """A stream longer than server.graceful_shutdown_s is not killed silently by uvicorn's cancel: shortly
    before it the gateway ends it with a `server_shutting_down` error event and [DONE], settles what was
    delivered, records it, and exits."""
    up, up_port = start_upstream(tmp_path)
    cfg = write_config(tmp_path, _backends(up_port), server={"graceful_shutdown_s": 2})
    gw, port = start_gateway(cfg)
    try:
        rid = f"cut-{time.monotonic_ns()}"
        got, t = _stream_in_thread(port, rid, 60)
        t0 = time.monotonic()
        gw.signal(signal.SIGTERM)  # ~15 s of answer left, 2 s of grace
        t.join(20)
        took = time.monotonic() - t0
        gw.p.wait(20)
        body = "".join(got)
        assert 0.5 < took < 2.5, took  # cut at grace - 1 s, not at the end of the answer, not at once
        assert '"server_shutting_down"' in body and body.rstrip().endswith("data: [DONE]"), body[-500:]
        n = body.count('"content"')
        assert 1 <= n < 60
        assert gw.p.returncode in (0, -signal.SIGTERM), gw.log()[-2000:]
        assert "Cancel" not in gw.log()  # uvicorn had nothing left to cancel
        recs = audit(tmp_path)
        assert recs[rid]["status"] == 503 and recs[rid]["error"] == "server_shutting_down"
        rows = [r for r in ledger_rows(tmp_path) if r[0] == rid]
        # what was delivered was settled: the prompt estimate + at least one token per content event sent
        assert len(rows) == 1 and n <= rows[0][1] <= 11 + 60, (rows, n)
    finally:
        gw.stop()
        up.stop()
