"""Parse and validate vLLM's pooling and tokenizer APIs (pure): `POST /v1/rerank`, `POST /v1/score` and
`POST /tokenize`. None generates tokens; budgets are charged on the input tokens the engine counts.

Sizes (`Parsed.prompt_chars`) count what the engine tokenizes: rerank and score run the model once per
(query, document) / (text_1, text_2) pair, so the query is counted once per document, plus 16 characters per
pair for the pair's special tokens, so the budget reservation's upper bound holds for many short documents.
"""
from __future__ import annotations

from typing import Any

from gateway.api.parse import Parsed, _content_chars, _model, _opt_int, _type_error
from gateway.errors import bad_request
from gateway.telemetry.render import render_messages_plain

PAIR_OVERHEAD_CHARS = 16  # per (query, document) pair: the special tokens of the pair's template
MAX_PAIRS = 4096


def _no_stream(body: dict[str, Any], api: str) -> None:
    if body.get("stream"):
        raise bad_request(f"{api} does not support streaming.", param="stream", code="invalid_value")


def _required(body: dict[str, Any], name: str) -> Any:
    if name not in body:
        raise bad_request(f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
    return body[name]


def _texts(v: Any, param: str) -> list[str]:
    """A string or a non-empty array of strings, as a list."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        return v
    if isinstance(v, list) and not v:
        raise bad_request(f"'{param}' must not be empty.", param=param, code="invalid_value")
    raise _type_error(param, "a string or a non-empty array of strings", v)


def _pairs_chars(left: list[str], right: list[str], param: str) -> int:
    if len(left) != 1 and len(left) != len(right):
        raise bad_request(f"'{param}' must have one entry or as many entries as the other side "
                          f"({len(left)} vs {len(right)}).", param=param, code="invalid_value")
    n = max(len(left), len(right))
    if n > MAX_PAIRS:
        raise bad_request(f"At most {MAX_PAIRS} pairs per request, got {n}.", param=param, code="invalid_value")
    if len(left) == 1:
        return sum(len(left[0]) + len(r) + PAIR_OVERHEAD_CHARS for r in right)
    return sum(len(a) + len(b) + PAIR_OVERHEAD_CHARS for a, b in zip(left, right))


def parse_rerank(body: dict[str, Any]) -> Parsed:
    """vLLM's (Jina/Cohere-style) rerank: {model, query, documents, top_n?, return_documents?}."""
    model = _model(body)
    query = _required(body, "query")
    if not isinstance(query, str):
        raise _type_error("query", "a string", query)
    docs = _required(body, "documents")
    if not isinstance(docs, list):
        raise _type_error("documents", "an array of strings", docs)
    if not docs:
        raise bad_request("'documents' must contain at least one document.", param="documents", code="invalid_value")
    for i, d in enumerate(docs):
        if not isinstance(d, str):
            raise _type_error(f"documents[{i}]", "a string", d)
    _opt_int(body, "top_n", 0)
    rd = body.get("return_documents")
    if rd is not None and not isinstance(rd, bool):
        raise _type_error("return_documents", "a boolean", rd)
    _no_stream(body, "Rerank")
    return Parsed(model, False, False, None, _pairs_chars([query], docs, "documents"))


def parse_score(body: dict[str, Any]) -> Parsed:
    """vLLM's score: {model, text_1, text_2}, each a string or an array of strings (1:N or N:N pairs)."""
    model = _model(body)
    left = _texts(_required(body, "text_1"), "text_1")
    right = _texts(_required(body, "text_2"), "text_2")
    _no_stream(body, "Score")
    return Parsed(model, False, False, None, _pairs_chars(left, right, "text_1"))


def parse_tokenize(body: dict[str, Any]) -> Parsed:
    """vLLM's /tokenize: {model, prompt} or {model, messages} (a chat rendered with its template)."""
    model = _model(body)
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("Exactly one of 'prompt' or 'messages' is required.", param="prompt",
                          code="missing_required_parameter" if "prompt" not in body else "invalid_value")
    if "prompt" in body:
        p = body["prompt"]
        if not isinstance(p, str):
            raise _type_error("prompt", "a string", p)
        chars = len(p)
    else:
        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise _type_error("messages", "a non-empty array", msgs)
        chars = 0
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise _type_error(f"messages[{i}]", "an object", m)
            if not isinstance(m.get("role"), str):
                raise bad_request(f"Missing or invalid 'messages[{i}].role'.", param=f"messages[{i}].role",
                                  code="invalid_value")
            chars += _content_chars(m.get("content"), f"messages[{i}].content") + 4
    for flag in ("add_generation_prompt", "add_special_tokens", "return_token_strs", "continue_final_message"):
        v = body.get(flag)
        if v is not None and not isinstance(v, bool):
            raise _type_error(flag, "a boolean", v)
    return Parsed(model, False, False, None, chars)


def rerank_text(body: dict[str, Any]) -> str:
    q = body.get("query")
    docs = body.get("documents")
    head = q if isinstance(q, str) else ""
    return head + "".join(d for d in docs if isinstance(d, str)) if isinstance(docs, list) else head


def score_text(body: dict[str, Any]) -> str:
    parts = []
    for k in ("text_1", "text_2"):
        v = body.get(k)
        parts += [v] if isinstance(v, str) else [x for x in v if isinstance(x, str)] if isinstance(v, list) else []
    return "".join(parts)


def tokenize_text(body: dict[str, Any]) -> str:
    msgs = body.get("messages")
    if isinstance(msgs, list):
        return render_messages_plain([m for m in msgs if isinstance(m, dict)])
    p = body.get("prompt")
    return p if isinstance(p, str) else ""
