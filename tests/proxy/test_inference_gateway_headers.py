"""`inference_gateway: true` backends (a Gateway API Inference Extension / llm-d gateway upstream) are told the
request's fair-queue flow, its policy priority and its policy TTFT target in the EPP's headers, in llm-d's and
GIE's spellings (or the one `inference_gateway_headers` names); every other backend is told none of them, and no
backend ever gets a client's own copy. End to end: a real gateway in front of a real HTTP upstream that records
the headers it received."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from gateway.app import Gateway, build_app
from gateway.config import parse_config
from gateway.pipeline import RequestContext
from gateway.proxy.forward import EPP_HEADERS, FAIRNESS_ID_HEADER, OBJECTIVE_HEADER, inference_gateway_headers
from gateway.types import Decision, Principal
from gateway.wiring import wire
from tests.support.procs import start_upstream

KEY = "sk-gie-test-key"
POLICY = """
rules:
  - id: team-a-share
    match: {tenant: acme, team: a}
    set: {share: 3, priority: realtime, ttft_slo_ms: 750.4}
"""
LLMD = ("x-llm-d-inference-fairness-id", "x-llm-d-inference-objective", "x-llm-d-slo-ttft-ms", "x-llm-d-slo-tpot-ms")
GIE = (FAIRNESS_ID_HEADER, OBJECTIVE_HEADER, "x-slo-ttft-ms", "x-slo-tpot-ms")
# what a client sends to pick its own flow, objective, latency targets or model upstream: never forwarded as sent
SPOOFED = {h: "spoofed" for h in (*LLMD, *GIE, "x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite")}


async def test_an_inference_gateway_backend_gets_the_flow_objective_and_target_and_others_do_not(
        tmp_path: Path) -> None:
    up, port = start_upstream(tmp_path)
    (tmp_path / "p.yaml").write_text(POLICY)
    url = f"http://127.0.0.1:{port}/v1"
    no_health = {"enabled": False}
    raw = {"backends": [{"name": "gie", "kind": "openai", "url": url, "models": ["m-gie"], "inference_gateway": True,
                         "health": no_health},
                        {"name": "llmd-only", "kind": "openai", "url": url, "models": ["m-llmd"],
                         "inference_gateway": True, "inference_gateway_headers": "llm-d", "health": no_health},
                        {"name": "gie-only", "kind": "openai", "url": url, "models": ["m-gie-only"],
                         "inference_gateway": True, "inference_gateway_headers": "gie", "health": no_health},
                        {"name": "plain", "kind": "openai", "url": url, "models": ["m-plain"],
                         "health": no_health}],
           "keys": [{"key": KEY, "tenant": "acme", "team": "a"}, {"key": KEY + "-b", "tenant": "acme", "team": "b"}],
           "policy": {"files": [str(tmp_path / "p.yaml")], "audit_path": str(tmp_path / "a.jsonl")},
           "identity": {"sqlite_path": str(tmp_path / "i.db")}, "budgets": {"sqlite_path": str(tmp_path / "b.db")},
           "data_dir": str(tmp_path)}
    gw = Gateway(parse_config(yaml.safe_dump(raw), base_dir=tmp_path))
    wire(gw)
    app = build_app(gw)
    await gw.start()
    seen: dict[tuple[str, str], dict[str, str]] = {}
    models = ("m-gie", "m-llmd", "m-gie-only", "m-plain")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            for key in (KEY, KEY + "-b"):
                for model in models:
                    r = await c.post("/v1/chat/completions", headers={
                        "authorization": f"Bearer {key}", **SPOOFED,
                        "x-ttft-slo-ms": "20"},  # the gateway's own target header: judged here, never sent on
                        json={"model": model, "messages": [{"role": "user", "content": "x"}]})
                    assert r.status_code == 200, r.text
                    seen[key, model] = httpx.get(f"http://127.0.0.1:{port}/stats").json()["last_headers"]
    finally:
        await gw.close()
        up.stop()
    # team a's share rule names team a's flow, its priority and its TTFT target (whole ms), in both spellings
    a = seen[KEY, "m-gie"]
    for fair, obj, ttft, tpot in (LLMD, GIE):
        assert (a[fair], a[obj], a[ttft]) == ("acme/a", "realtime", "750"), a
        assert tpot not in a  # policy has no TPOT target
    # team b has no rule: its flow is the tenant, the default objective, and no target is sent
    b = seen[KEY + "-b", "m-gie"]
    for fair, obj, ttft, tpot in (LLMD, GIE):
        assert (b[fair], b[obj]) == ("acme", "standard") and ttft not in b and tpot not in b, b
    # one spelling when the backend names one; the other spelling's headers are not sent, not even the client's
    for key, flow in ((KEY, "acme/a"), (KEY + "-b", "acme")):
        only_llmd, only_gie = seen[key, "m-llmd"], seen[key, "m-gie-only"]
        assert only_llmd[LLMD[0]] == flow and not any(h in only_llmd for h in GIE), only_llmd
        assert only_gie[GIE[0]] == flow and not any(h in only_gie for h in LLMD), only_gie
    assert seen[KEY, "m-llmd"]["x-llm-d-slo-ttft-ms"] == "750" and seen[KEY, "m-gie-only"]["x-slo-ttft-ms"] == "750"
    # no backend ever gets a client's copy: the plain one gets none of them, the others only the gateway's values
    for (key, model), h in seen.items():
        assert "spoofed" not in h.values(), (key, model, h)
        assert "x-llm-d-model-name-rewrite" not in h and "x-gateway-model-name-rewrite" not in h
        assert "x-ttft-slo-ms" not in h
    for key in (KEY, KEY + "-b"):
        assert not EPP_HEADERS & set(seen[key, "m-plain"]), seen[key, "m-plain"]


def test_a_traced_request_keeps_its_trace_context_but_never_an_epp_header(tmp_path: Path) -> None:
    """ctx.upstream_headers carries what the gateway adds (the trace context): an EPP header put there by any
    stage is dropped, so only inference_gateway_headers decides what an endpoint picker reads."""
    from gateway.proxy.forward import Dispatcher

    raw = {"backends": [{"name": "plain", "kind": "openai", "url": "http://127.0.0.1:9/v1", "models": ["m"],
                         "health": {"enabled": False}},
                        {"name": "ig", "kind": "openai", "url": "http://127.0.0.1:9/v1", "models": ["m"],
                         "inference_gateway": True, "inference_gateway_headers": "llm-d",
                         "health": {"enabled": False}}],
           "identity": {"sqlite_path": str(tmp_path / "i.db")}, "budgets": {"sqlite_path": str(tmp_path / "b.db")},
           "data_dir": str(tmp_path)}
    gw = Gateway(parse_config(yaml.safe_dump(raw), base_dir=tmp_path))
    disp: Dispatcher = gw.dispatcher
    ctx = RequestContext(request_id="r1", endpoint="chat", headers={}, body={})
    ctx.principal = Principal(id="k", kind="api_key", tenant="t")
    ctx.decision = Decision(priority="batch", ttft_slo_ms=2000.0)
    ctx.upstream_headers.update({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", **SPOOFED})
    from gateway.proxy.dialects import dialect_for
    from gateway.routing.plan import Candidate

    by_name = {b.name: b for b in gw.config.raw.backends}
    plain = disp._headers(ctx, Candidate(by_name["plain"], "m"), dialect_for("openai"))
    ig = disp._headers(ctx, Candidate(by_name["ig"], "m"), dialect_for("openai"))
    assert plain["traceparent"].startswith("00-1111") and not EPP_HEADERS & set(plain)
    assert {h: ig[h] for h in EPP_HEADERS & set(ig)} == {
        "x-llm-d-inference-fairness-id": "t", "x-llm-d-inference-objective": "batch", "x-llm-d-slo-ttft-ms": "2000"}


def test_the_headers_without_a_decision_or_principal() -> None:
    c = RequestContext(request_id="r", endpoint="chat", headers={}, body={})
    assert inference_gateway_headers(c, "gie") == {FAIRNESS_ID_HEADER: "anonymous", OBJECTIVE_HEADER: "standard"}
    assert inference_gateway_headers(c) == {FAIRNESS_ID_HEADER: "anonymous", OBJECTIVE_HEADER: "standard",
                                            LLMD[0]: "anonymous", LLMD[1]: "standard"}
    c.principal = Principal(id="k", kind="api_key", tenant="t", team="x", key_id="k1")
    c.decision = Decision(priority="batch", share=2.0, share_scope="key", ttft_slo_ms=0.2)
    assert inference_gateway_headers(c, "llm-d") == {LLMD[0]: "key:k1", LLMD[1]: "batch", LLMD[2]: "1"}


def test_an_unknown_spelling_is_a_config_error_naming_the_key() -> None:
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match="inference_gateway_headers"):
        parse_config(yaml.safe_dump({"backends": [{"name": "x", "url": "http://127.0.0.1:9/v1", "models": ["m"],
                                                   "inference_gateway": True,
                                                   "inference_gateway_headers": "x-llm-d"}]}))
