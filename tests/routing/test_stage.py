"""PredictiveRouteStage's spill to partners (issue 9): a partner route is used only when policy allows a
spill, only after no own engine is predicted to meet the TTFT target, and only inside the decision's
residency class; a model only partners serve is their ordinary route."""
from __future__ import annotations

import asyncio

import httpx
import pytest
import yaml

from gateway.config import parse_config
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.proxy.health import Health
from gateway.routing.stage import PredictiveRouteStage
from gateway.types import Decision, Principal
from tests.support.wait import async_wait_until


def _cfg():
    b = lambda name, country, op, models=("m",): {  # noqa: E731
        "name": name, "kind": "openai", "url": f"http://127.0.0.1:9/{name}/v1", "models": list(models),
        "location": {"country": country}, "retention": "zero", "operator": op}
    return parse_config(yaml.safe_dump({"backends": [
        b("own-de", "DE", "self"), b("partner-se", "SE", "partner"), b("partner-us", "US", "partner"),
        b("only-partner", "FI", "partner", ("p-model",))]}))


def _ctx(*, spill: bool, prompt_tokens: int, model: str = "m", eea: bool = True, content: str = "x"
         ) -> RequestContext:
    c = RequestContext(request_id=f"r-{spill}-{prompt_tokens}", endpoint="chat", headers={},
                       body={"model": model, "messages": [{"role": "user", "content": content}]})
    c.model, c.model_chain, c.prompt_tokens_est = model, (model,), prompt_tokens
    c.principal = Principal(id="k", kind="api_key", tenant="acme")
    countries = frozenset({"DE", "SE", "FI"}) if eea else None
    c.decision = Decision(allow=True, spill_to_partner=spill, ttft_slo_ms=1000.0, allowed_countries=countries,
                          residency_rule="eea" if eea else None)
    return c


@pytest.fixture
def stage():
    cfg = _cfg()
    return PredictiveRouteStage(lambda: cfg, Health(cfg))


async def test_in_time_requests_stay_on_own_engines_even_when_spill_is_allowed(stage):
    c = _ctx(spill=True, prompt_tokens=100)
    await stage.run(c)
    assert [x.backend.name for x in c.route.candidates] == ["own-de", "partner-se"]
    assert c.evidence["route"]["admission"] == "admit"


async def test_an_own_upstream_without_a_model_is_neither_spilled_from_nor_refused_on_a_prediction(stage):
    """Issue 34: own-de is `kind: openai`, an upstream the gateway has no model of. The prior's ~25 s for
    200k tokens is no promise: the request goes to it (pass-through), not to a partner, and is not refused;
    the evidence says which mode each candidate is in and why."""
    for spill in (True, False):
        c = _ctx(spill=spill, prompt_tokens=200_000)
        await stage.run(c)
        assert c.route.candidates[0].backend.name == "own-de" and c.evidence["route"]["admission"] == "admit"
        assert c.evidence["route"]["mode"] == "pass_through"
        own = next(x for x in c.evidence["candidates"] if x["backend"] == "own-de")
        assert own["mode"] == "pass_through" and "kind openai" in own["mode_reason"]
        assert "x-predicted-ttft-ms" not in c.extra_headers  # no model, no prediction promised
    assert stage.stats["spilled"] == 0 and stage.stats["rejected"] == 0 and stage.stats["pass_through"] == 2


async def test_a_target_already_spent_on_arrival_is_refused_without_a_model(stage):
    """The one refusal that needs no model: the time since arrival is past the target."""
    c = _ctx(spill=False, prompt_tokens=100)
    c.decision = Decision(allow=True, ttft_slo_ms=0.001, allowed_countries=frozenset({"DE"}))
    with pytest.raises(GatewayError) as ei:
        await stage.run(c)
    assert ei.value.status == 429 and ei.value.code == "ttft_slo_unattainable"


