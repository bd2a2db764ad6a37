"""Parse and validate OpenAI Responses API bodies (`POST /v1/responses`), stateless (pure).

The gateway stores nothing: `store: true`, `previous_response_id`, `conversation`, `background: true` and
`item_reference` input items all need stored responses and are refused with a 400 naming the parameter. OpenAI's
default for `store` is true; here an absent `store` means false (the request is sent upstream with
`store: false`, so the response object says `"store": false`), documented in docs/api.md.

What is checked: `model`; `input` (a string, or a non-empty array of items: messages with a role and string or
content-part content, function calls and their outputs, reasoning items); `instructions`; `max_output_tokens`;
`stream` / `stream_options`; `temperature` / `top_p`; `tools` (an array of objects with a string `type`, passed
through unchanged); `metadata` (an object). Other fields pass through to the engine.

The shapes are the Structs of gateway/api/bodies.py (`ResponsesRequest`, its input items and content parts); the
rules here: the stateful fields refused, each input item and content part checked with the Struct its `type`
names (an unknown type refused), `stream_options` only with `stream: true`.
"""
from __future__ import annotations

from typing import Any

from gateway.api.bodies import (RESPONSES_ITEMS, RESPONSES_PARTS, FunctionCallOutputItem, MessageItem, ReasoningItem,
                                 ResponsesMediaPart, ResponsesRefusalPart, ResponsesRequest, by_type)
from gateway.api.parse import Parsed
from gateway.api.validate import Rules, type_error, validate
from gateway.errors import GatewayError, bad_request
from gateway.telemetry.render import render_messages_plain

PARTS = by_type(*RESPONSES_PARTS)
ITEMS = by_type(*RESPONSES_ITEMS)
_PART_TEXT = {kind: "refusal" if cls is ResponsesRefusalPart else "text" for kind, cls in PARTS.items()
              if cls is not ResponsesMediaPart}  # content-part types and the field holding their text


def _stateful(param: str, what: str) -> GatewayError:
    return bad_request(f"'{param}' is not supported: this gateway is stateless and {what}.", param=param,
                       code="unsupported_parameter")


def _type_of(obj: Any, param: str, item: bool = False) -> str:
    """An input item's or a content part's `type` (an item with a `role` is a message)."""
    if not isinstance(obj, dict):
        raise type_error(param, "an object", obj)
    kind = obj.get("type", "message" if item and "role" in obj else None)
    if kind is None and item:
        raise bad_request(f"Missing required parameter: '{param}.type' (or '{param}.role' for a message).",
                          param=f"{param}.type", code="missing_required_parameter")
    if not isinstance(kind, str):
        raise type_error(f"{param}.type", "a string", kind)
    return kind


def _part_chars(part: Any, param: str) -> int:
    """Characters of text in one content part, checked with the Struct its `type` names."""
    kind = _type_of(part, param)
    cls = PARTS.get(kind)
    if cls is None:
        raise bad_request(f"Invalid value for '{param}.type': {kind[:64]!r} is not a supported content part type.",
                          param=f"{param}.type", code="invalid_value")
    validate(part, cls, param=param)
    key = _PART_TEXT.get(kind)
    return len(part[key]) if key else 0


def _content_chars(content: str | list[Any], param: str) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(_part_chars(p, f"{param}[{j}]") for j, p in enumerate(content))


def _item_chars(item: Any, param: str) -> int:
    """Characters of text in one input item (plus 4 for its turn markers), checked with the Struct its `type`
    names; a bad item is a 400 naming it."""
    kind = _type_of(item, param, item=True)
    if kind == "item_reference":
        raise _stateful(f"{param}", "item references need stored responses")
    cls = ITEMS.get(kind)
    if cls is None:
        raise bad_request(f"Invalid value for '{param}.type': {kind[:64]!r} is not a supported input item type.",
                          param=f"{param}.type", code="invalid_value")
    validate(item, cls, RULES, param)
    if kind == "message":
        return _content_chars(item["content"], f"{param}.content") + 4
    if kind == "function_call":
        return len(item["name"]) + len(item["arguments"]) + 4
    if kind == "function_call_output":
        return _content_chars(item["output"], f"{param}.output") + 4
    return sum(_content_chars(item.get(key) or [], f"{param}.{key}") for key in ("summary", "content")) + 4


