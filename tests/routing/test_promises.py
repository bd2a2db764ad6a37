"""Issue 34, promises measured where the client measures them: the predicted TTFT and its upper bound count from
the request's arrival at the gateway; a request with a TTFT target is refused on arrival or served, never
refused after it waited in the gateway's queue; one without a target that waits out max_wait_s is refused and
counted apart. Against the simulator fleet with the real telemetry service, engines modelled from the prior."""
from __future__ import annotations

import asyncio
import time

import pytest
import yaml

from gateway.config import parse_config
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.proxy.health import Health
from gateway.routing.flow import Waiter
from gateway.routing.stage import PredictiveRouteStage


def _ctx(rid: str, slo: float | None = None) -> RequestContext:
    c = RequestContext(request_id=rid, endpoint="chat", headers={"x-ttft-slo-ms": str(slo)} if slo else {},
                       body={"model": "sim-model", "stream": True,
                             "messages": [{"role": "user", "content": "a short question"}]})
    c.model, c.model_chain, c.prompt_tokens_est = "sim-model", ("sim-model",), 10
    c.stream = True
    return c


@pytest.fixture(params=["vllm", "sglang"])  # the fleet presenting as vLLM (kind sim) and as SGLang (kind sglang)
async def rig(request):
    from backends.sim.fleet import start_fleet
    from gateway.telemetry.service import TelemetryService

    async with start_fleet(1, profiles=["tiny"], present_as=request.param) as fleet:
        engines = fleet.manifest()["engines"]
        cfg = parse_config(yaml.safe_dump({"backends": [
            {"name": e["name"], "kind": e["kind"], "url": e["url"], "models": ["sim-model"], "kv_events": e["kv_events"],
             "replay": e["replay"], "metrics": e["metrics"]} for e in engines],
            "telemetry": {"scrape_interval_s": 0.1},
            "routing": {"model_validity": {"min_observations": 0}, "flow_control": {"max_wait_s": 0.2, "max_queue_per_flow": 1}}}))
        tel = TelemetryService(cfg)
        await tel.start()
        try:
            for _ in range(100):
                if all((ld := tel.load(e["name"])) is not None and ld.healthy for e in engines):
                    break
                await asyncio.sleep(0.05)
            yield PredictiveRouteStage(lambda: cfg, Health(cfg), telemetry=tel), engines
        finally:
            await tel.close()


async def test_the_prediction_and_its_bound_count_from_arrival(rig):
    st, engines = rig
    c = _ctx("arrived-earlier")
    c.received_at = time.perf_counter() - 0.3  # it arrived 300 ms ago (queued in the server, parsed, decided)
    await st.run(c)
    pick = c.route.candidates[0]
    assert pick.mode == "modelled"
    assert pick.predicted_ttft_ms >= 300 and pick.predicted_ttft_upper_ms >= pick.predicted_ttft_ms
    assert float(c.extra_headers["x-predicted-ttft-ms"]) >= 300
    assert c.evidence["route"]["since_arrival_ms"] >= 300
    await st.finish(c)


def _close_engines(st: PredictiveRouteStage, engines: list[dict]) -> None:
    """Another flow already waits in the queue for every engine (so a new request is not first in line), and
    no engine opens for anyone (the gate's answer for engines whose queued prefill the model says is too long)."""
    names = frozenset(e["name"] for e in engines)
    now = st.clock()
    st.flow.queue.push(Waiter("someone-else", "standard", 1.0, False, names, now, now + 60,
                              uncached=dict.fromkeys(names, 1)), 1.0)
    st.flow.may_start = lambda *a, **k: frozenset()  # type: ignore[method-assign]


async def test_a_request_with_a_target_that_waited_is_served_not_refused(rig):
    st, engines = rig
    _close_engines(st, engines)
    c = _ctx("waits-then-served", slo=60_000)  # admitted on arrival: its predicted wait fits the target
    await asyncio.wait_for(st.run(c), 10)
    assert c.route.candidates[0].backend.name == engines[0]["name"]
    q = c.evidence["route"]["queue"]
    assert q["queued"] and q["waited_ms"] >= 150 and q["outcome"] == "dispatched", q
    assert st.flow.stats["late"] == 1 and st.stats["rejected"] == 0 and st.stats["refused_after_wait"] == 0
    await st.finish(c)


async def test_a_target_is_not_held_in_the_gateway_when_its_flow_is_alone(rig):
    """Issue 34 (burst goodput): with nobody else to be fair to, a request with a target that no engine opens for
    within what its target allows is not queued in the gateway (the wait could only spend its target: the engines
    serve in order): admission judges it on arrival against the engines' own predictions, full queues included."""
    st, engines = rig
    st.flow.may_start = lambda *a, **k: frozenset()  # type: ignore[method-assign]  # no engine opens
    c = _ctx("fits", slo=60_000)
    await asyncio.wait_for(st.run(c), 10)
    q = c.evidence["route"]["queue"]
    assert not q["queued"] and q["outcome"] == "dispatched", q
    assert st.stats["target_not_held"] == 1 and st.flow.stats["queued"] == 0
    await st.finish(c)
    c = _ctx("cannot-fit", slo=1)
    with pytest.raises(GatewayError) as ei:
        await asyncio.wait_for(st.run(c), 10)
    assert ei.value.code == "ttft_slo_unattainable" and st.flow.stats["queued"] == 0


async def test_a_request_without_a_target_is_refused_after_max_wait_and_counted_apart(rig):
    st, engines = rig
    _close_engines(st, engines)
    c = _ctx("waits-then-refused")
    with pytest.raises(GatewayError) as ei:
        await asyncio.wait_for(st.run(c), 10)
    assert ei.value.status == 429 and ei.value.code == "flow_queue_timeout"
    assert st.stats["refused_after_wait"] == 1


async def test_a_request_without_a_target_whose_flow_queue_is_full_goes_to_the_engine_not_refused(rig):
    """A plain proxy would serve it: nothing was promised, so a full flow queue sends it past flow control."""
    st, engines = rig
    _close_engines(st, engines)
    names = frozenset(e["name"] for e in engines)
    now = st.clock()
    st.flow.queue.push(Waiter("anonymous", "standard", 1.0, False, names, now, now + 60,  # its flow: 1 waiting,
                              uncached=dict.fromkeys(names, 1)), 1.0)  # max_queue_per_flow 1: full
    c = _ctx("overflow")
    await asyncio.wait_for(st.run(c), 10)
    assert c.route.candidates[0].backend.name == engines[0]["name"]
    assert st.flow.stats["overflow"] == 1 and st.stats["rejected"] == 0
    await st.finish(c)
    # with a target, a full flow queue is a refusal on arrival
    c = _ctx("full-with-target", slo=60_000)
    with pytest.raises(GatewayError) as ei:
        await asyncio.wait_for(st.run(c), 10)
    assert ei.value.code == "flow_queue_full"
