"""The simulator's /v1/messages (backends/sim/anthropic_api.py) over real sockets: the message object and typed
stream as vLLM serves them, usage (the whole prompt as input_tokens, cache fields null) agreeing with the chat
path's, Anthropic-shaped errors."""
from __future__ import annotations

import json

import httpx

from backends.sim.fleet import start_fleet

SYSTEM = "You are a terse assistant. " * 20
MSGS = [{"role": "user", "content": "Name three prime numbers and explain why they are prime."}]


def events(raw: str) -> list[tuple[str, dict]]:
    out = []
    for block in raw.strip().split("\n\n"):
        lines = block.split("\n")
        name = lines[0].removeprefix("event: ")
        out.append((name, json.loads(lines[1].removeprefix("data: "))))
    return out


async def test_messages_json_stream_usage_and_errors():
    async with start_fleet(1, profiles=["tiny"]) as fleet:
        url = fleet[0].url
        async with httpx.AsyncClient(timeout=10) as c:
            chat = await c.post(url + "/chat/completions", json={
                "model": "sim-model", "max_tokens": 5,
                "messages": [{"role": "system", "content": SYSTEM}, *MSGS]})
            prompt = chat.json()["usage"]["prompt_tokens"]
            r = await c.post(url + "/messages", json={"model": "sim-model", "max_tokens": 5, "system": SYSTEM,
                                                      "messages": MSGS})
            assert r.status_code == 200, r.text
            m = r.json()
            assert m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_")
            assert m["stop_reason"] == "max_tokens" and m["content"][0]["type"] == "text" and m["content"][0]["text"]
            # the same prompt as the chat's, counted whole (vLLM reports no cache reads on this API)
            assert m["usage"] == {"input_tokens": prompt, "output_tokens": 5, "cache_creation_input_tokens": None,
                                  "cache_read_input_tokens": None}
            # system as text blocks and content as blocks render the same prompt
            r = await c.post(url + "/messages", json={
                "model": "sim-model", "max_tokens": 3, "system": [{"type": "text", "text": SYSTEM}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": MSGS[0]["content"]}]}]})
            assert r.json()["usage"]["input_tokens"] == prompt

            r = await c.post(url + "/messages", json={"model": "sim-model", "max_tokens": 6, "stream": True,
                                                      "messages": MSGS})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            evs = events(r.text)
            names = [n for n, _ in evs]
            assert names[:3] == ["message_start", "content_block_start", "content_block_delta"]
            assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
            assert all(n == d["type"] for n, d in evs)
            text = "".join(d["delta"]["text"] for n, d in evs if n == "content_block_delta")
            assert text
            start = evs[0][1]["message"]
            assert start["usage"] == {"input_tokens": start["usage"]["input_tokens"], "output_tokens": 0}
            assert start["usage"]["input_tokens"] > 0 and start["content"] == []
            delta = evs[-2][1]
            assert delta["delta"]["stop_reason"] == "max_tokens"
            assert delta["usage"] == {"input_tokens": start["usage"]["input_tokens"], "output_tokens": 6}

            # cache_salt and priority are ignored on this API, as vLLM's request model has neither: a salted
            # request still hits the unsalted cache, a priority without the priority scheduler is no error
            def hits(text: str) -> float:
                return sum(float(line.split()[-1]) for line in text.splitlines()
                           if line.startswith("vllm:prefix_cache_hits_total"))

            before = hits((await c.get(fleet[0].root + "/metrics")).text)
            r = await c.post(url + "/messages", json={"model": "sim-model", "max_tokens": 2, "system": SYSTEM,
                                                      "messages": MSGS, "cache_salt": "tenant-x", "priority": 5})
            assert r.status_code == 200, r.text
            assert hits((await c.get(fleet[0].root + "/metrics")).text) > before
            r = await c.post(url + "/chat/completions", json={
                "model": "sim-model", "max_tokens": 2, "cache_salt": "tenant-x",
                "messages": [{"role": "system", "content": SYSTEM}, *MSGS]})
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the chat path honours it

            r = await c.post(url + "/messages", json={"model": "sim-model", "messages": MSGS})
            assert r.status_code == 400 and r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
            r = await c.post(url + "/messages", json={"model": "nope", "max_tokens": 2, "messages": MSGS})
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
            r = await c.post(url + "/messages", json={"model": "sim-model", "max_tokens": 2,
                                                      "messages": [{"role": "tool", "content": "x"}]})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
