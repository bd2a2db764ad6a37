"""Parse and validate OpenAI Responses API bodies (`POST /v1/responses`), stateless (pure).

The gateway stores nothing: `store: true`, `previous_response_id`, `conversation`, `background: true` and
`item_reference` input items all need stored responses and are refused with a 400 naming the parameter. OpenAI's
default for `store` is true; here an absent `store` means false (the request is sent upstream with
`store: false`, so the response object says `"store": false`), documented in docs/api.md.

What is checked: `model`; `input` (a string, or a non-empty array of items: messages with a role and string or
content-part content, function calls and their outputs, reasoning items); `instructions`; `max_output_tokens`;
`stream` / `stream_options`; `temperature` / `top_p`; `tools` (an array of objects with a string `type`, passed
through unchanged); `metadata` (an object). Other fields pass through to the engine.
"""
from __future__ import annotations

from typing import Any

from gateway.api.parse import Parsed, _model, _opt_bool, _opt_int, _opt_number, _type_error
from gateway.errors import GatewayError, bad_request
from gateway.telemetry.render import render_messages_plain

ROLES = ("user", "assistant", "system", "developer")
# content-part types and the field holding their text (the image/file parts carry no text)
_PART_TEXT = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal",
              "summary_text": "text", "reasoning_text": "text"}
_PART_OTHER = ("input_image", "input_file", "input_audio")


def _stateful(param: str, what: str) -> GatewayError:
    return bad_request(f"'{param}' is not supported: this gateway is stateless and {what}.", param=param,
                       code="unsupported_parameter")


def _part_chars(part: Any, param: str) -> int:
    if not isinstance(part, dict):
        raise _type_error(param, "an object", part)
    kind = part.get("type")
    if not isinstance(kind, str):
        raise _type_error(f"{param}.type", "a string", kind)
    key = _PART_TEXT.get(kind)
    if key is not None:
        v = part.get(key)
        if not isinstance(v, str):
            raise _type_error(f"{param}.{key}", "a string", v)
        return len(v)
    if kind in _PART_OTHER:
        return 0
    raise bad_request(f"Invalid value for '{param}.type': {kind[:64]!r} is not a supported content part type.",
                      param=f"{param}.type", code="invalid_value")


def _content_chars(content: Any, param: str) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(_part_chars(p, f"{param}[{j}]") for j, p in enumerate(content))
    raise _type_error(param, "a string or an array of content parts", content)


def _str_field(item: dict[str, Any], key: str, param: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise _type_error(f"{param}.{key}", "a string", v)
    return v


def _item_chars(item: Any, param: str) -> int:
    """Characters of text in one input item (plus 4 for its turn markers); a bad item is a 400 naming it."""
    if not isinstance(item, dict):
        raise _type_error(param, "an object", item)
    kind = item.get("type", "message" if "role" in item else None)
    if kind is None:
        raise bad_request(f"Missing required parameter: '{param}.type' (or '{param}.role' for a message).",
                          param=f"{param}.type", code="missing_required_parameter")
    if not isinstance(kind, str):
        raise _type_error(f"{param}.type", "a string", kind)
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise bad_request(f"Invalid value for '{param}.role': expected one of {', '.join(ROLES)}.",
                              param=f"{param}.role", code="invalid_value")
        if "content" not in item:
            raise bad_request(f"Missing required parameter: '{param}.content'.", param=f"{param}.content",
                              code="missing_required_parameter")
        return _content_chars(item["content"], f"{param}.content") + 4
    if kind == "function_call":
        _str_field(item, "call_id", param)
        return len(_str_field(item, "name", param)) + len(_str_field(item, "arguments", param)) + 4
    if kind == "function_call_output":
        _str_field(item, "call_id", param)
        out = item.get("output")
        if isinstance(out, str):
            return len(out) + 4
        if isinstance(out, list):
            return _content_chars(out, f"{param}.output") + 4
        raise _type_error(f"{param}.output", "a string or an array of content parts", out)
    if kind == "reasoning":
        n = 0
        for key in ("summary", "content"):
            parts = item.get(key)
            if parts is None:
                continue
            if not isinstance(parts, list):
                raise _type_error(f"{param}.{key}", "an array", parts)
            n += sum(_part_chars(p, f"{param}.{key}[{j}]") for j, p in enumerate(parts))
        return n + 4
    if kind == "item_reference":
        raise _stateful(f"{param}", "item references need stored responses")
    raise bad_request(f"Invalid value for '{param}.type': {kind[:64]!r} is not a supported input item type.",
                      param=f"{param}.type", code="invalid_value")


def input_chars(value: Any) -> int:
    """Characters of text in a Responses `input` (a string or an array of items); 400 naming the bad part."""
    if isinstance(value, str):
        if not value:
            raise bad_request("'input' must not be empty.", param="input", code="invalid_value")
        return len(value)
    if isinstance(value, list):
        if not value:
            raise bad_request("'input' must contain at least one item.", param="input", code="invalid_value")
        return sum(_item_chars(item, f"input[{i}]") for i, item in enumerate(value))
    raise _type_error("input", "a string or an array of input items", value)


def parse_responses(body: dict[str, Any]) -> Parsed:
    model = _model(body)
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise _type_error("store", "a boolean", store)
    if store:
        raise bad_request("'store: true' is not supported: this gateway is stateless and does not store responses; "
                          "send 'store: false' or leave it out (an absent 'store' means false here).",
                          param="store", code="unsupported_value")
    if body.get("previous_response_id") is not None:
        raise _stateful("previous_response_id", "keeps no earlier responses; send the whole conversation in "
                                                "'input'")
    if body.get("conversation") is not None:
        raise _stateful("conversation", "keeps no conversations; send the whole conversation in 'input'")
    if _opt_bool(body, "background"):
        raise _stateful("background", "background responses need stored responses")
    if "input" not in body:
        raise bad_request("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    chars = input_chars(body["input"])
    ins = body.get("instructions")
    if ins is not None:
        if not isinstance(ins, str):
            raise _type_error("instructions", "a string", ins)
        chars += len(ins) + 4
    stream = _opt_bool(body, "stream")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _type_error("stream_options", "an object", so)
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.", param="stream_options",
                              code="invalid_value")
    _opt_number(body, "temperature", 0, 2)
    _opt_number(body, "top_p", 0, 1)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _type_error("tools", "an array", tools)
        for i, t in enumerate(tools):
            if not isinstance(t, dict):
                raise _type_error(f"tools[{i}]", "an object", t)
            if not isinstance(t.get("type"), str):
                raise _type_error(f"tools[{i}].type", "a string", t.get("type"))
    md = body.get("metadata")
    if md is not None and not isinstance(md, dict):
        raise _type_error("metadata", "an object", md)
    return Parsed(model, stream, False, _opt_int(body, "max_output_tokens"), chars)


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
