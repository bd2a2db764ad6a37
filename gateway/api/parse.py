"""Parse and validate OpenAI request bodies (pure): every bad input becomes a 400 naming the param."""
from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import GatewayError, bad_request

_NUMBER = (int, float)


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


def _type_error(param: str, expected: str, value: Any) -> GatewayError:
    got = "null" if value is None else type(value).__name__
    return bad_request(f"Invalid type for '{param}': expected {expected}, got {got}.", param=param,
                       code="invalid_type")


def _opt_number(body: dict[str, Any], name: str, lo: float | None = None, hi: float | None = None) -> None:
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, _NUMBER):
        raise _type_error(name, "a number", v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {v}.", param=name, code="invalid_value")


def _opt_int(body: dict[str, Any], name: str, lo: int = 1) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _type_error(name, "an integer", v)
    if v < lo:
        raise bad_request(f"'{name}' must be >= {lo}, got {v}.", param=name, code="invalid_value")
    return v


def _opt_bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def _model(body: dict[str, Any]) -> str:
    if "model" not in body:
        raise bad_request("Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
    m = body["model"]
    if not isinstance(m, str):
        raise _type_error("model", "a string", m)
    if not m or len(m) > 256:
        raise bad_request("'model' must be a non-empty string of at most 256 characters.", param="model",
                          code="invalid_value")
    return m


class Parsed:
    """What the pipeline needs from a body, validated."""

    __slots__ = ("model", "stream", "include_usage", "max_tokens", "prompt_chars")

    def __init__(self, model: str, stream: bool, include_usage: bool, max_tokens: int | None, prompt_chars: int):
        self.model = model
        self.stream = stream
        self.include_usage = include_usage
        self.max_tokens = max_tokens
        self.prompt_chars = prompt_chars


# Content-part fields that carry text (OpenAI: text parts, assistant refusals): a string when present.
_PART_TEXT = ("text", "refusal")


def _part_chars(part: Any, param: str) -> int:
    """Characters of text in one chat content part. The known shapes are checked (a `text` or `refusal` that
    is not a string, an `image_url` that is neither a URL string nor an object with one): 400 naming the
    field, never a crash further down (a non-string `text` used to reach the upstream re-encode as a 500).
    Other part types (input_audio, file, video_url, ...) pass through to the engine unchanged."""
    if not isinstance(part, dict):
        raise _type_error(param, "an object", part)
    kind = part.get("type")
    if kind is not None and not isinstance(kind, str):
        raise _type_error(f"{param}.type", "a string", kind)
    n = 0
    for key in _PART_TEXT:
        if key in part or kind == key:
            v = part.get(key)
            if not isinstance(v, str):
                raise _type_error(f"{param}.{key}", "a string", v)
            n += len(v)
    if kind == "image_url" or "image_url" in part:
        img = part.get("image_url")
        url = img.get("url") if isinstance(img, dict) else img
        if not isinstance(url, str):
            raise _type_error(f"{param}.image_url" + (".url" if isinstance(img, dict) else ""),
                              "a string URL" if not isinstance(img, dict) else "a string", url)
    return n


def _content_chars(content: Any, param: str) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        n = 0
        for j, part in enumerate(content):
            n += _part_chars(part, f"{param}[{j}]")
        return n
    raise _type_error(param, "a string or an array of content parts", content)


def _stream_fields(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _opt_bool(body, "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise _type_error("stream_options", "an object", so)
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.", param="stream_options",
                              code="invalid_value")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise _type_error("stream_options.include_usage", "a boolean", iu)
        include_usage = bool(iu)
    return stream, include_usage


def _sampling(body: dict[str, Any]) -> None:
    _opt_number(body, "temperature", 0, 2)
    _opt_number(body, "top_p", 0, 1)
    _opt_number(body, "presence_penalty", -2, 2)
    _opt_number(body, "frequency_penalty", -2, 2)
    _opt_int(body, "n", 1)
    if body.get("n") not in (None, 1) and body.get("stream"):
        pass  # allowed by OpenAI; usage still reported once
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise _type_error("stop", "a string or an array of strings", stop)


def parse_chat(body: dict[str, Any]) -> Parsed:
    model = _model(body)
    if "messages" not in body:
        raise bad_request("Missing required parameter: 'messages'.", param="messages",
                          code="missing_required_parameter")
    msgs = body["messages"]
    if not isinstance(msgs, list):
        raise _type_error("messages", "an array", msgs)
    if not msgs:
        raise bad_request("'messages' must contain at least one message.", param="messages", code="invalid_value")
    chars = 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(f"Missing or invalid 'messages[{i}].role'.", param=f"messages[{i}].role",
                              code="invalid_value")
        chars += _content_chars(m.get("content"), f"messages[{i}].content") + 4
    stream, include_usage = _stream_fields(body)
    _sampling(body)
    mt = _opt_int(body, "max_completion_tokens")
    mt2 = _opt_int(body, "max_tokens")
    return Parsed(model, stream, include_usage, mt if mt is not None else mt2, chars)


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
    raise _type_error(param, expected, v)


def parse_completions(body: dict[str, Any]) -> Parsed:
    model = _model(body)
    if "prompt" not in body:
        raise bad_request("Missing required parameter: 'prompt'.", param="prompt", code="missing_required_parameter")
    chars = _text_or_tokens(body["prompt"], "prompt",
                            "a string, an array of strings or an array of token ids (ints >= 0)")
    stream, include_usage = _stream_fields(body)
    _sampling(body)
    return Parsed(model, stream, include_usage, _opt_int(body, "max_tokens"), chars)


def parse_embeddings(body: dict[str, Any]) -> Parsed:
    model = _model(body)
    if "input" not in body:
        raise bad_request("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    chars = _text_or_tokens(body["input"], "input", "a string or a non-empty array")
    if body.get("stream"):
        raise bad_request("Embeddings do not support streaming.", param="stream", code="invalid_value")
    ef = body.get("encoding_format")
    if ef is not None and ef not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'.", param="encoding_format",
                          code="invalid_value")
    return Parsed(model, False, False, None, chars)


PARSERS = {"chat": parse_chat, "completions": parse_completions, "embeddings": parse_embeddings}
