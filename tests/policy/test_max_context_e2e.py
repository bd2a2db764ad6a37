"""max_context end to end: the in-process gateway (wired like `gateway serve`) in front of simulated engines,
under a policy that sets `max_context`. A request that does not fit is a 400 `context_length_exceeded` naming
the rule, its audit record says why, and no engine sees it; a fitting one is served; a chat request without
max_tokens is served with max_tokens lowered to what fits."""
from __future__ import annotations

from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
import yaml

from backends.sim.fleet import start_fleet
from gateway.app import Gateway, build_app
from gateway.config import parse_config
from gateway.wiring import wire

KEY = "ctx-test-key-0123456789"
ADMIN_KEY = "ctx-admin-key-0123456789"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}

POLICY = """
version: 1
defaults: {allow: true}
rules:
  - id: acme-context
    match: {tenant: acme}
    set: {max_context: 300}
"""


def _config(tmp: Path, engines: list[dict[str, Any]]) -> dict[str, Any]:
    (tmp / "policy.yaml").write_text(POLICY)
    return {
        "server": {"host": "127.0.0.1", "port": 0},
        "backends": [{"name": e["name"], "url": e["url"], "kind": "vllm", "models": ["sim-model"],
                      "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                      "capabilities": ["chat", "completions", "embeddings"]} for e in engines],
        "keys": [{"name": "plain", "key": KEY, "tenant": "acme"}],
        "admin": {"key": ADMIN_KEY},
        "policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / "audit.jsonl")},
        "identity": {"sqlite_path": str(tmp / "gw.db")},
        "budgets": {"sqlite_path": str(tmp / "budgets.db")},
        "data_dir": str(tmp),
    }


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient, Any]]:
    async with start_fleet(1, profiles=["tiny"]) as fleet:
        cfg = parse_config(yaml.safe_dump(_config(tmp_path, fleet.manifest()["engines"])), base_dir=tmp_path)
        gw = Gateway(cfg)
        wire(gw)
        app = build_app(gw)
        await gw.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
                yield gw, c, fleet
        finally:
            await gw.close()


async def _chat(c: httpx.AsyncClient, content: str, **body: Any) -> httpx.Response:
    return await c.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                        json={"model": "sim-model", "messages": [{"role": "user", "content": content}], **body})


async def test_max_context_end_to_end(stack) -> None:
    gw, c, fleet = stack
    long_prompt = "word " * 200  # 1000 characters: about 250 tokens estimated (+1 for the message)

    r = await _chat(c, long_prompt, max_tokens=100)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
    assert err["param"] == "max_tokens" and err["rule"] == "acme-context"
    assert "acme-context" in err["message"] and "300" in err["message"] and "351" in err["message"]
    rid = r.headers["x-request-id"]
    rec = (await c.get(f"/admin/decisions/{rid}", headers=ADMIN)).json()
    assert rec["status"] == 400 and rec["error"] == "context_length_exceeded" and rec["backend"] is None
    assert rec["decision"]["max_context"] == 300
    assert rec["evidence"]["max_context"] == {"rule": "acme-context", "max_context": 300, "prompt_tokens_est": 251,
                                              "max_tokens": 100, "requested_context": 351, "outcome": "refused"}

    r = await _chat(c, long_prompt, max_tokens=40)  # 251 + 40 fits
    assert r.status_code == 200, r.text

    r = await _chat(c, long_prompt)  # no max_tokens: lowered to the 49 tokens left
    assert r.status_code == 200, r.text
    # the simulated engine generates exactly max_tokens when one is sent: the lowered value reached it
    assert r.json()["usage"]["completion_tokens"] == 49 and r.json()["choices"][0]["finish_reason"] == "length"
    rec = (await c.get(f"/admin/decisions/{r.headers['x-request-id']}", headers=ADMIN)).json()
    assert rec["evidence"]["max_context"]["outcome"] == "max_tokens_lowered"
    assert rec["evidence"]["max_context"]["set_max_tokens"] == 49
