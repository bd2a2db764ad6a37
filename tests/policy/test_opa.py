"""OPA delegation against a server speaking OPA's /v1/data API with a real Rego evaluator (regopy),
and against a real `opa` binary when one is on PATH."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from gateway.policy.compiler import compile_text
from gateway.policy.config import OPAConfig
from gateway.policy.model import RequestAttrs
from gateway.policy.opa import OPAPolicy, build_input, merge_result
from gateway.types import Principal
from tests.policy.opa_server import RegoDataServer

REGO = Path(__file__).resolve().parents[2] / "policies" / "rego" / "gateway.rego"
LOCAL = "rules:\n  - id: budget\n    match: {team: t1}\n    budgets: [{window: day, tokens: 100}]\n    set: {priority: realtime}\n"


def P(**kw):
    kw.setdefault("tenant", "acme")
    return Principal(id="k", kind="api_key", **kw)


@pytest.fixture
def server():
    with RegoDataServer([REGO]) as s:
        yield s


def opa(url, **kw):
    cfg = OPAConfig(url=url, **{"timeout_ms": 500.0, **kw})
    local = compile_text(LOCAL)
    return OPAPolicy(cfg, local=lambda: local)


async def check_semantics(pol: OPAPolicy):
    d = await pol.adecide(P(partner="opper", team="t1"), RequestAttrs(model="qwen3"))
    assert d.allow and d.jurisdiction == "EEA" and d.retention == "zero" and d.ttft_slo_ms == 1500
    assert d.priority == "standard"  # OPA's value overrides the local one
    assert [b.rule_id for b in d.budgets] == ["budget"]  # local budgets are kept
    d = await pol.adecide(P(scopes=("intern",)), RequestAttrs(model="kimi-k3-x"))
    assert not d.allow and d.deny_rule == "opa:interns-no-frontier" and d.deny_status == 403
    d = await pol.adecide(P(), RequestAttrs(model="q", headers={"x-data-classification": "secret"}))
    assert not d.allow and d.deny_rule == "opa:secret-data-denied"
    # no tenant: the Rego decision is undefined -> deny
    d = await pol.adecide(P(tenant=""), RequestAttrs(model="q"))
    assert not d.allow and "undefined" in d.reason
    d = await pol.adecide(P(), RequestAttrs(model="q"))
    assert d.allow and d.allowed_countries is None


async def test_allow_deny_undefined(server):
    pol = opa(server.url)
    try:
        await check_semantics(pol)
    finally:
        await pol.close()


async def test_decision_cache(server):
    pol = opa(server.url, cache_ttl_s=60)
    try:
        for _ in range(5):
            assert (await pol.adecide(P(partner="opper"), RequestAttrs(model="q", now=1000.0))).allow
        assert server.requests == 1 and pol.stats["cache_hits"] == 4
        await pol.adecide(P(partner="opper"), RequestAttrs(model="q2", now=1000.0))  # different input
        assert server.requests == 2
        # what real clients send differs per request only in transport/tracing headers: still one query
        for i in range(3):
            h = {"x-request-id": f"r{i}", "traceparent": f"00-{i:032x}-{i:016x}-01", "content-length": str(90 + i),
                 "x-stainless-retry-count": str(i), "x-team-region": "eu"}
            assert (await pol.adecide(P(partner="opper"), RequestAttrs(model="q3", now=1000.0, headers=h))).allow
        assert server.requests == 3 and pol.stats["cache_hits"] == 6
        await pol.adecide(P(partner="opper"), RequestAttrs(model="q3", now=1000.0, headers={"x-team-region": "us"}))
        assert server.requests == 4  # a header a policy may read is part of the input
    finally:
        await pol.close()
    clock = [0.0]
    pol = OPAPolicy(OPAConfig(url=server.url, cache_ttl_s=1.0), clock=lambda: clock[0])
    try:
        await pol.adecide(P(), RequestAttrs(model="q", now=1000.0))
        clock[0] = 2.0  # the entry expired
        await pol.adecide(P(), RequestAttrs(model="q", now=1000.0))
        assert server.requests == 6
    finally:
        await pol.close()


async def test_timeout_fails_closed_and_is_not_cached(server):
    pol = opa(server.url, timeout_ms=100.0)
    server.delay_s = 0.5
    try:
        t0 = time.perf_counter()
        d = await pol.adecide(P(partner="opper"), RequestAttrs(model="q"))
        assert time.perf_counter() - t0 < 0.4
        assert not d.allow and d.deny_status == 503 and "timed out" in d.reason
        server.delay_s = 0.0
        assert (await pol.adecide(P(partner="opper"), RequestAttrs(model="q"))).allow
    finally:
        await pol.close()


async def test_unreachable_fails_closed():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    pol = opa(f"http://127.0.0.1:{port}")
    try:
        d = await pol.adecide(P(), RequestAttrs(model="q"))
        assert not d.allow and d.deny_status == 503
    finally:
        await pol.close()


async def test_local_deny_wins_without_asking(server):
    local = compile_text("rules:\n  - id: nope\n    deny: true\n")
    pol = OPAPolicy(OPAConfig(url=server.url), local=lambda: local)
    d = await pol.adecide(P(), RequestAttrs(model="q"))
    assert not d.allow and d.deny_rule == "nope" and server.requests == 0
    await pol.close()


def test_input_document_has_no_credentials():
    doc = build_input(P(), RequestAttrs(model="q", headers={"authorization": "Bearer sk-1", "x-team": "a"}, now=125.0), None)
    assert doc["request"]["headers"] == {"x-team": "a"}
    assert doc["request"]["time"] == {"unix": 120, "weekday": "thu", "hour": 0}


@pytest.mark.skipif(shutil.which("opa") is None, reason="no opa binary on PATH")
async def test_against_real_opa_binary():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen(["opa", "run", "--server", f"--addr=127.0.0.1:{port}", str(REGO)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        pol = opa(f"http://127.0.0.1:{port}")
        try:
            await check_semantics(pol)
        finally:
            await pol.close()
    finally:
        proc.terminate()
        proc.wait(5)


async def test_stage_turns_opa_outage_into_503():
    from gateway.errors import GatewayError
    from gateway.pipeline import RequestContext
    from gateway.policy.stage import PolicyStage

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    pol = opa(f"http://127.0.0.1:{port}")
    c = RequestContext(request_id="r", endpoint="chat", headers={}, body={})
    c.principal, c.model = P(), "q"
    with pytest.raises(GatewayError) as ei:
        await PolicyStage(lambda: pol).run(c)
    assert ei.value.status == 503 and ei.value.code == "policy_unavailable"
    await pol.close()


@pytest.mark.parametrize("field,value,ok", [
    ("max_context", 4096, 4096), ("max_context", 4096.0, 4096), ("max_context", "4096", None),
    ("max_context", 4096.5, None), ("max_context", 0, None), ("max_context", True, None),
    ("max_tokens", -1, None), ("ttft_slo_ms", 1500, 1500.0), ("ttft_slo_ms", "fast", None),
    ("priority", "sheddable", "batch"), ("priority", "urgent", None), ("priority", 1, None)])
def test_a_malformed_opa_value_fails_closed_with_the_reason(field, value, ok):
    """A Rego policy answering e.g. max_context: "4096" must not reach the request path as a string (it
    would raise there and become a 500): the decision is a deny naming the field."""
    d = merge_result(None, {"allow": True, field: value}, True)
    attr = {"max_tokens": "max_tokens_cap"}.get(field, field)
    if ok is None:
        assert not d.allow and d.deny_rule == "opa" and f"'{field}'" in d.reason
    else:
        assert d.allow and getattr(d, attr) == ok


async def test_a_reload_that_adds_changes_or_removes_opa_swaps_the_client(server):
    """policy.opa is part of the reloadable config: the holder asks the new OPA (or none) after a reload."""
    import yaml

    from gateway.config import parse_config
    from gateway.wiring import PolicyHolder

    def cfg(opa_url):
        raw = {"backends": [{"name": "b", "url": "http://127.0.0.1:9/v1", "models": ["q"]}],
               "policy": {"files": []}}
        if opa_url:
            raw["policy"]["opa"] = {"url": opa_url, "timeout_ms": 500}
        return parse_config(yaml.safe_dump(raw))

    holder = PolicyHolder(cfg(None))
    await holder.start()
    try:
        assert not isinstance(holder.provider(), OPAPolicy)
        await holder.swap_config(cfg(server.url))
        pol = holder.provider()
        assert isinstance(pol, OPAPolicy) and pol.config.url == server.url
        d = await pol.adecide(P(tenant=""), RequestAttrs(model="q"))  # the Rego policy: no tenant -> undefined
        assert not d.allow and server.requests == 1
        await holder.swap_config(cfg(server.url))  # unchanged: the same client (and its cache) stays
        assert holder.provider() is pol
        await holder.swap_config(cfg(None))
        assert not isinstance(holder.provider(), OPAPolicy) and pol._client is None
    finally:
        await holder.close()
