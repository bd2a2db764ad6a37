"""The batch lane's pacer reads the real router (PredictiveRouteStage and its Predictor) without dispatching:
concurrency rises while the predicted realtime TTFT has headroom and halves when it does not."""
from __future__ import annotations

import yaml

from gateway.app import Gateway
from gateway.batch.scheduler import Pacer, realtime_prediction
from gateway.config import parse_config
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.types import Decision, Principal
from gateway.routing.stage import PredictiveRouteStage


def _gw(**batch) -> Gateway:
    cfg = parse_config(yaml.safe_dump({
        "backends": [{"name": f"e{i}", "kind": "openai", "url": f"http://127.0.0.1:{9900 + i}/v1",
                      "models": ["m"], "location": {"country": "DE"}} for i in range(2)],
        "routing": {"default_ttft_slo_ms": 1000},
        "batch": {"min_concurrency": 1, "max_concurrency": 8, "headroom": 0.5, **batch}}))
    gw = Gateway(cfg)
    gw.router = PredictiveRouteStage(lambda: gw.config, gw.health)
    return gw


def _realtime(i: int, prompt_tokens: int) -> RequestContext:
    c = RequestContext(request_id=f"rt-{i}", endpoint="chat", headers={},
                       body={"model": "m", "messages": [{"role": "user", "content": f"question {i} " + "x" * 64}]})
    c.model, c.model_chain, c.prompt_tokens_est = "m", ("m",), prompt_tokens
    c.principal = Principal(id="k", kind="api_key", tenant="acme")
    c.decision = Decision(allow=True, priority="realtime")
    return c


async def test_concurrency_rises_while_idle_and_halves_under_realtime_load():
    gw = _gw()
    p = Pacer(gw.config.raw.batch)
    assert p.allowance(gw, [], 0) == 1  # idle fleet: the cold-start prediction is far under 0.5 x 1000 ms
    grown = [p.allowance(gw, [], int(p.conc)) for _ in range(20)]  # every slot busy each tick: +1 per tick
    assert int(p.conc) == 8 and grown[-1] == 0 and p.room
    idle = realtime_prediction(gw)
    assert idle < 500
    # realtime load: requests routed (not dispatched) by the real route stage queue prefill on both engines
    ctxs = []
    for i in range(8):
        c = _realtime(i, 3000)
        try:
            await gw.router.run(c)
            ctxs.append(c)
        except GatewayError as e:  # admission refuses realtime once the fleet is full: it leaves no flight
            assert e.code == "ttft_slo_unattainable"
    assert len(ctxs) >= 2
    busy = realtime_prediction(gw)
    assert busy > 500 > idle
    assert p.allowance(gw, [], 8) == 0 and not p.room and int(p.conc) == 4  # halved, no new line
    assert p.allowance(gw, [], 8) == 0 and int(p.conc) == 4  # at most one halving per cooldown
    for c in ctxs:  # realtime finishes: room again, and concurrency climbs back
        await gw.router.finish(c)
    assert realtime_prediction(gw) < 500
    assert p.allowance(gw, [], 4) == 1 and p.room and int(p.conc) == 5


def test_only_max_concurrency_bounds_without_a_router():
    gw = _gw(max_concurrency=3)
    gw.router = None
    p = Pacer(gw.config.raw.batch)
    for _ in range(5):
        p.allowance(gw, [], int(p.conc))
    assert int(p.conc) == 3 and p.allowance(gw, [], 1) == 2


def test_unworkable_batch_settings_are_refused_naming_file_line_and_key():
    import pytest

    from gateway.config import ConfigError

    for text, key in (("batch:\n  lease_s: 0\n", "batch.lease_s"),
                      ("batch:\n  min_concurrency: 4\n  max_concurrency: 2\n", "batch.max_concurrency"),
                      ("batch:\n  headroom: -1\n", "batch.headroom")):
        with pytest.raises(ConfigError) as e:
            parse_config(text, source="g.yaml")
        assert str(e.value).startswith("g.yaml:") and key in str(e.value)
