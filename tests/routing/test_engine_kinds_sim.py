"""One routing plane for both engine kinds: the route stage and the real telemetry service over the simulated
fleet presenting as vLLM (backends of kind `sim`) and as SGLang (kind `sglang`: SGLang 0.5.23's KV-event wire,
`sglang:*` metrics, /tokenize, error shape, priority order). Each test runs once per kind and asserts the same
thing: the engine is pass-through until its model is learned from served requests and modelled after; the
prediction of cached tokens agrees with what the engine reports; the facts, views and evidence the admin plane
and the dashboard show have one shape whatever the kind."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import yaml

from gateway.config import parse_config
from gateway.pipeline import RequestContext
from gateway.proxy.health import Health
from gateway.proxy.forward import exchange_for
from gateway.routing.plan import Candidate
from gateway.routing.stage import PredictiveRouteStage
from gateway.types import Usage

from tests.support.wait import async_wait_until

PROMPT = " ".join(f"policy{i} applies" for i in range(300))
MIN_OBS = 6


def _ctx(rid: str, content: str) -> RequestContext:
    c = RequestContext(request_id=rid, endpoint="chat", headers={},
                       body={"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
    c.model, c.model_chain, c.prompt_tokens_est = "sim-model", ("sim-model",), 10
    return c


@pytest.fixture(params=["vllm", "sglang"])
async def rig(request):
    from backends.sim.fleet import start_fleet
    from gateway.telemetry.service import TelemetryService

    async with start_fleet(2, profiles=["tiny"], present_as=request.param, priority_policy=True) as fleet:
        engines = fleet.manifest()["engines"]
        cfg = parse_config(yaml.safe_dump({"backends": [
            {"name": e["name"], "kind": e["kind"], "url": e["url"], "models": ["sim-model"],
             "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
             "priority_scheduling": True} for e in engines],
            "telemetry": {"scrape_interval_s": 0.1},
            # learned after MIN_OBS served requests; the band is wide: this pins the transition, not the fit
            "routing": {"model_validity": {"min_observations": MIN_OBS, "max_mdare": 50.0}}}))
        tel = TelemetryService(cfg)
        await tel.start()
        try:
            for _ in range(100):
                if all((ld := tel.load(e["name"])) is not None and ld.healthy and tel.index.block_size(e["name"])
                       for e in engines):
                    break
                await asyncio.sleep(0.05)
            async with httpx.AsyncClient(timeout=20) as client:
                yield PredictiveRouteStage(lambda: cfg, Health(cfg), telemetry=tel), tel, engines, client, \
                    request.param
        finally:
            await tel.close()


async def _serve(st: PredictiveRouteStage, client: httpx.AsyncClient, engines: list[dict], c: RequestContext) -> dict:
    """Route `c`, send it to the engine the stage picked, and finish it with the engine's answer."""
    await st.run(c)
    cand = c.route.candidates[0]
    name = cand.backend.name
    url = next(e["url"] for e in engines if e["name"] == name)
    t0 = time.perf_counter()
    r = await client.post(url + "/chat/completions", content=_upstream_body(c, cand),
                          headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    c.ttft_s = time.perf_counter() - t0
    c.backend, c.backend_model, c.status = name, "sim-model", 200
    c.usage = Usage(u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"])
    await st.finish(c)
    return c.evidence


async def _indexed(tel, c: RequestContext) -> None:  # type: ignore[no-untyped-def]
    """Wait until the KV events of `c`'s prompt reached the index: /admin/fleet shows its engine holding at least
    the prompt's full blocks, with the fields its events carried."""
    assert c.usage is not None and c.backend is not None
    want = c.usage.prompt_tokens // 16

    def seen() -> bool:
        f = tel.fleet_snapshot()["engines"][c.backend]
        return sum(f["cached_blocks"].values()) >= want and bool(f["kv_event_fields"])

    await async_wait_until(seen, what=f"the KV events of {c.request_id} ({want} blocks) in the index")


def _upstream_body(c: RequestContext, cand) -> bytes:  # type: ignore[no-untyped-def]
    """What the gateway sends this candidate: the kind's dialect builds it (priority in the kind's order...)."""
    ex = exchange_for(c, cand)
    assert ex is not None
    return ex.body(c, cand)


async def test_the_engine_is_passed_through_until_its_model_is_learned_then_modelled(rig):
    st, tel, engines, client, kind = rig
    cfg = st._config()
    now = st.clock()
    first = {e["name"]: st.mode(cfg.backend(e["name"]), tel, now) for e in engines}
    assert all(not m.modelled and f"model not learned yet (0 of {MIN_OBS}" in m.reason for m in first.values()), first
    for i in range(3 * MIN_OBS):
        await _serve(st, client, engines, _ctx(f"learn-{i}", f"question {i} " + "words " * (20 + i)))

    def modelled() -> list[str]:  # the mode is memoised for 0.25 s: a learned engine shows once the memo lapses
        return [n for n, m in st.snapshot()["modes"].items() if m["mode"] == "modelled"]

    await async_wait_until(modelled, what="an engine shown as modelled in the routing snapshot")
    snap = st.snapshot()
    learned = [n for n, m in snap["modes"].items() if m["mode"] == "modelled"]
    assert learned, snap["modes"]
    for n in learned:
        assert "telemetry live, fit valid" in snap["modes"][n]["reason"]
        assert snap["engines"][n]["mode"]["mode"] == "modelled"


async def test_cached_tokens_are_predicted_from_the_kinds_kv_events_and_agree(rig):
    st, tel, engines, client, kind = rig
    warm = _ctx("warm", PROMPT + " first")
    await _serve(st, client, engines, warm)
    await _indexed(tel, warm)
    for i in range(3):
        ev = await _serve(st, client, engines, _ctx(f"rep-{i}", PROMPT + f" question {i}"))
        assert ev["predicted_cached_tokens"] == ev["actual_cached_tokens"] > 500, ev
    ag = tel.agreement()
    assert ag["predicted_tokens"] == ag["actual_tokens"] > 1500 and ag["token_agreement"] == 1.0


async def test_admin_views_have_one_shape_whatever_the_kind(rig):
    """/admin/fleet (fleet_snapshot) and /admin/routing (stage snapshot) per engine: the same keys, and the facts
    from each kind's own telemetry (block size from its events or metrics, capacity from its metrics)."""
    st, tel, engines, client, kind = rig
    shape = _ctx("shape", PROMPT)
    await _serve(st, client, engines, shape)
    await _indexed(tel, shape)
    fleet = tel.fleet_snapshot()["engines"]
    routing = st.snapshot()["engines"]
    for e in engines:
        f = fleet[e["name"]]
        assert set(f) == {"block_size", "cached_blocks", "kv_events", "stale", "stale_reason", "stale_detail",
                          "load", "inflight", "agreement", "kv_event_fields", "kv_groups"}
        assert f["block_size"] == 16 and f["load"]["healthy"] and f["load"]["num_gpu_blocks"]
        facts = routing[e["name"]]["facts"]
        assert facts["block_size"] == 16 and facts["kv_capacity_blocks"] == f["load"]["num_gpu_blocks"]
        assert set(routing[e["name"]]["view"]) == {"inflight", "ahead_tokens", "prefilling_tokens", "running"}
    fields = set().union(*(set(f["kv_event_fields"]) for f in fleet.values()))
    # what each kind's events carry (shown per engine in /admin/fleet): vLLM's extra_keys and groups, SGLang's own
    assert {"block_hashes", "token_ids", "block_size", "medium"} <= fields
    if kind == "sglang":
        assert "group_idx" not in fields and "extra_keys" not in fields
    else:
        assert "group_idx" in fields


async def test_priorities_keep_their_order_on_the_engine(rig):
    """The routing stage's priority values (lower runs first) reach each kind in its own order: queued behind a
    busy engine, a realtime request starts before a batch one that arrived first."""
    st, tel, engines, client, kind = rig
    e = engines[0]
    url = e["url"]
    values = st._config().raw.routing.priority_values  # realtime 0, batch 10: lower runs first
    cand = Candidate(st._config().backend(e["name"]), "sim-model")

    async def one(tag: str, content: str, max_tokens: int = 1) -> float:
        c = _ctx(tag, content)
        c.body["max_tokens"] = max_tokens
        if tag in values:
            c.body_overrides["priority"] = values[tag]  # what the routing stage sets (stage.py)
        r = await client.post(url + "/chat/completions", content=_upstream_body(c, cand),
                              headers={"content-type": "application/json"})
        assert r.status_code == 200
        return time.perf_counter()

    # fill the engine (tiny profile) so that later arrivals queue
    hogs = [asyncio.create_task(one("hog", f"hog {i} " + "x " * 900, 40)) for i in range(6)]
    await asyncio.sleep(0.05)
    batch = asyncio.create_task(one("batch", "batch question " + "y " * 300))
    await asyncio.sleep(0.02)
    realtime = asyncio.create_task(one("realtime", "realtime question " + "z " * 300))
    t_batch, t_rt = await batch, await realtime
    await asyncio.gather(*hogs)
    assert t_rt <= t_batch
