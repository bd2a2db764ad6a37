"""Parse and validate Anthropic Messages request bodies (`POST /v1/messages`, pure): every bad input becomes a
400 naming the param, as `gateway.api.parse` does for OpenAI bodies (the wire, gateway/api/wire/anthropic.py,
gives it Anthropic's error shape).

What Anthropic requires is required here: `model`, `max_tokens` (an integer >= 1: it is the completion cap the
budget reserves for) and `messages` (a non-empty array of `user`/`assistant` turns whose `content` is a string
or an array of content blocks). `system` is a string or an array of text blocks; `stream` a boolean;
`temperature` and `top_p` numbers in [0, 1]; `top_k` an integer >= 0; `stop_sequences` an array of strings;
`tools` an array of objects with a `name`; `tool_choice` an object of type auto/any/tool (with a `name`)/none.
Block types other than text, image, tool_use, tool_result, document and thinking pass through unchecked (the
engine answers for them).

The shapes are the Structs of gateway/api/bodies.py (`MessagesRequest` and its blocks); the rules here: a content
block is checked with the Struct its `type` names, and `tool_choice` of type `tool` names its tool."""
from __future__ import annotations

import json
from typing import Any

from gateway.api.bodies import ANTHROPIC_BLOCKS, AnthropicMessage, MessagesRequest, ToolChoice, ToolResultBlock, by_type
from gateway.api.parse import Parsed
from gateway.api.validate import Rules, type_error, validate

BLOCKS = by_type(*ANTHROPIC_BLOCKS)


def _block_chars(block: Any, param: str) -> int:
    """Characters of prompt text in one content block (an object): a block of a known `type` is checked with
    its Struct, others pass through to the engine."""
    if not isinstance(block, dict):
        raise type_error(param, "an object", block)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise type_error(f"{param}.type", "a string", kind)
    cls = BLOCKS.get(kind)
    if cls is None:
        return 0
    validate(block, cls, RULES, param)
    if kind in ("text", "thinking"):
        return len(block[kind])
    if kind == "tool_use":
        return len(str(block["input"]))
    if kind == "tool_result":
        return _result_chars(block, param)
    return 0


def _result_chars(block: dict[str, Any], param: str) -> int:
    """A tool result's content: a string, or blocks as a message's."""
    c = block.get("content")
    if isinstance(c, list):
        return sum(_block_chars(b, f"{param}.content[{j}]") for j, b in enumerate(c))
    return len(c) if isinstance(c, str) else 0


def _message_chars(m: dict[str, Any], param: str) -> int:
    c = m["content"]
    if isinstance(c, str):
        return len(c)
    return sum(_block_chars(b, f"{param}.content[{j}]") for j, b in enumerate(c))


def _tool_choice(tc: dict[str, Any], param: str) -> None:
    if tc["type"] == "tool" and not isinstance(tc.get("name"), str):
        raise type_error("tool_choice.name", "a string", tc.get("name"))


RULES: Rules = {AnthropicMessage: {"content[]": _block_chars}, ToolResultBlock: {"content[]": _block_chars},
                ToolChoice: {"name": _tool_choice}}


def parse_messages(body: dict[str, Any]) -> Parsed:
    req = validate(body, MessagesRequest, RULES)
    system = req.system
    chars = len(system) if isinstance(system, str) else sum(len(b.text) for b in system) if system else 0
    for i, m in enumerate(body["messages"]):
        chars += _message_chars(m, f"messages[{i}]") + 4
    if req.tool_choice is not None:
        _tool_choice(body["tool_choice"], "tool_choice")
    # Anthropic streams always carry usage (message_start, message_delta): nothing to ask for or strip
    return Parsed(req.model, bool(req.stream), False, req.max_tokens, chars)


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
