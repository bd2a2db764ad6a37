"""The Responses API parser (gateway/api/parse_responses.py): what it accepts, what it counts, and every bad
input (stateful fields included) a 400 naming the parameter."""
from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.parse import decode_json
from gateway.api.parse_responses import parse_responses, prompt_text
from gateway.errors import GatewayError


def test_string_input_and_fields():
    p = parse_responses({"model": "m", "input": "hello", "instructions": "be brief", "max_output_tokens": 9,
                         "stream": True, "temperature": 0.5, "top_p": 1,
                         "tools": [{"type": "function", "name": "f", "parameters": {}}]})
    assert (p.model, p.stream, p.max_tokens, p.include_usage) == ("m", True, 9, False)
    assert p.prompt_chars == len("hello") + len("be brief") + 4


def test_item_input_counts_every_text():
    body = {"model": "m", "input": [
        {"role": "user", "content": "abc"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "defg"}]},
        {"type": "function_call", "call_id": "c1", "name": "fn", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                     {"type": "input_image", "image_url": "data:x"}]}]}
    p = parse_responses(body)
    assert p.prompt_chars == (3 + 4) + (4 + 4) + (2 + 2 + 4) + (2 + 4) + (2 + 4)
    text = prompt_text({**body, "instructions": "sys"})
    assert text.startswith("<|im_start|>system\nsys") and "abc" in text and "defg" in text and "hi" in text


def test_store_false_and_absent_are_fine():
    assert parse_responses({"model": "m", "input": "x", "store": False}).model == "m"
    assert parse_responses({"model": "m", "input": "x"}).model == "m"


@pytest.mark.parametrize("body,param,code", [
    ({"model": "m", "input": "x", "store": True}, "store", "unsupported_value"),
    ({"model": "m", "input": "x", "store": "yes"}, "store", "invalid_type"),
    ({"model": "m", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id",
     "unsupported_parameter"),
    ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"model": "m", "input": "x", "background": True}, "background", "unsupported_parameter"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "unsupported_parameter"),
    ({"input": "x"}, "model", "missing_required_parameter"),
    ({"model": "m"}, "input", "missing_required_parameter"),
    ({"model": "m", "input": ""}, "input", "invalid_value"),
    ({"model": "m", "input": []}, "input", "invalid_value"),
    ({"model": "m", "input": 3}, "input", "invalid_type"),
    ({"model": "m", "input": [3]}, "input[0]", "invalid_type"),
    ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role", "invalid_value"),
    ({"model": "m", "input": [{"role": "user"}]}, "input[0].content", "missing_required_parameter"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[0].content[0].text", "invalid_type"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "hologram"}]}]},
     "input[0].content[0].type", "invalid_value"),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments",
     "invalid_type"),
    ({"model": "m", "input": [{"type": "telepathy"}]}, "input[0].type", "invalid_value"),
    ({"model": "m", "input": [{"content": "x"}]}, "input[0].type", "missing_required_parameter"),
    ({"model": "m", "input": "x", "instructions": 1}, "instructions", "invalid_type"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"model": "m", "input": "x", "max_output_tokens": "9"}, "max_output_tokens", "invalid_type"),
    ({"model": "m", "input": "x", "temperature": 3}, "temperature", "invalid_value"),
    ({"model": "m", "input": "x", "top_p": -1}, "top_p", "invalid_value"),
    ({"model": "m", "input": "x", "stream": "yes"}, "stream", "invalid_type"),
    ({"model": "m", "input": "x", "stream_options": {}}, "stream_options", "invalid_value"),
    ({"model": "m", "input": "x", "tools": {}}, "tools", "invalid_type"),
    ({"model": "m", "input": "x", "tools": [{"name": "f"}]}, "tools[0].type", "invalid_type"),
    ({"model": "m", "input": "x", "metadata": []}, "metadata", "invalid_type"),
])
def test_bad_inputs_name_the_param(body, param, code):
    with pytest.raises(GatewayError) as e:
        parse_responses(body)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)


def test_store_refusal_says_why():
    with pytest.raises(GatewayError) as e:
        parse_responses({"model": "m", "input": "x", "store": True})
    assert "stateless" in e.value.message and "store" in e.value.message


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=20)
_items = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "robot", 3]),
                                          "content": _json}) | _json, max_size=4)


@settings(max_examples=200, deadline=None)
@given(inp=st.one_of(st.text(max_size=20), _items, _json), extra=st.dictionaries(
    st.sampled_from(["instructions", "max_output_tokens", "stream", "tools", "temperature", "store"]), _json,
    max_size=3))
def test_any_body_is_accepted_or_a_400_naming_a_param(inp, extra):
    """Whatever the JSON: a Parsed with a non-negative size, or a 400 with a param (never another exception)."""
    try:
        p = parse_responses(decode_json(orjson.dumps({"model": "m", "input": inp, **extra})))
    except GatewayError as e:
        assert e.status == 400 and e.param
    else:
        assert p.prompt_chars >= 0 and p.model == "m"


def test_as_chat_is_the_chat_an_engine_renders():
    from gateway.api.parse_responses import as_chat

    body = {"model": "m", "instructions": "sys", "tools": [
        {"type": "function", "name": "lookup", "description": "d", "parameters": {"type": "object"}},
        {"type": "web_search"}], "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "see"},
                                     {"type": "input_image", "image_url": "data:img"}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "reasoning", "summary": []}]}
    chat = as_chat(body)
    assert chat["model"] == "m"
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "ab"},
        {"role": "user", "content": [{"type": "text", "text": "see"},
                                     {"type": "image_url", "image_url": {"url": "data:img"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "lookup", "description": "d",
                                                               "parameters": {"type": "object"}}}]
    assert as_chat({"model": "m", "input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


def test_routing_reads_the_chat_view():
    from gateway.pipeline import RequestContext
    from gateway.routing.prompt import routing_body

    ctx = RequestContext(request_id="r", endpoint="responses", headers={},
                         body={"model": "m", "instructions": "sys", "input": "hello"})
    assert routing_body(ctx)["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]
