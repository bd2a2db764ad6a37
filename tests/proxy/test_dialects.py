"""Backend dialects (gateway/proxy/dialects): one per config `kind`, what each sends upstream, and the
dispatcher skipping a backend whose kind cannot serve the request's endpoint."""
from __future__ import annotations

import typing

import orjson
import pytest

from gateway.api.endpoints import BY_NAME
from gateway.config import ConfigError, parse_config
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.proxy import dialects
from gateway.proxy.dialects import DIALECTS, Dialect, dialect_for, publishes_kv_events
from gateway.proxy.forward import Dispatcher, exchange_for
from gateway.proxy.health import Health
from gateway.routing.plan import Candidate, RoutePlan

CFG = parse_config("""
backends:
  - {name: eng, url: "http://127.0.0.1:9/v1", kind: vllm, models: [m]}
  - {name: partner, url: "http://127.0.0.1:9/v1", kind: openai, operator: partner, models: [m]}
""")


def ctx(endpoint: str, body: dict, **kw: typing.Any) -> RequestContext:
    c = RequestContext(request_id="r", endpoint=endpoint, headers={}, body=body)
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def test_every_configurable_kind_has_a_dialect() -> None:
    """The config takes exactly the registry's kinds (gateway/config.py checks `kind` against DIALECTS)."""
    for kind in DIALECTS:
        cfg = parse_config(f'backends: [{{name: b, url: "http://127.0.0.1:9/v1", kind: {kind}, models: [m]}}]')
        assert cfg.backend("b").kind == kind
    with pytest.raises(ConfigError, match=r"backends\[0\]\.kind: must be one of anthropic, openai, sglang, sim, vllm"):
        parse_config('backends: [{name: b, url: "http://127.0.0.1:9/v1", kind: tgi, models: [m]}]')
    assert publishes_kv_events(CFG.backend("eng")) and not publishes_kv_events(CFG.backend("partner"))


def test_vllm_serves_every_endpoint_natively_and_keeps_its_extensions() -> None:
    d = dialect_for("vllm")
    assert all(d.serves(ep) for ep in BY_NAME.values())
    c = ctx("chat", {"model": "m", "messages": [], "provider": {"zdr": True}}, stream=True, max_tokens=5,
            body_overrides={"cache_salt": "s", "priority": 3})
    body = orjson.loads(exchange_for(c, Candidate(CFG.backend("eng"), "m")).body(c, Candidate(CFG.backend("eng"), "m")))
    assert body["cache_salt"] == "s" and "provider" not in body and body["max_tokens"] == 5
    assert "priority" not in body  # the backend does not schedule by priority
    assert body["stream_options"] == {"include_usage": True}  # the OpenAI wire always asks for stream usage


def test_openai_partners_get_no_vllm_fields_and_the_cap_in_the_clients_field() -> None:
    c = ctx("chat", {"model": "m", "messages": [], "max_completion_tokens": 50}, max_tokens=7,
            body_overrides={"cache_salt": "s"})
    cand = Candidate(CFG.backend("partner"), "m")
    body = orjson.loads(exchange_for(c, cand).body(c, cand))
    assert "cache_salt" not in body and body["max_completion_tokens"] == 7 and "max_tokens" not in body
    e = ctx("embeddings", {"model": "m", "input": "x"}, max_tokens=7)
    assert "max_tokens" not in orjson.loads(exchange_for(e, cand).body(e, cand))  # embeddings generate nothing


class ChatOnly(Dialect):
    kind = "openai"
    native = frozenset({"chat"})


async def test_the_dispatcher_skips_a_backend_whose_kind_cannot_serve_the_endpoint(monkeypatch) -> None:
    monkeypatch.setitem(dialects.DIALECTS, "openai", ChatOnly())
    d = Dispatcher(lambda: None, Health(CFG), lambda c, cand: None)  # type: ignore[arg-type,return-value]
    c = ctx("embeddings", {"model": "m", "input": "x"}, model="m")
    c.route = RoutePlan(candidates=[Candidate(CFG.backend("partner"), "m")])
    with pytest.raises(GatewayError) as e:
        await d.open(c)
    assert e.value.code == "no_backend_available"
    assert c.attempts == [{"backend": "partner", "skipped": "kind openai does not serve /v1/embeddings"}]