async def _modelled_sim_stage(fleet, partner_url: str):
    """A route stage over a real simulated fleet (real telemetry), whose engines count as modelled from the
    prior (`routing.model_validity.min_observations: 0`), plus an EEA and a US partner."""
    from gateway.telemetry.service import TelemetryService

    engines = fleet.manifest()["engines"]
    own = [{"name": e["name"], "kind": "sim", "url": e["url"], "models": ["m"], "kv_events": e["kv_events"],
            "replay": e["replay"], "metrics": e["metrics"], "location": {"country": "DE"}, "retention": "zero"}
           for e in engines]
    part = [{"name": n, "kind": "openai", "url": partner_url, "models": ["m"], "location": {"country": cc},
             "retention": "zero", "operator": "partner"} for n, cc in (("partner-se", "SE"), ("partner-us", "US"))]
    cfg = parse_config(yaml.safe_dump({"backends": own + part, "telemetry": {"scrape_interval_s": 0.1},
                                       "routing": {"model_validity": {"min_observations": 0}}}))
    tel = TelemetryService(cfg)
    await tel.start()
    for _ in range(100):  # a first healthy scrape per engine: telemetry live
        if all((ld := tel.load(e["name"])) is not None and ld.healthy for e in engines):
            break
        await asyncio.sleep(0.05)
    return PredictiveRouteStage(lambda: cfg, Health(cfg), telemetry=tel), tel


async def test_over_target_on_modelled_engines_spills_to_a_partner_in_the_same_residency_class():
    from backends.sim.fleet import start_fleet

    async with start_fleet(1, profiles=["tiny"]) as fleet:
        stage, tel = await _modelled_sim_stage(fleet, "http://127.0.0.1:9/p/v1")
        try:
            long = "several words of a long prompt " * 8000  # ~40k tokens: the prior predicts seconds, target 1 s
            c = _ctx(spill=True, prompt_tokens=40_000, content=long)
            await stage.run(c)
            names = [x.backend.name for x in c.route.candidates]
            own = fleet.manifest()["engines"][0]["name"]
            assert names == ["partner-se", own] and c.evidence["route"]["admission"] == "spill", names
            assert "partner-us" not in names  # outside the EEA: never a spill target
            assert any(d["backend"] == "partner-us" and d["filter"] == "residency" for d in c.evidence["dropped"])
            assert stage.stats["spilled"] == 1
            # without spill permission: partners dropped, and the modelled engine's prediction refuses it early
            c = _ctx(spill=False, prompt_tokens=40_000, content=long)
            with pytest.raises(GatewayError) as ei:
                await stage.run(c)
            assert ei.value.status == 429 and ei.value.code == "ttft_slo_unattainable"
            assert any(d["backend"] == "partner-se" and d["filter"] == "spill" for d in c.evidence["dropped"])
            # a short request in time, without spill permission: the own engine only
            c = _ctx(spill=False, prompt_tokens=100)
            await stage.run(c)
            assert [x.backend.name for x in c.route.candidates] == [own]
        finally:
            await tel.close()


async def test_a_model_only_partners_serve_is_their_ordinary_route(stage):
    c = _ctx(spill=False, prompt_tokens=100, model="p-model")
    await stage.run(c)
    assert [x.backend.name for x in c.route.candidates] == ["only-partner"]
    assert c.evidence["route"]["admission"] == "admit"


async def test_a_prediction_made_on_a_stale_kv_view_says_so_in_the_evidence():
    """Against the simulator fleet with the real telemetry service: when an engine's KV view is being rebuilt
    after lost events (the subscriber's stale state), the request's route evidence names that engine."""
    from backends.sim.fleet import start_fleet
    from gateway.telemetry.service import TelemetryService

    async with start_fleet(2, profiles=["tiny"]) as fleet:
        engines = fleet.manifest()["engines"]
        cfg = parse_config(yaml.safe_dump({"backends": [
            {"name": e["name"], "kind": "sim", "url": e["url"], "models": ["sim-model"], "kv_events": e["kv_events"],
             "replay": e["replay"], "metrics": e["metrics"]} for e in engines]}))
        tel = TelemetryService(cfg)
        await tel.start()
        try:
            st = PredictiveRouteStage(lambda: cfg, Health(cfg), telemetry=tel)
            c = _ctx(spill=False, prompt_tokens=10, model="sim-model", eea=False)
            await st.run(c)
            assert "stale_kv_views" not in c.evidence["route"]
            await st.finish(c)
            stale = engines[1]["name"]
            tel.subscribers[stale].stale = True
            c = _ctx(spill=False, prompt_tokens=10, model="sim-model", eea=False)
            await st.run(c)
            assert c.evidence["route"]["stale_kv_views"] == [stale]
            assert c.evidence["route"]["kv_views"] == {stale: {"stale": True, "reason": "gap"}}
            await st.finish(c)
            # the block counts /admin/fleet and /metrics show are counted off the loop, and equal the index's
            async with httpx.AsyncClient(timeout=10) as client:  # some blocks on an engine, straight to it
                r = await client.post(engines[0]["url"] + "/completions", json={"prompt": "blocks " * 64,
                                                                                "max_tokens": 1})
                assert r.status_code == 200
            await async_wait_until(lambda: sum(tel.index.engine_blocks(engines[0]["name"]).values()) > 0,
                                   what="the engine's KV events in the index")
            await tel.refresh_block_counts()
            snap = tel.fleet_snapshot()["engines"]
            assert {n: e["cached_blocks"] for n, e in snap.items()} == {
                e["name"]: tel.index.engine_blocks(e["name"]) for e in engines}
            assert sum(sum(e["cached_blocks"].values()) for e in snap.values()) > 0
        finally:
            await tel.close()


