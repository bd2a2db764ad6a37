"""The response cache through the official openai SDK against a real `python -m gateway serve`: a repeated
streamed request is replayed from the cache (the upstream sees one request), the SDK assembles the same text
and usage, and reads `x-gateway-cache` from the raw response."""
from __future__ import annotations

import httpx
import openai
import pytest
import yaml

from tests.support.procs import free_port, start_gateway, start_upstream

pytestmark = pytest.mark.e2e
KEY = "cache-sdk-key-0123456789"


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache-sdk")
    up, up_port = start_upstream(tmp)
    (tmp / "policy.yaml").write_text(yaml.safe_dump({"version": 1, "rules": [
        {"id": "cache-all", "match": {"tenant": "t"}, "set": {"cache": {"mode": "exact", "ttl_s": 600}}}]}))
    port = free_port()
    cfg = {"server": {"host": "127.0.0.1", "port": port},
           "backends": [{"name": "up", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1", "models": ["m"],
                         "location": {"country": "DE"}}],
           "keys": [{"key": KEY, "tenant": "t", "name": "k"}],
           "cache": {"location": {"country": "DE"}},
           "policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / "audit.jsonl")},
           "identity": {"sqlite_path": str(tmp / "id.db")},
           "budgets": {"sqlite_path": str(tmp / "budgets.db")}}
    path = tmp / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    g, _ = start_gateway(path)
    yield {"base": f"http://127.0.0.1:{port}", "up": up_port}
    g.stop()
    up.stop()


def upstream_requests(gw) -> int:
    return httpx.get(f"http://127.0.0.1:{gw['up']}/stats").json()["requests"]


def test_streamed_hit_replays_through_the_openai_sdk(gw):
    client = openai.OpenAI(base_url=gw["base"] + "/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": "Tell me about the Orion release"}]

    def run() -> tuple[str, str, object]:
        with client.chat.completions.with_streaming_response.create(
                model="m", messages=msgs, stream=True, stream_options={"include_usage": True}, max_tokens=6) as raw:
            header = raw.headers.get("x-gateway-cache")
            text, usage = "", None
            for chunk in raw.parse():
                for ch in chunk.choices:
                    text += ch.delta.content or ""
                usage = chunk.usage or usage
        return header, text, usage

    before = upstream_requests(gw)
    h1, t1, u1 = run()
    h2, t2, u2 = run()
    assert (h1, h2) == ("miss", "hit")
    assert t2 == t1 and t1
    assert u2.completion_tokens == u1.completion_tokens and u2.prompt_tokens == u1.prompt_tokens
    assert upstream_requests(gw) == before + 1  # the hit never reached the upstream
    resp = client.chat.completions.with_raw_response.create(model="m", messages=msgs, max_tokens=6)
    assert resp.headers["x-gateway-cache"] == "hit" and resp.parse().choices[0].message.content == t1
