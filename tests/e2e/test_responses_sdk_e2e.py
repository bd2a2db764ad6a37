"""/v1/responses, /v1/rerank, /v1/score and /tokenize end to end: a real gateway process (`python -m gateway
serve`) in front of a simulated fleet process (vLLM's shapes), the official openai SDK for the Responses API.

Pins: usage read from the response object and from `response.completed`/`response.incomplete`, and the spend
ledger charged exactly those input/output tokens; `store: true` and other stateful fields refused with an
OpenAI-shaped 400 naming the field (an absent store is sent upstream as false, the response says so); bad
inputs on every new path an OpenAI-shaped 4xx; rerank/score/tokenize served only by backends with the
capability, charged their input tokens, refused up front when the input bound passes the budget; a Responses
stream without max_output_tokens cut at the remaining budget in the Responses stream shape."""
from __future__ import annotations

import sqlite3
import time

import httpx
import openai
import pytest

from tests.support.stack import make_stack

pytestmark = pytest.mark.e2e
KEY = "resp-e2e-key-0123456789"
CUT_KEY = "resp-cut-key-0123456789"
TINY_KEY = "resp-tiny-key-0123456789"
CUT_BUDGET = 80  # "go" is bounded at 2 + 16 + 16 = 34 input tokens: 46 tokens left for the stream
TINY_BUDGET = 60


