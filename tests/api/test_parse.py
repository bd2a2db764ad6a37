"""Request validation is pure: each bad body gives a 400 naming the offending param."""
from __future__ import annotations

import pytest

from gateway.api.parse import decode_json, parse_chat, parse_completions, parse_embeddings
from gateway.errors import GatewayError


def test_chat_ok_fields():
    p = parse_chat({"model": "m", "messages": [{"role": "user", "content": "abcd"}], "stream": True,
                    "stream_options": {"include_usage": True}, "max_completion_tokens": 7})
    assert (p.model, p.stream, p.include_usage, p.max_tokens) == ("m", True, True, 7)
    assert p.prompt_chars >= 4


def test_content_parts_are_counted():
    p = parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 40}]}]})
    assert p.prompt_chars >= 40


@pytest.mark.parametrize("raw", [b"", b"{", b"null", b"3", b'"s"'])
def test_decode_json_rejects(raw):
    with pytest.raises(GatewayError) as e:
        decode_json(raw)
    assert e.value.status == 400 and e.value.code == "invalid_json"


@pytest.mark.parametrize("fn,body,param", [
    (parse_completions, {"model": "m", "prompt": [1, "a"]}, "prompt"),
    (parse_completions, {"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
    (parse_embeddings, {"model": "m", "input": []}, "input"),
    (parse_embeddings, {"model": "m", "input": "x", "encoding_format": "png"}, "encoding_format"),
    (parse_chat, {"model": "", "messages": [{"role": "user"}]}, "model"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": "1"}, "top_p"),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": 3}, "stop"),
])
def test_param_named(fn, body, param):
    with pytest.raises(GatewayError) as e:
        fn(body)
    assert e.value.status == 400 and e.value.param == param
    assert set(e.value.body()["error"]) >= {"message", "type", "param", "code"}


def test_token_prompts_accepted():
    assert parse_completions({"model": "m", "prompt": [1, 2, 3]}).prompt_chars == 12
    assert parse_embeddings({"model": "m", "input": [[1, 2], [3]]}).prompt_chars == 12
