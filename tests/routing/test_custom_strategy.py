"""A `routing.strategy` list changes the engine the real route stage picks, and the evidence names it."""
from __future__ import annotations

import yaml

from gateway.config import parse_config
from gateway.pipeline import RequestContext
from gateway.proxy.health import Health
from gateway.routing.stage import PredictiveRouteStage
from gateway.types import Decision, Principal

PROMPT = "You are a careful assistant. " * 120  # ~3.5k chars: a dozen approximate blocks


def _stage(strategy):
    backends = [{"name": n, "kind": "openai", "url": f"http://127.0.0.1:9/{n}/v1", "models": ["m"],
                 "location": {"country": "DE"}, "retention": "zero"} for n in ("e0", "e1")]
    cfg = parse_config(yaml.safe_dump({"backends": backends, "routing": {"strategy": strategy}}))
    return PredictiveRouteStage(lambda: cfg, Health(cfg))


def _ctx(rid: str) -> RequestContext:
    c = RequestContext(request_id=rid, endpoint="chat", headers={},
                       body={"model": "m", "messages": [{"role": "user", "content": PROMPT}]})
    c.model, c.model_chain, c.prompt_tokens_est = "m", ("m",), 900
    c.principal = Principal(id="k", kind="api_key", tenant="acme")
    c.decision = Decision(allow=True)
    return c


async def _pick_after_e1_served_the_prefix(strategy) -> tuple[str, dict]:
    st = _stage(strategy)
    warm = _ctx("warm")
    await st.run(warm)
    warm.route.candidates.sort(key=lambda c: c.backend.name != "e1")
    warm.backend, warm.status = "e1", 200  # e1 served the prompt: its prefix is in the approximate tree
    await st.finish(warm)
    c = _ctx("next")
    await st.run(c)
    return c.route.candidates[0].backend.name, c.evidence["route"]


async def test_a_custom_list_changes_the_chosen_engine():
    # load only: both idle, a tie, so the first listed engine
    pick, route = await _pick_after_e1_served_the_prefix([{"type": "capacity"}, {"type": "load"}])
    assert pick == "e0" and route["strategy"] == "capacity,load*1"
    # the approximate prefix match: the engine that served the prompt
    pick, route = await _pick_after_e1_served_the_prefix([{"type": "capacity"}, {"type": "prefix_hash"}])
    assert pick == "e1" and route["strategy"] == "capacity,prefix_hash*1"
    # the same scorer at weight 0 counts for nothing: the tie again
    pick, route = await _pick_after_e1_served_the_prefix([{"type": "prefix_hash", "weight": 0},
                                                          {"type": "load"}])
    assert pick == "e0" and route["strategy"] == "prefix_hash*0,load*1"


async def test_the_preset_and_its_list_pick_alike():
    preset, route = await _pick_after_e1_served_the_prefix("prefix_hash")
    listed, _ = await _pick_after_e1_served_the_prefix([{"type": "capacity"}, {"type": "prefix_hash"},
                                                        {"type": "min_score"}])
    assert preset == listed == "e1" and route["strategy"] == "prefix_hash"