def _backends(man: dict) -> list[dict]:
    e0, e1 = man["engines"]
    return [{"name": "pool", "kind": "sim", "url": e0["url"], "models": ["sim-model"],
             "capabilities": ["chat", "completions", "rerank", "score"]},
            {"name": "gen", "kind": "sim", "url": e1["url"], "models": ["sim-model", "gen-only"],
             "model_map": {"gen-only": "sim-model"}},
            # an OpenAI-compatible API (kind openai) in front of the second engine: Responses is native there
            {"name": "oai", "kind": "openai", "url": e1["url"], "models": ["oai-model"],
             "model_map": {"oai-model": "sim-model"}}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    with make_stack(tmp, engines=2, backends=_backends, keys={KEY: "acme", CUT_KEY: "cut", TINY_KEY: "tiny"},
                    policy={"version": 1, "rules": [
                        {"id": "acme", "match": {"tenant": "acme"}, "budgets": [{"window": "day", "tokens": 1_000_000}]},
                        {"id": "cut", "match": {"tenant": "cut"}, "budgets": [{"window": "day", "tokens": CUT_BUDGET}]},
                        {"id": "tiny", "match": {"tenant": "tiny"},
                         "budgets": [{"window": "day", "tokens": TINY_BUDGET}]}]},
                    observability={"log_level": "warning"}) as s:
        yield {"base": s.base, "tmp": tmp, "engines": s.engines}


def ledger_row(tmp, client_rid: str) -> dict:
    for _ in range(100):  # the ledger outbox flushes every 50 ms
        db = sqlite3.connect(tmp / "budgets.db")
        db.row_factory = sqlite3.Row
        try:
            rows = db.execute("select * from budget_ledger where client_request_id = ?", (client_rid,)).fetchall()
        except sqlite3.OperationalError:
            rows = []
        finally:
            db.close()
        if rows:
            assert len(rows) == 1
            return dict(rows[0])
        time.sleep(0.05)
    raise AssertionError(f"no ledger row for {client_rid}")


def sdk(stack, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack["base"] + "/v1", api_key=key, max_retries=0)


def test_responses_json_usage_is_what_the_ledger_charges(stack):
    r = sdk(stack).responses.with_raw_response.create(
        model="sim-model", instructions="Answer briefly.", input="Name three prime numbers.", max_output_tokens=8,
        extra_headers={"x-request-id": "resp-json-1"})
    resp = r.parse()
    assert r.headers["x-gateway-backend"] in ("pool", "gen")
    assert resp.id.startswith("resp_") and resp.output_text
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.to_dict()["store"] is False  # absent store means false: nothing is kept
    u = resp.usage
    assert u.output_tokens == 8 and u.input_tokens > 8 and u.total_tokens == u.input_tokens + 8
    row = ledger_row(stack["tmp"], "resp-json-1")
    assert (row["prompt_tokens"], row["completion_tokens"], row["total_tokens"]) == (
        u.input_tokens, u.output_tokens, u.total_tokens)
    assert row["status"] == 200 and row["tenant"] == "acme"


def test_responses_items_input_with_tools_passthrough(stack):
    resp = sdk(stack).responses.create(
        model="sim-model", max_output_tokens=4, temperature=0.2,
        tools=[{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}],
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]},
               {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c1", "output": "Paris"}])
    assert resp.usage.output_tokens == 4 and resp.tools[0].name == "lookup"


def test_responses_stream_usage_from_the_terminal_event(stack):
    events = list(sdk(stack).responses.create(model="sim-model", input="Tell me about caches.",
                                              max_output_tokens=12, stream=True,
                                              extra_headers={"x-request-id": "resp-stream-1"}))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.incomplete"
    assert "response.output_text.delta" in types and "response.output_text.done" in types
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and final.output_text == text and final.usage.output_tokens == 12
    row = ledger_row(stack["tmp"], "resp-stream-1")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (final.usage.input_tokens, 12)
    assert not row["cut_by_budget"]


def test_stateful_fields_are_a_400_naming_them(stack):
    c = sdk(stack)
    for kw, param in [({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
                      ({"background": True}, "background")]:
        with pytest.raises(openai.BadRequestError) as ei:
            c.responses.create(model="sim-model", input="hi", **kw)
        assert ei.value.status_code == 400
        assert ei.value.body["param"] == param and ei.value.body["type"] == "invalid_request_error"
    assert "stateless" in ei.value.body["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/responses", {"model": "sim-model", "input": 3}, "input"),
    ("/v1/responses", {"model": "sim-model", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ("/v1/responses", {"model": "sim-model", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/responses", {"input": "x"}, "model"),
    ("/v1/rerank", {"model": "sim-model", "query": "q"}, "documents"),
    ("/v1/rerank", {"model": "sim-model", "query": "q", "documents": ["a", 2]}, "documents[1]"),
    ("/v1/rerank", {"model": "sim-model", "query": "q", "documents": ["a"], "stream": True}, "stream"),
    ("/v1/score", {"model": "sim-model", "text_1": 1, "text_2": "b"}, "text_1"),
    ("/v1/score", {"model": "sim-model", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/tokenize", {"model": "sim-model"}, "prompt"),
    ("/tokenize", {"model": "sim-model", "prompt": "x", "messages": []}, "prompt"),
    ("/tokenize", {"model": "sim-model", "messages": [{"content": "x"}]}, "messages[0].role"),
])
def test_bad_inputs_get_an_openai_shaped_4xx(stack, path, body, param):
    r = httpx.post(stack["base"] + path, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert set(err) >= {"message", "type", "param", "code"}


def test_unknown_model_and_no_auth_on_new_paths(stack):
    for path, body in [("/v1/responses", {"model": "nope", "input": "x"}),
                       ("/v1/rerank", {"model": "nope", "query": "q", "documents": ["d"]}),
                       ("/tokenize", {"model": "nope", "prompt": "x"})]:
        r = httpx.post(stack["base"] + path, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", (path, r.text)
        r = httpx.post(stack["base"] + path, json=body, timeout=10)
        assert r.status_code == 401 and "error" in r.json()


def _post(stack, path: str, body: dict, rid: str, key: str = KEY) -> httpx.Response:
    return httpx.post(stack["base"] + path, json=body, timeout=10,
                      headers={"authorization": f"Bearer {key}", "x-request-id": rid})


def test_rerank_and_score_go_to_capable_backends_and_charge_input_tokens(stack):
    docs = ["bananas are yellow", "paris is the capital of france", "berlin is a city"]
    for i in range(4):
        r = _post(stack, "/v1/rerank", {"model": "sim-model", "query": "capital of france", "documents": docs,
                                        "top_n": 2}, f"rerank-{i}")
        assert r.status_code == 200, r.text
        assert r.headers["x-gateway-backend"] == "pool"  # "gen" lacks the rerank capability
        o = r.json()
        assert o["results"][0]["index"] == 1 and len(o["results"]) == 2
        row = ledger_row(stack["tmp"], f"rerank-{i}")
        assert (row["prompt_tokens"], row["completion_tokens"]) == (o["usage"]["prompt_tokens"], 0)
    r = _post(stack, "/v1/score", {"model": "sim-model", "text_1": "capital of france", "text_2": docs}, "score-1")
    assert r.status_code == 200 and r.headers["x-gateway-backend"] == "pool"
    s = r.json()
    assert len(s["data"]) == 3 and max(s["data"], key=lambda d: d["score"])["index"] == 1
    row = ledger_row(stack["tmp"], "score-1")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (s["usage"]["prompt_tokens"], 0)


def test_tokenize_at_the_engine_root_charged_its_count(stack):
    r = _post(stack, "/tokenize", {"model": "sim-model", "prompt": "the quick brown fox"}, "tok-1")
    assert r.status_code == 200, r.text
    o = r.json()
    assert o["count"] == len(o["tokens"]) > 0 and o["max_model_len"] == 1024
    direct = httpx.post(stack["engines"][0]["url"].removesuffix("/v1") + "/tokenize",
                        json={"model": "sim-model", "prompt": "the quick brown fox"}).json()
    assert direct["tokens"] == o["tokens"]
    row = ledger_row(stack["tmp"], "tok-1")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (o["count"], 0)
    r = _post(stack, "/tokenize", {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}, "tok-2")
    assert r.status_code == 200 and ledger_row(stack["tmp"], "tok-2")["prompt_tokens"] == r.json()["count"]


def test_pooling_input_bound_past_the_budget_is_refused_up_front(stack):
    docs = ["a document about something " * 3] * 4  # 4 pairs x (query + doc + 16) chars, far over 60 tokens
    r = _post(stack, "/v1/rerank", {"model": "sim-model", "query": "what", "documents": docs}, "tiny-1", TINY_KEY)
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
    assert r.headers["retry-after"]
    r = _post(stack, "/tokenize", {"model": "sim-model", "prompt": "ok"}, "tiny-2", TINY_KEY)
    assert r.status_code == 200  # a small input still fits


def test_responses_stream_is_cut_at_the_remaining_budget(stack):
    events = list(sdk(stack, CUT_KEY).responses.create(model="sim-model", input="go", stream=True,
                                                       extra_headers={"x-request-id": "resp-cut-1"}))
    types = [e.type for e in events]
    assert types[-2:] == ["error", "response.failed"], types
    assert events[-2].code == "insufficient_quota" and "udget" in events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "insufficient_quota"
    assert failed.id == events[0].response.id
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta")  # part was delivered
    row = ledger_row(stack["tmp"], "resp-cut-1")
    assert row["cut_by_budget"] and row["completion_tokens"] > 0
    assert row["total_tokens"] <= CUT_BUDGET + 8  # never more than the budget plus one delta past the allowance
    with pytest.raises(openai.RateLimitError):  # and the budget is spent
        sdk(stack, CUT_KEY).responses.create(model="sim-model", input="go", max_output_tokens=30)


def test_a_model_no_capable_backend_serves_is_a_400_not_a_retry(stack):
    """Only "gen" serves gen-only and it lacks the rerank capability: a permanent answer (400 naming the
    model), not a 503 with Retry-After that clients would retry forever."""
    r = _post(stack, "/v1/rerank", {"model": "gen-only", "query": "q", "documents": ["d"]}, "nocap-1")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_supported" and err["param"] == "model" and "rerank" in err["message"]
    assert "retry-after" not in r.headers
    r = _post(stack, "/v1/responses", {"model": "gen-only", "input": "hi", "max_output_tokens": 2}, "nocap-2")
    assert r.status_code == 200 and r.headers["x-gateway-backend"] == "gen"  # generation needs no capability


def test_an_openai_kind_backend_serves_responses_natively(stack):
    r = sdk(stack).responses.with_raw_response.create(model="oai-model", input="hello", max_output_tokens=3,
                                                      stream=False, extra_headers={"x-request-id": "oai-1"})
    assert r.headers["x-gateway-backend"] == "oai" and r.parse().usage.output_tokens == 3
    events = list(sdk(stack).responses.create(model="oai-model", input="hello", max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 3
    # tokenize is vLLM's, not OpenAI's: no backend of that model can serve it, a permanent 400 (not a 503)
    r = _post(stack, "/tokenize", {"model": "oai-model", "prompt": "x"}, "oai-2")
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text
    assert "/tokenize" in r.json()["error"]["message"] and "retry-after" not in r.headers
