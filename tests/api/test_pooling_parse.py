"""The rerank / score / tokenize parsers and the pooling wire (gateway/api/parse_pooling.py,
gateway/api/wire/pooling.py): sizes count every (query, document) pair, so the budget's upper bound holds;
bad inputs are 400s naming the param; usage is input tokens only."""
from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.endpoints import BY_NAME, BY_PATH, prompt_token_bound
from gateway.api.parse import decode_json
from gateway.api.parse_pooling import PAIR_OVERHEAD_CHARS, parse_rerank, parse_score, parse_tokenize
from gateway.api.wire.pooling import POOLING
from gateway.errors import GatewayError


def test_rerank_counts_the_query_once_per_document():
    p = parse_rerank({"model": "m", "query": "abc", "documents": ["de", "fghi"], "top_n": 1})
    assert (p.model, p.stream, p.max_tokens) == ("m", False, None)
    assert p.prompt_chars == (3 + 2 + PAIR_OVERHEAD_CHARS) + (3 + 4 + PAIR_OVERHEAD_CHARS)


def test_score_one_to_many_and_many_to_many():
    assert parse_score({"model": "m", "text_1": "ab", "text_2": ["c", "d"]}).prompt_chars == 2 * (3 + 16)
    assert parse_score({"model": "m", "text_1": ["ab", "c"], "text_2": ["d", "ef"]}).prompt_chars == 2 * (3 + 16)
    assert parse_score({"model": "m", "text_1": "a", "text_2": "b"}).prompt_chars == 2 + 16


def test_tokenize_prompt_or_messages():
    assert parse_tokenize({"model": "m", "prompt": "hello"}).prompt_chars == 5
    assert parse_tokenize({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                           "add_generation_prompt": True}).prompt_chars == 2 + 4


@pytest.mark.parametrize("fn,body,param", [
    (parse_rerank, {"model": "m", "documents": ["a"]}, "query"),
    (parse_rerank, {"model": "m", "query": 1, "documents": ["a"]}, "query"),
    (parse_rerank, {"model": "m", "query": "q"}, "documents"),
    (parse_rerank, {"model": "m", "query": "q", "documents": "a"}, "documents"),
    (parse_rerank, {"model": "m", "query": "q", "documents": []}, "documents"),
    (parse_rerank, {"model": "m", "query": "q", "documents": ["a", None]}, "documents[1]"),
    (parse_rerank, {"model": "m", "query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    (parse_rerank, {"model": "m", "query": "q", "documents": ["a"], "return_documents": 1}, "return_documents"),
    (parse_rerank, {"model": "m", "query": "q", "documents": ["a"], "stream": True}, "stream"),
    (parse_rerank, {"query": "q", "documents": ["a"]}, "model"),
    (parse_score, {"model": "m", "text_2": "b"}, "text_1"),
    (parse_score, {"model": "m", "text_1": "a"}, "text_2"),
    (parse_score, {"model": "m", "text_1": [], "text_2": "b"}, "text_1"),
    (parse_score, {"model": "m", "text_1": "a", "text_2": [1]}, "text_2"),
    (parse_score, {"model": "m", "text_1": ["a", "b"], "text_2": ["c"]}, "text_1"),
    (parse_score, {"model": "m", "text_1": "a", "text_2": ["b"] * 5000}, "text_1"),
    (parse_tokenize, {"model": "m"}, "prompt"),
    (parse_tokenize, {"model": "m", "prompt": "a", "messages": []}, "prompt"),
    (parse_tokenize, {"model": "m", "prompt": 5}, "prompt"),
    (parse_tokenize, {"model": "m", "messages": []}, "messages"),
    (parse_tokenize, {"model": "m", "messages": ["x"]}, "messages[0]"),
    (parse_tokenize, {"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    (parse_tokenize, {"model": "m", "prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
])
def test_bad_inputs_name_the_param(fn, body, param):
    with pytest.raises(GatewayError) as e:
        fn(body)
    assert e.value.status == 400 and e.value.param == param


@settings(max_examples=200, deadline=None)
@given(query=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
       docs=st.lists(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
                     min_size=1, max_size=20))
def test_rerank_reservation_bound_covers_pair_tokens(query, docs):
    """The budget's upper bound is at least what a cross-encoder counts for ASCII text: one token per byte of
    query and document at most, plus the pair's special tokens, for every pair."""
    body = {"model": "m", "query": query, "documents": docs}
    raw = orjson.dumps(body)
    p = parse_rerank(decode_json(raw))
    worst = sum(len(query) + len(d) + 4 for d in docs)  # byte-level BPE: <= 1 token/byte, + [CLS] [SEP] [SEP] ...
    assert prompt_token_bound(raw, body, p.prompt_chars) >= worst


def test_pooling_wire_usage():
    assert POOLING.usage({"usage": {"prompt_tokens": 9, "total_tokens": 9, "completion_tokens": 0}}).prompt_tokens == 9
    u = POOLING.usage({"usage": {"total_tokens": 7}})  # rerank's {"total_tokens"} usage
    assert (u.prompt_tokens, u.completion_tokens) == (7, 0)
    assert POOLING.usage({"count": 4, "tokens": [1, 2, 3, 4], "max_model_len": 9}).prompt_tokens == 4
    assert POOLING.usage({"results": []}) is None and POOLING.usage([1]) is None


def test_table_entries():
    assert BY_PATH["/tokenize"].upstream_path == "/tokenize"  # vLLM's server root, not under /v1
    for name, cap in (("rerank", "rerank"), ("score", "score"), ("tokenize", None), ("embeddings", "embeddings"),
                      ("responses", None)):
        ep = BY_NAME[name]
        assert ep.capability == cap
    for name in ("rerank", "score", "tokenize"):
        assert not BY_NAME[name].generates and BY_NAME[name].wire is POOLING
    assert BY_NAME["responses"].max_tokens_key({}) == "max_output_tokens"
