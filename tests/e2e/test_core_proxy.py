"""End to end: the real gateway process in front of a real upstream process, driven by the openai SDK and
raw HTTP. Pins the OpenAI surface, error shapes, streaming pass-through, usage handling, timeouts and
cancellation on client disconnect."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import orjson
import pytest

from tests.support.procs import free_port, start_gateway, start_upstream

GW_KEY = "test-gateway-key-123456"
ADMIN_KEY = "test-admin-key-654321"
UP_KEY = "upstream-secret-abcdef"

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["native", "aiohttp", "httpx"])
def stack(request, tmp_path_factory):
    """The same suite runs over both upstream transports."""
    tmp = tmp_path_factory.mktemp("core")
    up, up_port = start_upstream(tmp, key=UP_KEY)
    dead_port = free_port()
    gw_port = free_port()
    cfg = tmp / "gateway.yaml"
    cfg.write_text(f"""
server: {{host: 127.0.0.1, port: {gw_port}, max_body_bytes: 200000, upstream_client: {request.param}}}
backends:
  - name: local
    kind: openai
    url: http://127.0.0.1:{up_port}/v1
    api_key_env: UPSTREAM_KEY
    models: [mock-model, retry-model]
    capabilities: [chat, completions, embeddings]
    location: {{country: DE}}
    retention: zero
    timeouts: {{connect_s: 1, first_token_s: 1.5, idle_s: 1.0, total_s: 10}}
  - name: down
    kind: openai
    url: http://127.0.0.1:{dead_port}/v1
    models: [down-model, retry-model]
    location: {{country: FR}}
    health: {{enabled: false, failures_to_open: 1000}}
keys:
  - key_env: GATEWAY_KEY
    tenant: demo
admin:
  key_env: GATEWAY_ADMIN_KEY
