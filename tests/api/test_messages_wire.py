"""The Anthropic client wire (gateway/api/wire/anthropic.py): usage as Anthropic defines it, response facts,
first-token detection, a stream's usage captured from message_start/message_delta, the budget cut, and
Anthropic-shaped errors (body and `event: error`) with Anthropic's error type for every status."""
from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.api.wire.anthropic import ANTHROPIC, error_type, usage_from
from gateway.api.wire.base import StreamState
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.types import Usage


def ctx(**kw) -> RequestContext:
    c = RequestContext(request_id="r", endpoint="messages", headers={}, body={})
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def ev(obj: dict) -> bytes:
    return b"event: " + obj["type"].encode() + b"\ndata: " + orjson.dumps(obj)


START = {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                                              "usage": {"input_tokens": 7, "cache_read_input_tokens": 32,
                                                        "output_tokens": 1}}}
BLOCK = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}


def delta(text: str) -> dict:
    return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}


END = [{"type": "content_block_stop", "index": 0},
       {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 12}},
       {"type": "message_stop"}]


def test_usage_counts_cache_reads_and_writes_as_prompt():
    assert usage_from({"input_tokens": 5, "output_tokens": 3}) == Usage(5, 3, None)
    assert usage_from({"input_tokens": 5, "cache_read_input_tokens": 40, "cache_creation_input_tokens": 2,
                       "output_tokens": 3}) == Usage(47, 3, 40)
    # vLLM: the whole prompt as input_tokens, the cache fields null (cached unknown)
    assert usage_from({"input_tokens": 47, "output_tokens": 3, "cache_read_input_tokens": None,
                       "cache_creation_input_tokens": None}) == Usage(47, 3, None)
    assert usage_from(None) is None and usage_from({"input_tokens": "x", "output_tokens": -1}) == Usage(0, 0, None)
    assert ANTHROPIC.usage({"usage": {"input_tokens": 1, "output_tokens": 2}}) == Usage(1, 2, None)
    assert ANTHROPIC.usage([]) is None


def test_facts_of_a_body():
    c = ctx()
    ANTHROPIC.facts(c, {"id": "msg_9", "type": "message", "stop_reason": "max_tokens"})
    assert c.response_id == "msg_9" and c.finish_reasons == ("max_tokens",)


def test_a_stream_captures_usage_facts_and_its_end():
    c = ctx()
    s = StreamState()
    out = [ANTHROPIC.process(c, s, ev(e)) for e in (START, BLOCK, {"type": "ping"}, delta("Hello"), delta(" you"))]
    assert all(o is not None and o.endswith(b"\n\n") for o in out)
    assert c.response_id == "msg_1" and c.usage == Usage(39, 1, 32) and not s.done
    assert s.delivered_tokens == 2
    for e in END:
        ANTHROPIC.process(c, s, ev(e))
    assert s.done and c.usage == Usage(39, 12, 32) and c.finish_reasons == ("end_turn",)
    # vLLM (and newer Anthropic versions) repeat the input usage in message_delta: it wins
    c2, s2 = ctx(), StreamState()
    ANTHROPIC.process(c2, s2, ev(START))
    ANTHROPIC.process(c2, s2, ev({"type": "message_delta", "delta": {}, "usage": {"input_tokens": 50,
                                                                                  "output_tokens": 4}}))
    assert c2.usage == Usage(50, 4, None)
    # comments and unparseable events pass through untouched
    assert ANTHROPIC.process(c2, s2, b": keepalive") == b": keepalive\n\n"


def test_first_token_is_the_first_non_empty_delta():
    first = ANTHROPIC.is_first_token
    assert not first(ev(START)) and not first(ev(BLOCK)) and not first(ev({"type": "ping"}))
    assert not first(ev(delta(""))) and first(ev(delta("a")))
    assert first(ev({"type": "content_block_delta", "index": 1,
                     "delta": {"type": "input_json_delta", "partial_json": "{"}}))
    assert first(ev({"type": "message_stop"})) and first(ev({"type": "error", "error": {}}))
    assert not first(b": comment")


def test_the_budget_cut_ends_the_stream_with_an_anthropic_error_event():
    c = ctx(completion_token_allowance=3)
    s = StreamState()
    ANTHROPIC.process(c, s, ev(START))
    assert ANTHROPIC.process(c, s, ev(delta("abcd"))).count(b"event:") == 1  # 1 token delivered
    out = ANTHROPIC.process(c, s, ev(delta("abcdefgh")))  # 3 tokens: the allowance is reached
    assert c.cut_by_budget and c.error == "insufficient_quota"
    head, _, tail = out.partition(b"\n\n")
    assert b"content_block_delta" in head
    assert tail.startswith(b"event: error\ndata: ")
    body = orjson.loads(tail.split(b"data: ", 1)[1])
    assert body == {"type": "error", "error": {"type": "rate_limit_error", "message": body["error"]["message"]}}
    assert "Budget" in body["error"]["message"]


@pytest.mark.parametrize("status,etype", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (405, "invalid_request_error"), (408, "invalid_request_error"),
    (413, "request_too_large"), (415, "invalid_request_error"), (429, "rate_limit_error"), (500, "api_error"),
    (502, "api_error"), (503, "overloaded_error"), (504, "api_error"), (529, "overloaded_error")])
def test_errors_are_anthropic_shaped(status, etype):
    err = GatewayError(status, "why", code="some_code")
    assert error_type(status) == etype
    assert orjson.loads(ANTHROPIC.error_body(err)) == {"type": "error", "error": {"type": etype, "message": "why"}}
    event = ANTHROPIC.error_event(err)
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    assert orjson.loads(event.split(b"data: ", 1)[1]) == orjson.loads(ANTHROPIC.error_body(err))


@given(st.lists(st.text(max_size=12), min_size=1, max_size=20), st.integers(1, 40))
def test_a_cut_stream_never_delivers_past_the_allowance_plus_one_event(texts, allowance):
    c = ctx(completion_token_allowance=allowance)
    s = StreamState()
    ANTHROPIC.process(c, s, ev(START))
    sent = 0
    for t in texts:
        ANTHROPIC.process(c, s, ev(delta(t)))
        if c.cut_by_budget:
            break
        sent = s.delivered_tokens
    assert sent < allowance  # whatever went out before the cutting event was still inside the allowance
    assert c.cut_by_budget == (s.delivered_tokens >= allowance)
