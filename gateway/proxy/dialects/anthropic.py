"""A partner speaking Anthropic's native Messages API (kind `anthropic`): `/v1/messages` passes through as it
is; OpenAI `/v1/chat/completions` requests are translated into Messages and the answers (JSON and streams)
back into chat completions. The gateway's credential goes upstream as `x-api-key` with `anthropic-version`;
Anthropic error bodies (`{"type": "error", "error": {"type", "message"}}`) are read for their message and type.

Chat -> Messages:
- `system` / `developer` messages become the top-level `system` (joined by blank lines, in order);
- `user` / `assistant` messages keep their role, string content or text/image parts as content blocks;
  assistant `tool_calls` become `tool_use` blocks, `tool` messages `tool_result` blocks in a user turn;
  consecutive turns of one role are merged (Anthropic wants them alternating);
- `max_tokens`: the policy/budget cap, else the client's `max_completion_tokens` / `max_tokens`, else
  DEFAULT_MAX_TOKENS (4096; Anthropic requires the field, OpenAI chat does not);
- `stop` (string or list) -> `stop_sequences`; `temperature` clamped to Anthropic's [0, 1]; `top_p`;
  `user` -> `metadata.user_id`; `tools` (function tools) -> `{name, description, input_schema}`;
  `tool_choice` auto/required/none/{function} -> auto/any/none/{tool}; `stream`.
Messages -> chat: text blocks joined as the message content, `tool_use` blocks as `tool_calls`; stop reasons
end_turn/stop_sequence -> stop, max_tokens -> length, tool_use -> tool_calls, refusal -> content_filter;
usage prompt = input + cache_read + cache_creation (cached = cache_read), completion = output.
Streams: message_start -> the role chunk, text/thinking/tool-input deltas -> content / reasoning_content /
tool_calls chunks, message_delta -> the finish chunk, message_stop -> the usage-only chunk and `[DONE]`,
an upstream `error` event -> an OpenAI error chunk and `[DONE]`.
"""
from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.api.endpoints import Endpoint
from gateway.api.parse_messages import as_chat
from gateway.api.wire.anthropic import usage_from
from gateway.proxy import sse
from gateway.proxy.dialects.base import Dialect, Exchange, StreamTranslator

ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096
FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
          "pause_turn": "stop", "refusal": "content_filter"}


def _obj(d: dict[str, Any], key: str) -> dict[str, Any]:
    v = d.get(key)
    return v if isinstance(v, dict) else {}


