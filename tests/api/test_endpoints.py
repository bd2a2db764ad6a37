"""The endpoint table (gateway/api/endpoints.py): one entry per inference API, served by the app at its path,
and the facts stages read from it instead of comparing endpoint names."""
from __future__ import annotations

import pathlib
import re

import orjson

from gateway.api.endpoints import BY_NAME, BY_PATH, ENDPOINTS, prepare
from gateway.api.ingress import InferenceEndpoint
from gateway.app import Gateway, build_app
from gateway.config import parse_config
from gateway.pipeline import RequestContext

CFG = """
backends:
  - {name: e0, url: "http://127.0.0.1:9/v1", kind: vllm, models: [m]}
"""


def test_names_and_paths_are_unique_and_every_entry_is_complete() -> None:
    assert len(BY_NAME) == len(ENDPOINTS) and len(BY_PATH) == len(ENDPOINTS)
    for ep in ENDPOINTS:
        assert ep.path.startswith("/") and ep.upstream_path, ep.name  # a leading "/": relative to the server root
        assert callable(ep.parse) and callable(ep.prompt_text) and ep.operation and ep.prompt_param
        assert ep.wire is not None
        if ep.default_max_tokens is not None:
            assert ep.generates, f"{ep.name}: a default completion length on an endpoint that generates nothing"


def test_the_app_serves_exactly_the_table_on_the_data_plane() -> None:
    app = build_app(Gateway(parse_config(CFG)))
    served = {path: ep for path, ep in app._data_plane.items()}
    assert set(served) == set(BY_PATH)
    assert all(isinstance(ep, InferenceEndpoint) and ep.ep is BY_PATH[p] for p, ep in served.items())


def test_generation_facts_per_entry() -> None:
    chat, completions, embeddings = BY_NAME["chat"], BY_NAME["completions"], BY_NAME["embeddings"]
    assert chat.implied_max_tokens(None) is None and chat.implied_max_tokens(7) == 7
    assert completions.implied_max_tokens(None) == 16  # OpenAI's and vLLM's default for /v1/completions
    assert not embeddings.generates and embeddings.prompt_param == "input"
    # chat caps go into the field the client used
    assert chat.max_tokens_key({"max_completion_tokens": 3}) == "max_completion_tokens"
    assert chat.max_tokens_key({}) == "max_tokens"


def test_prepare_fills_the_context_from_the_parsed_body() -> None:
    cfg = parse_config(CFG)
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 9}
    c = RequestContext(request_id="r", endpoint="chat", headers={}, body=body)
    raw = orjson.dumps(body)
    prepare(c, BY_NAME["chat"].parse(body), raw, cfg)
    assert (c.model, c.stream, c.client_wants_usage, c.max_tokens) == ("m", True, True, 9)
    assert c.model_chain == ("m",) and c.prompt_tokens_max >= c.prompt_tokens_est >= 1
    assert c.ep is BY_NAME["chat"]


def test_no_stage_compares_endpoint_names() -> None:
    """Endpoint-specific behaviour lives in the table: a new endpoint must not need `ctx.endpoint ==` branches."""
    root = pathlib.Path(__file__).resolve().parents[2] / "gateway"
    pat = re.compile(r"ctx\.endpoint\s*(==|!=|in\b|not in\b)")
    hits = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line)]
    assert hits == []
