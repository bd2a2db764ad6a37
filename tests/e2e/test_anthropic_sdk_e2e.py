"""Anthropic Messages end to end: the official `anthropic` SDK (`client.messages.create`, stream and not) and
the official `openai` SDK against a real `python -m gateway serve` in front of a simulated fleet process.

Engine 0 is a kind `sim` backend (vLLM's native /v1/messages); engine 1 is registered as kind `anthropic` (a
partner speaking Anthropic's Messages API; the simulator's /v1/messages plays that upstream), reached both by
/v1/messages natively and by OpenAI chat completions translated both ways. Bad inputs on /v1/messages get
Anthropic-shaped 4xx (`{"type": "error", "error": {"type", "message"}}`), refusals from identity, ingress,
budgets and residency included; the audit record carries the usage the budget was charged from."""
from __future__ import annotations

import json
import sqlite3
import time

import anthropic
import httpx
import openai
import pytest

from tests.support.stack import make_stack

pytestmark = pytest.mark.e2e
KEY = "anth-e2e-key-0123456789"
QUOTA_KEY = "anth-quota-key-0123456789"
EU_KEY = "anth-eu-key-0123456789"
METER_KEY = "anth-meter-key-0123456789"
ISO_KEY = "anth-iso-key-0123456789"
PARTNER_SECRET = "partner-anthropic-secret-0123"
MSGS = [{"role": "user", "content": "Name three prime numbers and say why they are prime."}]


def _backends(tmp):  # type: ignore[no-untyped-def]
    def make(man: dict) -> list[dict]:
        e0, e1 = man["engines"]
        return [{"name": "engine", "url": e0["url"], "kind": "sim", "models": ["sim-model"],
                 "kv_events": e0["kv_events"], "replay": e0["replay"], "metrics": e0["metrics"],
                 "location": {"country": "US"}, "retention": "zero"},
                {"name": "claude-partner", "url": e1["url"], "kind": "anthropic", "models": ["claude-sim"],
                 "model_map": {"claude-sim": "sim-model"}, "api_key_file": str(tmp / "partner.key"),
                 "location": {"country": "US"}, "retention": "zero", "operator": "partner"}]
    return make


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("anthropic")
    (tmp / "partner.key").write_text(PARTNER_SECRET)
    with make_stack(tmp, engines=2, fleet_args=["--locations", "US,US"], backends=_backends(tmp),
                    keys={KEY: {"tenant": "acme", "name": "k"}, QUOTA_KEY: {"tenant": "quota", "name": "q"},
                          EU_KEY: {"tenant": "eu", "name": "e"}, METER_KEY: {"tenant": "metered", "name": "m"},
                          ISO_KEY: {"tenant": "iso", "name": "i"}},
                    policy={"version": 1, "defaults": {"allow": True}, "rules": [
                        {"id": "tiny-daily-quota", "match": {"tenant": "quota"},
                         "budgets": [{"window": "day", "tokens": 10}]},
                        {"id": "eu-stays-in-eea", "match": {"tenant": "eu"}, "require": {"jurisdiction": "EEA"}},
                        {"id": "metered", "match": {"tenant": "metered"},
                         "budgets": [{"window": "day", "tokens": 100000}]},
                        {"id": "isolated", "match": {"tenant": "iso"}, "set": {"cache_isolation": True}}]},
                    server={"max_body_bytes": 200_000},
                    budgets={"prices": {"sim-model": {"input": 1.0, "output": 4.0}}}) as s:
        e0, e1 = s.engines
        yield {"base": s.base, "tmp": tmp, "engine": e0, "partner": e1}