# ------------------------------------------------------------------ chat request -> Messages request
def _image_block(part: dict[str, Any]) -> dict[str, Any]:
    img = part.get("image_url")
    url = img.get("url") if isinstance(img, dict) else img
    url = url if isinstance(url, str) else ""
    if url.startswith("data:") and ";base64," in url:
        media, _, data = url[5:].partition(";base64,")
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _blocks(content: Any) -> list[dict[str, Any]]:
    """OpenAI message content as Anthropic content blocks (empty text dropped: Anthropic refuses it)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    out: list[dict[str, Any]] = []
    for p in content if isinstance(content, list) else ():
        if not isinstance(p, dict):
            continue
        t = p.get("type")
        if t == "text" and isinstance(p.get("text"), str) and p["text"]:
            out.append({"type": "text", "text": p["text"]})
        elif t == "image_url" or "image_url" in p:
            out.append(_image_block(p))
    return out


def _text_of(content: Any) -> str:
    return "".join(b["text"] for b in _blocks(content) if b["type"] == "text")


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = _obj(call, "function")
    args = fn.get("arguments")
    try:
        inp = orjson.loads(args) if isinstance(args, str) and args else {}
    except orjson.JSONDecodeError:
        inp = {"arguments": args}
    return {"type": "tool_use", "id": str(call.get("id") or ""), "name": str(fn.get("name") or ""),
            "input": inp if isinstance(inp, dict) else {"value": inp}}


def chat_to_messages(body: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    """An OpenAI chat body as an Anthropic Messages body (see the module docstring for the mapping)."""
    system: list[str] = []
    turns: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": list(blocks)})

    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if role in ("system", "developer"):
            text = _text_of(m.get("content"))
            if text:
                system.append(text)
        elif role == "tool":
            add("user", [{"type": "tool_result", "tool_use_id": str(m.get("tool_call_id") or ""),
                          "content": _text_of(m.get("content"))}])
        elif role == "assistant":
            blocks = _blocks(m.get("content"))
            blocks += [_tool_use(c) for c in m.get("tool_calls") or () if isinstance(c, dict)]
            add("assistant", blocks)
        else:
            add("user", _blocks(m.get("content")))
    out: dict[str, Any] = {"model": body.get("model"), "messages": turns}
    if system:
        out["system"] = "\n\n".join(system)
    mt = max_tokens if max_tokens is not None else body.get("max_completion_tokens") or body.get("max_tokens")
    out["max_tokens"] = mt if isinstance(mt, int) and not isinstance(mt, bool) else DEFAULT_MAX_TOKENS
    stop = body.get("stop")
    if isinstance(stop, str):
        out["stop_sequences"] = [stop]
    elif isinstance(stop, list) and stop:
        out["stop_sequences"] = [s for s in stop if isinstance(s, str)]
    t = body.get("temperature")
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        out["temperature"] = min(float(t), 1.0)
    if isinstance(body.get("top_p"), (int, float)):
        out["top_p"] = body["top_p"]
    if isinstance(body.get("user"), str):
        out["metadata"] = {"user_id": body["user"]}
    tools = [t for t in body.get("tools") or () if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if tools:
        out["tools"] = [{"name": t["function"].get("name"), "description": t["function"].get("description", ""),
                         "input_schema": t["function"].get("parameters") or {"type": "object", "properties": {}}}
                        for t in tools]
    tc = body.get("tool_choice")
    if tc in ("auto", "none"):
        out["tool_choice"] = {"type": tc}
    elif tc == "required":
        out["tool_choice"] = {"type": "any"}
    elif isinstance(tc, dict) and isinstance(tc.get("function"), dict):
        out["tool_choice"] = {"type": "tool", "name": tc["function"].get("name")}
    if body.get("stream"):
        out["stream"] = True
    return out


# ------------------------------------------------------------------ Messages response -> chat response
def _openai_usage(u: Any) -> dict[str, Any] | None:
    got = usage_from(u)
    if got is None:
        return None
    out: dict[str, Any] = {"prompt_tokens": got.prompt_tokens, "completion_tokens": got.completion_tokens,
                           "total_tokens": got.total_tokens}
    if got.cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": got.cached_tokens}
    return out


def message_to_chat(msg: dict[str, Any]) -> dict[str, Any]:
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for b in msg.get("content") or ():
        if not isinstance(b, dict):
            continue
        if b.get("type") == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif b.get("type") == "tool_use":
            calls.append({"id": b.get("id"), "type": "function", "function": {
                "name": b.get("name"), "arguments": orjson.dumps(b.get("input") or {}).decode()}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    out: dict[str, Any] = {"id": msg.get("id"), "object": "chat.completion", "created": int(time.time()),
                           "model": msg.get("model"),
                           "choices": [{"index": 0, "message": message,
                                        "finish_reason": FINISH.get(str(msg.get("stop_reason")), "stop")}]}
    usage = _openai_usage(msg.get("usage"))
    if usage is not None:
        out["usage"] = usage
    return out


class MessagesToChatStream(StreamTranslator):
    """Anthropic stream events -> OpenAI `chat.completion.chunk` events, ending with usage and `[DONE]`."""

    def __init__(self) -> None:
        self.id = ""
        self.model: Any = None
        self.created = int(time.time())
        self.start_usage: dict[str, Any] = {}
        self.usage: dict[str, Any] = {}
        self.tools: dict[int, int] = {}  # Anthropic block index -> OpenAI tool_calls index

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse.sse(orjson.dumps({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                     "model": self.model,
                                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}))

    def feed(self, event: bytes) -> list[bytes]:
        data = sse.event_data(event)
        obj = sse.parse_chunk(data) if data is not None else None
        if obj is None:
            return []
        t = obj.get("type")
        if t == "message_start":
            msg = _obj(obj, "message")
            self.id = str(msg.get("id") or "")
            self.model = msg.get("model")
            self.start_usage = dict(_obj(msg, "usage"))
            return [self._chunk({"role": "assistant", "content": ""})]
        if t == "content_block_start":
            block = _obj(obj, "content_block")
            if block.get("type") == "tool_use":
                i = len(self.tools)
                self.tools[int(obj.get("index") or 0)] = i
                return [self._chunk({"tool_calls": [{"index": i, "id": block.get("id"), "type": "function",
                                                     "function": {"name": block.get("name"), "arguments": ""}}]})]
            return []
        if t == "content_block_delta":
            d = _obj(obj, "delta")
            kind = d.get("type")
            if kind == "text_delta" and d.get("text"):
                return [self._chunk({"content": d["text"]})]
            if kind == "thinking_delta" and d.get("thinking"):
                return [self._chunk({"reasoning_content": d["thinking"]})]
            if kind == "input_json_delta" and d.get("partial_json"):
                i = self.tools.get(int(obj.get("index") or 0), 0)
                return [self._chunk({"tool_calls": [{"index": i, "function": {"arguments": d["partial_json"]}}]})]
            return []
        if t == "message_delta":
            self.usage.update(_obj(obj, "usage"))
            d = _obj(obj, "delta")
            reason = d.get("stop_reason")
            return [self._chunk({}, FINISH.get(str(reason), "stop"))] if reason else []
        if t == "message_stop":
            usage = _openai_usage({**self.start_usage, **self.usage})
            out = []
            if usage is not None:
                out.append(sse.sse(orjson.dumps({"id": self.id, "object": "chat.completion.chunk",
                                                 "created": self.created, "model": self.model, "choices": [],
                                                 "usage": usage})))
            return out + [sse.sse(sse.DONE)]
        if t == "error":
            err = _obj(obj, "error")
            # the upstream's message whole: the dispatcher scrubs and bounds it (gateway/proxy/scrub.py)
            body = {"error": {"message": str(err.get("message") or "upstream stream error"),
                              "type": str(err.get("type") or "api_error")[:64], "param": None,
                              "code": "upstream_error"}}
            return [sse.sse(orjson.dumps(body)), sse.sse(sse.DONE)]
        return []  # ping, content_block_stop


class ChatToMessages(Exchange):
    """OpenAI chat completions carried to an Anthropic Messages backend."""

    translates = True

    def __init__(self, dialect: Dialect, ep: Endpoint) -> None:
        super().__init__(dialect, ep)
        self.path = "messages"

    def body(self, ctx: Any, cand: Any) -> bytes:
        out = chat_to_messages(ctx.body, ctx.max_tokens)
        out["model"] = cand.backend.upstream_model(cand.model)
        return orjson.dumps(out)

    def response(self, raw: bytes) -> bytes:
        try:
            msg = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw  # the ingress answers invalid upstream JSON with a 502
        return orjson.dumps(message_to_chat(msg)) if isinstance(msg, dict) else raw

    def stream(self) -> StreamTranslator:
        return MessagesToChatStream()


class AnthropicDialect(Dialect):
    kind = "anthropic"
    provider = "anthropic"
    native = frozenset({"messages"})
    drop_fields = ("cache_salt",)
    retryable_statuses = frozenset({529})  # Anthropic's overloaded_error: the next candidate may have room

    def exchange(self, ep: Endpoint) -> Exchange | None:
        if ep.name == "chat":
            return ChatToMessages(self, ep)
        return super().exchange(ep)

    def auth_headers(self, bearer: str | None) -> dict[str, str]:
        h = {"anthropic-version": ANTHROPIC_VERSION}
        if bearer:
            scheme, _, key = bearer.partition(" ")
            h["x-api-key"] = key if scheme.lower() == "bearer" and key else bearer
        return h

    def error_message(self, status: int, body: bytes) -> str:
        err = self.error_fields(body)
        msg = err.get("message")
        return msg if isinstance(msg, str) else super().error_message(status, body)

    def error_fields(self, body: bytes) -> dict[str, Any]:
        """Anthropic's error object: its `type` (invalid_request_error, ...) and message; no OpenAI `code`."""
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return {}
        err = obj.get("error") if isinstance(obj, dict) else None
        if not isinstance(err, dict):
            return {}
        return {k: err[k] for k in ("type", "message") if isinstance(err.get(k), str)}


