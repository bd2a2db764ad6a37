"""The simulator's /v1/responses, /v1/rerank and /v1/score (backends/sim/extra_api.py) over real sockets, in
vLLM's shapes: the response object and its typed stream with usage agreeing with the chat path's prompt,
incomplete at max_output_tokens, store false; rerank ordered by relevance with top_n; score pairs; usage as
input tokens; OpenAI-shaped errors."""
from __future__ import annotations

import json

import httpx

from backends.sim.fleet import start_fleet
from gateway.api.parse_responses import as_chat

INS = "You are a terse assistant. " * 10
Q = "Name three prime numbers."


def events(raw: str) -> list[tuple[str, dict]]:
    out = []
    for block in raw.strip().split("\n\n"):
        lines = block.split("\n")
        name = lines[0].removeprefix("event: ")
        data = json.loads(lines[1].removeprefix("data: "))
        assert data["type"] == name
        out.append((name, data))
    return out


async def test_responses_json_and_stream():
    async with start_fleet(1, profiles=["tiny"]) as fleet:
        url = fleet[0].url
        async with httpx.AsyncClient(timeout=10) as c:
            chat = await c.post(url + "/chat/completions", json={
                "model": "sim-model", "max_tokens": 5,
                "messages": [{"role": "system", "content": INS}, {"role": "user", "content": Q}]})
            prompt = chat.json()["usage"]["prompt_tokens"]
            r = await c.post(url + "/responses", json={"model": "sim-model", "instructions": INS, "input": Q,
                                                       "max_output_tokens": 5})
            assert r.status_code == 200, r.text
            o = r.json()
            assert o["object"] == "response" and o["id"].startswith("resp_") and o["store"] is False
            assert o["status"] == "incomplete" and o["incomplete_details"] == {"reason": "max_output_tokens"}
            assert o["output"][0]["type"] == "message" and o["output"][0]["content"][0]["text"]
            u = o["usage"]
            assert u["input_tokens"] == prompt and u["output_tokens"] == 5 and u["total_tokens"] == prompt + 5
            assert u["input_tokens_details"]["cached_tokens"] > 0  # the chat warmed the same prefix
            # items render the same prompt as the string
            r = await c.post(url + "/responses", json={"model": "sim-model", "instructions": INS, "max_output_tokens": 2,
                                                       "input": [{"role": "user", "content": [
                                                           {"type": "input_text", "text": Q}]}]})
            assert r.json()["usage"]["input_tokens"] == prompt
            # the chat view routing tokenizes (gateway/api/parse_responses.as_chat) counts what the engine counts
            view = as_chat({"model": "sim-model", "instructions": INS, "input": [
                {"role": "user", "content": [{"type": "input_text", "text": Q}]}]})
            tok = await c.post(url.removesuffix("/v1") + "/tokenize", json=view)
            assert tok.json()["count"] == prompt
            r = await c.post(url + "/responses", json={"model": "sim-model", "input": Q, "max_output_tokens": 6,
                                                       "stream": True})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            evs = events(r.text)
            names = [n for n, _ in evs]
            assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                                 "response.content_part.added"]
            assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                                  "response.output_item.done", "response.incomplete"]
            assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
            text = "".join(d["delta"] for n, d in evs if n == "response.output_text.delta")
            final = evs[-1][1]["response"]
            assert text and text == evs[-4][1]["text"] == final["output"][0]["content"][0]["text"]
            assert final["usage"]["output_tokens"] == 6 and final["id"] == evs[0][1]["response"]["id"]
            r = await c.post(url + "/responses", json={"model": "sim-model", "input": "hi", "stream": True})
            assert events(r.text)[-1][0] == "response.completed"  # a natural stop

            r = await c.post(url + "/responses", json={"model": "sim-model", "input": 3})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input"
            r = await c.post(url + "/responses", json={"model": "sim-model", "input": "x",
                                                       "previous_response_id": "resp_x"})
            assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


async def test_rerank_and_score():
    async with start_fleet(1, profiles=["tiny"]) as fleet:
        url = fleet[0].url
        async with httpx.AsyncClient(timeout=10) as c:
            tok = (await c.post(fleet[0].url.removesuffix("/v1") + "/tokenize",
                                json={"model": "sim-model", "prompt": "capital of france"})).json()["count"]
            docs = ["bananas are yellow", "paris is the capital of france", "the capital city"]
            r = await c.post(url + "/rerank", json={"model": "sim-model", "query": "capital of france",
                                                    "documents": docs, "top_n": 2})
            assert r.status_code == 200, r.text
            o = r.json()
            assert [x["index"] for x in o["results"]] == [1, 2]
            assert o["results"][0]["relevance_score"] > o["results"][1]["relevance_score"]
            assert o["results"][0]["document"] == {"text": docs[1]}
            assert o["usage"]["prompt_tokens"] == o["usage"]["total_tokens"] > 3 * (tok + 3)  # query once per doc
            r = await c.post(url + "/score", json={"model": "sim-model", "text_1": "capital of france",
                                                   "text_2": docs})
            s = r.json()
            assert r.status_code == 200 and [d["index"] for d in s["data"]] == [0, 1, 2]
            assert s["data"][1]["score"] == max(d["score"] for d in s["data"])
            assert s["usage"]["prompt_tokens"] == o["usage"]["prompt_tokens"] and s["usage"]["completion_tokens"] == 0
            r = await c.post(url + "/score", json={"model": "sim-model", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "text_1"
            r = await c.post(url + "/rerank", json={"model": "sim-model", "query": "q", "documents": []})
            assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
