"""The Responses wire (gateway/api/wire/responses.py) over streams shaped like vLLM's and OpenAI's: typed
events, first token at the first output delta, usage from response.completed, the end at a terminal event, a
budget cut ending the stream with `error` + `response.failed`; the upstream body always says store: false."""
from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.endpoints import BY_NAME
from gateway.api.wire.base import StreamState
from gateway.api.wire.responses import RESPONSES, event_type, usage_from
from gateway.pipeline import RequestContext
from gateway.types import Usage
from gateway.proxy import sse

EP = BY_NAME["responses"]


def _ev(kind: str, seq: int, **fields) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, "sequence_number": seq, **fields})


def _resp(status: str = "in_progress", usage=None, **extra) -> dict:
    return {"id": "resp_abc", "object": "response", "created_at": 1, "model": "m", "status": status, "output": [],
            "store": False, "usage": usage, **extra}


def stream(deltas: list[str], terminal: str = "response.completed", usage=None) -> list[bytes]:
    u = usage or {"input_tokens": 11, "output_tokens": len(deltas), "total_tokens": 11 + len(deltas),
                  "input_tokens_details": {"cached_tokens": 3}, "output_tokens_details": {"reasoning_tokens": 0}}
    evs = [_ev("response.created", 0, response=_resp()), _ev("response.in_progress", 1, response=_resp()),
           _ev("response.output_item.added", 2, output_index=0, item={"type": "message", "id": "msg_1"}),
           _ev("response.content_part.added", 3, item_id="msg_1", output_index=0, content_index=0,
               part={"type": "output_text", "text": ""})]
    seq = 4
    for d in deltas:
        evs.append(_ev("response.output_text.delta", seq, item_id="msg_1", output_index=0, content_index=0,
                       delta=d, logprobs=[]))
        seq += 1
    evs.append(_ev("response.output_text.done", seq, item_id="msg_1", output_index=0, content_index=0,
                   text="".join(deltas)))
    status = {"response.completed": "completed", "response.incomplete": "incomplete",
              "response.failed": "failed"}[terminal]
    extra = {"incomplete_details": {"reason": "max_output_tokens"}} if status == "incomplete" else {}
    evs.append(_ev(terminal, seq + 1, response=_resp(status, u, **extra)))
    return evs


def _ctx(allowance: int | None = None) -> RequestContext:
    ctx = RequestContext(request_id="req_1", endpoint="responses", headers={}, body={"model": "m", "input": "x"},
                         stream=True)
    ctx.completion_token_allowance = allowance
    return ctx


def test_event_types_and_first_token():
    evs = stream(["Hel", "lo"])
    assert [event_type(e) for e in evs[:2]] == [b"response.created", b"response.in_progress"]
    firsts = [RESPONSES.is_first_token(e) for e in evs]
    assert firsts.index(True) == 4  # the first output delta, not the created/in_progress/added events
    no_event_line = sse.event_data(evs[4])
    assert RESPONSES.is_first_token(b"data: " + no_event_line)  # the data's type is read when no event: line


@pytest.mark.parametrize("terminal,reason", [("response.completed", "stop"), ("response.incomplete", "length"),
                                             ("response.failed", "failed")])
def test_usage_from_the_terminal_event_and_the_stream_ends_there(terminal, reason):
    ctx, st_ = _ctx(), StreamState()
    out = b"".join(RESPONSES.process(ctx, st_, e) or b"" for e in stream(["a", "b", "c"], terminal))
    assert st_.done
    assert (ctx.usage.prompt_tokens, ctx.usage.completion_tokens, ctx.usage.cached_tokens) == (11, 3, 3)
    assert ctx.response_id == "resp_abc" and ctx.finish_reasons[-1] == reason
    assert out.count(b"\n\n") == len(stream(["a", "b", "c"])) and b"[DONE]" not in out  # passed through whole
    assert st_.delivered_tokens == 3


def test_error_event_ends_the_stream():
    st_ = StreamState()
    RESPONSES.process(_ctx(), st_, _ev("error", 5, code="server_error", message="boom", param=None))
    assert st_.done


@settings(max_examples=100, deadline=None)
@given(deltas=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=40),
       allowance=st.integers(1, 30))