def _stored(body: dict[str, Any], param: str) -> None:
    """What needs stored responses: `store: true`, `previous_response_id`, `conversation`."""
    if body.get("store"):
        raise bad_request("'store: true' is not supported: this gateway is stateless and does not store responses; "
                          "send 'store: false' or leave it out (an absent 'store' means false here).",
                          param="store", code="unsupported_value")
    if body.get("previous_response_id") is not None:
        raise _stateful("previous_response_id", "keeps no earlier responses; send the whole conversation in "
                                                "'input'")
    if body.get("conversation") is not None:
        raise _stateful("conversation", "keeps no conversations; send the whole conversation in 'input'")


def _background(body: dict[str, Any], param: str) -> None:
    if body.get("background"):
        raise _stateful("background", "background responses need stored responses")


def _stream_options(body: dict[str, Any], param: str) -> None:
    if body.get("stream_options") is not None and not body.get("stream"):
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", param="stream_options",
                          code="invalid_value")


RULES: Rules = {
    ResponsesRequest: {"store": _stored, "background": _background, "input[]": _item_chars,
                       "stream_options": _stream_options},
    MessageItem: {"content[]": _part_chars}, FunctionCallOutputItem: {"output[]": _part_chars},
    ReasoningItem: {"summary[]": _part_chars, "content[]": _part_chars},
}


def input_chars(value: str | list[Any]) -> int:
    """Characters of text in a (validated) Responses `input`: a string, or items checked by their type."""
    if isinstance(value, str):
        return len(value)
    return sum(_item_chars(item, f"input[{i}]") for i, item in enumerate(value))


def parse_responses(body: dict[str, Any]) -> Parsed:
    req = validate(body, ResponsesRequest, RULES)
    _stored(body, "")
    _background(body, "")
    chars = input_chars(req.input)
    if req.instructions is not None:
        chars += len(req.instructions) + 4
    _stream_options(body, "")
    return Parsed(req.model, bool(req.stream), False, req.max_output_tokens, chars)


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as text for routing (the same rendering as a chat's)."""
    return render_messages_plain(as_chat(body)["messages"])


def _chat_part(part: Any) -> dict[str, Any] | None:
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    key = _PART_TEXT.get(kind) if isinstance(kind, str) else None
    if key is not None:
        return {"type": "text", "text": part.get(key, "")}
    if kind == "input_image":
        url = part.get("image_url")
        return {"type": "image_url", "image_url": {"url": url}} if isinstance(url, str) else None
    return None


def _chat_content(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    parts = [p for p in map(_chat_part, content) if p is not None]
    if parts and all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A (validated) Responses body as the OpenAI chat body an engine renders for it, as vLLM's Responses API
    builds its chat (`instructions` as the system message first, a string `input` as one user message, message
    items as messages with text parts joined, `function_call` items as the assistant's `tool_calls`,
    `function_call_output` items as `tool` messages, reasoning items left out; function tools as chat tools).
    Routing tokenizes and keys the prompt from this (the endpoint's `chat_view`)."""
    msgs: list[dict[str, Any]] = []
    ins = body.get("instructions")
    if isinstance(ins, str) and ins:
        msgs.append({"role": "system", "content": ins})
    inp = body.get("input")
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for item in inp:
            if not isinstance(item, dict):
                continue
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                msgs.append({"role": item.get("role"), "content": _chat_content(item.get("content"))})
            elif kind == "function_call":
                msgs.append({"role": "assistant", "content": None, "tool_calls": [{
                    "id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}]})
            elif kind == "function_call_output":
                msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _chat_content(item.get("output"))})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": msgs}
    tools = [t for t in body.get("tools") or () if isinstance(t, dict) and t.get("type") == "function"
             and isinstance(t.get("name"), str)]
    if tools:
        chat["tools"] = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                           "parameters": t.get("parameters") or {}}}
                         for t in tools]
    return chat
