"""Parse and validate OpenAI request bodies (pure): every bad input becomes a 400 naming the param.

The bodies' shapes are the Structs of gateway/api/bodies.py (`validate` checks them and words their faults); what
stays here are the rules a type cannot state, each keyed to the field after which it runs:
- chat: a content part of type text, refusal or image_url carries that field; `stream_options` only with
  `stream: true`;
- completions: `prompt` as strings, token ids (ints in [0, 2^31)) or arrays of token ids, not empty, not mixed;
  `stream_options` as for chat;
- embeddings: `input` as a completions prompt; `stream` refused when truthy.
"""
from __future__ import annotations

from typing import Any

import orjson

from gateway.api.bodies import ChatPart, ChatRequest, CompletionRequest, EmbeddingRequest, StreamOptions
from gateway.api.validate import Rule, Rules, extra_of, struct_fields, type_error, validate
from gateway.errors import bad_request


def decode_json(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise bad_request("Request body is empty; expected a JSON object.", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"Request body is not valid JSON: {e.args[0] if e.args else 'parse error'}",
                          code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"Request body must be a JSON object, got {type(body).__name__}.", code="invalid_json")
    check_nesting(body, raw)
    return body


def check_nesting(body: Any, raw: bytes) -> None:
    """400 when `body` nests deeper than MAX_DEPTH levels. `raw` is the JSON text it was decoded from (or text
    containing it, as a batch line contains its body): a body nests at most as deep as it has opening brackets
    (those inside strings counted too: an upper bound), so the walk is needed only past MAX_DEPTH of them; two
    C-speed counts, not a Python walk. Shared by the realtime endpoints and batch lines (gateway/batch/jsonl.py)."""
    if raw.count(b"{") + raw.count(b"[") > MAX_DEPTH and _too_deep(body, MAX_DEPTH):
        raise bad_request(f"Request body is nested deeper than {MAX_DEPTH} levels.", code="invalid_json")


MAX_DEPTH = 64
"""Deepest JSON nesting accepted. orjson parses up to 1024 levels but serialises only 255 (the body is
re-encoded for the upstream) and the evidence scrubbers recurse, so deeper bodies are refused up front."""


def _too_deep(value: Any, limit: int) -> bool:
    """True when `value` nests dicts/lists more than `limit` levels (iterative: no recursion on hostile input)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return True
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values() if isinstance(x, (dict, list)))
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return False


class Parsed:
    """What the pipeline needs from a body, validated."""

    __slots__ = ("model", "stream", "include_usage", "max_tokens", "prompt_chars")

    def __init__(self, model: str, stream: bool, include_usage: bool, max_tokens: int | None, prompt_chars: int):
        self.model = model
        self.stream = stream
        self.include_usage = include_usage
        self.max_tokens = max_tokens
        self.prompt_chars = prompt_chars


def _needs(key: str, expected: str) -> Rule:
    """A part whose `type` is `key` carries `key` (the Struct checks its type where present)."""
    def rule(part: dict[str, Any], param: str) -> None:
        if part.get("type") == key and key not in part:
            raise type_error(f"{param}.{key}", expected, None)
    return rule


_PART_RULES: dict[str, Rule] = {"text": _needs("text", "a string"), "refusal": _needs("refusal", "a string"),
                                "image_url": _needs("image_url", "a string URL")}


def _parts_chars(parts: list[dict[str, Any]], param: str) -> int:
    """Characters of text in (validated) chat content parts; a part of type text, refusal or image_url without
    that field is a 400 naming it (a non-string `text` used to reach the upstream re-encode as a 500). The param
    is only formatted for a refusal: this runs for every multimodal chat."""
    n = 0
    for j, part in enumerate(parts):
        kind = part.get("type")
        if kind in _PART_RULES and kind not in part:
            _PART_RULES[kind](part, f"{param}[{j}]")
        n += len(part.get("text", "")) + len(part.get("refusal", ""))
    return n


def messages_chars(msgs: list[dict[str, Any]]) -> int:
    """Characters of text in (validated) chat messages, plus 4 per message for its turn markers."""
    n = 4 * len(msgs)
    for i, m in enumerate(msgs):
        c = m.get("content")
        if isinstance(c, str):
            n += len(c)
        elif c:
            n += _parts_chars(c, f"messages[{i}].content")
    return n


def _stream_options(body: dict[str, Any], param: str) -> None:
    """`stream_options` only with `stream: true` (a non-object `stream_options` is its type's fault)."""
    if isinstance(body.get("stream_options"), dict) and not body.get("stream"):
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", param="stream_options",
                          code="invalid_value")


def _token_id(x: Any) -> bool:
    """A plausible token id: a non-negative int that fits int32 (negative or huge ids crash or stall engines)."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31


def _text_or_tokens(v: Any, param: str, expected: str) -> int:
    """Size in characters (4 per token id) of a completions `prompt` / embeddings `input`: a string, strings,
    token ids, or lists of token ids; anything else is a 400 naming the param."""
    if isinstance(v, str):
        return len(v)
    if isinstance(v, list) and v:
        if all(isinstance(x, str) for x in v):
            return sum(len(x) for x in v)
        if all(_token_id(x) for x in v):
            return 4 * len(v)
        if all(isinstance(x, list) and x and all(_token_id(t) for t in x) for x in v):
            return 4 * sum(len(x) for x in v)
    raise type_error(param, expected, v)


def _prompt(body: dict[str, Any], param: str) -> None:
    _text_or_tokens(body["prompt"], "prompt", _PROMPT)


def _input(body: dict[str, Any], param: str) -> None:
    _text_or_tokens(body["input"], "input", _INPUT)


def _no_stream(body: dict[str, Any], param: str) -> None:
    if body.get("stream"):
        raise bad_request("Embeddings do not support streaming.", param="stream", code="invalid_value")


def _input_then_stream(body: dict[str, Any], param: str) -> None:
    _input(body, param)
    _no_stream(body, param)


_PROMPT = extra_of(next(f.type for f in struct_fields(CompletionRequest) if f.name == "prompt"))["expected"]
_INPUT = extra_of(next(f.type for f in struct_fields(EmbeddingRequest) if f.name == "input"))["expected"]
CHAT_RULES: Rules = {ChatPart: _PART_RULES, ChatRequest: {"stream": _stream_options}}
COMPLETION_RULES: Rules = {CompletionRequest: {"prompt": _prompt, "stream": _stream_options}}
EMBEDDING_RULES: Rules = {EmbeddingRequest: {"input": _input_then_stream}}


def _include_usage(so: StreamOptions | None) -> bool:
    return bool(so is not None and so.include_usage)


def parse_chat(body: dict[str, Any]) -> Parsed:
    req = validate(body, ChatRequest, CHAT_RULES)
    chars = messages_chars(body["messages"])
    _stream_options(body, "")
    mt = req.max_completion_tokens
    return Parsed(req.model, bool(req.stream), _include_usage(req.stream_options),
                  mt if mt is not None else req.max_tokens, chars)


def parse_completions(body: dict[str, Any]) -> Parsed:
    req = validate(body, CompletionRequest, COMPLETION_RULES)
    chars = _text_or_tokens(req.prompt, "prompt", _PROMPT)
    _stream_options(body, "")
    return Parsed(req.model, bool(req.stream), _include_usage(req.stream_options), req.max_tokens, chars)


def parse_embeddings(body: dict[str, Any]) -> Parsed:
    req = validate(body, EmbeddingRequest, EMBEDDING_RULES)
    chars = _text_or_tokens(req.input, "input", _INPUT)
    _no_stream(body, "")
    return Parsed(req.model, False, False, None, chars)


PARSERS = {"chat": parse_chat, "completions": parse_completions, "embeddings": parse_embeddings}
