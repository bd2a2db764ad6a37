"""End to end: flow control in a real gateway process in front of a simulated fleet (two vllm-default engines:
2048-token chunks, KV events on), talked to over HTTP.

Pins the two ways one caller hurt everyone before flow control:
- long prompts: with two engines, only one prefills a long prompt at a time (`long_engine_share` 0.5); the
  other long prompt waits in the gateway (its audit record says: lane long, queued, waited), and the short
  prompts sent meanwhile are served by the engine without a long prefill;
- a flooding tenant: tenant b keeps 32 requests open, tenant a sends one at a time. a's requests are served
  (the fair queue puts a first), b's excess is refused with 429 and Retry-After, and the audit records and
  /metrics name the flow, the queue and the reason.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from backends.sim.fleet import FleetProcess
from bench.routing import text
from tests.support.procs import audit_record, free_port, start_gateway

KEY_A = "flow-e2e-key-a-0123456789"
KEY_B = "flow-e2e-key-b-0123456789"
ADMIN = "flow-e2e-admin-0123456789"
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flow")
    fleet = FleetProcess(["--engines", "2", "--profile", "vllm-default", "--base-port", "0"], tmp / "fleet.json")
    man = fleet.start()
    try:
        port = free_port()
        backends = [{"name": e["name"], "kind": "sim", "url": e["url"], "models": ["sim-model"],
                     "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                     "location": {"country": "DE"}, "timeouts": {"first_token_s": 60, "total_s": 120}}
                    for e in man["engines"]]
        cfg = tmp / "gateway.yaml"
        cfg.write_text(json.dumps({
            "server": {"host": "127.0.0.1", "port": port}, "backends": backends,
            "keys": [{"key": KEY_A, "tenant": "a"}, {"key": KEY_B, "tenant": "b"}], "admin": {"key": ADMIN},
            # the engines' chunk budget (2048) is learned from their KV events; the threshold is set so the
            # first long prompt already counts as long
            "routing": {"flow_control": {"long_prompt_tokens": 4000},
                        # the warm-up's few requests per engine make its model valid (gateway/routing/mode.py)
                        "model_validity": {"min_observations": 4}},
            "telemetry": {"scrape_interval_s": 0.2}, "observability": {"log_level": "warning"}}))
        gw, _ = start_gateway(cfg)
        try:
            yield {"base": f"http://127.0.0.1:{port}", "engines": [e["name"] for e in man["engines"]]}
        finally:
            gw.stop()
    finally:
        fleet.stop()


def body(content: str) -> dict:
    return {"model": "sim-model", "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": content}]}


async def send(client: httpx.AsyncClient, base: str, key: str, content: str, slo_ms: float, rid: str) -> dict:
    t0 = time.perf_counter()
    out = {"rid": rid, "status": None, "ttft_s": None, "headers": {}, "error": None, "sent": t0, "first": None}
    async with client.stream("POST", base + "/v1/chat/completions", json=body(content),
                             headers={"authorization": f"Bearer {key}", "x-ttft-slo-ms": str(slo_ms),
                                      "x-request-id": rid}) as r:
        out["status"] = r.status_code
        out["headers"] = dict(r.headers)
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread())["error"]
            return out
        async for line in r.aiter_lines():
            if out["ttft_s"] is None and line.startswith("data: {") and '"content"' in line:
                out["first"] = time.perf_counter()
                out["ttft_s"] = out["first"] - t0
    return out


def decision(base: str, client_rid: str) -> dict:
    return audit_record(base, client_rid, ADMIN)


def test_long_prompts_take_one_engines_prefill_at_a_time_and_short_ones_keep_flowing(stack):
    base = stack["base"]
    rng = random.Random(11)

    async def run() -> tuple[list[dict], list[dict]]:
        async with httpx.AsyncClient(timeout=60) as c:
            for i in range(8):  # both engines learned (prefill rate) and showed their chunk budget
                await asyncio.gather(*(send(c, base, KEY_A, text(rng, 300), 5000, f"warm-{i}-{j}") for j in range(2)))
            longs = [asyncio.create_task(send(c, base, KEY_A, text(rng, 7000), 20_000, f"long-{i}"))
                     for i in range(2)]
            await asyncio.sleep(0.2)
            shorts = []
            for i in range(8):
                shorts.append(await send(c, base, KEY_A, text(rng, 150), 5000, f"short-{i}"))
                await asyncio.sleep(0.05)
            return list(await asyncio.gather(*longs)), shorts

    longs, shorts = asyncio.run(run())
    assert [r["status"] for r in longs] == [200, 200], longs
    assert all(r["status"] == 200 for r in shorts), shorts
    recs = [decision(base, r["rid"]) for r in longs]
    queues = [rec["route"]["queue"] for rec in recs]
    assert all(q["lane"] == "long" for q in queues), queues
    waited = [q for q in queues if q["queued"]]
    assert len(waited) == 1 and waited[0]["waited_ms"] > 100, queues  # the second waited for the first's prefill
    i_first = min(range(2), key=lambda i: recs[i]["route"]["queue"]["waited_ms"])
    long_engine, long_first_token = recs[i_first]["backend"], longs[i_first]["first"]
    # the short prompts served while the first long prompt prefilled went to the other engine, and did not
    # wait for it
    during = [r for r in shorts if r["first"] < long_first_token]
    assert len(during) >= 3, (shorts, longs)
    engines = [decision(base, r["rid"])["backend"] for r in during]
    assert all(e != long_engine for e in engines), (engines, long_engine)
    assert max(r["ttft_s"] for r in during) < 0.5 * longs[i_first]["ttft_s"], (during, longs)


def test_a_flooding_tenant_is_refused_its_excess_and_the_other_is_served(stack):
    base = stack["base"]
    rng = random.Random(5)
    stop = time.perf_counter() + 6.0
    results: dict[str, list[dict]] = {"a": [], "b": []}

    async def flood(c: httpx.AsyncClient, i: int) -> None:
        n = 0
        while time.perf_counter() < stop:
            r = await send(c, base, KEY_B, text(rng, 300), 1000, f"b-{i}-{n}")
            results["b"].append(r)
            n += 1
            if r["status"] != 200:
                await asyncio.sleep(0.02)

    async def polite(c: httpx.AsyncClient) -> None:
        await asyncio.sleep(1.0)  # b has filled the queues
        n = 0
        while time.perf_counter() < stop:
            results["a"].append(await send(c, base, KEY_A, text(rng, 300), 1000, f"a-{n}"))
            n += 1
            await asyncio.sleep(0.05)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            await asyncio.gather(polite(c), *(flood(c, i) for i in range(32)))

    asyncio.run(run())
    a, b = results["a"], results["b"]
    a_ok = [r for r in a if r["status"] == 200]
    assert len(a) >= 5 and len(a_ok) >= 0.9 * len(a), [(r["status"], r["error"]) for r in a if r["status"] != 200]
    refused = [r for r in b if r["status"] == 429]
    assert refused, "the flooding tenant was never refused"
    codes = {r["error"]["code"] for r in refused}
    assert codes <= {"ttft_slo_unattainable", "flow_queue_timeout", "flow_queue_full"}, codes
    assert all("retry-after" in r["headers"] for r in refused)
    assert sum(r["status"] == 200 for r in b) > 0  # b is served too (its share and what a leaves)

    rec = decision(base, refused[-1]["rid"])
    q = rec["route"]["queue"]
    assert q["flow"] == "b" and q["class"] == "standard" and q["outcome"] in (
        "refused", "queue_timeout", "queue_full"), q
    ok_rec = decision(base, a_ok[-1]["rid"])
    assert ok_rec["route"]["queue"]["flow"] == "a" and ok_rec["route"]["queue"]["outcome"] == "dispatched"

    snap = httpx.get(base + "/admin/routing", headers={"authorization": f"Bearer {ADMIN}"}).json()["flow"]
    assert snap["flows"]["b"]["refused"] and not snap["flows"]["a"]["refused"].get("queue_full")
    assert snap["flows"]["a"]["served_prompt_tokens"] > 0 and snap["flows"]["b"]["served_completion_tokens"] > 0
    metrics = httpx.get(base + "/metrics").text
    assert 'gateway_flow_served_tokens_total{flow="a",kind="prompt"}' in metrics
    assert 'gateway_flow_refusals_total{flow="b"' in metrics
