"""The `anthropic` backend dialect (gateway/proxy/dialects/anthropic.py): chat -> Messages request translation,
Messages -> chat responses and streams, credentials and error bodies; then the real path, an in-process gateway
whose anthropic-kind backend is the simulator's /v1/messages behind a recording proxy (what went upstream:
path, x-api-key, anthropic-version, the translated body)."""
from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
import yaml
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from backends.sim.fleet import start_fleet
from gateway.api.endpoints import BY_NAME
from gateway.app import Gateway, build_app
from gateway.config import load_config
from gateway.proxy import sse
from gateway.proxy.dialects import dialect_for
from gateway.proxy.dialects.anthropic import (
    DEFAULT_MAX_TOKENS,
    ChatToMessages,
    MessagesToChatStream,
    chat_to_messages,
    message_to_chat,
)
from gateway.proxy.forward import client_error_body
from gateway.wiring import wire

D = dialect_for("anthropic")


def test_exchanges_per_endpoint():
    assert type(D.exchange(BY_NAME["messages"])).__name__ == "Exchange"  # native pass-through
    ex = D.exchange(BY_NAME["chat"])
    assert isinstance(ex, ChatToMessages) and ex.translates and ex.path == "messages"
    assert D.exchange(BY_NAME["completions"]) is None and D.exchange(BY_NAME["embeddings"]) is None
    assert not D.kv_events and D.provider == "anthropic"
    # vLLM engines (and the simulator) serve /v1/messages natively
    assert dialect_for("vllm").exchange(BY_NAME["messages"]).path == "messages"
    assert dialect_for("openai").exchange(BY_NAME["messages"]) is None


def test_credentials_go_as_x_api_key_with_the_version():
    assert D.auth_headers("Bearer sk-ant-1") == {"x-api-key": "sk-ant-1", "anthropic-version": "2023-06-01"}
    assert D.auth_headers(None) == {"anthropic-version": "2023-06-01"}


def test_anthropic_error_bodies_are_read():
    body = orjson.dumps({"type": "error", "error": {"type": "invalid_request_error", "message": "prompt too long"}})
    assert D.error_message(400, body) == "prompt too long"
    assert D.error_fields(body) == {"type": "invalid_request_error", "message": "prompt too long"}
    assert D.error_message(500, b"<html>") == "upstream answered HTTP 500" and D.error_fields(b"[]") == {}
    # relayed to an OpenAI client in OpenAI's shape
    out = orjson.loads(client_error_body(400, body, D))
    assert out["error"]["message"] == "prompt too long" and out["error"]["type"] == "invalid_request_error"