async def test_refusals_name_the_rule_that_excluded_each_backend(stage):
    """403 when residency/retention excluded every backend names the rule behind each kind of exclusion; a
    503 where some were excluded and the rest are down says so (it named no rule before)."""
    c = _ctx(spill=False, prompt_tokens=10)
    c.decision = Decision(allow=True, allowed_countries=frozenset({"JP"}), residency_rule="japan-only",
                          retention="zero", retention_rule="zr")
    with pytest.raises(GatewayError) as ei:
        await stage.run(c)
    assert ei.value.status == 403 and "'japan-only'" in ei.value.message and "'zr'" not in ei.value.message
    c = _ctx(spill=False, prompt_tokens=10)  # EEA: own-de and partner-se allowed but down, partner-us excluded
    for name in ("own-de", "partner-se"):
        for _ in range(5):
            stage._health.failure(name, "down")
    with pytest.raises(GatewayError) as ei:
        await stage.run(c)
    assert ei.value.status == 503 and "excluded by the residency/retention of rule 'eea'" in ei.value.message


async def test_the_round_robin_stage_keeps_partners_to_spill_only_too():
    """The minimal assemblies' RouteStage applies the same partner rule: no spill permission, no partner, also
    when the own engine is down; a partner-only model is the partners' route."""
    from gateway.routing.stage import RouteStage

    cfg = _cfg()
    st = RouteStage(lambda: cfg, Health(cfg))
    c = _ctx(spill=False, prompt_tokens=10)
    await st.run(c)
    assert [x.backend.name for x in c.route.candidates] == ["own-de"]
    c = _ctx(spill=True, prompt_tokens=10)
    await st.run(c)
    assert [x.backend.name for x in c.route.candidates] == ["own-de", "partner-se"]
    for _ in range(5):
        st._health.failure("own-de", "down")
    with pytest.raises(GatewayError) as ei:
        await st.run(_ctx(spill=False, prompt_tokens=10))
    assert ei.value.status == 503
    c = _ctx(spill=False, prompt_tokens=10, model="p-model")
    await st.run(c)
    assert [x.backend.name for x in c.route.candidates] == ["only-partner"]


async def test_own_engines_down_or_excluded_never_open_partners_without_spill(stage):
    c = _ctx(spill=False, prompt_tokens=10)
    c.decision = Decision(allow=True, retention="zero", retention_rule="zr")
    for _ in range(5):
        stage._health.failure("own-de", "down")
    with pytest.raises(GatewayError) as ei:
        await stage.run(c)
    assert ei.value.status == 503 and "spill_to_partner" in ei.value.message
    assert {d["backend"] for d in c.evidence["dropped"] if d["filter"] == "spill"} == {"partner-se", "partner-us"}


def test_kv_view_evidence_names_each_stale_engine_with_its_reason():
    from gateway.routing.stage import kv_view_evidence

    views = {"a": {"stale": True, "reason": "wrong_topic", "detail": "x", "batches": 0},
             "b": {"stale": True, "reason": "no_events", "detail": "y", "batches": 0}}
    assert kv_view_evidence(["a", "b", "c"], views.get) == {
        "a": {"stale": True, "reason": "wrong_topic"}, "b": {"stale": True, "reason": "no_events"},
        "c": {"stale": True, "reason": None}}
    assert kv_view_evidence(["a"], None) == {"a": {"stale": True, "reason": None}}


def test_engine_part_is_the_ttft_after_the_prediction():
    from gateway.routing.feedback import engine_part

    assert engine_part(0.250, 0.040) == pytest.approx(0.210)
    assert engine_part(0.250, -1.0) == pytest.approx(0.250)  # no negative elapsed time
    assert engine_part(0.010, 0.020) == pytest.approx(1e-4)  # never zero or negative for the learner