def test_budget_cut_stops_at_the_allowance_in_the_responses_shape(deltas, allowance):
    ctx, st_ = _ctx(allowance), StreamState()
    outs = []
    for e in stream(deltas):
        o = RESPONSES.process(ctx, st_, e)
        if o:
            outs.append(o)
        if ctx.cut_by_budget:
            break
    delivered = sum(max(1, (len(d) + 3) // 4) for d in deltas)
    if delivered < allowance:
        assert not ctx.cut_by_budget and ctx.usage is not None
        return
    assert ctx.cut_by_budget and ctx.error == "insufficient_quota" and st_.done
    assert allowance <= ctx.delivered_completion_tokens < allowance + 3  # one delta past at most (12 chars)
    tail = outs[-1].split(b"\n\n")
    err, failed = sse.parse_chunk(sse.event_data(tail[1])), sse.parse_chunk(sse.event_data(tail[2]))
    assert tail[1].startswith(b"event: error\n") and err["code"] == "insufficient_quota"
    assert tail[2].startswith(b"event: response.failed\n") and failed["response"]["status"] == "failed"
    assert failed["response"]["id"] == "resp_abc" and failed["response"]["error"]["code"] == "insufficient_quota"
    assert failed["sequence_number"] == err["sequence_number"] + 1


def test_json_usage_and_facts():
    obj = _resp("completed", {"input_tokens": 7, "output_tokens": 5, "total_tokens": 12,
                              "input_tokens_details": {"cached_tokens": 0}})
    u = RESPONSES.usage(obj)
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (7, 5, 0)
    assert usage_from({"usage": None}) is None


def test_upstream_body_says_store_false_and_caps_max_output_tokens():
    from gateway.config import BackendConfig
    from gateway.proxy.dialects import dialect_for
    from gateway.routing.plan import Candidate

    ctx = _ctx()
    ctx.max_tokens = 20
    ctx.body = {"model": "m", "input": "x", "provider": {"zdr": True}}
    for kind in ("vllm", "sim", "openai"):
        cand = Candidate(backend=BackendConfig(name="b", url="http://h/v1", kind=kind), model="m")
        ex = dialect_for(kind).exchange(EP)
        assert ex is not None and ex.path == "responses"
        body = orjson.loads(ex.body(ctx, cand))
        assert body["store"] is False and body["max_output_tokens"] == 20 and "provider" not in body


def test_error_event_shape():
    from gateway.errors import GatewayError

    ev = RESPONSES.error_event(GatewayError(502, "Upstream broke.", code="upstream_error"))
    assert ev.startswith(b"event: error\ndata: ") and ev.endswith(b"\n\n")
    assert sse.parse_chunk(sse.event_data(ev.strip())) == {"type": "error", "code": "upstream_error",
                                                           "message": "Upstream broke.", "param": None}


_ev_json = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=10),
                        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=3),
                        max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(events=st.lists(st.one_of(
    st.binary(max_size=64),
    st.builds(lambda k, d: b"event: " + k.encode() + b"\ndata: " + orjson.dumps(d),
              st.sampled_from(["response.output_text.delta", "response.completed", "response.created", "error",
                               "response.failed", "x"]),
              st.fixed_dictionaries({"type": st.sampled_from(["response.output_text.delta", "response.completed",
                                                              "response.created", "error", "zzz"])},
                                    optional={"delta": _ev_json, "sequence_number": _ev_json,
                                              "response": _ev_json | st.fixed_dictionaries({}, optional={
                                                  "id": _ev_json, "status": _ev_json, "incomplete_details": _ev_json,
                                                  "usage": _ev_json | st.fixed_dictionaries({}, optional={
                                                      "input_tokens": _ev_json, "output_tokens": _ev_json,
                                                      "input_tokens_details": _ev_json})})}))), max_size=12),
       allowance=st.none() | st.integers(1, 20))
def test_any_upstream_events_pass_or_end_cleanly(events, allowance):
    """Whatever an upstream sends (garbage, wrong types in known events): bytes out or nothing, never an
    exception, and usage only ever a Usage."""
    ctx, st_ = _ctx(allowance), StreamState()
    for e in events:
        RESPONSES.is_first_token(e)
        out = RESPONSES.process(ctx, st_, e)
        assert out is None or isinstance(out, bytes)
        if ctx.cut_by_budget:
            break
    u = ctx.usage
    assert u is None or (isinstance(u, Usage) and u.prompt_tokens >= 0 and u.completion_tokens >= 0)
    assert all(isinstance(r, str) for r in ctx.finish_reasons)
    assert ctx.response_id is None or isinstance(ctx.response_id, str)