# ------------------------------------------------------------------ Messages clients on a vLLM engine's chat API
# vLLM's own /v1/messages drops `cache_salt` and `priority` (its AnthropicMessagesRequest has neither), so a
# request that needs either (the policy's cache isolation, a priority-scheduling engine) is carried to the
# engine's /v1/chat/completions instead, translated as vLLM itself translates it, and answered back in
# Anthropic's shapes; every other one goes to /v1/messages natively.
CHAT_FINISH = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}


def messages_to_chat_body(body: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    """An Anthropic Messages body as vLLM's chat request for it (as_chat, then the sampling fields)."""
    chat = as_chat(body)
    chat["max_tokens"] = max_tokens if max_tokens is not None else body.get("max_tokens")
    for src, dst in (("stop_sequences", "stop"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("top_k", "top_k")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        kind = tc.get("type")
        if kind in ("auto", "none"):
            chat["tool_choice"] = kind
        elif kind == "any":
            chat["tool_choice"] = "required"
        elif kind == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}}
    user = _obj(body, "metadata").get("user_id")
    if isinstance(user, str):
        chat["user"] = user
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _anthropic_usage(u: Any) -> dict[str, Any]:
    """OpenAI usage as Anthropic's: input_tokens the uncached prompt, cache_read_input_tokens the cached part."""
    if not isinstance(u, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    def n(v: Any) -> int:
        return v if isinstance(v, int) and not isinstance(v, bool) else 0

    cached = n(_obj(u, "prompt_tokens_details").get("cached_tokens"))
    prompt, out = n(u.get("prompt_tokens")), n(u.get("completion_tokens"))
    return {"input_tokens": max(0, prompt - cached), "cache_read_input_tokens": cached, "output_tokens": out}


def chat_to_message(obj: dict[str, Any]) -> dict[str, Any]:
    raw = obj.get("choices")
    choice = raw[0] if isinstance(raw, list) and raw and isinstance(raw[0], dict) else {}
    msg = _obj(choice, "message")
    content: list[dict[str, Any]] = []
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if isinstance(msg.get("content"), str) and msg["content"]:
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or ():
        if isinstance(call, dict):
            content.append(_tool_use(call))
    return {"id": obj.get("id"), "type": "message", "role": "assistant", "model": obj.get("model"),
            "content": content, "stop_reason": CHAT_FINISH.get(str(choice.get("finish_reason")), "end_turn"),
            "stop_sequence": None, "usage": _anthropic_usage(obj.get("usage"))}


def n_index(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _event(obj: dict[str, Any]) -> bytes:
    return b"event: " + str(obj["type"]).encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


class ChatToMessagesStream(StreamTranslator):
    """OpenAI chat chunks -> Anthropic stream events (message_start, content blocks, message_delta with the
    usage chunk's usage, message_stop at [DONE])."""

    def __init__(self) -> None:
        self.started = False
        self.index = -1
        self.block: tuple[str, int] | None = None  # (kind, tool index) of the open content block
        self.finish: str | None = None
        self.delta_sent = False

    def _open(self, kind: str, block: dict[str, Any], tool: int = -1) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.block = (kind, tool)
        return out + [_event({"type": "content_block_start", "index": self.index, "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        self.block = None
        return [_event({"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def _message_delta(self, usage: Any) -> list[bytes]:
        self.delta_sent = True
        return self._close() + [_event({"type": "message_delta", "usage": _anthropic_usage(usage), "delta": {
            "stop_reason": CHAT_FINISH.get(str(self.finish), "end_turn"), "stop_sequence": None}})]

    def feed(self, event: bytes) -> list[bytes]:
        data = sse.event_data(event)
        if data is None:
            return []
        if data == sse.DONE:
            return (([] if self.delta_sent else self._message_delta(None))
                    + [_event({"type": "message_stop"})])
        obj = sse.parse_chunk(data)
        if obj is None:
            return []
        if isinstance(obj.get("error"), dict):
            msg = str(obj["error"].get("message") or "upstream stream error")  # scrubbed by the dispatcher
            return [_event({"type": "error", "error": {"type": "api_error", "message": msg}})]
        out: list[bytes] = []
        if not self.started:
            self.started = True
            out.append(_event({"type": "message_start", "message": {
                "id": obj.get("id"), "type": "message", "role": "assistant", "model": obj.get("model"),
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0}}}))
        raw = obj.get("choices")
        choices: list[Any] = raw if isinstance(raw, list) else []
        if not choices and isinstance(obj.get("usage"), dict):
            return out + self._message_delta(obj["usage"])
        for ch in choices:
            if not isinstance(ch, dict):
                continue
            d = _obj(ch, "delta")
            think = d.get("reasoning_content") or d.get("reasoning")
            if isinstance(think, str) and think:
                if self.block is None or self.block[0] != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": think}))
            text = d.get("content")
            if isinstance(text, str) and text:
                if self.block is None or self.block[0] != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": text}))
            for call in d.get("tool_calls") or ():
                if not isinstance(call, dict):
                    continue
                fn = _obj(call, "function")
                i = n_index(call.get("index"))
                if self.block is None or self.block != ("tool", i):
                    out += self._open("tool", {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                                               "input": {}}, i)
                if isinstance(fn.get("arguments"), str) and fn["arguments"]:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
            if isinstance(ch.get("finish_reason"), str):
                self.finish = ch["finish_reason"]
        return out


class MessagesOnVLLM(Exchange):
    """/v1/messages on a vLLM engine: natively, unless the request carries a cache_salt or a priority the
    engine schedules by (its /v1/messages would drop them): then through /v1/chat/completions."""

    def __init__(self, dialect: Dialect, ep: Endpoint) -> None:
        super().__init__(dialect, ep)
        self.via_chat = False

    def body(self, ctx: Any, cand: Any) -> bytes:
        over = ctx.body_overrides
        if "cache_salt" not in over and not ("priority" in over and cand.backend.priority_scheduling):
            return super().body(ctx, cand)
        self.via_chat = True
        self.translates = True
        self.path = "chat/completions"
        ctx.evidence["messages_via"] = "chat/completions"  # the engine's /v1/messages would drop salt/priority
        chat = messages_to_chat_body(ctx.body, ctx.max_tokens)
        chat["model"] = cand.backend.upstream_model(cand.model)
        chat.update(over)
        self.dialect.adjust(ctx, cand, chat)
        return orjson.dumps(chat)

    def response(self, raw: bytes) -> bytes:
        if not self.via_chat:
            return raw
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
        return orjson.dumps(chat_to_message(obj)) if isinstance(obj, dict) else raw

    def stream(self) -> StreamTranslator | None:
        return ChatToMessagesStream() if self.via_chat else None
