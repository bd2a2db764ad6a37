"""Kind `sglang` through the dialect registry: what it serves, what it is sent (priority in SGLang's order, the
salt, LoRA as `<base>:<adapter>`), how its errors read, and that every "which kinds have telemetry" question is
answered by the registry. SGLang's shapes as read in SGLang 0.5.23 (entrypoints/openai/protocol.py ErrorResponse,
serving_base.py `_parse_model_parameter`, arg_groups/fields/schedule.py priority options)."""
from __future__ import annotations

import typing

import orjson
import pytest

from gateway.api.endpoints import BY_NAME
from gateway.config import ConfigError, parse_config
from gateway.pipeline import RequestContext
from gateway.proxy.dialects import DIALECTS, TELEMETRY_KINDS, dialect_for, publishes_kv_events, telemetry_form
from gateway.proxy.forward import client_error_body, exchange_for
from gateway.routing import engines, mode
from gateway.routing.plan import Candidate
from gateway.routing.prompt import lora_name

CFG = parse_config("""
backends:
  - {name: sgl, url: "http://127.0.0.1:9/v1", kind: sglang, models: [m, m-sql], priority_scheduling: true,
     model_map: {m-sql: "base-model:sql"}, lora_adapters: ["base-model:sql"]}
  - {name: sgl-low, url: "http://127.0.0.1:9/v1", kind: sglang, models: [m], priority_scheduling: true,
     priority_low_values_first: true}
  - {name: sgl-fifo, url: "http://127.0.0.1:9/v1", kind: sglang, models: [m]}
  - {name: eng, url: "http://127.0.0.1:9/v1", kind: vllm, models: [m], priority_scheduling: true}
""")


def ctx(endpoint: str, body: dict, **kw: typing.Any) -> RequestContext:
    c = RequestContext(request_id="r", endpoint=endpoint, headers={}, body=body)
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def sent(backend: str, c: RequestContext, model: str = "m") -> dict:
    cand = Candidate(CFG.backend(backend), model)
    ex = exchange_for(c, cand)
    assert ex is not None
    return orjson.loads(ex.body(c, cand))


def test_the_registry_answers_which_kinds_publish_telemetry():
    assert TELEMETRY_KINDS == {"vllm", "sim", "sglang"}
    assert engines.TELEMETRY_KINDS is TELEMETRY_KINDS and mode.MODELLED_KINDS is TELEMETRY_KINDS
    assert publishes_kv_events(CFG.backend("sgl")) and telemetry_form("sglang") == "sglang"
    assert telemetry_form("sim") == telemetry_form("vllm") == "vllm" and telemetry_form("openai") is None
    d = dialect_for("sglang")
    assert d.provider == "sglang" and d.kv_events and not d.kv_report_full
    assert mode.decide_mode(mode.Observed("sglang"), CFG.raw.routing.model_validity).reason == \
        "no telemetry service"  # a modelled kind: it gets as far as asking for its telemetry


def test_sglang_serves_openai_endpoints_but_not_vllms_score():
    d = dialect_for("sglang")
    assert {n for n, ep in BY_NAME.items() if d.serves(ep)} == \
        {"chat", "completions", "embeddings", "responses", "rerank", "tokenize", "messages"}


def test_priority_is_sent_in_sglangs_order_and_only_where_it_schedules_by_it():
    over = {"cache_salt": "s", "priority": 5}  # routing.priority_values: standard = 5, lower runs first (vLLM)
    body = sent("sgl", ctx("chat", {"model": "m", "messages": []}, body_overrides=dict(over)))
    assert body["priority"] == -5 and body["cache_salt"] == "s"  # SGLang runs higher values first
    assert sent("sgl-low", ctx("chat", {"model": "m", "messages": []}, body_overrides=dict(over)))["priority"] == 5
    assert "priority" not in sent("sgl-fifo", ctx("chat", {"model": "m", "messages": []}, body_overrides=dict(over)))
    assert sent("eng", ctx("chat", {"model": "m", "messages": []}, body_overrides=dict(over)))["priority"] == 5
    # realtime (0) still runs before batch (10): -0 > -10
    rt = sent("sgl", ctx("chat", {"model": "m", "messages": []}, body_overrides={"priority": 0}))["priority"]
    bt = sent("sgl", ctx("chat", {"model": "m", "messages": []}, body_overrides={"priority": 10}))["priority"]
    assert rt > bt
    # a client's own priority (no routing override) is not the gateway's to reorder
    assert sent("sgl", ctx("chat", {"model": "m", "messages": [], "priority": 7}))["priority"] == 7
    # nor does the vLLM-only report mode reach SGLang
    assert "vllm_xargs" not in sent("sgl", ctx("chat", {"model": "m", "messages": []}))


def test_messages_with_a_salt_or_priority_go_through_chat_as_for_vllm():
    body = sent("sgl", ctx("messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
                           body_overrides={"cache_salt": "s", "priority": 10}, evidence={}))
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["priority"] == -10


def test_lora_adapters_are_keyed_by_the_adapter_name_sglangs_events_carry():
    assert dialect_for("sglang").lora_key("base-model:sql") == "sql"
    assert dialect_for("sglang").lora_key("plain") == "plain"
    assert lora_name(Candidate(CFG.backend("sgl"), "m-sql")) == "sql"
    assert lora_name(Candidate(CFG.backend("sgl"), "m")) is None
    assert sent("sgl", ctx("chat", {"model": "m-sql", "messages": []}), "m-sql")["model"] == "base-model:sql"


def test_sglang_errors_read_from_its_top_level_error_response():
    d = dialect_for("sglang")
    legacy = orjson.dumps({"object": "error", "message": "Input length 9000 exceeds the context length 8192.",
                           "type": "BadRequestError", "param": "messages", "code": 400})
    assert d.error_message(400, legacy).startswith("Input length 9000")
    assert d.error_fields(legacy) == {"message": "Input length 9000 exceeds the context length 8192.",
                                      "type": "BadRequestError", "param": "messages", "code": 400}
    out = orjson.loads(client_error_body(400, legacy, d))["error"]
    assert out["message"].startswith("Input length 9000") and out["type"] == "BadRequestError"
    assert out["param"] == "messages" and out["code"] == "upstream_rejected"  # a numeric code is not passed on
    generate = orjson.dumps({"error": {"message": "bad sampling params"}})  # /generate's shape
    assert d.error_message(400, generate) == "bad sampling params"
    assert d.error_message(503, b"not json") == "upstream answered HTTP 503"
    assert 503 in d.retryable_statuses  # queue full / aborted by a higher priority: try the next candidate


def test_config_refuses_vllms_report_mode_for_sglang():
    with pytest.raises(ConfigError, match="kv_cache_report_mode: 'full' is vLLM's"):
        parse_config('backends: [{name: b, url: "http://x/v1", kind: sglang, models: [m], '
                     'kv_cache_report_mode: full}]')
    assert set(DIALECTS) >= TELEMETRY_KINDS
