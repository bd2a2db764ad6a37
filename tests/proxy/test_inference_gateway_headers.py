"""`inference_gateway: true` backends (a Gateway API Inference Extension / llm-d gateway upstream) are told the
request's fair-queue flow and its policy priority in the EPP's headers; every other backend is told neither.
End to end: a real gateway in front of a real HTTP upstream that records the headers it received."""
from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from gateway.app import Gateway, build_app
from gateway.config import parse_config
from gateway.pipeline import RequestContext
from gateway.proxy.forward import FAIRNESS_ID_HEADER, OBJECTIVE_HEADER, inference_gateway_headers
from gateway.types import Decision, Principal
from gateway.wiring import wire
from tests.support.procs import start_upstream

KEY = "sk-gie-test-key"
POLICY = """
rules:
  - id: team-a-share
    match: {tenant: acme, team: a}
    set: {share: 3, priority: realtime}
"""


async def test_an_inference_gateway_backend_gets_the_flow_and_objective_and_others_do_not(tmp_path: Path) -> None:
    up, port = start_upstream(tmp_path)
    (tmp_path / "p.yaml").write_text(POLICY)
    url = f"http://127.0.0.1:{port}/v1"
    raw = {"backends": [{"name": "gie", "kind": "openai", "url": url, "models": ["m-gie"], "inference_gateway": True,
                         "health": {"enabled": False}},
                        {"name": "plain", "kind": "openai", "url": url, "models": ["m-plain"],
                         "health": {"enabled": False}}],
           "keys": [{"key": KEY, "tenant": "acme", "team": "a"}, {"key": KEY + "-b", "tenant": "acme", "team": "b"}],
           "policy": {"files": [str(tmp_path / "p.yaml")], "audit_path": str(tmp_path / "a.jsonl")},
           "identity": {"sqlite_path": str(tmp_path / "i.db")}, "budgets": {"sqlite_path": str(tmp_path / "b.db")},
           "data_dir": str(tmp_path)}
    gw = Gateway(parse_config(yaml.safe_dump(raw), base_dir=tmp_path))
    wire(gw)
    app = build_app(gw)
    await gw.start()
    seen: dict[tuple[str, str], dict[str, str]] = {}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            for key in (KEY, KEY + "-b"):
                for model in ("m-gie", "m-plain"):
                    r = await c.post("/v1/chat/completions", headers={
                        "authorization": f"Bearer {key}",
                        # a client cannot pick its own flow or objective upstream
                        FAIRNESS_ID_HEADER: "spoofed", OBJECTIVE_HEADER: "spoofed"},
                        json={"model": model, "messages": [{"role": "user", "content": "x"}]})
                    assert r.status_code == 200, r.text
                    seen[key, model] = httpx.get(f"http://127.0.0.1:{port}/stats").json()["last_headers"]
    finally:
        await gw.close()
        up.stop()
    # team a's share rule names team a's flow; team b has no share rule: its flow is the tenant
    assert seen[KEY, "m-gie"][FAIRNESS_ID_HEADER] == "acme/a"
    assert seen[KEY, "m-gie"][OBJECTIVE_HEADER] == "realtime"
    assert seen[KEY + "-b", "m-gie"][FAIRNESS_ID_HEADER] == "acme"
    assert seen[KEY + "-b", "m-gie"][OBJECTIVE_HEADER] == "standard"
    for key in (KEY, KEY + "-b"):
        h = seen[key, "m-plain"]
        assert FAIRNESS_ID_HEADER not in h and OBJECTIVE_HEADER not in h, h


def test_the_headers_without_a_decision_or_principal() -> None:
    c = RequestContext(request_id="r", endpoint="chat", headers={}, body={})
    assert inference_gateway_headers(c) == {FAIRNESS_ID_HEADER: "anonymous", OBJECTIVE_HEADER: "standard"}
    c.principal = Principal(id="k", kind="api_key", tenant="t", team="x", key_id="k1")
    c.decision = Decision(priority="batch", share=2.0, share_scope="key")
    assert inference_gateway_headers(c) == {FAIRNESS_ID_HEADER: "key:k1", OBJECTIVE_HEADER: "batch"}