def audit(tmp, rid: str, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = tmp / "audit.jsonl"
        if p.exists():
            for line in p.read_text().splitlines():
                rec = json.loads(line)
                if rid in (rec.get("request_id"), rec.get("client_request_id")):
                    return rec
        time.sleep(0.05)
    raise AssertionError(f"no audit record for {rid}")


def client(stack, key: str = KEY, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack["base"], api_key=key, max_retries=0, **kw)


@pytest.mark.parametrize("model", ["sim-model", "claude-sim"])
def test_messages_create_json(stack, model):
    """Natively on a vLLM-kind engine and on an Anthropic-kind partner: the SDK parses a Message; the audit
    record's usage is Anthropic's input (+ cache reads) and output tokens."""
    c = client(stack)
    raw = c.messages.with_raw_response.create(model=model, max_tokens=7, system="Be terse.", messages=MSGS,
                                              extra_headers={"x-request-id": f"anth-json-{model}"})
    msg = raw.parse()
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 7 and msg.usage.input_tokens > 0
    rec = audit(stack["tmp"], f"anth-json-{model}")
    assert rec["endpoint"] == "messages" and rec["status"] == 200
    assert rec["backend"] == ("engine" if model == "sim-model" else "claude-partner")
    prompt = msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    assert rec["usage"]["prompt_tokens"] == prompt and rec["usage"]["completion_tokens"] == 7
    assert rec["response_id"] == msg.id and rec["finish_reasons"] == ["max_tokens"]


@pytest.mark.parametrize("model", ["sim-model", "claude-sim"])
def test_messages_create_stream(stack, model):
    c = client(stack)
    stream = c.messages.create(model=model, max_tokens=9, messages=MSGS, stream=True,
                               extra_headers={"x-request-id": f"anth-stream-{model}"})
    kinds, text = [], []
    for ev in stream:
        kinds.append(ev.type)
        if ev.type == "content_block_delta":
            text.append(ev.delta.text)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert "".join(text)
    # the SDK's stream helper accumulates the same events into a final Message with usage
    with c.messages.stream(model=model, max_tokens=9, messages=MSGS) as s:
        joined = "".join(s.text_stream)
        final = s.get_final_message()
    assert joined and final.usage.output_tokens == 9 and final.stop_reason == "max_tokens"
    rec = audit(stack["tmp"], f"anth-stream-{model}")
    assert rec["stream"] and rec["status"] == 200 and rec["usage"]["completion_tokens"] == 9
    assert rec["usage"]["prompt_tokens"] > 0 and rec["ttft_ms"]["actual"] is not None


def test_openai_chat_through_an_anthropic_partner(stack):
    """OpenAI chat completions reach the Anthropic-kind backend translated to Messages and come back as chat
    completions, JSON and streamed (usage chunk and [DONE] included)."""
    c = openai.OpenAI(base_url=stack["base"] + "/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "system", "content": "Be terse."}, *MSGS]
    r = c.chat.completions.create(model="claude-sim", max_tokens=6, messages=msgs,
                                  extra_headers={"x-request-id": "oai-anth-json"})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    rec = audit(stack["tmp"], "oai-anth-json")
    assert rec["backend"] == "claude-partner" and rec["usage"]["prompt_tokens"] == r.usage.prompt_tokens

    chunks = list(c.chat.completions.create(model="claude-sim", max_tokens=6, messages=msgs, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    # without include_usage the gateway strips the usage-only chunk, as for any chat stream
    plain = list(c.chat.completions.create(model="claude-sim", max_tokens=4, messages=msgs, stream=True))
    assert all(ch.usage is None for ch in plain) and "".join(
        ch.choices[0].delta.content or "" for ch in plain if ch.choices)


def test_routing_sees_the_system_prompt_of_a_messages_request(stack):
    """Routing reads a Messages body as the chat the engine renders (`system` first: the endpoint's chat_view),
    so the KV index predicts the cached system prompt of a later request with another question: at least the
    engine's count of the system turn's full blocks. Reading `messages` alone would predict nothing cached."""
    c = client(stack)
    system = "You are the support assistant of the Orion project; answer in one short sentence. " * 12
    c.messages.create(model="sim-model", max_tokens=2, system=system, messages=MSGS)
    rec = None
    for i in range(50):  # until the engine's KV events for the first request have reached the gateway's index
        rid = f"anth-kv-{i}"
        c.messages.create(model="sim-model", max_tokens=2, system=system,
                          messages=[{"role": "user", "content": f"Question number {i}: what is Orion?"}],
                          extra_headers={"x-request-id": rid})
        rec = audit(stack["tmp"], rid)
        if rec["cached_tokens"]["predicted"]:
            break
        time.sleep(0.1)
    assert rec is not None and rec["cached_tokens"]["predicted"], rec
    # at least the system turn's full blocks (the engine's own count of them), and less than the whole prompt
    e = stack["engine"]
    root = e["url"].removesuffix("/v1")
    n_system = httpx.post(root + "/tokenize", json={"messages": [{"role": "system", "content": system}],
                                                    "add_generation_prompt": False}).json()["count"]
    bs = e["block_size"]
    assert n_system // bs * bs <= rec["cached_tokens"]["predicted"] < rec["usage"]["prompt_tokens"]


def ledger_row(tmp, rid: str, timeout: float = 5.0) -> tuple:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        db = sqlite3.connect(tmp / "budgets.db")
        try:
            rows = db.execute("select total_tokens, completion_tokens, tenant, cut_by_budget from budget_ledger "
                              "where client_request_id = ?", (rid,)).fetchall()
        except sqlite3.OperationalError:  # the table is created with the first flush
            rows = []
        finally:
            db.close()
        if rows:
            return rows[0]
        time.sleep(0.05)
    raise AssertionError(f"no ledger row for {rid}")


@pytest.mark.parametrize("stream", [False, True])
def test_budgets_are_charged_from_input_and_output_tokens(stack, stream):
    c = client(stack, METER_KEY)
    rid = f"anth-meter-{stream}"
    if stream:
        with c.messages.stream(model="sim-model", max_tokens=8, messages=MSGS,
                               extra_headers={"x-request-id": rid}) as s:
            msg = s.get_final_message()
    else:
        raw = c.messages.with_raw_response.create(model="sim-model", max_tokens=8, messages=MSGS,
                                                  extra_headers={"x-request-id": rid})
        assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 100000  # the reservation is visible
        msg = raw.parse()
    total, completion, tenant, cut = ledger_row(stack["tmp"], rid)
    assert tenant == "metered" and not cut
    assert completion == msg.usage.output_tokens == 8
    assert total == msg.usage.input_tokens + msg.usage.output_tokens


def anth_error(r: httpx.Response, status: int, etype: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == etype
    return body["error"]["message"]


def test_bad_inputs_get_anthropic_shaped_4xx(stack):
    c = client(stack)
    with pytest.raises(anthropic.BadRequestError) as ei:
        # NOT_GIVEN leaves the field out of the body (the SDK's type hints require it; the API does too)
        c.messages.create(model="sim-model", messages=MSGS, max_tokens=anthropic.NOT_GIVEN, timeout=30)
    assert ei.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in ei.value.message
    with pytest.raises(anthropic.BadRequestError) as ei:
        c.messages.create(model="sim-model", max_tokens=5, messages=[{"role": "tool", "content": "x"}])
    assert "messages[0].role" in ei.value.message
    with pytest.raises(anthropic.BadRequestError) as ei:
        c.messages.create(model="sim-model", max_tokens=5, messages=[{"role": "user", "content": 5}])
    assert "messages[0].content" in ei.value.message
    with pytest.raises(anthropic.AuthenticationError) as ei:
        client(stack, "wrong-key-0123456789").messages.create(model="sim-model", max_tokens=5, messages=MSGS)
    assert ei.value.status_code == 401 and ei.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as ei:
        c.messages.create(model="no-such-model", max_tokens=5, messages=MSGS)
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "not_found_error"

    url = stack["base"] + "/v1/messages"
    ok = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    body = {"model": "sim-model", "max_tokens": 5, "messages": MSGS}
    anth_error(httpx.post(url, content=json.dumps(body), headers={**ok, "content-type": "text/plain"}), 415,
               "invalid_request_error")
    anth_error(httpx.get(url, headers=ok), 405, "invalid_request_error")
    anth_error(httpx.post(url, json={**body, "system": "x" * 300_000}, headers=ok), 413, "request_too_large")
    anth_error(httpx.post(url, content=b"{", headers={**ok, "content-type": "application/json"}), 400,
               "invalid_request_error")
    anth_error(httpx.post(url, json=body), 401, "authentication_error")  # no key at all
    # an unauthenticated caller learns nothing about its body: 401 before the 400
    anth_error(httpx.post(url, json={"model": "sim-model"}, headers={"x-api-key": "nope-0123456789"}), 401,
               "authentication_error")
    msg = anth_error(httpx.post(url, json={**body, "temperature": 1.5}, headers=ok), 400, "invalid_request_error")
    assert "temperature" in msg


def test_authorization_bearer_works_like_x_api_key(stack):
    url = stack["base"] + "/v1/messages"
    body = {"model": "sim-model", "max_tokens": 3, "messages": MSGS}
    for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY, "anthropic-version": "2023-06-01"}):
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == 200 and r.json()["type"] == "message", r.text


def test_budget_and_residency_refusals_are_anthropic_shaped(stack):
    with pytest.raises(anthropic.RateLimitError) as ei:
        client(stack, QUOTA_KEY).messages.create(model="sim-model", max_tokens=50, messages=MSGS)
    err = ei.value
    assert err.status_code == 429 and err.body["error"]["type"] == "rate_limit_error"
    assert int(err.response.headers["retry-after"]) >= 1 and err.response.headers["x-should-retry"] == "false"
    with pytest.raises(anthropic.PermissionDeniedError) as ei:
        client(stack, EU_KEY).messages.create(model="sim-model", max_tokens=5, messages=MSGS)
    assert ei.value.status_code == 403 and ei.value.body["error"]["type"] == "permission_error"
    # a refused stream request is refused before the stream starts, in the same shape
    with pytest.raises(anthropic.RateLimitError):
        client(stack, QUOTA_KEY).messages.create(model="sim-model", max_tokens=50, messages=MSGS, stream=True)


def test_upstream_rejection_is_relayed_in_the_clients_shape(stack):
    """An Anthropic partner's own 4xx (here: the prompt is longer than its context) reaches an OpenAI client as
    an OpenAI error and an Anthropic client as an Anthropic error, with the partner's message."""
    long = [{"role": "user", "content": "word " * 3000}]
    r = httpx.post(stack["base"] + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "claude-sim", "max_tokens": 5, "messages": long}, timeout=30)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    r = httpx.post(stack["base"] + "/v1/messages", headers={"x-api-key": KEY},
                   json={"model": "claude-sim", "max_tokens": 5, "messages": long}, timeout=30)
    assert "context length" in anth_error(r, 400, "invalid_request_error")


@pytest.mark.parametrize("stream", [False, True])
def test_cache_isolation_holds_on_messages(stack, stream):
    """vLLM's /v1/messages drops cache_salt, so an isolated tenant's request goes to the engine's chat API with
    its salt (translated both ways): another tenant's identical prompt is not a cache hit for it, its own
    repeat is, and the answer is still an Anthropic message / stream with cache reads reported."""
    system = f"Isolation check {stream}: you are a careful assistant for tenant data. " * 10
    body = dict(model="sim-model", max_tokens=4, system=system, messages=MSGS)

    def ask(key: str, rid: str):
        c = client(stack, key)
        if not stream:
            return c.messages.create(**body, extra_headers={"x-request-id": rid})
        with c.messages.stream(**body, extra_headers={"x-request-id": rid}) as s:
            text = "".join(s.text_stream)
            msg = s.get_final_message()
        assert text and msg.content[0].text == text
        return msg

    ask(KEY, f"iso-other-{stream}")  # another tenant warms the shared cache with the same prompt
    first = ask(ISO_KEY, f"iso-1-{stream}")
    assert first.type == "message" and first.stop_reason == "max_tokens" and first.usage.output_tokens == 4
    assert first.usage.cache_read_input_tokens == 0  # not the other tenant's blocks
    again = ask(ISO_KEY, f"iso-2-{stream}")
    assert again.usage.cache_read_input_tokens > 0  # its own
    rec = audit(stack["tmp"], f"iso-2-{stream}")
    assert rec["evidence"]["messages_via"] == "chat/completions" and rec["decision"]["cache_isolation"] is True
    assert rec["usage"]["cached_tokens"] == again.usage.cache_read_input_tokens
    assert rec["usage"]["prompt_tokens"] == again.usage.input_tokens + again.usage.cache_read_input_tokens
    other = audit(stack["tmp"], f"iso-other-{stream}")
    assert "messages_via" not in other["evidence"]  # no salt: vLLM's /v1/messages natively


def test_a_stream_whose_upstream_dies_ends_with_an_error_the_sdk_raises(stack):
    """The partner's engine crashes after the first delta: the gateway ends the stream with Anthropic's
    `event: error` (api_error), which the official SDK raises as an APIStatusError; the audit record says 502.
    (Last in the file: the partner engine restarts afterwards.)"""
    root = stack["partner"]["url"].removesuffix("/v1")
    httpx.post(root + "/sim/faults", json={"slow_factor": 50.0}).raise_for_status()  # a long generation
    got = []
    try:
        stream = client(stack).messages.create(model="claude-sim", max_tokens=400, messages=MSGS, stream=True,
                                                extra_headers={"x-request-id": "anth-crash"})
        with pytest.raises(anthropic.APIStatusError) as ei:
            for ev in stream:
                got.append(ev.type)
                if ev.type == "content_block_delta" and "crash" not in got:  # once: it dies 50 ms later
                    httpx.post(root + "/sim/faults", json={"crash": True, "restart_after_s": 0.5})
                    got.append("crash")
    finally:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the engine comes back; clear the fault
            try:
                if httpx.post(root + "/sim/faults", json={"slow_factor": 1.0}, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
    assert got[0] == "message_start" and "crash" in got and "message_stop" not in got
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "api_error"
    rec = audit(stack["tmp"], "anth-crash")
    assert rec["status"] == 502 and rec["error"] == "upstream_stream_broken"
