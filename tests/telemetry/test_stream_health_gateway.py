"""Issue 17 end to end: a real gateway process in front of a simulated engine whose KV events never reach it.

The engine serves the gateway's request, so the gateway's finish hook knows it stored blocks; no batch arrives
(the backend's kv_events names a port nothing publishes on, and its metrics URL is unreachable, so the served
request is the only evidence, and the block size is unknown: assumed 1024 tokens). Within the grace period the engine is stale with reason no_events in
/admin/fleet, /metrics, the dashboard data and the next request's route evidence."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from backends.sim.fleet import start_fleet
from tests.support.procs import free_port, start_gateway

KEY = "kv-silence-key-0123456789"
ADMIN = "kv-silence-admin-0123456789"
pytestmark = pytest.mark.e2e


async def _poll(c: httpx.AsyncClient, url: str, cond, timeout: float = 10.0):
    async def go():
        while True:
            r = await c.get(url, headers={"authorization": f"Bearer {ADMIN}"})
            if r.status_code == 200 and cond(r):
                return r
            await asyncio.sleep(0.1)
    return await asyncio.wait_for(go(), timeout)


async def test_served_requests_without_kv_events_are_reported_no_events(tmp_path):
    async with start_fleet(1, profiles=["l40s-8b"]) as fleet:
        m = fleet.manifest()["engines"][0]
        port = free_port()
        cfg = tmp_path / "gateway.yaml"
        cfg.write_text(json.dumps({
            "server": {"host": "127.0.0.1", "port": port},
            "backends": [{"name": "e0", "kind": "sim", "url": m["url"], "models": ["sim-model"],
                          "kv_events": f"tcp://127.0.0.1:{free_port()}",
                          "metrics": f"http://127.0.0.1:{free_port()}/metrics"}],
            "keys": [{"key": KEY, "tenant": "t1"}], "admin": {"key": ADMIN},
            "telemetry": {"kv_silence_grace_s": 0.5, "scrape_interval_s": 0.2},
            "observability": {"log_level": "warning"}}))
        gw, _ = await asyncio.to_thread(start_gateway, cfg)
        base = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(timeout=20) as c:
                body = {"model": "sim-model", "max_tokens": 2,
                        "messages": [{"role": "user", "content": "cache block " * 700}]}
                r = await c.post(base + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
                assert r.status_code == 200, r.text
                # > 1024 tokens: with neither events nor /metrics the block size is unknown and assumed 1024
                assert r.json()["usage"]["prompt_tokens"] > 1100
                fleet_r = await _poll(c, base + "/admin/fleet",
                                      lambda r: r.json()["engines"]["engines"]["e0"]["stale"])
                e = fleet_r.json()["engines"]["engines"]["e0"]
                assert e["stale_reason"] == "no_events" and e["kv_events"]["batches"] == 0
                assert e["kv_events"]["subscribed_topic"] == "" and e["kv_events"]["other_topic_frames"] == 0
                assert e["kv_events"]["pending_activity_source"] == "served_request"
                text = (await c.get(base + "/metrics")).text
                assert 'gateway_kv_stream_stale{engine="e0",reason="no_events"} 1.0' in text
                assert 'gateway_kv_stream_stale{engine="e0",reason="wrong_topic"} 0.0' in text
                ui = (await c.get(base + "/admin/ui/data", headers={"authorization": f"Bearer {ADMIN}"})).json()
                row = next(x for x in ui["engines"] if x["name"] == "e0")
                assert row["stale"] and row["stale_reason"] == "no_events" and "no KV batch" in row["stale_detail"]
                r = await c.post(base + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
                rid = r.headers["x-request-id"]
                rec = await _poll(c, f"{base}/admin/decisions/{rid}", lambda r: r.json().get("backend"))
                assert rec.json()["route"]["stale_kv_views"] == ["e0"]
                assert rec.json()["route"]["kv_views"] == {"e0": {"stale": True, "reason": "no_events"}}
            assert gw.log().count("KV view is stale (no_events)") == 1  # one warning for the one change
        finally:
            await asyncio.to_thread(gw.stop)
