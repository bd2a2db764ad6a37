"""The Anthropic Messages parser (gateway/api/parse_messages.py): what Anthropic requires is required, every
bad input is a 400 naming its param, and (hypothesis) no body of JSON values makes it raise anything else."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.endpoints import BY_PATH
from gateway.api.parse_messages import parse_messages
from gateway.errors import GatewayError

OK = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hello"}]}


def bad(body: dict, param: str) -> str:
    with pytest.raises(GatewayError) as ei:
        parse_messages(body)
    assert ei.value.status == 400 and ei.value.param == param, (ei.value.param, ei.value.message)
    return ei.value.message


def test_a_minimal_body_and_what_it_yields():
    p = parse_messages(OK)
    assert (p.model, p.max_tokens, p.stream, p.include_usage) == ("m", 10, False, False)
    assert p.prompt_chars == len("hello") + 4
    p = parse_messages({**OK, "stream": True, "system": [{"type": "text", "text": "abc"}],
                        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                  {"type": "image", "source": {"type": "url",
                                                                                               "url": "x"}}]},
                                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                                        "name": "f", "input": {}}]},
                                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                                   "content": [{"type": "text", "text": "r"}]}]}],
                        "temperature": 0.5, "top_p": 1, "top_k": 5, "stop_sequences": ["\n"],
                        "metadata": {"user_id": "u"}})
    assert p.stream and p.prompt_chars >= len("abc") + len("hi") + len("r")


def test_the_endpoint_entry():
    ep = BY_PATH["/v1/messages"]
    assert ep.name == "messages" and ep.upstream_path == "messages" and ep.wire.name == "anthropic"
    assert ep.generates and ep.max_tokens_key(OK) == "max_tokens" and not ep.cacheable and not ep.batchable
    text = ep.prompt_text({**OK, "system": [{"type": "text", "text": "SYS"}]})
    assert text.index("SYS") < text.index("hello")


@pytest.mark.parametrize("body,param,says", [
    ({"max_tokens": 1, "messages": OK["messages"]}, "model", "Missing"),
    ({"model": "m", "messages": OK["messages"]}, "max_tokens", "Missing required parameter: 'max_tokens'"),
    ({**OK, "max_tokens": None}, "max_tokens", "integer"),
    ({**OK, "max_tokens": 0}, "max_tokens", ">= 1"),
    ({**OK, "max_tokens": "5"}, "max_tokens", "integer"),
    ({**OK, "max_tokens": True}, "max_tokens", "integer"),
    ({"model": "m", "max_tokens": 1}, "messages", "Missing"),
    ({**OK, "messages": []}, "messages", "at least one"),
    ({**OK, "messages": "hi"}, "messages", "array"),
    ({**OK, "messages": ["hi"]}, "messages[0]", "object"),
    ({**OK, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "'user' or 'assistant'"),
    ({**OK, "messages": [{"role": "user"}]}, "messages[0].content", "Missing"),
    ({**OK, "messages": [{"role": "user", "content": 3}]}, "messages[0].content", "content blocks"),
    ({**OK, "messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type", "string"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text", "string"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages[0].content[0].source",
     "object"),
    ({**OK, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                            "input": "x"}]}]},
     "messages[0].content[0].input", "object"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                                       "content": 5}]}]},
     "messages[0].content[0].content", "content blocks"),
    ({**OK, "system": 5}, "system", "text blocks"),
    ({**OK, "system": [{"type": "image"}]}, "system[0].type", "'text'"),
    ({**OK, "system": [{"type": "text"}]}, "system[0].text", "string"),
    ({**OK, "stream": "yes"}, "stream", "boolean"),
    ({**OK, "temperature": 1.5}, "temperature", "between"),
    ({**OK, "top_p": "x"}, "top_p", "number"),
    ({**OK, "top_k": -1}, "top_k", ">= 0"),
    ({**OK, "stop_sequences": "stop"}, "stop_sequences", "array of strings"),
    ({**OK, "stop_sequences": [1]}, "stop_sequences", "array of strings"),
    ({**OK, "metadata": []}, "metadata", "object"),
    ({**OK, "tools": {}}, "tools", "array"),
    ({**OK, "tools": ["x"]}, "tools[0]", "object"),
    ({**OK, "tools": [{"input_schema": {}}]}, "tools[0].name", "non-empty"),
    ({**OK, "tool_choice": "auto"}, "tool_choice", "object"),
    ({**OK, "tool_choice": {"type": "function"}}, "tool_choice.type", "one of"),
    ({**OK, "tool_choice": {"type": "tool"}}, "tool_choice.name", "string"),
])
def test_bad_inputs_name_their_param(body, param, says):
    assert says in bad(body, param)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=3),
                           max_leaves=12)
blocks = st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking",
                                                         "other"]) | json_values},
                               optional={"text": json_values, "source": json_values, "input": json_values,
                                         "id": json_values, "name": json_values, "tool_use_id": json_values,
                                         "content": json_values})
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | json_values},
                                optional={"content": st.text(max_size=5) | st.lists(blocks, max_size=3) | json_values})


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional={
    "model": st.just("m") | json_values, "max_tokens": st.integers(-1, 5) | json_values,
    "messages": st.lists(message, max_size=3) | json_values, "system": json_values | st.lists(blocks, max_size=2),
    "stream": json_values, "temperature": json_values, "top_k": json_values, "stop_sequences": json_values,
    "tools": json_values, "tool_choice": json_values}))
def test_any_body_is_parsed_or_refused_with_a_400_naming_a_param(body):
    try:
        p = parse_messages(body)
    except GatewayError as e:
        assert e.status == 400 and e.param
        return
    assert isinstance(p.max_tokens, int) and p.max_tokens >= 1 and p.prompt_chars >= 4


def test_the_chat_view_is_what_an_engine_renders():
    from gateway.api.parse_messages import as_chat

    body = {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Sys."}],
            "tools": [{"name": "add", "description": "adds", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Calling."},
                                                  {"type": "tool_use", "id": "t1", "name": "add",
                                                   "input": {"a": 2}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [{"type": "text", "text": "4"}]},
                                             {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                          "data": "QQ=="}}]}]}
    chat = as_chat(body)
    assert chat["model"] == "m"
    assert chat["messages"] == [
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "Calling.",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "4"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,QQ=="}}]}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "add", "description": "adds",
                                                               "parameters": {"type": "object"}}}]
    assert BY_PATH["/v1/messages"].chat_view is as_chat and BY_PATH["/v1/chat/completions"].chat_view is None