def test_chat_request_to_messages():
    body = {"model": "m", "messages": [
        {"role": "system", "content": "Rule one."}, {"role": "developer", "content": [{"type": "text", "text": "Two."}]},
        {"role": "user", "content": "Hi"}, {"role": "user", "content": [
            {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
            {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
        {"role": "assistant", "content": "It is 2."}],
        "stop": "END", "temperature": 1.7, "top_p": 0.9, "user": "u-1", "stream": True,
        "tools": [{"type": "function", "function": {"name": "add", "description": "adds",
                                                    "parameters": {"type": "object"}}}],
        "tool_choice": "required", "stream_options": {"include_usage": True}, "cache_salt": "s"}
    out = chat_to_messages(body, None)
    assert out["system"] == "Rule one.\n\nTwo."
    assert [t["role"] for t in out["messages"]] == ["user", "assistant", "user", "assistant"]  # merged, alternating
    user = out["messages"][0]["content"]
    assert user[0] == {"type": "text", "text": "Hi"} and user[1] == {"type": "text", "text": "see"}
    assert user[2] == {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}
    assert user[3] == {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}
    assert out["messages"][1]["content"] == [{"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 1}}]
    assert out["messages"][2]["content"] == [{"type": "tool_result", "tool_use_id": "c1", "content": "2"}]
    assert out["max_tokens"] == DEFAULT_MAX_TOKENS and out["stop_sequences"] == ["END"]
    assert out["temperature"] == 1.0 and out["top_p"] == 0.9 and out["metadata"] == {"user_id": "u-1"}
    assert out["tools"] == [{"name": "add", "description": "adds", "input_schema": {"type": "object"}}]
    assert out["tool_choice"] == {"type": "any"} and out["stream"] is True
    assert "stream_options" not in out and "cache_salt" not in out and "user" not in out
    # the cap the budget/policy set wins; else the client's field; tool_choice variants
    assert chat_to_messages({**body, "max_tokens": 50}, 20)["max_tokens"] == 20
    assert chat_to_messages({**body, "max_completion_tokens": 30}, None)["max_tokens"] == 30
    assert chat_to_messages({**body, "tool_choice": "none"}, None)["tool_choice"] == {"type": "none"}
    assert chat_to_messages({**body, "tool_choice": {"type": "function", "function": {"name": "add"}}},
                            None)["tool_choice"] == {"type": "tool", "name": "add"}
    assert chat_to_messages({**body, "stop": ["a", "b"]}, None)["stop_sequences"] == ["a", "b"]


def test_messages_response_to_chat():
    msg = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "stop_reason": "tool_use",
           "content": [{"type": "text", "text": "Let me "}, {"type": "text", "text": "add."},
                       {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}}],
           "usage": {"input_tokens": 10, "cache_read_input_tokens": 32, "output_tokens": 5}}
    out = message_to_chat(msg)
    assert out["object"] == "chat.completion" and out["id"] == "msg_1"
    ch = out["choices"][0]
    assert ch["message"]["content"] == "Let me add." and ch["finish_reason"] == "tool_calls"
    assert ch["message"]["tool_calls"] == [{"id": "t1", "type": "function",
                                            "function": {"name": "add", "arguments": '{"a":1}'}}]
    assert out["usage"] == {"prompt_tokens": 42, "completion_tokens": 5, "total_tokens": 47,
                            "prompt_tokens_details": {"cached_tokens": 32}}
    for reason, finish in (("end_turn", "stop"), ("stop_sequence", "stop"), ("max_tokens", "length"),
                           ("refusal", "content_filter")):
        assert message_to_chat({**msg, "stop_reason": reason})["choices"][0]["finish_reason"] == finish
    assert ChatToMessages(D, BY_NAME["chat"]).response(b"not json") == b"not json"


def ev(obj: dict) -> bytes:
    return b"event: " + obj["type"].encode() + b"\ndata: " + orjson.dumps(obj)


def stream_events(texts: list[str], reason: str = "end_turn", tool: bool = False) -> list[bytes]:
    out = [ev({"type": "message_start", "message": {"id": "msg_s", "model": "m", "content": [],
                                                    "usage": {"input_tokens": 9, "output_tokens": 1}}}),
           ev({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
           ev({"type": "ping"})]
    out += [ev({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}})
            for t in texts]
    out.append(ev({"type": "content_block_stop", "index": 0}))
    if tool:
        out += [ev({"type": "content_block_start", "index": 1,
                    "content_block": {"type": "tool_use", "id": "t9", "name": "f", "input": {}}}),
                ev({"type": "content_block_delta", "index": 1,
                    "delta": {"type": "input_json_delta", "partial_json": '{"x":'}}),
                ev({"type": "content_block_delta", "index": 1,
                    "delta": {"type": "input_json_delta", "partial_json": ' 1}'}})]
    out += [ev({"type": "message_delta", "delta": {"stop_reason": reason}, "usage": {"output_tokens": 7}}),
            ev({"type": "message_stop"})]
    return out


def chunks(events: list[bytes]) -> list[Any]:
    tr = MessagesToChatStream()
    out = [e for raw in events for e in tr.feed(raw)] + tr.end()
    parsed = []
    for e in out:
        assert e.startswith(b"data: ") and e.endswith(b"\n\n")
        data = sse.event_data(e.rstrip(b"\n"))
        parsed.append("[DONE]" if data == sse.DONE else orjson.loads(data))
    return parsed


@given(st.lists(st.text(min_size=1, max_size=8), max_size=12))
def test_a_stream_translates_to_chat_chunks(texts):
    got = chunks(stream_events(texts))
    assert got[-1] == "[DONE]"
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "msg_s" for c in got[:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in got[:-1] if c["choices"]) == "".join(texts)
    finish = [c["choices"][0]["finish_reason"] for c in got[:-1] if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == ["stop"]
    usage = got[-2]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 9, "completion_tokens": 7,
                                                         "total_tokens": 16}


def test_a_tool_stream_and_an_upstream_error_event():
    got = chunks(stream_events(["ok"], reason="tool_use", tool=True))
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in got[:-1]
             if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    assert calls[0] == {"index": 0, "id": "t9", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert "".join(c["function"]["arguments"] for c in calls) == '{"x": 1}'
    assert [c["choices"][0]["finish_reason"] for c in got[:-1] if c["choices"] and
            c["choices"][0]["finish_reason"]] == ["tool_calls"]
    err = chunks([ev({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})])
    assert err[-1] == "[DONE]" and err[0]["error"]["message"] == "Overloaded"
    assert err[0]["error"]["type"] == "overloaded_error"
    # a stream that stops without message_stop owes nothing: the dispatcher ends it with the wire's error
    tr = MessagesToChatStream()
    for raw in stream_events(["a"])[:-1]:
        tr.feed(raw)
    assert tr.end() == []


# ------------------------------------------------------------------ the real path, in process
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def stack(tmp_path: Path):
    seen: list[dict[str, Any]] = []
    async with start_fleet(1, profiles=["tiny"]) as fleet, httpx.AsyncClient(timeout=30) as fwd:
        sim = fleet[0].url

        async def record(request: Request) -> Response:
            raw = await request.body()
            seen.append({"path": request.url.path, "headers": dict(request.headers), "body": orjson.loads(raw)})
            up = await fwd.send(fwd.build_request("POST", sim + "/messages", content=raw,
                                                  headers={"content-type": "application/json"}), stream=True)
            md = seen[-1]["body"].get("metadata") or {}
            cut = md.get("user_id") == "cut-after-first-delta"  # a partner whose stream dies part-way
            if md.get("user_id") == "overloaded-once" and sum(
                    (x["body"].get("metadata") or {}).get("user_id") == "overloaded-once" for x in seen) == 1:
                return Response(orjson.dumps({"type": "error", "error": {"type": "overloaded_error",
                                                                         "message": "Overloaded"}}), 529,
                                media_type="application/json")

            if up.headers.get("content-type", "").startswith("text/event-stream"):
                async def body():
                    buf = b""
                    async for chunk in up.aiter_raw():
                        if not cut:
                            yield chunk
                            continue
                        buf += chunk
                        if b"content_block_delta" in buf:
                            head = buf[:buf.index(b"content_block_delta")]
                            yield buf[:buf.index(b"\n\n", len(head)) + 2]
                            break
                    await up.aclose()
                return StreamingResponse(body(), up.status_code, media_type="text/event-stream")
            data = await up.aread()
            return Response(data, up.status_code, media_type="application/json")

        port = _port()
        server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/messages", record, methods=["POST"])]),
                                               host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        (tmp_path / "partner.key").write_text("sk-ant-partner-0123")
        (tmp_path / "policy.yaml").write_text("version: 1\ndefaults: {allow: true}\nrules: []\n")
        cfg = {"server": {"host": "127.0.0.1", "port": 0},
               "backends": [{"name": name, "url": f"http://127.0.0.1:{port}/v1", "kind": "anthropic",
                             "models": ["claude-sim"], "model_map": {"claude-sim": "sim-model"},
                             "api_key_file": str(tmp_path / "partner.key"), "location": {"country": "DE"},
                             "retention": "zero", "operator": "partner"} for name in ("claude", "claude-b")],
               "keys": [{"name": "a", "key": "anth-dialect-key-0123456789", "tenant": "acme"}],
               "policy": {"files": [str(tmp_path / "policy.yaml")], "audit_path": str(tmp_path / "audit.jsonl")},
               "identity": {"sqlite_path": str(tmp_path / "gw.db")},
               "budgets": {"sqlite_path": str(tmp_path / "budgets.db")}, "data_dir": str(tmp_path)}
        path = tmp_path / "gw.yaml"
        path.write_text(yaml.safe_dump(cfg))
        gw = Gateway(load_config(path))
        wire(gw)
        app = build_app(gw)
        await gw.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                         headers={"authorization": "Bearer anth-dialect-key-0123456789"},
                                         timeout=30) as c:
                yield c, seen
        finally:
            await gw.close()
            server.should_exit = True
            await task


async def test_chat_reaches_the_partner_as_messages_with_its_credentials(stack):
    c, seen = stack
    r = await c.post("/v1/chat/completions", json={
        "model": "claude-sim", "max_tokens": 6, "stop": ["zz"],
        "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello there"}]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 6 and out["choices"][0]["message"]["content"]
    up = seen[-1]
    assert up["path"] == "/v1/messages"
    assert up["headers"]["x-api-key"] == "sk-ant-partner-0123" and up["headers"]["anthropic-version"] == "2023-06-01"
    assert "authorization" not in up["headers"]
    assert up["body"] == {"model": "sim-model", "system": "Be terse.", "max_tokens": 6, "stop_sequences": ["zz"],
                          "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]}

    r = await c.post("/v1/chat/completions", json={"model": "claude-sim", "max_tokens": 5, "stream": True,
                                                   "messages": [{"role": "user", "content": "Hello"}]})
    assert r.status_code == 200
    data = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and all(orjson.loads(d)["object"] == "chat.completion.chunk" for d in data[:-1])
    assert not any("usage" in orjson.loads(d) and orjson.loads(d)["usage"] for d in data[:-1])  # not asked for
    assert seen[-1]["body"]["stream"] is True and "stream_options" not in seen[-1]["body"]


async def test_messages_pass_through_natively(stack):
    c, seen = stack
    body = {"model": "claude-sim", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
            "provider": {"zdr": True}}
    r = await c.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    assert seen[-1]["body"] == {"model": "sim-model", "max_tokens": 4, "messages": body["messages"]}
    assert seen[-1]["headers"]["x-api-key"] == "sk-ant-partner-0123"
    # embeddings cannot go to an Anthropic partner: no backend serves them
    r = await c.post("/v1/embeddings", json={"model": "claude-sim", "input": "x"})
    assert r.status_code >= 400 and "error" in r.json()


async def test_a_partner_stream_that_dies_ends_in_the_clients_error_shape(stack):
    """The partner closes its stream after the first delta: an Anthropic client gets Anthropic's `event: error`,
    an OpenAI client an OpenAI error chunk and [DONE]."""
    c, seen = stack
    body = {"model": "claude-sim", "max_tokens": 30, "stream": True, "metadata": {"user_id": "cut-after-first-delta"},
            "messages": [{"role": "user", "content": "Hello"}]}
    r = await c.post("/v1/messages", json=body)
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e.strip()]
    assert events[0].startswith("event: message_start") and "content_block_delta" in r.text
    assert "message_stop" not in r.text
    last = events[-1].split("\n")
    assert last[0] == "event: error"
    assert orjson.loads(last[1][6:])["error"] == {"type": "api_error",
                                                  "message": "Upstream closed the stream before it finished."}

    r = await c.post("/v1/chat/completions", json={"model": "claude-sim", "max_tokens": 30, "stream": True,
                                                   "user": "cut-after-first-delta",
                                                   "messages": [{"role": "user", "content": "Hello"}]})
    data = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and orjson.loads(data[-2])["error"]["code"] == "upstream_error"


async def test_an_overloaded_partner_529_is_tried_on_the_next_candidate(stack):
    """Anthropic's 529 overloaded_error is retryable (the dialect's retryable_statuses): the second partner
    route answers."""
    c, seen = stack
    r = await c.post("/v1/messages", json={"model": "claude-sim", "max_tokens": 3, "metadata": {"user_id": "overloaded-once"},
                                           "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    assert sum((x["body"].get("metadata") or {}).get("user_id") == "overloaded-once" for x in seen) == 2


# ------------------------------------------------------------------ /v1/messages carried to a vLLM engine's chat API
def test_messages_on_vllm_go_native_unless_a_salt_or_priority_must_reach_the_engine():
    from types import SimpleNamespace

    from gateway.pipeline import RequestContext
    from gateway.proxy.dialects.anthropic import MessagesOnVLLM

    vllm = dialect_for("vllm")
    body = {"model": "claude", "max_tokens": 9, "system": "S", "stop_sequences": ["x"], "top_k": 3,
            "tool_choice": {"type": "any"}, "metadata": {"user_id": "u"}, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}

    def ctx(**over):
        c = RequestContext(request_id="r", endpoint="messages", headers={}, body=body)
        c.max_tokens = 9
        c.body_overrides.update(over)
        return c

    def cand(prio: bool):
        b = SimpleNamespace(upstream_model=lambda m: "up-" + m, priority_scheduling=prio,
                            kv_cache_report_mode="incremental")  # the BackendConfig fields the dialect reads
        return SimpleNamespace(backend=b, model="claude")

    ex = vllm.exchange(BY_NAME["messages"])
    assert isinstance(ex, MessagesOnVLLM)
    sent = orjson.loads(ex.body(ctx(priority=5), cand(False)))  # priority the engine ignores anyway: native
    assert ex.path == "messages" and not ex.translates and ex.stream() is None and "priority" not in sent
    assert sent["system"] == "S" and sent["model"] == "up-claude"
    for c, cd in ((ctx(cache_salt="t1"), cand(False)), (ctx(priority=5), cand(True))):
        ex = vllm.exchange(BY_NAME["messages"])
        sent = orjson.loads(ex.body(c, cd))
        assert ex.path == "chat/completions" and ex.translates and c.evidence["messages_via"] == "chat/completions"
        assert sent["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
        assert sent["max_tokens"] == 9 and sent["stop"] == ["x"] and sent["top_k"] == 3 and sent["user"] == "u"
        assert sent["tool_choice"] == "required" and sent["stream"] is True
        assert sent["stream_options"] == {"include_usage": True} and sent["model"] == "up-claude"
        assert ("cache_salt" in sent) == ("cache_salt" in c.body_overrides)
        assert ("priority" in sent) == cd.backend.priority_scheduling


def test_a_chat_answer_as_an_anthropic_message():
    from gateway.proxy.dialects.anthropic import chat_to_message

    out = chat_to_message({"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": "Sure.", "reasoning_content": "think",
                    "tool_calls": [{"id": "c1", "type": "function",
                                    "function": {"name": "f", "arguments": '{"a": 1}'}}]}}],
        "usage": {"prompt_tokens": 50, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 32}}})
    assert out["type"] == "message" and out["stop_reason"] == "tool_use" and out["id"] == "chatcmpl-1"
    assert [b["type"] for b in out["content"]] == ["thinking", "text", "tool_use"]
    assert out["content"][2] == {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}
    assert out["usage"] == {"input_tokens": 18, "cache_read_input_tokens": 32, "output_tokens": 7}
    plain = chat_to_message({"choices": [{"finish_reason": "length", "message": {"content": "x"}}]})
    assert plain["stop_reason"] == "max_tokens" and plain["usage"]["input_tokens"] == 0


def chat_chunk(delta: dict, finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "model": "m",
                                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def anthropic_events(raw: list[bytes]) -> list[dict]:
    from gateway.proxy.dialects.anthropic import ChatToMessagesStream

    tr = ChatToMessagesStream()
    out = []
    for e in [x for r in raw for x in tr.feed(r)] + tr.end():
        head, data = e.rstrip(b"\n").split(b"\n")
        obj = orjson.loads(data[6:])
        assert head == b"event: " + obj["type"].encode()
        out.append(obj)
    return out


@given(st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=12))
def test_a_chat_stream_as_anthropic_events(texts):
    raw = [chat_chunk({"role": "assistant", "content": ""})] + [chat_chunk({"content": t}) for t in texts]
    raw += [chat_chunk({}, "length"),
            b"data: " + orjson.dumps({"id": "c", "choices": [], "usage": {
                "prompt_tokens": 20, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 16}}}),
            b"data: [DONE]"]
    evs = anthropic_events(raw)
    kinds = [e["type"] for e in evs]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e["delta"]["text"] for e in evs if e["type"] == "content_block_delta") == "".join(texts)
    delta = evs[-2]
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"] == {"input_tokens": 4, "cache_read_input_tokens": 16, "output_tokens": 5}


def test_a_chat_stream_with_tools_thinking_and_an_error():
    evs = anthropic_events([
        chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"reasoning_content": "hmm"}),
        chat_chunk({"content": "ok"}),
        chat_chunk({"tool_calls": [{"index": 0, "id": "t1", "type": "function",
                                    "function": {"name": "f", "arguments": ""}}]}),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}, "tool_calls"),
        b"data: [DONE]"])
    starts = [e["content_block"]["type"] for e in evs if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert [e["index"] for e in evs if e["type"] == "content_block_stop"] == [0, 1, 2]
    assert "".join(e["delta"].get("partial_json", "") for e in evs if e["type"] == "content_block_delta") == '{"a": 1}'
    assert evs[-2]["type"] == "message_delta" and evs[-2]["delta"]["stop_reason"] == "tool_use"
    assert evs[-1] == {"type": "message_stop"}
    err = anthropic_events([b'data: {"error": {"message": "engine died", "type": "x"}}'])
    assert err == [{"type": "error", "error": {"type": "api_error", "message": "engine died"}}]
