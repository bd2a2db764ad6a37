"""Request-body validation cost per endpoint: each endpoint's parser (`Endpoint.parse`, gateway/api/endpoints.py)
timed over typical bodies, already decoded (the JSON decode is the same for every parser and timed apart).

    .venv/bin/python bench/parse_cost.py [--repeat 7] [--number 20000]

Prints microseconds per call (the best of `--repeat` runs of `--number` calls: the least disturbed by the other
work on the box), so a before/after comparison runs this at both commits on the same machine.
"""
from __future__ import annotations

import argparse
import timeit

import orjson

from gateway.api.endpoints import BY_NAME
from gateway.api.media import Upload

_TURNS = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
          {"role": "user", "content": "What is the capital of France? " * 4},
          {"role": "assistant", "content": "Paris."},
          {"role": "user", "content": "And of Germany?"}]

BODIES: list[tuple[str, str, dict]] = [
    ("chat", "chat, 4 string turns", {"model": "m", "messages": _TURNS, "temperature": 0.7, "max_tokens": 64,
                                      "stream": True, "stream_options": {"include_usage": True}}),
    ("chat", "chat, 1 turn", {"model": "m", "messages": [{"role": "user", "content": "hello"}]}),
    ("chat", "chat, content parts", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                     {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}],
        "max_completion_tokens": 32}),
    ("chat", "chat, 40 turns", {"model": "m", "messages": _TURNS * 10, "top_p": 0.9, "n": 1, "stop": ["\n"]}),
    ("completions", "completions", {"model": "m", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}),
    ("embeddings", "embeddings, 8 strings", {"model": "m", "input": ["some text to embed"] * 8,
                                             "encoding_format": "float"}),
    ("responses", "responses, string input", {"model": "m", "input": "hello", "instructions": "be brief",
                                              "max_output_tokens": 64, "temperature": 0.5}),
    ("responses", "responses, items", {"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "2+2?"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{\"a\":2}"},
        {"type": "function_call_output", "call_id": "c1", "output": "4"}],
        "tools": [{"type": "function", "name": "add", "parameters": {}}], "stream": True}),
    ("messages", "messages, 4 turns", {"model": "m", "max_tokens": 64, "system": "Be brief.",
                                       "messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": [{"type": "text", "text": "hey"}]},
                                                    {"role": "user", "content": "2+2?"}],
                                       "temperature": 0.5, "stream": True}),
    ("rerank", "rerank, 8 documents", {"model": "m", "query": "capital of france", "documents": ["paris"] * 8,
                                       "top_n": 3}),
    ("score", "score", {"model": "m", "text_1": "a", "text_2": ["b", "c"]}),
    ("tokenize", "tokenize, messages", {"model": "m", "messages": _TURNS}),
    ("transcriptions", "transcriptions", {"model": "w", "file": Upload("a.wav", "audio/wav", b"RIFF" * 64),
                                          "language": "en", "temperature": "0.2", "response_format": "json"}),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--number", type=int, default=20000)
    a = ap.parse_args()
    print(f"{'body':28s} {'parse us':>9s}")
    for name, label, body in BODIES:
        parse = BY_NAME[name].parse
        parse(body)  # valid: a bench of the accept path
        best = min(timeit.repeat(lambda: parse(body), repeat=a.repeat, number=a.number)) / a.number
        print(f"{label:28s} {best * 1e6:9.2f}")
    raw = orjson.dumps(BODIES[0][2])
    best = min(timeit.repeat(lambda: orjson.loads(raw), repeat=a.repeat, number=a.number)) / a.number
    print(f"{'(orjson.loads, chat 4 turns)':28s} {best * 1e6:9.2f}")


if __name__ == "__main__":
    main()
