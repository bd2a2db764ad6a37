"""Parse and validate Anthropic Messages request bodies (`POST /v1/messages`, pure): every bad input becomes a
400 naming the param, as `gateway.api.parse` does for OpenAI bodies (the wire, gateway/api/wire/anthropic.py,
gives it Anthropic's error shape).

What Anthropic requires is required here: `model`, `max_tokens` (an integer >= 1: it is the completion cap the
budget reserves for) and `messages` (a non-empty array of `user`/`assistant` turns whose `content` is a string
or an array of content blocks). `system` is a string or an array of text blocks; `stream` a boolean;
`temperature` and `top_p` numbers in [0, 1]; `top_k` an integer >= 0; `stop_sequences` an array of strings;
`tools` an array of objects with a `name`; `tool_choice` an object of type auto/any/tool (with a `name`)/none.
Block types other than text, image, tool_use, tool_result, document and thinking pass through unchecked (the
engine answers for them)."""
from __future__ import annotations

import json
from typing import Any

from gateway.api.parse import Parsed, _model, _opt_bool, _opt_int, _opt_number, _type_error
from gateway.errors import bad_request

ROLES = ("user", "assistant")


def _text_field(block: dict[str, Any], key: str, param: str) -> int:
    v = block.get(key)
    if not isinstance(v, str):
        raise _type_error(f"{param}.{key}", "a string", v)
    return len(v)


def _block_chars(block: Any, param: str) -> int:
    """Characters of prompt text in one content block; the known block shapes are checked."""
    if not isinstance(block, dict):
        raise _type_error(param, "an object", block)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise _type_error(f"{param}.type", "a string", kind)
    if kind == "text":
        return _text_field(block, "text", param)
    if kind == "thinking":
        return _text_field(block, "thinking", param)
    if kind in ("image", "document"):
        src = block.get("source")
        if not isinstance(src, dict):
            raise _type_error(f"{param}.source", "an object", src)
        return 0
    if kind == "tool_use":
        for key in ("id", "name"):
            _text_field(block, key, param)
        inp = block.get("input")
        if not isinstance(inp, dict):
            raise _type_error(f"{param}.input", "an object", inp)
        return len(str(inp))
    if kind == "tool_result":
        _text_field(block, "tool_use_id", param)
        c = block.get("content")
        if c is None:
            return 0
        if isinstance(c, str):
            return len(c)
        if isinstance(c, list):
            return sum(_block_chars(b, f"{param}.content[{j}]") for j, b in enumerate(c))
        raise _type_error(f"{param}.content", "a string or an array of content blocks", c)
    return 0


def _content_chars(content: Any, param: str) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(_block_chars(b, f"{param}[{j}]") for j, b in enumerate(content))
    raise _type_error(param, "a string or an array of content blocks", content)


def _system_chars(system: Any) -> int:
    if system is None:
        return 0
    if isinstance(system, str):
        return len(system)
    if isinstance(system, list):
        n = 0
        for j, b in enumerate(system):
            param = f"system[{j}]"
            if not isinstance(b, dict):
                raise _type_error(param, "an object", b)
            if b.get("type") != "text":
                raise bad_request(f"'{param}.type' must be 'text'.", param=f"{param}.type", code="invalid_value")
            n += _text_field(b, "text", param)
        return n
    raise _type_error("system", "a string or an array of text blocks", system)


