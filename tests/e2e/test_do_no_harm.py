"""Issue 34, first do no harm: the README's minimal config (one `kind: openai` upstream, everything else
default) in front of an OpenAI-compatible upstream that takes 200 ms to its first token and streams 10 chunks
10 ms apart (a partner API), and a simulated engine whose model is not learned: at 64 and 256 concurrent
streams nothing is refused and nothing is held in the gateway. Asserted on the gateway's own counters
(/admin/routing), not on timings; /admin/routing and the audit record say which mode each upstream is in."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from backends.sim.fleet import FleetProcess
from tests.support.procs import audit_record, free_port, start_gateway, start_upstream

KEY = "harm-test-key-0123456789"
ADMIN = "harm-test-admin-0123456789"
pytestmark = pytest.mark.e2e


def _gateway(tmp, backend: dict, routing: dict | None = None):
    port = free_port()
    cfg = {"server": {"host": "127.0.0.1", "port": port}, "backends": [backend],
           "keys": [{"key": KEY, "tenant": "demo"}], "admin": {"key": ADMIN},
           "observability": {"log_level": "warning"}}
    if routing:
        cfg["routing"] = routing
    path = tmp / f"gateway-{port}.yaml"
    path.write_text(json.dumps(cfg))
    gw, _ = start_gateway(path)
    return gw, f"http://127.0.0.1:{port}"


async def _burst(base: str, model: str, n: int, extra: dict) -> list[tuple[int, bool]]:
    """n concurrent streaming requests; (status, saw [DONE]) each."""
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        async def one(i: int) -> tuple[int, bool]:
            body = {"model": model, "stream": True, "max_tokens": 10,
                    "messages": [{"role": "user", "content": f"question {i} about the weather"}], **extra}
            async with c.stream("POST", base + "/v1/chat/completions", json=body,
                                headers={"authorization": f"Bearer {KEY}"}) as r:
                text = (await r.aread()).decode()
                return r.status_code, "[DONE]" in text
        return list(await asyncio.gather(*(one(i) for i in range(n))))


def _routing(base: str) -> dict:
    return httpx.get(base + "/admin/routing", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10).json()


def _assert_nothing_held_or_refused(base: str, results: list[tuple[int, bool]], backend: str) -> dict:
    assert all(s == 200 and done for s, done in results), [r for r in results if r != (200, True)][:5]
    snap = _routing(base)
    adm, flow = snap["admission"], snap["flow"]
    assert adm["rejected"] == 0 and adm["refused_after_wait"] == 0, adm
    assert flow["stats"]["queued"] == 0 and flow["waiting"] == 0, flow["stats"]  # never held in the gateway
    assert snap["modes"][backend]["mode"] == "pass_through", snap["modes"]
    return snap


def test_a_partner_like_upstream_is_passed_through_at_64_and_256_streams(tmp_path):
    up, up_port = start_upstream(tmp_path)
    gw = None
    try:
        gw, base = _gateway(tmp_path, {"name": "partner", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1",
                                       "models": ["mock-model"], "location": {"country": "DE"},
                                       "retention": "zero"})
        sent = 0
        for n in (64, 256):
            res = asyncio.run(_burst(base, "mock-model", n, {"x_test_latency": {"first_s": 0.2, "chunk_s": 0.01}}))
            sent += n
            snap = _assert_nothing_held_or_refused(base, res, "partner")
        assert "kind openai" in snap["modes"]["partner"]["reason"]
        assert snap["admission"]["pass_through"] == sent
        # the audit record names the mode of the chosen upstream and of each candidate, and why
        r = httpx.post(base + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}",
                                                              "x-request-id": "harm-audit-1"},
                       json={"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 200 and "x-predicted-ttft-ms" not in r.headers  # no model, no promise
        rec = audit_record(base, "harm-audit-1", ADMIN)
        assert rec["route"]["mode"] == "pass_through"
        assert rec["candidates"][0]["mode"] == "pass_through" and "kind openai" in rec["candidates"][0]["mode_reason"]
        assert {"queue_wait_us", "tokenize_us", "compute_us"} <= set(rec["route"])
        metrics = httpx.get(base + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10).text
        assert 'gateway_upstream_mode{backend="partner",mode="pass_through"} 1.0' in metrics
    finally:
        if gw is not None:
            gw.stop()
        up.stop()


def test_a_simulated_engine_whose_model_is_not_learned_is_passed_through(tmp_path):
    fleet = FleetProcess(["--engines", "1", "--profile", "vllm-default", "--base-port", "0"], tmp_path / "fleet.json")
    man = fleet.start()
    gw = None
    try:
        e = man["engines"][0]
        # the bar for a learned model is set above what this test sends: the engine stays unlearned throughout
        gw, base = _gateway(tmp_path, {"name": e["name"], "kind": "sim", "url": e["url"], "models": ["sim-model"],
                                       "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                                       "location": {"country": "DE"}},
                            routing={"model_validity": {"min_observations": 100_000}})
        for n in (64, 256):
            res = asyncio.run(_burst(base, "sim-model", n, {}))
            snap = _assert_nothing_held_or_refused(base, res, e["name"])
        reason = snap["modes"][e["name"]]["reason"]
        assert "not learned yet" in reason or "metrics" in reason, reason
    finally:
        if gw is not None:
            gw.stop()
        fleet.stop()


def test_an_operators_inflight_limit_is_the_one_hold_for_a_pass_through_upstream(tmp_path):
    """backends[].max_inflight: past it a request without a target waits for a slot (and is served), one with a
    target is refused at once with 429 backend_inflight_limit; the evidence names the limit."""
    up, up_port = start_upstream(tmp_path)
    gw = None
    try:
        gw, base = _gateway(tmp_path, {"name": "partner", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1",
                                       "models": ["mock-model"], "location": {"country": "DE"},
                                       "retention": "zero", "max_inflight": 2})

        async def run() -> tuple[list[tuple[int, bool]], httpx.Response]:
            slow = asyncio.create_task(_burst(base, "mock-model", 6, {"x_test_latency": {"first_s": 0.5}}))
            async with httpx.AsyncClient(timeout=30) as c:
                for _ in range(200):  # until both slots are taken
                    if _routing(base)["inflight_limits"]["in_use"].get("partner") == 2:
                        break
                    await asyncio.sleep(0.01)
                r = await c.post(base + "/v1/chat/completions",
                                 headers={"authorization": f"Bearer {KEY}", "x-ttft-slo-ms": "5000",
                                          "x-request-id": "harm-limit-1"},
                                 json={"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]})
            return await slow, r

        res, refused = asyncio.run(run())
        assert all(s == 200 and done for s, done in res), res
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "backend_inflight_limit"
        assert "retry-after" in refused.headers
        snap = _routing(base)
        assert snap["inflight_limits"]["waited"] >= 1 and snap["inflight_limits"]["refused"] == 1
        assert snap["admission"]["rejected_inflight_limit"] == 1
        rec = audit_record(base, "harm-limit-1", ADMIN)
        assert rec["route"]["inflight_limit"] == {"partner": 2}
    finally:
        if gw is not None:
            gw.stop()
        up.stop()
