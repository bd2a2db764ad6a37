"""Refusals the official openai SDK reads correctly, against a real `python -m gateway serve`.

openai-python 1.x ignores a Retry-After above 60 s and retries a 429 after its own ~1 s backoff, so a daily or
monthly quota is asked again at once; the SDK installed here (see requirements-dev.lock) stops by itself only
above 120 s. `x-should-retry: false`, which both read before the status, stops either: the gateway counts one
request. Controls: with Retry-After stripped (what the 1.x SDK did with it) the header alone still stops the
retries; with the header stripped too, the same client asks 1 + max_retries times. Every response carries
Server-Timing with the gateway's own time."""
from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
import yaml

from tests.support.procs import free_port, start_gateway, start_upstream

pytestmark = pytest.mark.e2e
QUOTA_KEY = "sdk-quota-key-0123456789"
EU_KEY = "sdk-eu-key-0123456789"
OK_KEY = "sdk-ok-key-0123456789"


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sdk")
    up, up_port = start_upstream(tmp)
    (tmp / "policy.yaml").write_text(yaml.safe_dump({"version": 1, "rules": [
        {"id": "tiny-daily-quota", "match": {"tenant": "quota"}, "budgets": [{"window": "day", "tokens": 10}]},
        {"id": "eu-stays-in-eea", "match": {"tenant": "eu"}, "require": {"jurisdiction": "EEA"}}]}))
    port = free_port()
    cfg = {"server": {"host": "127.0.0.1", "port": port},
           "backends": [{"name": "up", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1",
                         "models": ["up-model"], "location": {"country": "US"}, "retention": "zero"}],
           "keys": [{"key": QUOTA_KEY, "tenant": "quota", "name": "q"}, {"key": EU_KEY, "tenant": "eu", "name": "e"},
                    {"key": OK_KEY, "tenant": "ok", "name": "o"}],
           "policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / "audit.jsonl")},
           "identity": {"sqlite_path": str(tmp / "id.db")},
           "budgets": {"sqlite_path": str(tmp / "budgets.db")}}
    path = tmp / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    g, _ = start_gateway(path)
    yield f"http://127.0.0.1:{port}"
    g.stop()
    up.stop()


def refusals(base: str, code: str) -> float:
    """Refusals with this code the gateway counted (gateway_rejections_total)."""
    text = httpx.get(base + "/metrics").text
    return sum(float(m.group(1)) for m in re.finditer(
        r'^gateway_rejections_total\{[^}]*code="' + code + r'"[^}]*\} (\S+)$', text, re.M))


def ask(client: openai.OpenAI) -> None:
    client.chat.completions.create(model="up-model", max_tokens=40, messages=[{"role": "user", "content": "hi"}])


def test_the_sdk_does_not_retry_a_quota_refusal_that_resets_beyond_60s(gw):
    before = refusals(gw, "insufficient_quota")
    with pytest.raises(openai.RateLimitError) as ei:
        ask(openai.OpenAI(base_url=gw + "/v1", api_key=QUOTA_KEY, max_retries=2))
    assert ei.value.response.headers["x-should-retry"] == "false"
    assert int(ei.value.response.headers["retry-after"]) > 60
    assert refusals(gw, "insufficient_quota") - before == 1  # one request reached the gateway

    # controls: Retry-After removed (the 1.x SDK's view of one above 60 s): the header alone stops the retries;
    # both removed: the SDK retries the bare 429 (1 + max_retries requests at the gateway)
    def without(*names: str):
        def hook(r: httpx.Response) -> None:
            for n in names:
                r.headers.pop(n, None)
        return hook

    for stripped, asked in ((("retry-after", "retry-after-ms"), 1),
                            (("retry-after", "retry-after-ms", "x-should-retry"), 3)):
        before = refusals(gw, "insufficient_quota")
        with httpx.Client(event_hooks={"response": [without(*stripped)]}) as http, \
                pytest.raises(openai.RateLimitError):
            ask(openai.OpenAI(base_url=gw + "/v1", api_key=QUOTA_KEY, max_retries=2, http_client=http))
        assert refusals(gw, "insufficient_quota") - before == asked, stripped


def test_the_sdk_does_not_retry_residency_unsatisfiable(gw):
    before = refusals(gw, "residency_unsatisfiable")
    with pytest.raises(openai.PermissionDeniedError) as ei:
        ask(openai.OpenAI(base_url=gw + "/v1", api_key=EU_KEY, max_retries=2))
    assert ei.value.status_code == 403 and ei.value.code == "residency_unsatisfiable"
    assert ei.value.response.headers["x-should-retry"] == "false"
    assert refusals(gw, "residency_unsatisfiable") - before == 1


def timings(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur)
    return out


def test_server_timing_and_no_retry_header_where_a_retry_can_help(gw):
    body = {"model": "up-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    t0 = time.perf_counter()
    r = httpx.post(gw + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {OK_KEY}"})
    elapsed_ms = (time.perf_counter() - t0) * 1000
    assert r.status_code == 200 and "x-should-retry" not in r.headers
    t = timings(r.headers["server-timing"])
    assert {"gw", "upstream", "authenticate", "decide", "reserve", "route"} <= set(t)
    assert all(v >= 0 for v in t.values())
    assert t["gw"] + t["upstream"] <= elapsed_ms  # inside the client's round trip
    assert sum(v for k, v in t.items() if k not in ("gw", "upstream")) <= t["gw"]  # stages are the gateway's time

    stream = httpx.post(gw + "/v1/chat/completions", json={**body, "stream": True},
                        headers={"authorization": f"Bearer {OK_KEY}"})
    assert stream.status_code == 200 and {"gw", "upstream"} <= set(timings(stream.headers["server-timing"]))

    r = httpx.post(gw + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {QUOTA_KEY}"})
    assert r.status_code == 429 and r.headers["x-should-retry"] == "false"
    t = timings(r.headers["server-timing"])
    assert "gw" in t and "reserve" not in t and "upstream" not in t  # refused in reserve: no timing of its own
    r = httpx.post(gw + "/v1/chat/completions", json=body, headers={"authorization": "Bearer wrong-key-0123456789"})
    assert r.status_code == 401 and "x-should-retry" not in r.headers and "gw" in timings(r.headers["server-timing"])
    r = httpx.post(gw + "/v1/chat/completions", content=b"{", headers={"authorization": f"Bearer {OK_KEY}",
                                                                          "content-type": "application/json"})
    assert r.status_code == 400 and "gw" in timings(r.headers["server-timing"])
