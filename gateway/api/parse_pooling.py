"""Parse and validate vLLM's pooling and tokenizer APIs (pure): `POST /v1/rerank`, `POST /v1/score` and
`POST /tokenize`. None generates tokens; budgets are charged on the input tokens the engine counts.

Sizes (`Parsed.prompt_chars`) count what the engine tokenizes: rerank and score run the model once per
(query, document) / (text_1, text_2) pair, so the query is counted once per document, plus 16 characters per
pair for the pair's special tokens, so the budget reservation's upper bound holds for many short documents.
"""
from __future__ import annotations

from typing import Any

from gateway.api.bodies import RerankRequest, ScoreRequest, TokenizeRequest
from gateway.api.parse import CHAT_RULES, Parsed, messages_chars
from gateway.api.validate import Rules, validate
from gateway.errors import bad_request
from gateway.telemetry.render import render_messages_plain

PAIR_OVERHEAD_CHARS = 16  # per (query, document) pair: the special tokens of the pair's template
MAX_PAIRS = 4096


def _no_stream(body: dict[str, Any], api: str) -> None:
    if body.get("stream"):
        raise bad_request(f"{api} does not support streaming.", param="stream", code="invalid_value")


def _texts(v: str | list[str]) -> list[str]:
    return [v] if isinstance(v, str) else v


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


def _rerank_rules(body: dict[str, Any], param: str) -> int:
    _no_stream(body, "Rerank")
    return _pairs_chars([body["query"]], body["documents"], "documents")


def _score_rules(body: dict[str, Any], param: str) -> int:
    _no_stream(body, "Score")
    return _pairs_chars(_texts(body["text_1"]), _texts(body["text_2"]), "text_1")


def _one_of_prompt_or_messages(body: dict[str, Any], param: str) -> None:
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("Exactly one of 'prompt' or 'messages' is required.", param="prompt",
                          code="missing_required_parameter" if "prompt" not in body else "invalid_value")


RERANK_RULES: Rules = {RerankRequest: {"return_documents": _rerank_rules}}
SCORE_RULES: Rules = {ScoreRequest: {"text_2": _score_rules}}
TOKENIZE_RULES: Rules = {**CHAT_RULES, TokenizeRequest: {"model": _one_of_prompt_or_messages}}


def parse_rerank(body: dict[str, Any]) -> Parsed:
    """vLLM's (Jina/Cohere-style) rerank: {model, query, documents, top_n?, return_documents?}."""
    req = validate(body, RerankRequest, RERANK_RULES)
    return Parsed(req.model, False, False, None, _rerank_rules(body, ""))


def parse_score(body: dict[str, Any]) -> Parsed:
    """vLLM's score: {model, text_1, text_2}, each a string or an array of strings (1:N or N:N pairs)."""
    req = validate(body, ScoreRequest, SCORE_RULES)
    return Parsed(req.model, False, False, None, _score_rules(body, ""))


def parse_tokenize(body: dict[str, Any]) -> Parsed:
    """vLLM's /tokenize: {model, prompt} or {model, messages} (a chat rendered with its template)."""
    req = validate(body, TokenizeRequest, TOKENIZE_RULES)
    _one_of_prompt_or_messages(body, "")
    chars = len(req.prompt) if isinstance(req.prompt, str) else messages_chars(body["messages"])
    return Parsed(req.model, False, False, None, chars)


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