def parse_messages(body: dict[str, Any]) -> Parsed:
    model = _model(body)
    if "max_tokens" not in body:
        raise bad_request("Missing required parameter: 'max_tokens'.", param="max_tokens",
                          code="missing_required_parameter")
    max_tokens = _opt_int(body, "max_tokens")
    if max_tokens is None:
        raise _type_error("max_tokens", "an integer", None)
    if "messages" not in body:
        raise bad_request("Missing required parameter: 'messages'.", param="messages",
                          code="missing_required_parameter")
    msgs = body["messages"]
    if not isinstance(msgs, list):
        raise _type_error("messages", "an array", msgs)
    if not msgs:
        raise bad_request("'messages' must contain at least one message.", param="messages", code="invalid_value")
    chars = _system_chars(body.get("system"))
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"'messages[{i}].role' must be 'user' or 'assistant'.", param=f"messages[{i}].role",
                              code="invalid_value")
        if "content" not in m:
            raise bad_request(f"Missing required parameter: 'messages[{i}].content'.",
                              param=f"messages[{i}].content", code="missing_required_parameter")
        chars += _content_chars(m["content"], f"messages[{i}].content") + 4
    stream = _opt_bool(body, "stream")
    _opt_number(body, "temperature", 0, 1)
    _opt_number(body, "top_p", 0, 1)
    _opt_int(body, "top_k", 0)
    stop = body.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _type_error("stop_sequences", "an array of strings", stop)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _type_error("tools", "an array", tools)
        for j, t in enumerate(tools):
            if not isinstance(t, dict):
                raise _type_error(f"tools[{j}]", "an object", t)
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise bad_request(f"'tools[{j}].name' must be a non-empty string.", param=f"tools[{j}].name",
                                  code="invalid_value")
    tc = body.get("tool_choice")
    if tc is not None:
        if not isinstance(tc, dict):
            raise _type_error("tool_choice", "an object", tc)
        if tc.get("type") not in ("auto", "any", "tool", "none"):
            raise bad_request("'tool_choice.type' must be one of 'auto', 'any', 'tool', 'none'.",
                              param="tool_choice.type", code="invalid_value")
        if tc["type"] == "tool" and not isinstance(tc.get("name"), str):
            raise _type_error("tool_choice.name", "a string", tc.get("name"))
    md = body.get("metadata")
    if md is not None and not isinstance(md, dict):
        raise _type_error("metadata", "an object", md)
    # Anthropic streams always carry usage (message_start, message_delta): nothing to ask for or strip
    return Parsed(model, stream, False, max_tokens, chars)


def _openai_part(block: dict[str, Any]) -> dict[str, Any] | None:
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "text": block.get("text", "")}
    if kind == "image":
        raw = block.get("source")
        src: dict[str, Any] = raw if isinstance(raw, dict) else {}
        url = (f"data:{src.get('media_type')};base64,{src.get('data')}" if src.get("type") == "base64"
               else src.get("url", ""))
        return {"type": "image_url", "image_url": {"url": url}}
    return None


def _result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""


def as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A (validated) Messages body as the OpenAI chat body an engine renders for it, as vLLM's Anthropic
    adapter converts it (vllm/entrypoints/anthropic/serving.py; a lone text block as a string, tool input as
    json.dumps): `system` first, text and image blocks as content parts, `tool_use` blocks as the
    assistant's `tool_calls`, `tool_result` blocks as `tool` messages, `tools` as function tools. Routing
    tokenizes and keys the prompt from this (the endpoint's `chat_view`)."""
    msgs: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, list):
        system = "".join(b.get("text", "") for b in system if isinstance(b, dict))
    if isinstance(system, str) and system:
        msgs.append({"role": "system", "content": system})
    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if not isinstance(content, list):
            msgs.append({"role": m.get("role"), "content": content})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for b in content:
            if not isinstance(b, dict):
                continue
            if b.get("type") == "tool_use":
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {})}})
            elif b.get("type") == "tool_result":
                msgs.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                             "content": _result_text(b.get("content"))})
            else:
                p = _openai_part(b)
                if p is not None:
                    parts.append(p)
        if parts or calls:
            one_text = len(parts) == 1 and parts[0]["type"] == "text"
            out: dict[str, Any] = {"role": m.get("role"), "content": parts[0]["text"] if one_text else parts}
            if calls:
                out["tool_calls"] = calls
            msgs.append(out)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": msgs}
    tools = [t for t in body.get("tools") or () if isinstance(t, dict) and isinstance(t.get("name"), str)]
    if tools:
        chat["tools"] = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                           "parameters": t.get("input_schema") or {}}}
                         for t in tools]
    return chat
