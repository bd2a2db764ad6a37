"""Request validation is pure: each bad body gives a 400 naming the offending param."""
from __future__ import annotations

import orjson
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


def _chat_parts(*parts):
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}]}


@pytest.mark.parametrize("part,param", [
    ({"type": "text", "text": 5}, "messages[0].content[1].text"),
    ({"type": "text", "text": None}, "messages[0].content[1].text"),
    ({"type": "text", "text": ["a", "b"]}, "messages[0].content[1].text"),
    ({"type": "text"}, "messages[0].content[1].text"),
    ({"type": "text", "text": {"x": 1}}, "messages[0].content[1].text"),
    ({"type": 7, "text": "x"}, "messages[0].content[1].type"),
    ({"type": "refusal", "refusal": 1}, "messages[0].content[1].refusal"),
    ({"type": "image_url", "image_url": {"url": 5}}, "messages[0].content[1].image_url.url"),
    ({"type": "image_url", "image_url": None}, "messages[0].content[1].image_url"),
    ({"type": "image_url"}, "messages[0].content[1].image_url"),
    ("just a string", "messages[0].content[1]"),
])
def test_content_part_with_a_non_string_text_is_a_400_naming_the_field(part, param):
    """Issue 18: a text part whose `text` was 5, null or a list reached the gateway's internals as a 500."""
    with pytest.raises(GatewayError) as e:
        parse_chat(_chat_parts({"type": "text", "text": "ok"}, part))
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)


def test_well_formed_content_parts_still_pass():
    p = parse_chat(_chat_parts({"type": "text", "text": "abcd"},
                               {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}},
                               {"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
                               {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                               {"type": "file", "file": {"file_id": "f1"}},
                               {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}))
    assert p.prompt_chars >= 4


def _nested(depth: int) -> bytes:
    """A body nesting `depth` levels of dicts and lists (the body itself is level 1)."""
    inner = "1"
    for i in range(depth - 1):
        inner = f"[{inner}]" if i % 2 else f'{{"k":{inner}}}'
    return f'{{"x":{inner}}}'.encode() if depth > 1 else b'{"x":1}'


@pytest.mark.parametrize("depth, refused", [(2, False), (64, False), (65, True), (200, True)])
def test_decode_json_refuses_nesting_past_max_depth_exactly(depth, refused):
    from gateway.api.parse import MAX_DEPTH, _too_deep

    raw = _nested(depth)
    assert _too_deep(orjson.loads(raw), MAX_DEPTH) is refused  # the walk's own verdict on the body
    if refused:
        with pytest.raises(GatewayError) as e:
            decode_json(raw)
        assert e.value.status == 400 and e.value.code == "invalid_json" and "nested deeper" in e.value.message
    else:
        assert decode_json(raw) == orjson.loads(raw)


def test_decode_json_brackets_inside_strings_only_make_the_walk_run_never_refuse():
    """The bracket count is an upper bound on the depth: text full of brackets takes the walk, which accepts."""
    body = {"messages": [{"role": "user", "content": "[{" * 500}]}
    assert decode_json(orjson.dumps(body)) == body