async def test_time_spent_before_the_prediction_is_added_to_it_and_not_learned(stage):
    """A request that already spent 0.8 s before routing (parse, policy, tokenize, a busy box) is predicted at
    least 0.8 s from arrival, so a 1000 ms target is judged on what is left; the learner is fed the TTFT minus
    that time."""
    import time

    c = _ctx(spill=False, prompt_tokens=100)
    await stage.run(c)
    base = c.route.candidates[0].predicted_ttft_ms
    c2 = _ctx(spill=False, prompt_tokens=100)
    c2.request_id = "r-late"
    c2.received_at = time.perf_counter() - 0.8
    await stage.run(c2)
    assert c2.route.candidates[0].predicted_ttft_ms >= base + 800
    fl = stage._by_rid["r-late"]
    assert fl.elapsed_s >= 0.8
    seen: list[float] = []
    stage.predictor.observe = lambda engine, f, ttft_s, upper_s=None: seen.append(ttft_s) or 0.0
    c2.backend, c2.status, c2.ttft_s = "own-de", 200, fl.elapsed_s + 0.05
    await stage.finish(c2)
    assert seen == [pytest.approx(0.05)]


async def test_response_complete_plugins_are_told_of_each_finished_request_in_order(stage):
    """The learning on response is a plugin point (plugin.py ResponseComplete, like GIE's): the stage's own
    learners first, then an extension's; each is told after the stage released what it held (the request is no
    longer in flight), and one that fails does not stop the next."""
    seen: list[tuple[str, str, str, int]] = []

    class Broken:
        name = "broken"

        def response_complete(self, ctx, flight) -> None:
            raise RuntimeError("an extension's bug")

    class Counter:
        name = "counter"

        def response_complete(self, ctx, flight) -> None:
            seen.append((ctx.request_id, flight.engine, ctx.backend, stage.inflight.counts().get(flight.engine, 0)))

    assert [p.name for p in stage.on_response] == ["learn"]
    stage.on_response += [Broken(), Counter()]
    c = _ctx(spill=False, prompt_tokens=100)
    await stage.run(c)
    c.backend, c.status, c.ttft_s = "own-de", 200, 0.05
    await stage.finish(c)
    assert seen == [(c.request_id, "own-de", "own-de", 0)]


async def test_a_target_behind_others_in_fair_order_is_held_for_the_modelled_engines_not_sent_past_them():
    """Issue 34 (a tenant within its share keeps its goodput while another floods): when the modelled engines are
    closed and other flows wait ahead of it, a request with a target waits for them in the fair queue (judged with
    that wait) instead of going unjudged to a pass-through engine: a flood's excess would otherwise fill the
    pass-through engines and the flows within their share sent there would wait behind it."""
    from gateway.routing.flow import Waiter
    from gateway.routing.mode import Mode

    cfg = parse_config(yaml.safe_dump({"backends": [
        {"name": n, "kind": "openai", "url": f"http://127.0.0.1:9/{n}/v1", "models": ["m"]}
        for n in ("e-mod", "e-pt")]}))
    st = PredictiveRouteStage(lambda: cfg, Health(cfg))
    modes = {"e-mod": Mode(True, "test: modelled"), "e-pt": Mode(False, "test: pass-through")}
    st.mode = lambda b, tel, now: modes[b.name]  # type: ignore[method-assign]
    st.flow.may_start = lambda *a, **k: frozenset()  # type: ignore[method-assign]  # the modelled engine is closed
    from gateway.routing.flowkey import flow_id

    c = _ctx(spill=False, prompt_tokens=100)
    c.decision = Decision(allow=True, ttft_slo_ms=60_000.0)
    now = st.clock()
    for flow in ("someone-else", flow_id(c.principal, c.decision)):  # its own flow's earlier request waits too
        st.flow.queue.push(Waiter(flow, "standard", 1.0, False, frozenset({"e-mod"}), now, now + 60,
                                  uncached={"e-mod": 1}), 1.0)
    task = asyncio.create_task(stage_run := st.run(c))  # noqa: F841
    await asyncio.sleep(0.2)
    assert not task.done()  # waiting in the fair queue, not dispatched to e-pt
    assert st.stats["pass_through_held_for_fairness"] == 1 and st.stats["released_to_pass_through"] == 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