""")
    env = {"UPSTREAM_KEY": UP_KEY, "GATEWAY_KEY": GW_KEY, "GATEWAY_ADMIN_KEY": ADMIN_KEY}
    gw, _ = start_gateway(cfg, env=env)
    yield {"gw": gw, "up_port": up_port, "base": f"http://127.0.0.1:{gw_port}", "cfg": cfg, "env": env}
    gw.stop()
    up.stop()


def client(stack, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack["base"] + "/v1", api_key=GW_KEY, max_retries=0, **kw)


def up_stats(stack) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack['up_port']}/stats").json()


def post(stack, path: str, body=None, key: str | None = GW_KEY, headers=None, raw: bytes | None = None, **kw):
    h = {"content-type": "application/json"}
    if key:
        h["authorization"] = f"Bearer {key}"
    h.update(headers or {})
    content = raw if raw is not None else orjson.dumps(body)
    return httpx.post(stack["base"] + path, content=content, headers=h, timeout=15, **kw)


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(["message", "type", "param", "code"]) <= set(err)
    assert err["message"]
    if code:
        assert err["code"] == code, err
    if param:
        assert err["param"] == param, err
    assert r.headers.get("x-request-id")


# ---------------------------------------------------------------- OpenAI SDK, sync and async

def test_sdk_chat_non_streaming(stack):
    r = client(stack).chat.completions.create(model="mock-model", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5)
    assert r.choices[0].message.content == "hello world from the upstream"
    assert r.usage.completion_tokens == 5
    # the upstream got the gateway's own credential, never the client's
    assert up_stats(stack)["last_headers"]["authorization"] == f"Bearer {UP_KEY}"


def test_sdk_chat_streaming_strips_usage_chunk_client_did_not_ask_for(stack):
    chunks = list(client(stack).chat.completions.create(
        model="mock-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "hello world from the"
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)
    # ... while the gateway asked the upstream for usage
    assert up_stats(stack)["last_body"]["stream_options"] == {"include_usage": True}


def test_sdk_chat_streaming_keeps_usage_when_asked(stack):
    chunks = list(client(stack).chat.completions.create(
        model="mock-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_sdk_completions_and_embeddings_and_models(stack):
    c = client(stack)
    r = c.completions.create(model="mock-model", prompt="say", max_tokens=2)
    assert r.choices[0].text == "hello world"
    s = list(c.completions.create(model="mock-model", prompt="say", max_tokens=2, stream=True))
    assert "".join(x.choices[0].text for x in s if x.choices) == "hello world"
    e = c.embeddings.create(model="mock-model", input=["a", "b"])
    assert len(e.data) == 2 and e.data[0].embedding == [0.1, 0.2, 0.3]
    models = {m.id: m for m in c.models.list()}
    assert "mock-model" in models
    extra = models["mock-model"].model_extra
    assert {"backend": "local", "country": "DE"}.items() <= extra["locations"][0].items()
    assert extra["locations"][0]["retention"] == "zero"


async def test_sdk_async_stream_and_non_stream(stack):
    c = openai.AsyncOpenAI(base_url=stack["base"] + "/v1", api_key=GW_KEY, max_retries=0)
    r, stream = await asyncio.gather(
        c.chat.completions.create(model="mock-model", messages=[{"role": "user", "content": "x"}], max_tokens=2),
        c.chat.completions.create(model="mock-model", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                  stream=True))
    assert r.choices[0].message.content == "hello world"
    text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    assert text == "hello world"
    await c.close()


# ---------------------------------------------------------------- bad input

CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}


def test_malformed_json_is_400(stack):
    assert_openai_error(post(stack, "/v1/chat/completions", raw=b"{nope"), 400, "invalid_json")
    assert_openai_error(post(stack, "/v1/chat/completions", raw=b"[1,2]"), 400, "invalid_json")
    assert_openai_error(post(stack, "/v1/chat/completions", raw=b"\xff\xfe{"), 400, "invalid_json")


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "mock-model"}, "messages"),
    ({"model": 5, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "mock-model", "messages": "hi"}, "messages"),
    ({"model": "mock-model", "messages": [{"content": "x"}]}, "messages[0].role"),
    ({**CHAT, "max_tokens": "ten"}, "max_tokens"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "temperature": 7}, "temperature"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_wrong_types_and_missing_fields_name_the_param(stack, body, param):
    assert_openai_error(post(stack, "/v1/chat/completions", body), 400, param=param)


def test_completions_and_embeddings_validation(stack):
    assert_openai_error(post(stack, "/v1/completions", {"model": "mock-model"}), 400, param="prompt")
    assert_openai_error(post(stack, "/v1/embeddings", {"model": "mock-model", "input": 5}), 400, param="input")


def test_auth_errors_are_401(stack):
    assert_openai_error(post(stack, "/v1/chat/completions", CHAT, key=None), 401, "missing_api_key")
    r = post(stack, "/v1/chat/completions", CHAT, key="wrong-key-value")
    assert_openai_error(r, 401)
    assert "wrong-key-value" not in r.text
    r = httpx.get(stack["base"] + "/v1/models")
    assert_openai_error(r, 401)


def test_unknown_model_is_404(stack):
    assert_openai_error(post(stack, "/v1/chat/completions", {**CHAT, "model": "nope"}), 404, "model_not_found", "model")


def test_body_over_limit_is_413_and_wrong_content_type_415(stack):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 300000}]}
    assert_openai_error(post(stack, "/v1/chat/completions", big), 413, "request_too_large")
    assert_openai_error(post(stack, "/v1/chat/completions", CHAT, headers={"content-type": "text/plain"}), 415)


def test_unknown_route_and_method(stack):
    r = httpx.get(stack["base"] + "/v1/nothing-here")
    assert_openai_error(r, 404)
    r = httpx.put(stack["base"] + "/v1/chat/completions", headers={"authorization": f"Bearer {GW_KEY}"})
    assert_openai_error(r, 405)
    # GET is OpenAI's list of stored completions, which the gateway does not keep (tests/e2e/test_unserved_routes.py)
    r = httpx.get(stack["base"] + "/v1/chat/completions", headers={"authorization": f"Bearer {GW_KEY}"})
    assert_openai_error(r, 404, "stored_completions_not_supported")


def test_request_id_taken_from_client_when_valid_else_generated(stack):
    r = post(stack, "/v1/chat/completions", CHAT, headers={"x-request-id": "client-id-42"})
    assert r.headers["x-request-id"] == "client-id-42"
    r = post(stack, "/v1/chat/completions", CHAT, headers={"x-request-id": "bad id\twith spaces"})
    assert r.headers["x-request-id"].startswith("req_")
    assert_openai_error(post(stack, "/v1/chat/completions", {}, headers={"x-request-id": "err-1"}), 400)


# ---------------------------------------------------------------- upstream faults

def test_upstream_down_is_503_with_retry_after(stack):
    r = post(stack, "/v1/chat/completions", {**CHAT, "model": "down-model"})
    assert_openai_error(r, 503)
    assert r.headers["retry-after"] and r.headers["retry-after-ms"]


def test_retry_on_connect_error_goes_to_next_candidate(stack):
    for _ in range(4):  # round robin puts the dead backend first half of the time
        r = post(stack, "/v1/chat/completions", {**CHAT, "model": "retry-model", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_upstream_500_is_502(stack):
    r = post(stack, "/v1/chat/completions", {**CHAT, "x_test_fault": "error500"})
    assert_openai_error(r, 502, "upstream_error")
    assert "Traceback" not in r.text


def test_upstream_400_passes_through_its_error(stack):
    r = post(stack, "/v1/chat/completions", {**CHAT, "x_test_fault": "error400"})
    assert_openai_error(r, 400, "context_length_exceeded", "messages")


def test_slow_first_token_is_504(stack):
    r = post(stack, "/v1/chat/completions", {**CHAT, "stream": True, "x_test_fault": "slow_first:3"})
    assert_openai_error(r, 504, "upstream_timeout")


def test_idle_stream_ends_with_error_event_and_done(stack):
    with httpx.stream("POST", stack["base"] + "/v1/chat/completions", timeout=15,
                      headers={"authorization": f"Bearer {GW_KEY}", "content-type": "application/json"},
                      content=orjson.dumps({**CHAT, "stream": True, "max_tokens": 4, "x_test_fault": "slow_chunks:3"})) as r:
        assert r.status_code == 200
        body = r.read().decode()
    assert '"upstream_timeout"' in body
    assert body.rstrip().endswith("data: [DONE]")


def test_upstream_dying_mid_stream_ends_with_error_event_and_done(stack):
    with httpx.stream("POST", stack["base"] + "/v1/chat/completions", timeout=15,
                      headers={"authorization": f"Bearer {GW_KEY}", "content-type": "application/json"},
                      content=orjson.dumps({**CHAT, "stream": True, "max_tokens": 6, "x_test_fault": "die_mid"})) as r:
        body = r.read().decode()
    assert "hello" in body
    assert '"upstream_error"' in body
    assert body.rstrip().endswith("data: [DONE]")


def test_client_disconnect_cancels_upstream_at_once(stack):
    before = up_stats(stack)["streams_cancelled"]
    with httpx.stream("POST", stack["base"] + "/v1/chat/completions", timeout=15,
                      headers={"authorization": f"Bearer {GW_KEY}", "content-type": "application/json"},
                      content=orjson.dumps({**CHAT, "stream": True, "max_tokens": 50,
                                            "x_test_fault": "slow_chunks:0.5"})) as r:
        it = r.iter_raw()
        next(it)  # stream started
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and up_stats(stack)["streams_cancelled"] == before:
        time.sleep(0.05)
    assert up_stats(stack)["streams_cancelled"] == before + 1


def test_client_disconnect_cancels_a_non_streaming_upstream_request(stack):
    """No stream has started, so only the connection tells the gateway the client left: it must close the
    upstream request at once (the engine would otherwise keep generating an answer nobody reads)."""
    before = up_stats(stack)["hangs_abandoned"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack["base"] + "/v1/chat/completions", timeout=httpx.Timeout(15, read=0.5),
                   headers={"authorization": f"Bearer {GW_KEY}", "content-type": "application/json"},
                   content=orjson.dumps({**CHAT, "x_test_fault": "hang"}))
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and up_stats(stack)["hangs_abandoned"] == before:
        time.sleep(0.05)
    assert up_stats(stack)["hangs_abandoned"] == before + 1


def test_probes_and_metrics(stack):
    assert httpx.get(stack["base"] + "/healthz").json()["status"] == "ok"
    m = httpx.get(stack["base"] + "/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    names = {f.name for f in text_string_to_metric_families(m)}
    assert "gateway_requests" in names and "gen_ai_server_time_to_first_token_seconds" in names


def test_a_client_that_reads_slowly_gets_the_whole_stream(stack):
    """Back-pressure: a 20,000-event stream (~3 MB) to a client that reads nothing for 1.5 s (a small receive
    buffer) and then reads on. The gateway pauses relaying while the client's connection is full (push mode:
    the upstream read callback hands back to the stream's task, which awaits the drain) and loses or reorders
    no event."""
    import socket

    n = 20000
    body = orjson.dumps({**CHAT, "stream": True, "max_tokens": n})
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", int(stack["base"].rsplit(":", 1)[1])))
    s.settimeout(30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              + f"authorization: Bearer {GW_KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(1.5)
    got = bytearray()
    try:
        while not got.endswith(b"0\r\n\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    finally:
        s.close()
    head, _, rest = bytes(got).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    events = [ln for ln in rest.split(b"\n") if ln.startswith(b"data: ")]  # chunk-size lines never start so
    assert events[-1] == b"data: [DONE]"
    bad = [e for e in events[:-1] if b"\"choices\"" not in e]
    assert not bad, bad[:3]
    words = [orjson.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert len([w for w in words if w]) == n
